"""PyTorch Distributed Checkpoint: `.metadata` read and written, items read, per-rank files laid out."""
