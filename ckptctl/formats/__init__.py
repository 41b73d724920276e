"""Readers and writers of bytes: DCP (`.metadata`, items), pickles, torch.save archives, safetensors, Megatron args."""
