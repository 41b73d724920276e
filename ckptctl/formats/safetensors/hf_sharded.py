"""A folder torch's `HuggingFaceStorageWriter(save_distributed=True)` wrote, read as a checkpoint.

Each rank writes its own safetensors files (`shard-{rank + 1:05}-model-{i:05}-of-{n:05}.safetensors`)
and nobody writes a `.metadata`: a record of a file is that rank's piece of the tensor of its
name, and the file's `__metadata__["DCP_SHARDING_INFO"]` (JSON text) gives each record's
`saved_offsets` in its global tensor. No global shape is recorded anywhere; as torch's
`HuggingFaceStorageReader` and `consolidate_safetensors_files` do, a tensor's shape is the
extent of its pieces. Pieces that overlap are two files claiming the same elements and are
refused here, naming both; a gap is left to the coverage analysis every DCP checkpoint gets.
What no reader can see is a lost file whose pieces were the last rows of every tensor it held:
the tensors then look shorter, complete (export-hf's checks against the config catch it).

Each piece becomes a chunk at its file's blob (byte 0, the record's length), exactly as DCP's
`SerializationFormat.SAFETENSORS` records one, so the item readers find the record by name and
check its shape, dtype and offsets again before reading it.
"""

from __future__ import annotations

import math
from array import array
from dataclasses import dataclass, field
from pathlib import Path

from ckptctl.core.dtypes import DType
from ckptctl.util.errors import CheckpointError
from ckptctl.util.gc_pause import gc_paused
from ckptctl.core.geometry import Box, union_volume
from ckptctl.storage.hf_files import ImplausibleJson, parse_json
from ckptctl.storage.store import EntryKind, store_for
from ckptctl.core.checkpoint import Checkpoint, ChunkTable, TensorEntry, dtype_name
from ckptctl.formats.safetensors.reader import SHARDING_KEY, StoredTensor, read_header_and_metadata, shown_name

OFFSETS_KEY = "saved_offsets"
VERSION_KEY = "DCP_VERSION"
MAX_NUMEL = 1 << 50
"""Elements a tensor's pieces may extend to (as `.metadata` may claim)."""
MAX_PIECES = 1 << 24
"""Records a folder may hold in all its files (one per tensor per rank: 16,000 tensors at 1,024 ranks)."""
SHOWN_VERSION = 32


@dataclass
class _Tensor:
    """A tensor's pieces as they are met, file by file."""

    dtype: DType
    rank: int
    first: str
    files: array = field(default_factory=lambda: array("I"))
    places: array = field(default_factory=lambda: array("q"))
    offsets: list[tuple[int, ...]] = field(default_factory=list)
    sizes: list[tuple[int, ...]] = field(default_factory=list)


def safetensors_files(root: Path) -> list[Path]:
    """The folder's `*.safetensors` files, as torch's reader lists them (the folder's own, by name)."""
    store = store_for(root)
    return [p for p in store.glob(root, "*.safetensors") if store.kind(p) is not EntryKind.FOLDER]


def is_sharded_folder(root: Path) -> bool:
    """Whether `root` holds safetensors files the first of which carries DCP sharding info, and no
    index: an indexed folder is a model's (the writer indexes only what it consolidates), and its
    files are read as the index says."""
    if store_for(root).glob(root, "*.safetensors.index.json"):
        return False
    files = safetensors_files(root)
    return bool(files) and SHARDING_KEY in read_header_and_metadata(files[0])[1]


def _sharding(file: Path, metadata: dict[str, str], stored: dict[str, StoredTensor], first: Path) -> dict:
    """Each record's `saved_offsets` by name, from the file's `DCP_SHARDING_INFO`, checked against its records."""
    text = metadata.get(SHARDING_KEY)
    if text is None:
        raise CheckpointError(file, f"no {SHARDING_KEY} in its __metadata__, unlike {first.name}")
    data = text.encode()
    try:  # its values and nesting were measured with the header's: this parse is bounded by them
        info = parse_json(data, len(data))
    except ImplausibleJson as exc:
        raise CheckpointError(file, f"implausible {SHARDING_KEY} in __metadata__ ({exc})") from None
    except ValueError as exc:
        raise CheckpointError(file, f"{SHARDING_KEY} in __metadata__ is not JSON ({exc})") from None
    if not isinstance(info, dict):
        raise CheckpointError(file, f"{SHARDING_KEY} in __metadata__ is not a JSON object")
    extra = sorted(info.keys() - stored.keys())
    if extra:
        raise CheckpointError(file, f"{shown_name(extra[0])}: in {SHARDING_KEY} but not a tensor of this file")
    out = {}
    for name, st in stored.items():
        entry = info.get(name)
        offsets = entry.get(OFFSETS_KEY) if isinstance(entry, dict) else None
        if offsets is None:
            raise CheckpointError(file, f"{shown_name(name)}: no {OFFSETS_KEY} in {SHARDING_KEY}")
        if not (isinstance(offsets, list) and len(offsets) == len(st.shape)
                and all(type(o) is int and o >= 0 for o in offsets)):
            raise CheckpointError(file, f"{shown_name(name)}: {OFFSETS_KEY} {str(offsets)[:100]} are not "
                                        f"{len(st.shape)} offsets >= 0 for its shape {list(st.shape)}")
        out[name] = tuple(offsets)
    return out


def _version(file: Path, metadata: dict[str, str], first: tuple[str | None, Path] | None) -> str | None:
    """The file's `DCP_VERSION`, which must be the first file's (`first`: it and that file; None for the first)."""
    found = metadata.get(VERSION_KEY)
    if first is not None and found != first[0]:
        raise CheckpointError(file, f"{VERSION_KEY} {str(found)[:SHOWN_VERSION]!r} in __metadata__, "
                                    f"{str(first[0])[:SHOWN_VERSION]!r} in {first[1].name}")
    return found


def _piece(tensor: _Tensor, i: int, names: list[str]) -> str:
    return f"the piece at {list(tensor.offsets[i])} of {list(tensor.sizes[i])} in {names[tensor.files[i]]}"


def _check_disjoint(root: Path, name: str, tensor: _Tensor, shape: tuple[int, ...], names: list[str]) -> None:
    """Refuse two pieces of one tensor that share an element, naming both (empty pieces share none)."""
    full = [i for i, s in enumerate(tensor.sizes) if 0 not in s]
    rest = (0,) * (len(shape) - 1)
    if not shape:
        clash = (full[0], full[1]) if len(full) > 1 else None
    elif all(tensor.offsets[i][1:] == rest and tensor.sizes[i][1:] == shape[1:] for i in full):
        full.sort(key=lambda i: tensor.offsets[i][0])  # whole rows: the first overlap is with a neighbour
        clash = next(((a, b) for a, b in zip(full, full[1:])
                      if tensor.offsets[b][0] < tensor.offsets[a][0] + tensor.sizes[a][0]), None)
    else:
        boxes = [Box(tensor.offsets[i], tensor.sizes[i]) for i in full]
        if union_volume(boxes) == sum(b.numel for b in boxes):
            return
        clash = next((a, b) for x, a in enumerate(full) for b in full[x + 1:]
                     if all(oa < ob + sb and ob < oa + sa for oa, sa, ob, sb in
                            zip(tensor.offsets[a], tensor.sizes[a], tensor.offsets[b], tensor.sizes[b])))
    if clash is not None:
        a, b = clash
        raise CheckpointError(root / names[tensor.files[b]],
                              f"{shown_name(name)}: {_piece(tensor, b, names)} overlaps {_piece(tensor, a, names)}")


def open_sharded_folder(root: Path) -> Checkpoint:
    """The folder as a checkpoint: every tensor of every file a chunk of the tensor of its name."""
    with gc_paused():  # a record's few small objects at a time, millions of them
        return _sharded_folder(root)


def _sharded_folder(root: Path) -> Checkpoint:
    files = safetensors_files(root)
    names = [f.name for f in files]
    sizes: dict[str, int] = {}
    tensors: dict[str, _Tensor] = {}
    version: str | None = None
    pieces = 0
    for number, file in enumerate(files):
        stored, metadata = read_header_and_metadata(file)
        offsets = _sharding(file, metadata, stored, files[0])
        version = _version(file, metadata, (version, files[0]) if number else None)
        sizes[file.name] = store_for(file).size(file)
        pieces += len(stored)
        if pieces > MAX_PIECES:
            raise CheckpointError(root, f"implausible checkpoint (more than {MAX_PIECES} tensor pieces)")
        for name, st in stored.items():
            tensor = tensors.get(name)
            if tensor is None:
                tensor = tensors[name] = _Tensor(st.dtype, len(st.shape), file.name)
            elif st.dtype != tensor.dtype:
                raise CheckpointError(file, f"{shown_name(name)}: {dtype_name(st.dtype)} here, "
                                            f"{dtype_name(tensor.dtype)} in {tensor.first}")
            elif len(st.shape) != tensor.rank:
                raise CheckpointError(file, f"{shown_name(name)}: {len(st.shape)} dims here, {tensor.rank} "
                                            f"in {tensor.first}")
            tensor.files.append(number)
            tensor.places.extend((0, st.nbytes))  # the blob's start: the readers find the record by name
            tensor.offsets.append(offsets[name])
            tensor.sizes.append(st.shape)
    entries = {}
    for name, tensor in sorted(tensors.items()):
        shape = tuple(max(o[d] + s[d] for o, s in zip(tensor.offsets, tensor.sizes)) for d in range(tensor.rank))
        if math.prod(shape) > MAX_NUMEL:
            raise CheckpointError(root, f"{shown_name(name)}: implausible extent {list(shape)} of its pieces")
        _check_disjoint(root, name, tensor, shape, names)
        entries[name] = TensorEntry(name, shape, tensor.dtype,
                                    ChunkTable(names, tensor.files, tensor.places, tensor.offsets, tensor.sizes, {}))
    return Checkpoint(path=root, tensors=entries, bytes_entries={}, files=sizes, version=version,
                      metadata_files=tuple(names))
