"""torch's own reader of a distributed Hugging Face safetensors folder, the oracle of the tests
that write or read one."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader


def torch_hf_read(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the folder as torch's `HuggingFaceStorageReader` loads it (`dcp.load`, no
    process group), into zeros of the shapes it finds."""
    md = HuggingFaceStorageReader(str(folder)).read_metadata()
    out = {k: torch.zeros(v.size, dtype=v.properties.dtype) for k, v in md.state_dict_metadata.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(out, storage_reader=HuggingFaceStorageReader(str(folder)), no_dist=True)
    return out
