"""The typed in-memory picture of a checkpoint every command works from.

It holds what `.metadata` says (entries, global shapes, dtypes, chunks and where their
bytes are), never tensor data: building it reads `.metadata` and file sizes only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckptctl.dtypes import DType, as_dtype

def dtype_name(dtype: DType) -> str:
    """torch's own short name: `torch.bfloat16` → `bfloat16`."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True, slots=True)
class Chunk:
    """One saved piece of a tensor: a box of the global tensor stored as one item of a file."""

    file: str
    offset: int
    length: int
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    transforms: tuple[str, ...] = ()

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


@dataclass(frozen=True)
class TensorEntry:
    """A tensor of the state dict: global shape, dtype and the chunks that hold it."""

    fqn: str
    shape: tuple[int, ...]
    dtype: DType
    chunks: tuple[Chunk, ...]
    properties: Any = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", as_dtype(self.dtype))

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    @property
    def dtype_name(self) -> str:
        return dtype_name(self.dtype)


@dataclass(frozen=True)
class BytesEntry:
    """A non-tensor state-dict value, stored as raw `torch.save(obj)` bytes."""

    fqn: str
    file: str
    offset: int
    length: int
    transforms: tuple[str, ...] = ()


@dataclass
class Checkpoint:
    """A DCP checkpoint directory as described by its metadata."""

    path: Path
    tensors: dict[str, TensorEntry]
    bytes_entries: dict[str, BytesEntry]
    files: dict[str, int]
    planner_data: Any = None
    version: str | None = None
    metadata_files: tuple[str, ...] = (".metadata",)
    storage_meta: Any = field(default=None, repr=False)
    rank_conflicts: dict[str, str] = field(default_factory=dict)
    """Per-rank metadata files that disagree about an entry: FQN → what they say (first file's kept)."""
    unreferenced_files: tuple[str, ...] = ()
    """Data files in the directory (also in `files`) that no entry points to: another save's leftovers."""
    megatron_backend: str | None = None
    """`torch_dist` for a Megatron-Core dist_checkpointing checkpoint (its `metadata.json`): keys
    stacked along a leading layer axis, fc1 as `[W_all; V_all]` — not Megatron-FSDP's layouts."""
    mcore_metadata: bool = False
    """`.metadata` is megatron-core's own Metadata subclass, which only megatron-core ≤ 0.15 saves."""
    safetensors_folder: bool = False
    """A safetensors model folder read as a source: each chunk's (offset, length) are its tensor's
    dense bytes, and each FQN is the tensor's name in its file."""
    derived: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    """What the layers above compute once from the metadata and keep with it (`layout.analysis`)."""

    @property
    def total_bytes(self) -> int:
        return sum(self.files.values())

    @property
    def saved_world_size(self) -> int:
        """Number of ranks that wrote data files (`__{rank}_{n}.distcp`) the metadata points to."""
        ranks = {rank for name in self.files.keys() - set(self.unreferenced_files)
                 if (rank := file_rank(name)) is not None}
        return max(ranks) + 1 if ranks else 0


def file_rank(name: str) -> int | None:
    """The rank that wrote data file `__{rank}_{n}.distcp`, None for any other name."""
    stem = Path(name).name
    if stem.startswith("__") and "_" in stem[2:]:
        head = stem[2:].split("_", 1)[0]
        if head.isdigit():
            return int(head)
    return None
