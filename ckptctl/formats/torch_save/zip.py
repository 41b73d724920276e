"""Write a `torch.save(tensor)` archive around tensor bytes that are streamed in, not held.

DCP stores each tensor item as a complete `torch.save` zip archive. To stream bytes from
source records straight to an output record, ckptctl lays the archive out itself: the
records before the tensor data (its `data.pkl` and torch's small marker records) form a
*head*, the tensor bytes follow (64-byte aligned, as torch aligns them), and the rest of
the archive (data descriptor with the CRC-32, trailing records, central directory) forms a
*tail* that is built once the data's CRC is known. Sizes are known up front, so every
item's byte range in its file is known at planning time. The archive is what torch's own
streaming writer produces: stored entries, data descriptors, zip64 when sizes need it.
"""

from __future__ import annotations

import collections
import functools
import hashlib
import math
import struct
import zlib
from dataclasses import dataclass

from ckptctl.core.dtypes import DType, as_dtype
from ckptctl.formats.pickle.torch_pickle import Call, Persistent, dumps, ref
from ckptctl.core.geometry import strides

ARCHIVE = "archive"
ALIGNMENT = 64
_FLAGS = 0x0808  # data descriptor follows the data; names are UTF-8
_ZIP64_LIMIT = 0xFFFFFFFF
MARKER_RECORDS = ((".format_version", b"1"), (".storage_alignment", str(ALIGNMENT).encode()), ("byteorder", b"little"))
"""The small records torch.save writes after `data.pkl`, before the storages."""
TRAILING_VERSION = b"3\n"
"""The `version` record torch.save writes after the storages."""


def tensor_reduce(dtype: DType, shape: tuple[int, ...], key: str, stride: tuple[int, ...] | None = None) -> Call:
    """How torch.save pickles a dense CPU tensor whose storage is record `data/{key}`: a
    typed storage and `_rebuild_tensor_v2` for dtypes that have one, else v3 with the dtype."""
    numel = math.prod(shape)
    stride = strides(shape) if stride is None else stride
    hooks = collections.OrderedDict()
    if dtype.storage:  # dtypes with a legacy typed storage: torch keeps the v2 format
        storage = Persistent(("storage", ref("torch", dtype.storage), key, "cpu", numel))
        return Call(ref("torch._utils", "_rebuild_tensor_v2"), (storage, 0, tuple(shape), stride, False, hooks))
    storage = Persistent(("storage", ref("torch.storage", "UntypedStorage"), key, "cpu", numel * dtype.itemsize))
    return Call(ref("torch._utils", "_rebuild_tensor_v3"), (storage, 0, tuple(shape), stride, False, hooks, dtype))


@functools.lru_cache(maxsize=4096)  # records of a sharded tensor share a few shapes; pickling is Python code
def _tensor_pickle(dtype: DType, shape: tuple[int, ...]) -> bytes:
    return dumps(tensor_reduce(dtype, shape, "0"), protocol=2)


def tensor_pickle(dtype: DType, shape: tuple[int, ...]) -> bytes:
    """The `data.pkl` torch.save writes for a dense CPU tensor of this dtype and shape (protocol 2)."""
    return _tensor_pickle(as_dtype(dtype), tuple(shape))


@dataclass(frozen=True, slots=True)
class _Entry:
    name: str
    offset: int
    size: int
    crc: int | None  # None: the tensor data, whose CRC arrives later
    zip64: bool


def _local_header(name: bytes, pad_to: int | None, at: int, zip64: bool) -> bytes:
    extra = struct.pack("<HHQQ", 0x0001, 16, 0, 0) if zip64 else b""
    base = 30 + len(name) + len(extra)
    if pad_to is not None:
        pad = (-(at + base + 4)) % pad_to
        extra += struct.pack("<HH", 0x4246, pad) + b"Z" * pad  # torch's "FB" padding record
    version = 45 if zip64 else 20
    return struct.pack("<IHHHHHIIIHH", 0x04034B50, version, _FLAGS, 0, 0, 0, 0, 0, 0, len(name), len(extra)) + name + extra


def _descriptor(crc: int, size: int, zip64: bool) -> bytes:
    if zip64:
        return struct.pack("<IIQQ", 0x08074B50, crc, size, size)
    return struct.pack("<IIII", 0x08074B50, crc, size, size)


@dataclass(frozen=True)
class _Skeleton:
    """What every item of one dtype, shape and zip64 choice shares: the head and its entries."""

    head: bytes
    entries: tuple[_Entry, ...]
    nbytes: int
    data_zip64: bool


@functools.lru_cache(maxsize=4096)  # a sharded tensor's items share a few shapes; 40k items planned 1.3 s faster
def _skeleton(dtype: DType, shape: tuple[int, ...], force_zip64: bool) -> _Skeleton:
    return archive_skeleton(tensor_pickle(dtype, shape), math.prod(shape) * dtype.itemsize, force_zip64)


def archive_skeleton(pickled: bytes, nbytes: int, force_zip64: bool) -> _Skeleton:
    """The head of an item whose `data.pkl` is `pickled` and whose first storage record,
    `data/0`, holds the `nbytes` streamed in."""
    small = [("data.pkl", pickled), *MARKER_RECORDS]
    entries: list[_Entry] = []
    head = bytearray()
    for name, payload in small:
        entries.append(_Entry(name, len(head), len(payload), zlib.crc32(payload), False))
        head += _local_header(f"{ARCHIVE}/{name}".encode(), ALIGNMENT, len(head), False) + payload
    data_zip64 = force_zip64 or nbytes >= _ZIP64_LIMIT
    entries.append(_Entry("data/0", len(head), nbytes, None, data_zip64))
    head += _local_header(f"{ARCHIVE}/data/0".encode(), ALIGNMENT, len(head), data_zip64)
    return _Skeleton(bytes(head), tuple(entries), nbytes, data_zip64)


_U32 = struct.Struct("<I")


@dataclass(frozen=True, slots=True)
class _TailTemplate:
    """A tail with a zero CRC and a blank id, and where to patch both in: items of one
    shape share it, so each item's tail is a copy and four small writes, not a rebuild."""

    data: bytes
    crc_at: tuple[int, ...]  # the data's CRC-32: data descriptor and central directory
    id_at: int  # the serialization id's payload
    id_crc_at: tuple[int, ...]  # the id's CRC-32: its data descriptor and central directory


@functools.lru_cache(maxsize=4096)
def _tail_template(dtype: DType, shape: tuple[int, ...], id_len: int, force_zip64: bool) -> _TailTemplate:
    return archive_tail(_skeleton(dtype, shape, force_zip64), id_len, force_zip64)


def archive_tail(skeleton: _Skeleton, id_len: int, force_zip64: bool,
                 storages: tuple[tuple[str, bytes], ...] = ()) -> _TailTemplate:
    """Everything after the streamed data of an item: its descriptor, the further storage records
    `storages` (name, bytes: a TE Float8Tensor's scale_inv), the trailing records, the central directory."""
    at = len(skeleton.head) + skeleton.nbytes
    tail = bytearray(_descriptor(0, skeleton.nbytes, skeleton.data_zip64))
    crc_at, id_crc_at, id_at = [4], [], 0
    entries = list(skeleton.entries)
    for name, payload in (*storages, ("version", TRAILING_VERSION), (".data/serialization_id", bytes(id_len))):
        offset = at + len(tail)
        big = force_zip64 or offset >= _ZIP64_LIMIT
        entries.append(_Entry(name, offset, len(payload), zlib.crc32(payload), big))
        tail += _local_header(f"{ARCHIVE}/{name}".encode(), ALIGNMENT, offset, big)
        if name == ".data/serialization_id":
            id_at = len(tail)
            id_crc_at.append(len(tail) + len(payload) + 4)
        tail += payload + _descriptor(zlib.crc32(payload), len(payload), big)
    cd_start = at + len(tail)
    directory = bytearray()
    for e in entries:
        if e.crc is None:
            crc_at.append(len(tail) + len(directory) + 16)
        elif e.name == ".data/serialization_id":
            id_crc_at.append(len(tail) + len(directory) + 16)
        directory += _central_record(e)
    tail += directory
    tail += end_of_directory(len(entries), cd_start, len(directory), force_zip64 or any(e.zip64 for e in entries))
    return _TailTemplate(bytes(tail), tuple(crc_at), id_at, tuple(id_crc_at))


def _central_record(e: _Entry, archive: str = ARCHIVE) -> bytes:
    name = f"{archive}/{e.name}".encode()
    if e.zip64:
        extra = struct.pack("<HHQQQ", 0x0001, 24, e.size, e.size, e.offset)
        size32, offset32, version = _ZIP64_LIMIT, _ZIP64_LIMIT, 45
    else:
        extra, size32, offset32, version = b"", e.size, e.offset, 20
    return struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, version, version, _FLAGS, 0, 0, 0, e.crc or 0,
                       size32, size32, len(name), len(extra), 0, 0, 0, 0, offset32) + name + extra


def end_of_directory(count: int, start: int, size: int, zip64: bool) -> bytes:
    """End of central directory; with the zip64 record and locator when anything needs 64 bits."""
    out = b""
    if zip64 or count >= 0xFFFF or start >= _ZIP64_LIMIT or size >= _ZIP64_LIMIT:
        out += struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 45, 45, 0, 0, count, count, size, start)
        out += struct.pack("<IIQI", 0x07064B50, 0, start + size, 1)
    return out + struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, min(count, 0xFFFF), min(count, 0xFFFF),
                             min(size, _ZIP64_LIMIT), min(start, _ZIP64_LIMIT), 0)


class TorchSaveRecord:
    """One tensor item's record as bytes: `head` + `nbytes` of tensor data + `tail(crc)`.

    Items of one dtype and shape share their head and a tail template (cached): only the
    serialization id and the data's CRC differ, and both are patched into a copy of the
    template. Slotted: a plan holds one per output record.
    """

    __slots__ = ("dtype", "shape", "nbytes", "head", "_template", "_id")

    def __init__(self, dtype: DType, shape: tuple[int, ...], serialization_id: str, force_zip64: bool = False) -> None:
        self.dtype, self.shape = as_dtype(dtype), tuple(shape)
        skeleton = _skeleton(self.dtype, self.shape, force_zip64)
        self.nbytes, self.head = skeleton.nbytes, skeleton.head
        self._id = serialization_id.encode()
        self._template = _tail_template(self.dtype, self.shape, len(self._id), force_zip64)

    @property
    def tail_len(self) -> int:
        """Length of `tail(crc)`, whatever the CRC."""
        return len(self._template.data)

    @property
    def length(self) -> int:
        """Total item length in bytes."""
        return len(self.head) + self.nbytes + self.tail_len

    def tail(self, crc: int) -> bytes:
        """Everything after the tensor data, given the data's CRC-32."""
        t = self._template
        out = bytearray(t.data)
        out[t.id_at: t.id_at + len(self._id)] = self._id
        for at in t.crc_at:
            _U32.pack_into(out, at, crc)
        id_crc = zlib.crc32(self._id)
        for at in t.id_crc_at:
            _U32.pack_into(out, at, id_crc)
        return bytes(out)

    __call__ = tail
    """A record is its own `tail` callable: a plan keeps the record, not a bound method per record
    (64 bytes each, at a million records)."""


def serialization_id(key: str) -> str:
    """A deterministic 40-digit id (torch writes a random one) so equal runs give equal bytes."""
    digest = hashlib.blake2b(key.encode(), digest_size=16).digest()
    return str(int.from_bytes(digest, "little")).rjust(40, "0")[:40]
