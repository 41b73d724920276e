"""Read a DCP checkpoint's `.metadata` (or per-rank `__{rank}.metadata`) into a `Checkpoint`.

Reads the metadata pickle with the restricted unpickler and the data files' sizes, and
validates everything the file claims before anyone allocates or reads on its say-so:
paths stay inside the directory, byte ranges inside their files, chunk boxes inside their
global shape. Nothing else is read, so this is fast on any checkpoint size.
"""

from __future__ import annotations

import json
import math
import operator
import os
import re
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from ckptctl.util.errors import CheckpointError
from ckptctl.formats.dcp import classes
from ckptctl.formats.safetensors.hf_sharded import is_sharded_folder, open_sharded_folder
from ckptctl.util.gc_pause import gc_paused
from ckptctl.formats.dcp.templates import read_metadata
from ckptctl.formats.pickle.unpickle import MalformedPickleError, UnsafePickleError, load_metadata_pickle
from ckptctl.core.checkpoint import BytesEntry, Checkpoint, ChunkTable, TensorEntry
from ckptctl.storage.source_files import as_typed, checkpoints_inside, missing
from ckptctl.storage.store import EntryInfo, EntryKind, Store, store_for

METADATA_NAME = ".metadata"
_RANK_METADATA = re.compile(r"^__(\d+)\.metadata$")
MEGATRON_MARKER = "metadata.json"
"""Megatron-Core's dist_checkpointing writes it beside the DCP files: `{"sharded_backend": …}`."""
_MARKER_LIMIT = 1 << 16
MAX_NUMEL = 1 << 50
QUANTIZABLE = frozenset({"bfloat16", "float16", "float32"})
"""Logical dtypes of the quantized training tensors an item may hold (TE's FP8 and NVFP4): such an
item holds at least half a byte an element (NVFP4's two codes a byte), not the logical dtype's size."""
MAX_METADATA_BYTES = 1 << 31
TEMPLATE_MIN_BYTES = 1 << 21
"""`.metadata` from this size up is read by `dcp.templates` first. Below it C's unpickler is as
quick or quicker, and holds little: measured 14 ms against 25 ms at 140 KB of a megatron-core save
of few chunks per tensor (the templates interpret each tensor's header), 1.04 s against 0.40 s at
8.6 MB of 1,024 chunks per tensor."""


def _metadata_files(root: Path) -> list[Path]:
    """`.metadata`, else the per-rank `__{rank}.metadata` files in rank order (none: not DCP's own layout)."""
    store = store_for(root)
    if store.exists(root / METADATA_NAME):  # whatever it is: a device or FIFO is refused when opened
        return [root / METADATA_NAME]
    per_rank = sorted((root / name for name in store.list(root) if _RANK_METADATA.match(name)),
                      key=lambda p: int(_RANK_METADATA.match(p.name).group(1)))
    return per_rank


TORCH_DIST = "torch_dist"
"""The Megatron-Core dist_checkpointing backend ckptctl reads: DCP files, pickled plans beside the metadata."""


def megatron_backend(root: Path) -> str | None:
    """The `sharded_backend` of a Megatron-Core `dist_checkpointing` checkpoint (its
    `metadata.json`), None for any other DCP checkpoint; a backend other than torch_dist
    (zarr) is refused by name. A `metadata.json` that says nothing of the kind is not ours
    to judge."""
    path = root / MEGATRON_MARKER
    if not store_for(root).exists(path):
        return None
    text = read_small(path, _MARKER_LIMIT + 1)
    try:
        marker = json.loads(text) if len(text) <= _MARKER_LIMIT else None
    except (ValueError, RecursionError):
        return None
    backend = marker.get("sharded_backend") if isinstance(marker, dict) else None
    if not isinstance(backend, str):
        return None
    if backend != TORCH_DIST:
        raise CheckpointError(root, f"a Megatron-Core dist_checkpointing checkpoint ({MEGATRON_MARKER}: "
                                    f"sharded_backend {backend[:64]!r}); ckptctl reads its {TORCH_DIST!r} "
                                    "backend only")
    return backend


def read_small(path: Path, limit: int) -> bytes:
    """At most `limit` bytes of a small regular file (opened as any source): a marker or a common state."""
    with store_for(path).open_read(path) as small:
        return small.read_at(limit, 0)


def _load_one(path: Path, written_here: bool = False) -> classes.Metadata:
    handle = store_for(path).open_read(path)
    try:
        size = handle.size
        if size > MAX_METADATA_BYTES:
            raise CheckpointError(path, f"metadata is implausibly large ({size} bytes)")
        if size == 0:
            raise CheckpointError(path, "corrupt metadata pickle: the file is empty")
        if size >= TEMPLATE_MIN_BYTES and (md := read_metadata(handle.positioned_reader(), size)) is not None:
            return md
        with handle.whole() as data:  # pages are read as the pickle needs them
            return load_metadata_pickle(data, written_here)
    except UnsafePickleError as exc:
        raise CheckpointError(path, f"hostile or foreign pickle: {exc}") from None
    except MalformedPickleError as exc:
        raise CheckpointError(path, f"corrupt metadata pickle: {exc}") from None
    except OSError as exc:
        raise CheckpointError(path, f"cannot read: {exc.strerror or exc}") from None
    finally:
        handle.close()


@dataclass
class _Merged:
    """The union of one or more metadata files."""

    sd_md: dict[str, Any] = field(default_factory=dict)
    storage: classes.StorageColumns = field(default_factory=classes.StorageColumns)
    planner: dict[str, Any] = field(default_factory=dict)
    storage_meta: Any = None
    version: str | None = None
    conflicts: dict[str, str] = field(default_factory=dict)
    mcore_metadata: bool = False


def _signature(item: Any) -> tuple:
    return tuple(item.size), getattr(item.properties, "dtype", None)


def _describe(item: Any) -> str:
    return f"{list(item.size)} {getattr(item.properties, 'dtype', '?')}".replace("torch.", "")


def _kind(item: Any) -> str:
    return "a tensor" if isinstance(item, classes.TensorStorageMetadata) else "bytes"


def _merge(paths: list[Path], written_here: bool = False) -> _Merged:
    """Union of per-rank metadata files (DCP without collectives writes one per rank).

    A key two ranks both saved at the same offsets (a plain tensor) keeps the lowest
    rank's chunk and storage entry together: one rank's copy, as a coordinated save keeps.
    Ranks that disagree on a tensor's shape or dtype saved different tensors under one
    name; the first file's is kept and the disagreement recorded (`inspect --check` reports
    it, commands that copy data refuse it unless allowed).
    """
    out = _Merged()
    origin: dict[str, str] = {}
    known: dict[str, set[tuple]] = {}  # chunk offsets per tensor so far: each file adds only its own
    for path in paths:
        md = _load_one(path, written_here)
        out.storage_meta = out.storage_meta or md.storage_meta
        out.version = getattr(md, "version", None) or out.version
        out.mcore_metadata |= type(md) is classes.MCoreMetadata
        for fqn, item in md.state_dict_metadata.items():
            first = out.sd_md.get(fqn)
            if first is None:
                out.sd_md[fqn], origin[fqn] = item, path.name
            elif type(item) is not type(first):
                out.conflicts.setdefault(fqn, (
                    f"{fqn}: ranks saved different kinds of entry under this name ({_kind(first)} in "
                    f"{origin[fqn]}, {_kind(item)} in {path.name}); only {origin[fqn]}'s is read"))
            elif isinstance(item, classes.TensorStorageMetadata):
                if _signature(item) != _signature(first):
                    out.conflicts.setdefault(fqn, (
                        f"{fqn}: ranks saved different tensors under this name ({_describe(first)} in "
                        f"{origin[fqn]}, {_describe(item)} in {path.name}); only {origin[fqn]}'s is read"))
                    continue
                seen = known.get(fqn)
                if seen is None:
                    first.chunks = _columns(first.chunks)
                    seen = known[fqn] = set(first.chunks.offsets)
                for offsets, sizes in _pairs(item.chunks):
                    if offsets not in seen:
                        first.chunks.offsets.append(offsets)
                        first.chunks.sizes.append(sizes)
                        seen.add(offsets)
        if isinstance(md.planner_data, dict):
            out.planner.update(md.planner_data)
        if path is paths[0] and type(md.storage_data) is classes.StorageColumns:
            out.storage = md.storage_data  # the first file's table, as `dcp.templates` built it
        else:
            _add_storage(out.storage, md.storage_data)
    return out


def _pairs(chunks: Any) -> Any:
    """A tensor's chunks as (offsets, sizes) tuples: from `ChunkColumns` or from a list of records."""
    if type(chunks) is classes.ChunkColumns:
        return chunks.pairs()
    return ((tuple(c.offsets), tuple(c.sizes)) for c in chunks)


def _columns(chunks: Any) -> classes.ChunkColumns:
    if type(chunks) is classes.ChunkColumns:
        return chunks
    out = classes.ChunkColumns()
    for offsets, sizes in _pairs(chunks):
        out.offsets.append(offsets)
        out.sizes.append(sizes)
    return out


def _add_storage(table: classes.StorageColumns, storage: Any) -> None:
    """Another file's storage entries after `table`'s (a key already there keeps its first entry)."""
    if type(storage) is classes.StorageColumns:
        for fqn in storage.rows:
            for offsets, entry in storage.rows_of(fqn):
                table.add(fqn, offsets, *entry)
        return
    for index, info in (storage or {}).items():
        offsets = None if index.offset is None else tuple(index.offset)
        table.add(index.fqn, offsets, info.relative_path, info.offset, info.length, info.transform_descriptors)


def _resolve_file(root: Path, relative: Any, files: dict[str, int], where: Path) -> str:
    if not relative:  # a str: `unpickle` checked every field's type and range
        raise CheckpointError(where, f"storage entry has an invalid file name {relative!r}")
    if relative in files:
        return relative
    candidate = Path(relative)
    if candidate.is_absolute() or ".." in candidate.parts:
        raise CheckpointError(where, f"data file {relative!r} points outside the checkpoint directory")
    full = root / candidate
    try:
        real = full.resolve(strict=True)
    except (FileNotFoundError, RuntimeError):
        raise CheckpointError(full, "data file referenced by .metadata is missing") from None
    except OSError as exc:
        raise CheckpointError(full, f"cannot open: {exc.strerror or exc}") from None
    if root.resolve() not in real.parents:
        raise CheckpointError(full, "data file is a link that leaves the checkpoint directory")
    info = store_for(root).info(real)
    if not info.regular:
        raise CheckpointError(full, "not a regular file")
    files[relative] = info.size
    return relative


def _entry(store: Store, path: Path) -> EntryInfo | None:
    """What `store` says of the regular file at `path`, None for anything else or nothing."""
    try:
        info = store.info(path)
    except OSError:
        return None
    return info if info.regular else None


def _check_range(root: Path, file: str, offset: int, length: int, files: dict[str, int], fqn: str) -> None:
    if offset + length > files[file]:
        raise CheckpointError(
            root / file,
            f"file is {files[file]} bytes but {fqn} needs bytes {offset}..{offset + length} (truncated?)",
        )


def _located(root: Path, fqn: str, entry: tuple[str, int, int, tuple[str, ...]], files: dict[str, int],
             where: Path) -> str:
    """The validated file of a storage entry (file, byte offset, length, transforms): its range lies inside it."""
    file, offset, length, _ = entry
    if file not in files:  # a file met before was resolved then
        file = _resolve_file(root, file, files, where)
    if offset + length > files[file]:
        _check_range(root, file, offset, length, files, fqn)
    return file


@dataclass
class _StorageFiles:
    """What reading the tensors met so far: the storage table's files, by their number in it
    (their number among the checkpoint's files and their size), and the chunkings judged."""

    number: dict[int, int] = field(default_factory=dict)
    size: dict[int, int] = field(default_factory=dict)
    smallest: int = 1 << 63
    """The smallest of those sizes."""
    boxes: dict[tuple, tuple[list[int], int] | None] = field(default_factory=dict)
    """`_chunk_bytes` by (shape, itemsize, offsets, sizes): what tensors chunked alike share."""


def _table_in_order(root: Path, fqn: str, shape: tuple[int, ...], dtype: Any, chunks: Any,
                    storage: classes.StorageColumns, known: _StorageFiles, files: dict[str, int],
                    names: list[str], numbers: dict[str, int], where: Path) -> ChunkTable | None:
    """The chunk table of a tensor saved as torch saves one: its storage entries one per chunk, in
    the chunks' order, none transformed. Each check of `_tensor_entry` is made a column at a time;
    None when one fails (or the entries are in another order), and `_tensor_entry` then finds and
    names the fault chunk by chunk."""
    if fqn in storage.transformed:
        return None
    columns = _columns(chunks)  # as read by templates; made of the records C's unpickler built
    offsets, sizes = columns.offsets, columns.sizes
    keys, places = storage.rows.get(fqn, (None, None))
    if keys != offsets or not offsets:
        return None
    key = (shape, dtype.itemsize, tuple(offsets), tuple(sizes))
    if key not in known.boxes:  # tensors of one shape chunked alike are judged once
        if len(known.boxes) >= _BOXES_KEPT:
            known.boxes.clear()
        known.boxes[key] = _chunk_bytes(shape, dtype.itemsize, offsets, sizes)
    judged = known.boxes[key]
    if judged is None:
        return None
    needed, most = judged
    ids, starts, lengths = places[0::3], places[1::3], places[2::3]
    if min(lengths) < most and any(map(operator.lt, lengths, needed)):
        return None  # an item too short for its chunk's data
    met = known.number
    new = set(ids).difference(met)
    if new:
        for file_id in [i for i in dict.fromkeys(ids) if i in new]:  # each file once, in the order met
            file = storage.files[file_id]
            if file not in files:
                try:
                    file = _resolve_file(root, file, files, where)
                except CheckpointError:
                    return None  # named where the chunks come to it in order
            number = numbers.get(file)
            if number is None:
                number = numbers[file] = len(names)
                names.append(file)
            met[file_id], known.size[file_id] = number, files[file]
            known.smallest = min(known.smallest, files[file])
    ends = list(map(operator.add, starts, lengths))
    if max(ends) > known.smallest and any(map(operator.gt, ends, map(known.size.__getitem__, ids))):
        return None  # an item past its file's end
    spans = array("q", bytes(16 * len(offsets)))
    spans[0::2], spans[1::2] = starts, lengths
    return ChunkTable(names, array("I", map(met.__getitem__, ids)), spans, offsets, sizes, {})  # the columns kept


def _chunk_bytes(shape: tuple[int, ...], itemsize: int, offsets: list[tuple[int, ...]],
                 sizes: list[tuple[int, ...]]) -> tuple[list[int], int] | None:
    """The bytes each chunk's data takes, and the most of them (a quick test before the chunk-by-chunk
    one), when the chunks are of the shape's rank, at distinct offsets and inside the shape; else None."""
    rank = len(shape)
    if len(set(offsets)) != len(offsets) or {*map(len, offsets), *map(len, sizes)} != {rank}:
        return None
    for d in range(rank):  # every chunk inside the shape
        if max(map(operator.add, map(operator.itemgetter(d), offsets), map(operator.itemgetter(d), sizes))) > shape[d]:
            return None
    needed = list(map(itemsize.__mul__, map(math.prod, sizes)))
    return needed, max(needed)


_BOXES_KEPT = 256
"""Distinct chunkings `_table_in_order` remembers its judgement of (a full table starts again)."""


def _tensor_entry(root: Path, fqn: str, md: Any, storage: classes.StorageColumns, known: _StorageFiles,
                  files: dict[str, int], names: list[str], numbers: dict[str, int], where: Path) -> TensorEntry:
    """The entry of tensor `fqn`, its chunks a `ChunkTable` whose files are numbers into `names`, the
    checkpoint's data files in the order met (`numbers` inverts it). A tensor saved as torch saves one
    is checked a column at a time (`_table_in_order`), any other chunk by chunk."""
    shape = tuple(md.size)
    dtype = md.properties.dtype  # a DType, sizes and offsets integers >= 0: `unpickle` checked them
    if math.prod(shape) > MAX_NUMEL:
        raise CheckpointError(where, f"{fqn}: implausible shape {list(shape)}")
    table = _table_in_order(root, fqn, shape, dtype, md.chunks, storage, known, files, names, numbers, where)
    if table is not None:
        return TensorEntry(fqn, shape, dtype, table, md.properties)
    seen: set[tuple[int, ...]] = set()
    rank = len(shape)
    located = storage.entries(fqn)
    file_ids, places, all_offsets, all_sizes, all_transforms = array("I"), array("q"), [], [], {}
    for offsets, sizes in _pairs(md.chunks):
        if offsets in seen and 0 not in sizes:  # empty chunks of trailing ranks may share their place
            raise CheckpointError(where, f"{fqn}: two chunks at {list(offsets)}")
        seen.add(offsets)
        if len(offsets) != rank or len(sizes) != rank:
            raise CheckpointError(where, f"{fqn}: chunk rank {len(offsets)} does not match shape {list(shape)}")
        if not all(map(operator.le, map(operator.add, offsets, sizes), shape)):
            raise CheckpointError(
                where, f"{fqn}: chunk at {list(offsets)} of size {list(sizes)} lies outside shape {list(shape)}")
        entry = located.get(offsets)
        if entry is None:
            raise CheckpointError(where, f"{fqn}: chunk at {list(offsets)} has no storage entry")
        file = _located(root, fqn, entry, files, where)
        _, offset, length, transforms = entry
        least = -(-math.prod(sizes) // 2) if dtype.name in QUANTIZABLE else math.prod(sizes) * dtype.itemsize
        if not transforms and length < least:
            raise CheckpointError(root / file, f"{fqn}: item of {length} bytes cannot hold {least} bytes of data")
        number = numbers.get(file)
        if number is None:
            number = numbers[file] = len(names)
            names.append(file)
        if transforms:
            all_transforms[len(all_offsets)] = transforms
        file_ids.append(number)
        places.extend((offset, length))
        all_offsets.append(offsets)
        all_sizes.append(sizes)
    return TensorEntry(fqn, shape, dtype, ChunkTable(names, file_ids, places, all_offsets, all_sizes, all_transforms),
                       md.properties)


def open_checkpoint(path: str | os.PathLike, *, written_here: bool = False,
                    planned: Mapping[str, int] | None = None) -> Checkpoint:
    """Describe the checkpoint at `path` from its metadata; raises CheckpointError on bad input.

    `written_here`: an output this process has just written (`output_check`), whose keys need no
    scan for hash bombs; every other check is made. `planned`: the data files' sizes as planned, for
    an output whose `.metadata` is complete but whose files are still being written (the check that
    overlaps the writing): these sizes are taken for theirs, unread, and the directory is not listed
    (the caller compares the files on disk once they are complete)."""
    root = Path(path)
    store = store_for(root)
    kind = store.kind(root)
    if kind is EntryKind.MISSING:
        raise CheckpointError(as_typed(root), missing(root))
    if kind is not EntryKind.FOLDER:
        raise CheckpointError(root, "not a directory (a DCP checkpoint is a directory)")
    backend = megatron_backend(root)
    md_paths = _metadata_files(root)
    if not md_paths:
        if is_sharded_folder(root):  # torch's HF writer at save_distributed writes no .metadata
            return open_sharded_folder(root)
        raise CheckpointError(root, "no .metadata file (not a DCP checkpoint?)"
                              + checkpoints_inside(root, lambda p: store.kind(p / METADATA_NAME) is not EntryKind.MISSING
                                                   or store.kind(p / "__0.metadata") is not EntryKind.MISSING))
    with gc_paused():  # millions of small acyclic objects: the collector would rescan the growing heap
        ckpt = _checkpoint(root, md_paths, written_here, planned)
    ckpt.megatron_backend = backend
    return ckpt


def _checkpoint(root: Path, md_paths: list[Path], written_here: bool = False,
                planned: Mapping[str, int] | None = None) -> Checkpoint:
    """The checkpoint `md_paths` (its metadata files) describe, their entries checked (against the
    `planned` sizes of its files where given)."""
    where = md_paths[0]
    merged = _merge(md_paths, written_here)
    sd_md, storage = merged.sd_md, merged.storage
    files: dict[str, int] = dict(planned or {})  # a name already here is never resolved on disk
    names: list[str] = []
    numbers: dict[str, int] = {}
    known = _StorageFiles()
    tensors: dict[str, TensorEntry] = {}
    bytes_entries: dict[str, BytesEntry] = {}
    for fqn, item in sd_md.items():
        if isinstance(item, classes.TensorStorageMetadata):
            tensors[fqn] = _tensor_entry(root, fqn, item, storage, known, files, names, numbers, where)
        elif isinstance(item, classes.BytesStorageMetadata):
            entry = storage.entries(fqn).get(None)
            if entry is None:
                raise CheckpointError(where, f"{fqn}: bytes entry has no storage entry")
            file = _located(root, fqn, entry, files, where)
            bytes_entries[fqn] = BytesEntry(fqn, file, entry[1], entry[2], entry[3])
        else:
            raise CheckpointError(where, f"{fqn}: unknown storage type {type(item).__name__}")
    if planned is not None:
        referenced = {*names, *(b.file for b in bytes_entries.values())}
        unreferenced = [name for name in planned if name not in referenced]
    else:
        unreferenced = []
        store = store_for(root)
        for name in store.list(root):
            if name.endswith(".distcp") and name not in files and (info := _entry(store, root / name)) is not None:
                files[name] = info.size
                unreferenced.append(name)
    return Checkpoint(
        path=root,
        tensors=tensors,
        bytes_entries=bytes_entries,
        files=dict(sorted(files.items(), key=lambda kv: _natural(kv[0]))),
        planner_data=merged.planner or None,
        version=merged.version,
        metadata_files=tuple(p.name for p in md_paths),
        unreferenced_files=tuple(sorted(unreferenced, key=_natural)),
        storage_meta=merged.storage_meta,
        rank_conflicts=merged.conflicts,
        mcore_metadata=merged.mcore_metadata,
    )


def _natural(name: str) -> list:
    """Sort key that puts `__2_0.distcp` before `__10_0.distcp`: digit runs compare as numbers."""
    return [(0, int(t), "") if t.isdigit() else (1, 0, t) for t in re.split(r"(\d+)", name)]
