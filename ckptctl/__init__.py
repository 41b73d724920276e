"""ckptctl: inspect, reshard and export PyTorch Distributed Checkpoints offline."""

__version__ = "0.1.0"
