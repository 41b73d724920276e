"""Lay out a whole state dict as one `torch.save` file, the one `dcp_to_torch_save` writes, for streaming.

torch's converter loads every tensor into memory and pickles the nested state dict. The
archive can instead be laid out from metadata alone: `data.pkl` (the nested dict, one
persistent storage per tensor, pickled as torch.save pickles it) and torch's marker records
first, then one stored, 64-byte aligned record `data/<i>` per tensor at a known offset — a
`StreamItem` the engine fills from the source chunks, CRC-32 on the way —, then `version`,
the serialization id and the central directory, built once the records' CRCs are known.

Non-tensor entries are `torch.save(obj)` archives; torch unpickles them with
`weights_only=False`, running whatever code they name. Here an allow-list unpickler builds
plain values only (containers, numbers, strings, bytes, torch dtypes and sizes, argparse
namespaces), which are pickled again, as torch would pickle them, into `data.pkl`.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from ckptctl.util.errors import CheckpointError, OutputError
from ckptctl.formats.pickle.torch_pickle import dumps
from ckptctl.formats.torch_save.zip import (
    ALIGNMENT, MARKER_RECORDS, TRAILING_VERSION, _ZIP64_LIMIT, _Entry, _central_record, _descriptor, _local_header,
    end_of_directory, serialization_id, tensor_reduce,
)
from ckptctl.formats.pickle.unpickle import MalformedPickleError, UnsafePickleError, load_value_pickle
from ckptctl.core.geometry import full_box
from ckptctl.core.plan import StreamItem, TargetTensor
from ckptctl.storage.store import store_for

PICKLE_PROTOCOL = 2
"""torch.save's default protocol, so `data.pkl` reads as torch's own."""


# The nested state dict ---------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorSlot:
    """Where a tensor goes in the nested state dict: its storage is written by the engine."""

    target: TargetTensor


@dataclass(frozen=True)
class Value:
    """A decoded non-tensor entry's value, in place in the nested state dict."""

    fqn: str
    value: Any


def nest(entries: Sequence[tuple[str, TensorSlot | Value]], planner_data: Mapping[str, Any] | None,
         max_index: int, where: str) -> dict:
    """The state dict torch's converter rebuilds: each entry placed along its `planner_data` path
    (torch's `set_element`: a str key opens a dict, an int key a list padded with None), in the
    order given; an entry without a path stays at the top under its flat name.

    Paths come from the checkpoint, so they are checked: str or int keys, list indices below
    `max_index` (the entry count: no real list is longer), no entry inside another.
    """
    root: dict = {}
    for fqn, leaf in entries:
        path = _path(fqn, planner_data, max_index, where)
        node: Any = root
        for key, after in zip(path, path[1:]):
            fresh: dict | list = {} if type(after) is str else []
            if type(node) is dict:
                node = node.setdefault(key, fresh)
            else:
                _pad(node, key, fqn, where)
                if node[key] is None:
                    node[key] = fresh
                node = node[key]
            if type(node) not in (dict, list):
                raise CheckpointError(where, f"planner_data puts {fqn} inside another entry")
        last = path[-1]
        if type(node) is list:
            _pad(node, last, fqn, where)
        if (node.get(last) if type(node) is dict else node[last]) is not None:
            raise CheckpointError(where, f"planner_data puts {fqn} where another entry is")
        node[last] = leaf
    return root


def _path(fqn: str, planner_data: Mapping[str, Any] | None, max_index: int, where: str) -> tuple:
    path = planner_data.get(fqn) if isinstance(planner_data, dict) else None
    if path is None:
        return (fqn,)
    if (not isinstance(path, (list, tuple)) or not path
            or any(type(k) not in (str, int) or (type(k) is int and not 0 <= k < max_index) for k in path)):
        raise CheckpointError(where, f"planner_data path of {fqn} is malformed: {str(path)[:200]}")
    return tuple(path)


def _pad(node: list, key: Any, fqn: str, where: str) -> None:
    if type(key) is not int:
        raise CheckpointError(where, f"planner_data indexes a list with {key!r} on the way to {fqn}")
    node.extend([None] * (key + 1 - len(node)))


def torch_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """A contiguous tensor's strides as torch computes them (a zero-size dim counts as 1)."""
    out, acc = [], 1
    for dim in reversed(shape):
        out.append(acc)
        acc *= max(dim, 1)
    return tuple(reversed(out))


def state_pickle(tree: dict, where: str) -> tuple[bytes, list[TargetTensor]]:
    """`data.pkl` of the nested state dict and its tensors in pickling order: tensor i's storage
    is record `data/i`, as torch.save numbers storages as it meets them."""
    order: list[TargetTensor] = []

    def build(node: Any) -> Any:
        if type(node) is dict:
            return {k: build(v) for k, v in node.items()}
        if type(node) is list:
            return [build(v) for v in node]
        if isinstance(node, TensorSlot):
            t = node.target
            order.append(t)
            return tensor_reduce(t.dtype, t.shape, str(len(order) - 1), torch_strides(t.shape))
        return node.value if isinstance(node, Value) else node

    try:
        return dumps(build(tree), protocol=PICKLE_PROTOCOL), order
    except RecursionError:
        raise CheckpointError(where, "a non-tensor value is nested too deeply to pickle") from None


# Non-tensor values -------------------------------------------------------------------------------


LOAD_SAFE_GLOBALS = (argparse.Namespace, bytes, frozenset)
"""Of the globals a value may name (`unpickle.VALUE_GLOBALS`), what `torch.load(weights_only=True)`
must be told to allow (`safe_globals`): its default list lacks them (`bytes` is how an empty bytes
object pickles)."""


class CorruptValueError(UnsafePickleError):
    """A non-tensor value's pickle is damaged or hostile (a key too costly to hash, nesting too deep,
    more values than its size allows): an UnsafePickleError, so that whoever refuses a value that
    cannot be decoded refuses this one too, and one that can name the file says what is wrong."""


def decode_value(raw: bytes, opaque: Any = None) -> Any:
    """The object in a non-tensor entry's `torch.save` archive, built by the allow-list unpickler.

    With `opaque` (a class taking a global's module, name and REDUCE arguments), a global off the list
    becomes an inert `opaque` value instead of a refusal, and so does a tensor (its storage
    never read). Raises UnsafePickleError saying why when the value cannot be built that way, and
    its CorruptValueError when the pickle is damaged or hostile (`unpickle.load_value_pickle`).
    """
    try:
        with zipfile.ZipFile(io.BytesIO(raw)) as archive:
            pkl = [i for i in archive.infolist() if i.filename == "data.pkl" or i.filename.endswith("/data.pkl")]
            if len(pkl) != 1 or pkl[0].compress_type != zipfile.ZIP_STORED:  # torch stores; no inflating bombs
                raise UnsafePickleError("not a torch.save archive")
            data = archive.read(pkl[0])
        return load_value_pickle(data, opaque)
    except UnsafePickleError:
        raise
    except MalformedPickleError as exc:
        raise CorruptValueError(f"corrupt pickle: {exc}") from None
    except zipfile.BadZipFile as exc:
        raise UnsafePickleError(f"not a torch.save archive ({exc})") from None
    except Exception as exc:  # noqa: BLE001 - hostile bytes raise anything; they cost one message
        raise UnsafePickleError(f"unreadable ({type(exc).__name__}{f': {exc}' if str(exc) else ''})") from None


def encode_value(value: Any, archive: str = "archive") -> bytes:
    """`torch.save(value)` of a plain value (what `decode_value` builds), written without torch:
    an opaque value pickles again as the call of its global (its `__torch_pickle__`)."""
    file = placed_torch_save("", archive, dumps(value, protocol=PICKLE_PROTOCOL), [])
    return file.head + file.trailer()


# The archive -------------------------------------------------------------------------------------


class _DataTail:
    """A tensor record's data descriptor; the engine calls it with the CRC-32 of the bytes it
    streamed, which is kept for the central directory."""

    __slots__ = ("size", "zip64", "crc")

    def __init__(self, size: int, zip64: bool) -> None:
        self.size, self.zip64 = size, zip64
        self.crc: int | None = None

    @property
    def length(self) -> int:
        return 24 if self.zip64 else 16

    def __call__(self, crc: int) -> bytes:
        self.crc = crc
        return _descriptor(crc, self.size, self.zip64)


def _stored(archive: str, name: str, at: int, payload: bytes, zip64: bool) -> bytes:
    """A whole small record: local header (padded so the payload is aligned), payload, descriptor."""
    header = _local_header(f"{archive}/{name}".encode(), ALIGNMENT, at, zip64)
    return header + payload + _descriptor(zlib.crc32(payload), len(payload), zip64)


def _needs_zip64(offset: int, size: int, force: bool) -> bool:
    return force or offset >= _ZIP64_LIMIT or size >= _ZIP64_LIMIT


@dataclass
class TorchSaveFile:
    """One torch.save archive laid out before any data moves: `head` at 0, the tensor records
    (`items`), then `trailer()` at `trailer_at`, once the engine has written every record."""

    name: str
    archive: str
    head: bytes
    items: list[StreamItem]
    trailer_at: int
    size: int
    entries: list[_Entry]
    trailing: bytes
    """The records after the tensors (`version`, `.data/serialization_id`): known up front."""

    def data_offset(self, index: int) -> int:
        """Where record `data/index`'s tensor bytes start in the file."""
        item = self.items[index]
        return item.offset + len(item.head)

    def trailer(self) -> bytes:
        """The trailing records and the central directory, with every record's CRC."""
        crcs = (item.tail for item in self.items)  # each a `_DataTail`, called by the engine
        entries = []
        for e in self.entries:
            if e.crc is None:
                crc = next(crcs).crc
                if crc is None:
                    raise RuntimeError(f"{self.archive}/{e.name} was not written")
                e = _Entry(e.name, e.offset, e.size, crc, e.zip64)
            entries.append(e)
        directory = b"".join(_central_record(e, self.archive) for e in entries)
        start = self.trailer_at + len(self.trailing)
        zip64 = any(e.zip64 for e in entries)  # every entry is, when zip64 was forced
        return self.trailing + directory + end_of_directory(len(entries), start, len(directory), zip64)

    def write_trailer(self, directory: Path, sync: bool = True) -> None:
        """Write `trailer()` into the file in `directory`, once every record is (fsynced with `sync`)."""
        path = directory / self.name
        data, at = memoryview(self.trailer()), self.trailer_at
        try:
            with store_for(path).reopen(path) as out:
                out.write_all_at(data, at)
                if sync:
                    out.sync()
        except OSError as exc:
            raise OutputError(path, f"cannot write: {exc.strerror or exc}") from None


def placed_torch_save(name: str, archive: str, pickled: bytes, targets: Sequence[TargetTensor],
                      force_zip64: bool = False) -> TorchSaveFile:
    """Place `data.pkl`, torch's marker records, one record per target (`data/i` holds
    `targets[i]`, whole) and the trailing records in file `name`.

    The records' `reads` are left empty: planned a batch at a time just before they are
    written, since a TP-split tensor needs a copy run per row and chunk, too many to hold for a
    whole model. `archive` is the records' folder inside the zip (torch names it after the
    file); `force_zip64` writes zip64 structures for small files too (tests).
    """
    entries: list[_Entry] = []
    head = bytearray()
    for record, payload in (("data.pkl", pickled), *MARKER_RECORDS):
        big = _needs_zip64(len(head), len(payload), force_zip64)
        entries.append(_Entry(record, len(head), len(payload), zlib.crc32(payload), big))
        head += _stored(archive, record, len(head), payload, big)
    at = len(head)
    items = []
    for index, target in enumerate(targets):
        record = f"data/{index}"
        big = _needs_zip64(at, target.nbytes, force_zip64)
        header = _local_header(f"{archive}/{record}".encode(), ALIGNMENT, at, big)
        tail = _DataTail(target.nbytes, big)
        entries.append(_Entry(record, at, target.nbytes, None, big))
        items.append(StreamItem(name, at, header, target, full_box(target.shape), (), tail, tail.length))
        at += len(header) + target.nbytes + tail.length
    trailer_at = at
    trailing = bytearray()
    ident = serialization_id(archive + hashlib.sha256(head).hexdigest()).encode()  # deterministic, as torch_zip's
    for record, payload in (("version", TRAILING_VERSION), (".data/serialization_id", ident)):
        big = _needs_zip64(at, len(payload), force_zip64)
        entries.append(_Entry(record, at, len(payload), zlib.crc32(payload), big))
        trailing += _stored(archive, record, at, payload, big)
        at = trailer_at + len(trailing)
    directory = sum(len(_central_record(e, archive)) for e in entries)
    zip64 = any(e.zip64 for e in entries)
    size = at + directory + len(end_of_directory(len(entries), at, directory, zip64))
    return TorchSaveFile(name, archive, bytes(head), items, trailer_at, size, entries, bytes(trailing))
