"""Find a chunk's raw tensor bytes inside a `.distcp` file without loading the item.

A DCP tensor item is a whole `torch.save` zip archive at (offset, length) in its file; its
tensor bytes are one stored (uncompressed) record. Reading the archive's central directory
and its restricted `data.pkl` gives the exact byte offset of element 0, so every later read
is a plain positioned read of exactly the bytes needed. Items written through a stream
transform (zstd) cannot be addressed that way and are decoded through torch instead; items
of `SerializationFormat.SAFETENSORS` checkpoints are located through the safetensors header.
"""

from __future__ import annotations

import io
import json
import math
import operator
import struct
import threading
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Callable

from ckptctl.core.dtypes import BY_SAFETENSORS
from ckptctl.util.errors import CheckpointError
from ckptctl.formats.dcp.block_scaled import BlockScaleError, dequantize
from ckptctl.formats.pickle.subclass import TE_FLOAT8, Float8RecordSpec, WrappedRecordSpec, names_subclass
from ckptctl.formats.pickle.te_blocks import BlockScaledRecordSpec
from ckptctl.formats.pickle.unpickle import (MalformedPickleError, TensorRecordSpec, UnsafePickleError,
                                             load_tensor_record_spec)
from ckptctl.core.checkpoint import BytesEntry, Checkpoint, Chunk, TensorEntry, dtype_name
from ckptctl.storage.store import ReadHandle, store_for

_LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")
_LOCAL_SIGNATURE = 0x04034B50
MAX_ZIP_READ = 16 << 20
"""Largest zip structure (central directory, data.pkl) read from an item; torch's are a few kB."""
MAX_SAFETENSORS_HEADER = 16 << 20
PEEK_BYTES = 512
"""What `peek_kind` reads of an item: torch.save's first record is `data.pkl`, its first global
within a hundred bytes of the item's start."""
FLOAT8_ITEM_OVERHEAD = 64 << 10
"""More than a TE Float8Tensor item holds besides its codes (its `data.pkl`, scale_inv and zip
records: about 3 kB)."""
MAX_WHOLE_READ = 1 << 30
"""Largest item read whole into memory when the caller names no bound: a bytes entry (a
pickled object: args, RNG or dataloader state) or its decompressed form. Tensor chunks
are read through `locate` in blocks, or whole with their own bound (`read_chunk`)."""
ITEM_OVERHEAD = 1 << 20
"""What a torch.save item may hold beyond its tensor's bytes (zip records, data.pkl, alignment)."""
ZIP_VERSIONS = frozenset({0, 10, 20, 45})
"""Versions needed to extract that torch.save's writer (0) and ordinary zip writers declare
(1.0, 2.0, 4.5 for zip64); anything else asks for features torch's reader does not have."""
ZIP_FLAGS = 0x8 | 0x800
"""General-purpose flag bits torch.save sets: sizes in a data descriptor, UTF-8 names."""
_ZIP_ERRORS = (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, struct.error, NotImplementedError,
               RuntimeError, UnicodeDecodeError, ValueError, OverflowError, OSError)
"""What `zipfile` raises for a damaged or foreign archive (unknown methods, encryption, bad names)."""


@dataclass(frozen=True, slots=True)
class _Fixed:
    """Bytes that must equal a validated item's outside its holes: the kept runs, taken out by one
    `itemgetter` of slices and compared as one tuple (in C: a few slices and compares an item,
    and nothing to compile when a template is made)."""

    length: int
    runs: Callable[[bytes], Any] | None
    want: Any

    def matches(self, data: bytes) -> bool:
        return len(data) == self.length and (self.runs is None or self.runs(data) == self.want)


@dataclass(frozen=True, slots=True)
class _Template:
    """A fully validated item and the byte ranges that may differ in another item of the same
    structure: the tensor bytes, CRC-32 fields, the serialization id. An item whose other bytes
    are equal has the same zip directory, headers and `data.pkl`, so its tensor bytes are at
    the same place: located by one or two reads and a compare, without parsing it again."""

    data_start: int
    nbytes: int
    whole: _Fixed | None  # a small item whole, the tensor bytes a hole: read and compared at once
    head: _Fixed | None  # a larger one's bytes before the tensor data...
    tail: _Fixed | None  # ...and after it


MAX_TEMPLATE_ITEM = 1 << 16
"""Items up to this size are read whole in one `pread` to be compared with their template."""
READ_AHEAD_MIN, READ_AHEAD = 1 << 15, 1 << 19
"""Bytes read at once, first and at most, where small items are read front to back in a file (a
reshard of tiny chunks reads each rank file's items in order): one `pread` a window, not one an item."""
READ_WINDOWS = 4
"""Read-ahead windows kept (one per source file being read front to back: a rank file's records
read two when halving the world size)."""
MAX_TEMPLATES = 4096
"""Templates kept per reader (one per chunk dtype, shape and item length; a few per tensor kind)."""


def _kept(data: bytes, base: int, holes: list[tuple[int, int]]) -> _Fixed:
    """What another item must hold where this one holds `data` (its bytes from offset `base`):
    the same bytes outside `holes`."""
    runs, at = [], 0
    for start, stop in sorted((a - base, b - base) for a, b in holes if base <= a and b - base <= len(data)):
        if start > at:
            runs.append(slice(at, start))
        at = max(at, stop)
    if at < len(data):
        runs.append(slice(at, len(data)))
    if not runs:
        return _Fixed(len(data), None, None)
    getter = operator.itemgetter(*runs)
    return _Fixed(len(data), getter, getter(bytes(data)))


@dataclass(frozen=True, slots=True)
class _Float8Item:
    """Where a TE Float8Tensor item's FP8 codes (row-major, one byte each) and its scale_inv are."""

    spec: Float8RecordSpec
    data_at: int
    scale_at: int


@dataclass(frozen=True, slots=True)
class _BlockItem:
    """Where a TE block-scaled item's records (rowwise codes, scales, NVFP4's amax) start."""

    spec: BlockScaledRecordSpec
    starts: tuple[int, ...]


@dataclass(frozen=True)
class RawRecord:
    """A chunk's tensor bytes, row-major and dense: `nbytes` bytes at `byte_offset` of `path`."""

    path: Path
    byte_offset: int
    nbytes: int


class ItemReader:
    """Opens a checkpoint's files read-only, lazily, through its store, and answers where each
    chunk's bytes are. Hot reads go through the handle's `positioned_reader`, taken once a file."""

    def __init__(self, ckpt: Checkpoint) -> None:
        self.ckpt = ckpt
        self._store = store_for(ckpt.path)
        self._handles: dict[str, ReadHandle] = {}
        self._readers: dict[str, Callable[[int, int], bytes]] = {}
        self._lock = threading.Lock()
        self._safetensors_headers: dict[tuple[str, int], dict] = {}
        self._templates: dict[tuple[Any, tuple[int, ...], int], _Template] = {}
        self._paths: dict[str, Path] = {}
        self._windows: dict[str, tuple[int, bytes, int]] = {}  # file -> (start, bytes, end of the last item read)
        self._windows_lock = threading.Lock()
        self._kinds: dict[tuple[str, int], str] = {}  # (file, offset) → a wrapped item's kind
        self._float8: dict[tuple[str, int], _Float8Item] = {}  # (file, offset) → a TE Float8Tensor item
        self._blocks: dict[tuple[str, int], _BlockItem] = {}  # (file, offset) → a TE block-scaled item
        self.dequantize_fp8 = False
        """Whether `read_chunk` may dequantize a TE Float8Tensor item (export-hf, diff): a command
        that keeps items exactly (reshard) refuses it."""
        self.fp8_codes: frozenset[str] = frozenset()
        """Tensors whose chunks are read as their TE Float8Tensor items' FP8 codes, one byte an
        element (a reshard that keeps them: `formats.dcp.te_float8`); any other item of theirs is refused."""

    def close(self) -> None:
        with self._lock:
            for handle in self._handles.values():
                handle.close()
            self._handles.clear()
            self._readers.clear()

    def __enter__(self) -> "ItemReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def positioned_reader(self, file: str) -> Callable[[int, int], bytes]:
        """`file`'s (length, offset) → bytes function, for loops of positioned reads."""
        read = self._readers.get(file)  # an open file's without the lock (a dict read is atomic)
        if read is not None:
            return read
        self.handle(file)
        return self._readers[file]

    def handle(self, file: str) -> ReadHandle:
        """`file` opened through the checkpoint's store (once; threads share it)."""
        handle = self._handles.get(file)
        if handle is not None:
            return handle
        with self._lock:
            if file not in self._handles:
                handle = self._handles[file] = self._store.open_read(self.ckpt.path / file)
                self._readers[file] = handle.positioned_reader()
            return self._handles[file]

    def _bad(self, chunk: Chunk, reason: str) -> CheckpointError:
        return CheckpointError(self.ckpt.path / chunk.file, f"item at byte {chunk.offset}: {reason}")

    def locate(self, entry: TensorEntry, chunk: Chunk) -> RawRecord | None:
        """Where the chunk's dense bytes are, or None when the item must be decoded (transforms)."""
        if entry.fqn in self.fp8_codes:
            return self._codes(entry, chunk)
        if chunk.transforms:
            return None
        if self.ckpt.dense(chunk.file):  # a safetensors folder's: its header was checked on opening
            return RawRecord(self._path(chunk.file), chunk.offset, chunk.length)
        key = (entry.dtype, chunk.sizes, chunk.length)
        template = self._templates.get(key)
        if template is not None and self._matches(template, chunk):  # a torch.save item like one validated
            return RawRecord(self._path(chunk.file), chunk.offset + template.data_start, template.nbytes)
        header = self._safetensors_header(chunk.file, chunk.offset)
        if header is not None:
            return self._locate_safetensors(entry, chunk, header)
        return self._locate_torch_save(entry, chunk, key, template)

    def small_data(self, entry: TensorEntry, chunk: Chunk) -> memoryview | None:
        """A small item's tensor bytes, read whole and checked against the template of its kind
        in one `pread`; None when it is not small, no item of its kind was validated yet, or it
        differs from the template (`locate` then parses it). At a million tiny chunks, one read
        per chunk instead of two."""
        if chunk.transforms or self.ckpt.dense(chunk.file) or chunk.length > MAX_TEMPLATE_ITEM \
                or entry.fqn in self.fp8_codes:
            return None
        template = self._templates.get((entry.dtype, chunk.sizes, chunk.length))
        if template is None or template.whole is None:
            return None
        whole = bytes(self._item_bytes(chunk))
        if not template.whole.matches(whole):
            return None
        return memoryview(whole)[template.data_start:template.data_start + template.nbytes]

    def _item_bytes(self, chunk: Chunk) -> memoryview:
        """A small item's bytes (fewer at the end of its file), from the window on its file when the
        window holds them. A read that starts where the file's last one ended reads ahead, twice as
        far as the last time up to READ_AHEAD (as the kernel's read-ahead grows); any other reads
        the item alone. Windows are shared by the threads: READ_WINDOWS × READ_AHEAD bytes at most."""
        start, end = chunk.offset, chunk.offset + chunk.length
        with self._windows_lock:
            at, data, last_end = self._windows.get(chunk.file, (0, b"", -1))
            if at <= start and end <= at + len(data):
                self._windows[chunk.file] = (at, data, end)
                return memoryview(data)[start - at:end - at]
        size = min(READ_AHEAD, max(2 * len(data), READ_AHEAD_MIN)) if start == last_end else 0
        data = self.positioned_reader(chunk.file)(max(chunk.length, size), start)
        with self._windows_lock:
            if chunk.file not in self._windows and len(self._windows) >= READ_WINDOWS:
                self._windows.clear()
            self._windows[chunk.file] = (start, data, end)
        return memoryview(data)[:chunk.length]

    def _path(self, file: str) -> Path:
        path = self._paths.get(file)
        if path is None:
            path = self._paths[file] = self.ckpt.path / file
        return path

    def _locate_torch_save(self, entry: TensorEntry, chunk: Chunk, key: tuple, template: _Template | None
                           ) -> RawRecord | None:
        try:
            archive = zipfile.ZipFile(self.handle(chunk.file).window(chunk.offset, chunk.length, MAX_ZIP_READ))
            names = {info.filename: info for info in archive.infolist()}
            pkl = next((n for n in names if n.endswith("/data.pkl") or n == "data.pkl"), None)
            if pkl is None:
                raise self._bad(chunk, "torch.save archive without data.pkl")
            self._check_entry(chunk, archive, names[pkl], max_size=MAX_ZIP_READ)
            spec = load_tensor_record_spec(archive.read(pkl))
        except CheckpointError:
            raise
        except UnsafePickleError as exc:
            raise self._bad(chunk, f"hostile or foreign data.pkl: {exc}") from None
        except MalformedPickleError as exc:
            raise self._bad(chunk, f"corrupt data.pkl: {exc}") from None
        except _ZIP_ERRORS as exc:
            raise self._bad(chunk, f"not a torch.save archive ({type(exc).__name__}: {exc})") from None
        wrapped = type(spec) is WrappedRecordSpec  # torchao's wrapper: its value is the plain tensor it holds
        if wrapped:
            self._kinds[(chunk.file, chunk.offset)] = f"{spec.kind} (casts to {spec.cast.name})"
            spec = spec.inner
        if spec.dtype != entry.dtype or spec.size != chunk.sizes:
            raise self._bad(chunk, f"{entry.fqn}: item holds {dtype_name(spec.dtype)} {list(spec.size)}, "
                                   f"metadata says {entry.dtype_name} {list(chunk.sizes)}")
        folder = pkl[: -len("data.pkl")]
        if type(spec) is Float8RecordSpec:  # TE's FP8 codes and scale: decoded by `read_chunk` alone
            self._float8[(chunk.file, chunk.offset)] = self._float8_item(entry, chunk, archive, names, folder, spec)
            return None
        if type(spec) is BlockScaledRecordSpec:  # TE's MXFP8, blockwise, NVFP4: decoded by `read_chunk` alone
            self._blocks[(chunk.file, chunk.offset)] = self._block_item(entry, chunk, archive, names, folder, spec)
            return None
        data_start = self._record_start(entry, chunk, archive, names, folder, spec)
        if wrapped and not spec.is_dense:
            raise self._bad(chunk, f"{entry.fqn}: {self._kinds[(chunk.file, chunk.offset)]} holding a strided tensor")
        if not spec.is_dense or self._big_endian(chunk, archive, names, folder):
            return None  # decoded by torch (`read_chunk`), which swaps bytes and gathers strides
        itemsize = spec.dtype.itemsize
        start = data_start + spec.storage_offset * itemsize
        if template is None:
            made = self._template(chunk, archive, start, chunk.numel * itemsize)
            if made is not None:
                self._templates[key] = made
        return RawRecord(self._path(chunk.file), chunk.offset + start, chunk.numel * itemsize)

    def _record_start(self, entry: TensorEntry, chunk: Chunk, archive: zipfile.ZipFile,
                      names: dict[str, zipfile.ZipInfo], folder: str, spec: TensorRecordSpec) -> int:
        """Where the bytes of `spec`'s storage record start in the item, once it is checked to hold them."""
        record = names.get(folder + f"data/{spec.storage_key}")
        if record is None:
            raise self._bad(chunk, "tensor record missing")
        itemsize = spec.dtype.itemsize
        if record.file_size != spec.storage_numel * itemsize:
            raise self._bad(chunk, f"tensor record is {record.file_size} bytes but its storage is "
                                   f"{spec.storage_numel} × {itemsize} bytes")
        if math.prod(spec.size) and spec.storage_offset + sum((d - 1) * s for d, s in zip(spec.size, spec.stride)) \
                >= spec.storage_numel:
            raise self._bad(chunk, "tensor view runs past its storage")
        return self._check_entry(chunk, archive, record)

    def _float8_item(self, entry: TensorEntry, chunk: Chunk, archive: zipfile.ZipFile,
                     names: dict[str, zipfile.ZipInfo], folder: str, spec: Float8RecordSpec) -> _Float8Item:
        """A TE Float8Tensor item's codes and scale, checked: dense little-endian records in the item."""
        data_start = self._record_start(entry, chunk, archive, names, folder, spec.data)
        scale_start = self._record_start(entry, chunk, archive, names, folder, spec.scale_inv)
        if not spec.data.is_dense or self._big_endian(chunk, archive, names, folder):
            raise self._bad(chunk, f"{entry.fqn}: {spec.kind} with strided or big-endian data")
        return _Float8Item(spec, data_start + spec.data.storage_offset,
                           scale_start + 4 * spec.scale_inv.storage_offset)

    def _block_item(self, entry: TensorEntry, chunk: Chunk, archive: zipfile.ZipFile,
                    names: dict[str, zipfile.ZipInfo], folder: str, spec: BlockScaledRecordSpec) -> _BlockItem:
        """A TE block-scaled item's records, checked: dense little-endian records in the item."""
        if self._big_endian(chunk, archive, names, folder) or not all(r.is_dense for r in spec.records()):
            raise self._bad(chunk, f"{entry.fqn}: {spec.kind} with strided or big-endian records")
        return _BlockItem(spec, tuple(self._record_start(entry, chunk, archive, names, folder, r)
                                      + r.storage_offset * r.dtype.itemsize for r in spec.records()))

    def float8_item(self, entry: TensorEntry, chunk: Chunk) -> tuple[Float8RecordSpec, bytes] | None:
        """A TE Float8Tensor chunk's spec and its scale_inv's four bytes; None for any other item."""
        if chunk.transforms or self.ckpt.dense(chunk.file) or self._safetensors_header(chunk.file, chunk.offset):
            return None
        key = (chunk.file, chunk.offset)
        if key not in self._kinds and key not in self._float8:
            self._locate_torch_save(entry, chunk, (entry.dtype, chunk.sizes, chunk.length), None)
        item = self._float8.get(key)
        return None if item is None else (item.spec, self.located_scale(chunk))

    def block_item(self, entry: TensorEntry, chunk: Chunk) -> tuple[BlockScaledRecordSpec, bytes] | None:
        """A TE block-scaled chunk's spec and its rowwise scales' bytes (padding included, as
        saved); None for any other item."""
        item = self._located_block(entry, chunk)
        if item is None:
            return None
        nbytes = item.spec.scales.storage_numel * item.spec.scales.dtype.itemsize
        scales = self.positioned_reader(chunk.file)(nbytes, chunk.offset + item.starts[1])
        if len(scales) != nbytes:
            raise self._bad(chunk, "short read")
        return item.spec, scales

    def _located_block(self, entry: TensorEntry, chunk: Chunk) -> _BlockItem | None:
        if chunk.transforms or self.ckpt.dense(chunk.file) or self._safetensors_header(chunk.file, chunk.offset):
            return None
        key = (chunk.file, chunk.offset)
        if key not in self._kinds and key not in self._blocks and key not in self._float8:
            self._locate_torch_save(entry, chunk, (entry.dtype, chunk.sizes, chunk.length), None)
        return self._blocks.get(key)

    def located_scale(self, chunk: Chunk) -> bytes | None:
        """The scale_inv (four bytes) of a chunk already located as a TE Float8Tensor item (a chunk
        is located before it is read); None for any other."""
        item = self._float8.get((chunk.file, chunk.offset))
        if item is None:
            return None
        scale = self.positioned_reader(chunk.file)(4, chunk.offset + item.scale_at)
        if len(scale) != 4:
            raise self._bad(chunk, "short read")
        return scale

    def holds_float8(self, entry: TensorEntry) -> bool:
        """Whether the tensor's first item is a TE Float8Tensor (one small read for any other; none
        for an item longer than a Float8Tensor's of its chunk could be)."""
        first = next((c for c in entry.chunks if c.length), None)
        return first is not None and first.length <= first.numel + FLOAT8_ITEM_OVERHEAD \
            and self.names_subclass(first) and self.float8_item(entry, first) is not None

    def _codes(self, entry: TensorEntry, chunk: Chunk) -> RawRecord:
        """Where a TE Float8Tensor's or MXFP8Tensor's chunk's FP8 codes are (`fp8_codes`)."""
        block = None if (chunk.file, chunk.offset) in self._float8 else self._located_block(entry, chunk)
        if block is not None and block.spec.scaling.codes != "e2m1":  # codes of the logical shape, one byte each
            return RawRecord(self._path(chunk.file), chunk.offset + block.starts[0], chunk.numel)
        if self.float8_item(entry, chunk) is None:
            raise self._bad(chunk, f"{entry.fqn}: not a {TE_FLOAT8} item, where its tensor's others are")
        return RawRecord(self._path(chunk.file), chunk.offset + self._float8[(chunk.file, chunk.offset)].data_at,
                         chunk.numel)

    def peek_kind(self, entry: TensorEntry, chunk: Chunk) -> str | None:
        """`item_kind` for an item whose first `PEEK_BYTES` (its zip header and the start of its
        `data.pkl`, where the first global is named) name one of the subclasses; None for any
        other without parsing it (one small read: `inspect` asks this of each tensor's first item)."""
        return self.item_kind(entry, chunk) if self.names_subclass(chunk) else None

    def names_subclass(self, chunk: Chunk) -> bool:
        """Whether the chunk's item's first `PEEK_BYTES` name one of the subclasses (one small read)."""
        if chunk.transforms or self.ckpt.dense(chunk.file) or not chunk.length:
            return False
        return names_subclass(self.handle(chunk.file).read_at(min(PEEK_BYTES, chunk.length), chunk.offset))

    def item_kind(self, entry: TensorEntry, chunk: Chunk) -> str | None:
        """What the chunk's item holds when it is not a plain tensor: torchao's wrapper, TE's
        Float8Tensor (its FP8 format, scale and logical dtype); None for a plain tensor."""
        if chunk.transforms or self.ckpt.dense(chunk.file):
            return None
        key = (chunk.file, chunk.offset)
        if key not in self._kinds and key not in self._float8 and key not in self._blocks:
            self._locate_torch_save(entry, chunk, (entry.dtype, chunk.sizes, chunk.length), None)
        if key in self._float8 or key in self._blocks:
            spec = self._float8[key].spec if key in self._float8 else self._blocks[key].spec
            return f"{spec.kind}: {spec.describe()}"
        return self._kinds.get(key)

    def _template(self, chunk: Chunk, archive: zipfile.ZipFile, data_start: int, nbytes: int) -> _Template | None:
        """`chunk`'s validated item as a template: the CRC fields of its tensor record and of its
        serialization id, and the id itself, are what another item may hold differently (every
        other record, `data.pkl` included, must be byte-identical, its CRC with it)."""
        tail_len = chunk.length - data_start - nbytes
        if chunk.length - archive.start_dir > MAX_ZIP_READ or data_start > MAX_ZIP_READ \
                or len(self._templates) >= MAX_TEMPLATES:
            return None
        holes: list[tuple[int, int]] = []  # (start, stop) in the item
        item = self.handle(chunk.file)
        central = item.read_at(chunk.length - archive.start_dir, chunk.offset + archive.start_dir)
        pos = 0
        for info in archive.infolist():  # the directory's records, in order
            record_at = archive.start_dir + pos
            if central[pos:pos + 4] != b"PK\x01\x02" or len(central) < pos + 46:
                return None  # a directory zipfile reads otherwise than record after record: no template
            name_len, extra_len, comment_len = struct.unpack_from("<HHH", central, pos + 28)
            pos += 46 + name_len + extra_len + comment_len
            local = item.read_at(_LOCAL_HEADER.size, chunk.offset + info.header_offset) \
                if 0 <= info.header_offset <= chunk.length - _LOCAL_HEADER.size else b""
            if len(local) != _LOCAL_HEADER.size:  # a record no check looked at is damaged: no template
                return None
            start = info.header_offset + _LOCAL_HEADER.size + sum(struct.unpack_from("<HH", local, 26))
            is_id = info.filename.endswith("/.data/serialization_id")
            if start != data_start and not is_id:
                continue
            holes += [(record_at + 16, record_at + 20), (info.header_offset + 14, info.header_offset + 18)]
            end = start + info.compress_size
            if info.flag_bits & 0x8:  # data descriptor: optional signature, then the CRC
                at = end + 4 * (item.read_at(4, chunk.offset + end) == b"PK\x07\x08")
                holes.append((at, at + 4))
            if is_id:
                holes.append((start, end))
        data_end = data_start + nbytes
        head = item.read_at(data_start, chunk.offset)
        tail = item.read_at(tail_len, chunk.offset + data_end)
        if chunk.length <= MAX_TEMPLATE_ITEM:
            whole = head + bytes(nbytes) + tail
            return _Template(data_start, nbytes, _kept(whole, 0, [*holes, (data_start, data_end)]), None, None)
        return _Template(data_start, nbytes, None, _kept(head, 0, holes), _kept(tail, data_end, holes))

    def _matches(self, template: _Template, chunk: Chunk) -> bool:
        """Whether the item holds the template's bytes everywhere but its variable fields and data."""
        read = self.positioned_reader(chunk.file)
        if template.whole is not None:
            return template.whole.matches(read(chunk.length, chunk.offset))
        data_end = template.data_start + template.nbytes
        return template.head.matches(read(template.data_start, chunk.offset)) \
            and template.tail.matches(read(chunk.length - data_end, chunk.offset + data_end))

    def _big_endian(self, chunk: Chunk, archive: zipfile.ZipFile, names: dict[str, zipfile.ZipInfo],
                    folder: str) -> bool:
        """Whether torch saved the item on a big-endian machine (`byteorder` record): its raw
        bytes are not the little-endian values a copy writes. No record means native order."""
        info = names.get(folder + "byteorder")
        if info is None:
            return False
        self._check_entry(chunk, archive, info, max_size=16)
        try:
            order = archive.read(info)
        except _ZIP_ERRORS as exc:
            raise self._bad(chunk, f"not a torch.save archive ({type(exc).__name__}: {exc})") from None
        if order not in (b"little", b"big"):
            raise self._bad(chunk, f"byteorder record says {order[:16]!r}")
        return order == b"big"

    def _check_entry(self, chunk: Chunk, archive: zipfile.ZipFile, info: zipfile.ZipInfo,
                     max_size: int | None = None) -> int:
        """Where `info`'s bytes start in the item, after checking what torch's reader relies on:
        stored, not encrypted, its local header where the directory says and naming the same
        entry, its bytes inside the item, before the central directory, overlapping no other entry."""
        if info.compress_type != zipfile.ZIP_STORED or info.compress_size != info.file_size:
            raise self._bad(chunk, f"zip entry {info.filename} is compressed (method {info.compress_type}); "
                                   "torch.save stores entries")
        head = self.positioned_reader(chunk.file)(_LOCAL_HEADER.size, chunk.offset + info.header_offset) \
            if 0 <= info.header_offset <= chunk.length - _LOCAL_HEADER.size else b""
        fields = _LOCAL_HEADER.unpack(head) if len(head) == _LOCAL_HEADER.size else (0, 0, 0)
        local_flags, local_version = (fields[2], fields[1]) if fields[0] == _LOCAL_SIGNATURE else (0, 0)
        if (info.flag_bits | local_flags) & 0x1:
            raise self._bad(chunk, f"zip entry {info.filename} is encrypted")
        if (info.flag_bits | local_flags) & ~ZIP_FLAGS:
            raise self._bad(chunk, f"zip entry {info.filename} has unknown flag bits "
                                   f"0x{(info.flag_bits | local_flags) & ~ZIP_FLAGS & 0xFFFF:04x}")
        for version in (info.extract_version, local_version):
            if version not in ZIP_VERSIONS:
                raise self._bad(chunk, f"zip entry {info.filename} needs zip version {version}, "
                                       "not one torch.save archives use")
        if max_size is not None and info.file_size > max_size:
            raise self._bad(chunk, f"zip entry {info.filename} is implausibly large ({info.file_size} bytes)")
        at = info.header_offset
        if not 0 <= at <= chunk.length - _LOCAL_HEADER.size:
            raise self._bad(chunk, f"zip entry {info.filename} has its header outside the item")
        if fields[0] != _LOCAL_SIGNATURE:
            raise self._bad(chunk, f"zip entry {info.filename}: corrupt local header")
        name_len, extra_len = fields[-2:]
        name = self.positioned_reader(chunk.file)(name_len, chunk.offset + at + _LOCAL_HEADER.size)
        if name != info.orig_filename.encode("utf-8" if info.flag_bits & 0x800 else "cp437", "replace"):
            raise self._bad(chunk, f"zip entry {info.filename}: local header names another entry")
        start = at + _LOCAL_HEADER.size + name_len + extra_len
        end = start + info.file_size
        if end > min(chunk.length, archive.start_dir):
            raise self._bad(chunk, f"zip entry {info.filename} runs past the item or into its directory")
        for other in archive.infolist():
            if other is not info and at <= other.header_offset < end:
                raise self._bad(chunk, f"zip entry {info.filename} overlaps entry {other.filename}")
            if other is not info and other.header_offset < at < other.header_offset + _LOCAL_HEADER.size + \
                    len(other.orig_filename) + other.compress_size:
                raise self._bad(chunk, f"zip entry {info.filename} starts inside entry {other.filename}")
        return start

    def _safetensors_header(self, file: str, offset: int) -> dict | None:
        """The JSON header when a SAFETENSORS-format DCP blob starts at `offset` of `file`, else None.

        Such a writer puts a rank's bytes items first and then one safetensors blob holding
        all its tensors; every tensor item's (offset, length) is (blob start, numel × itemsize).
        Only blobs are remembered: a torch.save item is asked about once, and millions of
        remembered "no" answers would cost more memory than the metadata.
        """
        key = (file, offset)
        header = self._safetensors_headers.get(key)
        if header is not None:
            return header
        blob = self.handle(file)
        prefix = blob.read_at(9, offset)
        if len(prefix) != 9 or prefix[8:9] != b"{":  # a torch.save item has its method's 0 there
            return None
        (n,) = struct.unpack("<Q", prefix[:8])
        if n >= MAX_SAFETENSORS_HEADER:
            raise CheckpointError(self.ckpt.path / file, f"item at byte {offset}: safetensors header of {n} "
                                                         f"bytes is over the {MAX_SAFETENSORS_HEADER}-byte limit")
        if n >= min(self.ckpt.files.get(file, 0) - offset, MAX_SAFETENSORS_HEADER):
            return None
        try:
            parsed = json.loads(blob.read_at(n, offset + 8))
        except (ValueError, RecursionError):  # not JSON, or nested past the parser's depth
            return None
        meta = parsed.get("__metadata__") if isinstance(parsed, dict) else None
        if not isinstance(meta, dict) or "DCP_SHARDING_INFO" not in meta:
            return None
        try:  # parsed once per blob: each of its records is checked against it
            offsets = json.loads(meta["DCP_SHARDING_INFO"])
        except (ValueError, TypeError, RecursionError):
            offsets = None
        header = self._safetensors_headers[key] = {"json": parsed, "data_start": offset + 8 + n, "offsets": offsets}
        return header

    def _locate_safetensors(self, entry: TensorEntry, chunk: Chunk, header: dict) -> RawRecord:
        info = header["json"].get(entry.fqn)
        if not isinstance(info, dict):
            raise self._bad(chunk, f"{entry.fqn} not in safetensors header")
        try:
            start, end = (int(v) for v in info["data_offsets"])
            dtype, shape = BY_SAFETENSORS.get(info["dtype"]), tuple(info["shape"])
        except (KeyError, TypeError, ValueError) as exc:
            raise self._bad(chunk, f"{entry.fqn}: malformed safetensors header entry") from exc
        if (dtype != entry.dtype or shape != chunk.sizes or not 0 <= start <= end
                or end - start != chunk.numel * dtype.itemsize):
            raise self._bad(chunk, f"{entry.fqn}: safetensors record does not match metadata")
        if not self._saved_offsets_match(header, entry.fqn, chunk.offsets):
            raise self._bad(chunk, f"{entry.fqn}: safetensors record is the chunk at other offsets")
        if header["data_start"] + end > self.ckpt.files.get(chunk.file, 0):
            raise self._bad(chunk, f"{entry.fqn}: safetensors record runs past the file")
        return RawRecord(self.ckpt.path / chunk.file, header["data_start"] + start, end - start)

    @staticmethod
    def _saved_offsets_match(header: dict, fqn: str, offsets: tuple[int, ...]) -> bool:
        """torch's HF reader takes a record's global offsets from `DCP_SHARDING_INFO`; so do we."""
        try:
            return tuple(header["offsets"][fqn]["saved_offsets"]) == offsets
        except (KeyError, TypeError):
            return False

    def read_item_bytes(self, file: str, offset: int, length: int, transforms: tuple[str, ...],
                        limit: int = MAX_WHOLE_READ) -> bytes:
        """An item's bytes with any stream transforms undone, read whole: refused before
        allocating when the item (or what its transforms undo to) is over `limit` bytes."""
        if length > limit:
            raise CheckpointError(self.ckpt.path / file, f"item at byte {offset}: {length} bytes, over the {limit}-byte "
                                                         "limit for an item read whole")
        data = self.handle(file).read_at(length, offset)
        if len(data) != length:
            raise CheckpointError(self.ckpt.path / file, f"short read at byte {offset}")
        if not transforms:
            return data
        from torch.distributed.checkpoint._extension import ExtensionRegistry, StreamTransformExtension

        stream: IO[bytes] = io.BytesIO(data)
        try:
            for ext in ExtensionRegistry().from_descriptor_list(list(transforms)):
                if isinstance(ext, StreamTransformExtension):
                    stream = ext.transform_from(stream)
            data = stream.read(limit + 1)  # decompression stops one byte past the limit
        except ValueError as exc:
            raise CheckpointError(self.ckpt.path / file, f"cannot undo transforms {list(transforms)}: {exc}") from exc
        except Exception as exc:  # noqa: BLE001 - a corrupt stream raises the decompressor's own error types
            raise CheckpointError(self.ckpt.path / file, f"item at byte {offset}: cannot undo transforms "
                                                         f"{list(transforms)} ({type(exc).__name__})") from None
        if len(data) > limit:
            raise CheckpointError(self.ckpt.path / file, f"item at byte {offset}: transforms undo to more than "
                                                         f"{limit} bytes")
        return data

    def read_chunk(self, entry: TensorEntry, chunk: Chunk) -> Any:
        """The chunk as a dense torch tensor (one chunk in memory): the fallback and verification path."""
        import torch

        record = self.locate(entry, chunk)
        float8 = self._float8.get((chunk.file, chunk.offset)) if record is None else None
        if float8 is not None:
            return self._dequantized(entry, chunk, float8)
        block = self._blocks.get((chunk.file, chunk.offset)) if record is None else None
        if block is not None:
            return self._block_dequantized(entry, chunk, block)
        if record is not None:
            data = bytearray(self.positioned_reader(chunk.file)(record.nbytes, record.byte_offset))
            if len(data) != record.nbytes:
                raise self._bad(chunk, "short read")
            flat = torch.frombuffer(data, dtype=entry.dtype.torch) if data else torch.empty(0, dtype=entry.dtype.torch)
            return flat.reshape(chunk.sizes)
        raw = self.read_item_bytes(chunk.file, chunk.offset, chunk.length, chunk.transforms,
                                   max(chunk.length if not chunk.transforms else 0,
                                       chunk.numel * entry.dtype.itemsize + ITEM_OVERHEAD))
        try:
            tensor = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
        except Exception as exc:  # torch raises many types for a corrupt archive
            raise self._bad(chunk, f"cannot decode item ({type(exc).__name__})") from exc
        if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != chunk.sizes or tensor.dtype != entry.dtype:
            raise self._bad(chunk, f"{entry.fqn}: decoded item does not match metadata")
        return tensor.contiguous()

    def _dequantized(self, entry: TensorEntry, chunk: Chunk, item: _Float8Item) -> Any:
        """A TE Float8Tensor chunk's value as TE's dequantize computes it: float32(code) × scale_inv,
        rounded to the logical dtype (`dequantize_fp8.cuh`); refused unless `dequantize_fp8`."""
        import torch

        spec = item.spec
        if not self.dequantize_fp8:
            raise self._bad(chunk, f"{entry.fqn} is a {spec.kind} ({spec.describe()}); this command keeps "
                                   "tensors exactly and cannot rewrite FP8 items here (reshard keeps them at FSDP2's "
                                   "layout; export-hf and export-torch dequantize them)")
        read = self.positioned_reader(chunk.file)
        codes = bytearray(read(chunk.numel, chunk.offset + item.data_at))
        scale = read(4, chunk.offset + item.scale_at)
        if len(codes) != chunk.numel or len(scale) != 4:
            raise self._bad(chunk, "short read")
        values = torch.frombuffer(codes, dtype=torch.uint8) if codes else torch.empty(0, dtype=torch.uint8)
        scale_inv = torch.frombuffer(bytearray(scale), dtype=torch.float32)
        return (values.view(spec.fp8.torch).float() * scale_inv).to(entry.dtype.torch).reshape(chunk.sizes)

    def _block_dequantized(self, entry: TensorEntry, chunk: Chunk, item: _BlockItem) -> Any:
        """A TE block-scaled chunk's value as TE's dequantize computes it (`block_scaled.dequantize`);
        refused unless `dequantize_fp8`, and where TE's dequantize gives no value."""
        import torch

        spec = item.spec
        if not self.dequantize_fp8:
            raise self._bad(chunk, f"{entry.fqn} is a {spec.kind} ({spec.describe()}); this command keeps "
                                   "tensors exactly and cannot rewrite block-scaled items (export-hf dequantizes "
                                   "them)")
        read, records = self.positioned_reader(chunk.file), []
        for record, start in zip(spec.records(), item.starts):
            nbytes = math.prod(record.size) * record.dtype.itemsize
            raw = bytearray(read(nbytes, chunk.offset + start))
            if len(raw) != nbytes:
                raise self._bad(chunk, "short read")
            records.append(torch.frombuffer(raw, dtype=record.dtype.torch) if raw
                           else torch.empty(0, dtype=record.dtype.torch))
        try:
            return dequantize(spec.scaling, spec.size, entry.dtype.torch, *records)
        except BlockScaleError as exc:
            raise self._bad(chunk, f"{entry.fqn}: {exc}") from None

    def load_bytes_value(self, entry: BytesEntry, safe_globals: list | None = None) -> Any:
        """A bytes entry's object, via `torch.load(weights_only=True)` (plus any named safe globals)."""
        import torch

        raw = self.read_item_bytes(entry.file, entry.offset, entry.length, entry.transforms)
        try:
            with torch.serialization.safe_globals(safe_globals or []):
                return torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
        except Exception as exc:  # weights_only refusals and corrupt archives alike
            raise CheckpointError(self.ckpt.path / entry.file, f"{entry.fqn}: cannot decode bytes entry ({exc})".splitlines()[0]) from exc
