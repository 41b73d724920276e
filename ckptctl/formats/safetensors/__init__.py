"""safetensors files read and written, and torch's distributed Hugging Face storage folders read as a checkpoint."""
