"""The typed in-memory picture of a checkpoint every command works from.

It holds what `.metadata` says (entries, global shapes, dtypes, chunks and where their
bytes are), never tensor data: building it reads `.metadata` and file sizes only.
"""

from __future__ import annotations

import math
import re
from array import array
from dataclasses import dataclass, field, replace
from itertools import islice, starmap
from pathlib import Path
from typing import Any, Iterator

from ckptctl.core.dtypes import DType, as_dtype

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


class TupleView:
    """A read-only sequence whose items are made when read: equal to, hashed and shown as the
    tuple of its items."""

    __slots__ = ()

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (TupleView, tuple)):
            return tuple(self) == tuple(other)  # type: ignore[arg-type]
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self))  # type: ignore[arg-type]

    def __repr__(self) -> str:
        return repr(tuple(self))  # type: ignore[arg-type]


class ChunkTable(TupleView):
    """A tensor's chunks as columns: each chunk's file by number, byte offset and length in one
    array, box offsets and sizes as tuples equal ones share. About 40 bytes a chunk instead of a
    `Chunk` and its integers (about 150): a checkpoint of millions of chunks is read into these,
    and a `Chunk` is made when one is looked at. A read-only sequence of `Chunk`s."""

    __slots__ = ("_names", "_files", "_places", "_offsets", "_sizes", "_transforms")

    def __init__(self, names: list[str], files: array, places: array, offsets: list[tuple[int, ...]],
                 sizes: list[tuple[int, ...]], transforms: dict[int, tuple[str, ...]]) -> None:
        self._names, self._files, self._places = names, files, places  # places: offset, length per chunk
        self._offsets, self._sizes, self._transforms = offsets, sizes, transforms

    @property
    def offsets(self) -> list[tuple[int, ...]]:
        """Each chunk's box offsets, in order (the table's own column: not to be changed)."""
        return self._offsets

    @property
    def sizes(self) -> list[tuple[int, ...]]:
        """Each chunk's box sizes, in order (the table's own column: not to be changed)."""
        return self._sizes

    def columns(self) -> tuple[list[str], array, array]:
        """The file names, each chunk's file by number, and each chunk's byte offset and length in
        turn (the table's own columns, not to be changed): every storage place without a `Chunk`."""
        return self._names, self._files, self._places

    @property
    def transformed(self) -> bool:
        """Whether any chunk's item is transformed (compressed: read by decoding)."""
        return bool(self._transforms)

    def renamed(self, names: list[str]) -> "ChunkTable":
        """The same chunks in files named `names` instead (one for each of `columns()`'s names, in order)."""
        if len(names) != len(self._names):
            raise ValueError(f"{len(names)} file names for a table of {len(self._names)}")
        return ChunkTable(names, self._files, self._places, self._offsets, self._sizes, self._transforms)

    def __len__(self) -> int:
        return len(self._offsets)

    def _chunk(self, i: int) -> Chunk:
        return Chunk(self._names[self._files[i]], self._places[2 * i], self._places[2 * i + 1], self._offsets[i],
                     self._sizes[i], self._transforms.get(i, ()))

    def __getitem__(self, index: int | slice) -> Any:
        if isinstance(index, slice):
            return tuple(self._chunk(i) for i in range(*index.indices(len(self))))
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError("chunk index out of range")
        return self._chunk(index)

    def __iter__(self) -> Iterator[Chunk]:
        places = self._places
        chunks = starmap(Chunk, zip(map(self._names.__getitem__, self._files), islice(places, 0, None, 2),
                                    islice(places, 1, None, 2), self._offsets, self._sizes))
        if not self._transforms:
            return chunks
        return (replace(c, transforms=self._transforms[i]) if i in self._transforms else c
                for i, c in enumerate(chunks))


@dataclass(frozen=True)
class TensorEntry:
    """A tensor of the state dict: global shape, dtype and the chunks that hold it."""

    fqn: str
    shape: tuple[int, ...]
    dtype: DType
    chunks: tuple[Chunk, ...] | ChunkTable
    properties: Any = None
    record: str | None = None
    """Of a safetensors folder's tensor seen under another name (a NeMo Automodel PEFT save's
    base and adapter as the peft model names them): its name in its file's header."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", as_dtype(self.dtype))

    @property
    def stored_name(self) -> str:
        """The name its safetensors record has: `record`, else its own."""
        return self.record or self.fqn

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def boxes(self) -> Iterator[tuple[tuple[int, ...], tuple[int, ...]]]:
        """Each chunk's (offsets, sizes), in order, without making a `Chunk` of a table's row."""
        chunks = self.chunks
        if type(chunks) is ChunkTable:
            return zip(chunks.offsets, chunks.sizes)
        return ((c.offsets, c.sizes) for c in chunks)

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
    dense_files: frozenset[str] = frozenset()
    """Files whose chunks are dense bytes of safetensors tensors, not DCP items: a Hugging Face
    folder's, joined as the pretrained weights of a Megatron-Bridge LoRA save (`hf_base`)."""
    derived: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    """What the layers above compute once from the metadata and keep with it (`analysis.analysis`)."""

    def dense(self, file: str) -> bool:
        """Whether the chunks of `file` are dense tensor bytes at their (offset, length)."""
        return self.safetensors_folder or file in self.dense_files

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
    """The rank that wrote data file `__{rank}_{n}.distcp` (or `shard-{rank + 1}-model-…`, torch's HF
    writer's name at save_distributed), None for any other name."""
    stem = Path(name).name
    shard = re.fullmatch(r"shard-(\d+)-model-\d+-of-\d+\.safetensors", stem)
    if shard is not None and int(shard.group(1)) > 0:
        return int(shard.group(1)) - 1
    if stem.startswith("__") and "_" in stem[2:]:
        head = stem[2:].split("_", 1)[0]
        if head.isdigit():
            return int(head)
    return None
