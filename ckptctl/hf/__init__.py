"""Megatron and torchtitan ↔ Hugging Face conversion rules, one module per model family, registered in `registry`."""
