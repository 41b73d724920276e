"""Pickle `.metadata` byte for byte as `torch_pickle.dumps` does, at a few µs per chunk, without torch.

`torch_pickle` runs Python's pure-Python pickler: ~70 µs per chunk, minutes for millions.
`.metadata` has a fixed shape, so `dumps` writes its opcodes itself and reproduces what that
pickler decides: which objects it memoizes (strings, tuples, lists, dicts and globals by
identity; the `Instance`/`Call` stand-ins and state copies `torch_pickle` makes on the way
count too, though nothing fetches them again), when it starts a FRAME (at the first save
that begins once the current frame holds 64 KiB) and how it batches APPENDS/SETITEMS. Each
chunk and storage entry is written from a template when it fits the current frame, else one
save at a time like everything else. A value outside that shape (a float in planner_data,
a subclass) sends the whole metadata through `torch_pickle.dumps`.
"""

from __future__ import annotations

import io
import pickle
from itertools import islice
from struct import Struct
from typing import Any, BinaryIO, Callable, Iterator

from ckptctl.core.dtypes import DType
from ckptctl.formats.pickle import torch_pickle
from ckptctl.formats.dcp.classes import (
    CONTIGUOUS,
    STRIDED,
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Layout,
    MemoryFormat,
    Metadata,
    MetadataIndex,
    StorageInfo,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from ckptctl.formats.pickle.vm import memo_fetch
from ckptctl.formats.pickle.torch_pickle import Global, Size, ref

PROTOCOL = 4
FRAME_TARGET = pickle._Framer._FRAME_SIZE_TARGET
FRAME_MIN = pickle._Framer._FRAME_SIZE_MIN
BATCH = pickle._Pickler._BATCHSIZE
_U32, _U64, _I32, _U16 = Struct("<I"), Struct("<Q"), Struct("<i"), Struct("<H")
_TUPLE_CODES = (pickle.EMPTY_TUPLE, pickle.TUPLE1, pickle.TUPLE2, pickle.TUPLE3)
_NEW_STATE = pickle.EMPTY_TUPLE + pickle.NEWOBJ + pickle.MEMOIZE + pickle.EMPTY_DICT + pickle.MEMOIZE + pickle.MARK
"""After a record's class: NEWOBJ (memoized), then its state dict (memoized), opened for SETITEMS."""
_END_STATE = pickle.SETITEMS + pickle.BUILD
_CALL_END = pickle.TUPLE1 + pickle.MEMOIZE + pickle.REDUCE + pickle.MEMOIZE
"""After a one-argument call's argument: the args tuple (memoized), REDUCE (memoized)."""

SIZE = ref("torch", "Size")
LAYOUT = STRIDED.__torch_pickle__().func
MEMORY_FORMAT = CONTIGUOUS.__torch_pickle__().func
PROPERTIES = ref(*TensorProperties.torch_global())
RECORD_CLASSES = {c: ref(*c.torch_global()) for c in (
    Metadata, StorageMeta, ChunkStorageMetadata, TensorStorageMetadata, BytesStorageMetadata, MetadataIndex,
    StorageInfo)}
OFFSETS, SIZES = ChunkStorageMetadata.FIELDS
FQN, INDEX, OFFSET = MetadataIndex.FIELDS
PATH, _, LENGTH, _ = StorageInfo.FIELDS


class _Outside(Exception):
    """A value `.metadata`'s shape does not have: the whole goes through `torch_pickle`."""


class StreamedList:
    """A list of records made while the pickle is written, a batch at a time (`make()` yields them in
    order): a tensor's chunk records, millions at scale, are never all held. Pickled as the list."""

    __slots__ = ("make", "length")

    def __init__(self, make: Callable[[], Iterator[Any]], length: int) -> None:
        self.make, self.length = make, length

    def __iter__(self) -> Iterator[Any]:
        return self.make()

    def __len__(self) -> int:
        return self.length


class StreamedDict(StreamedList):
    """A dict made while the pickle is written: `make()` yields its (key, value) pairs in order."""

    __slots__ = ()

    def items(self) -> Iterator[tuple[Any, Any]]:
        return self.make()


def materialized(md: Metadata) -> Metadata:
    """`md` with its streamed lists and dicts made real (what `torch_pickle` pickles)."""
    sd = {}
    for fqn, item in md.state_dict_metadata.items():
        if type(item) is TensorStorageMetadata and type(item.chunks) is StreamedList:
            item = TensorStorageMetadata(item.properties, item.size, list(item.chunks))
        sd[fqn] = item
    storage = md.storage_data
    return Metadata(state_dict_metadata=sd, planner_data=md.planner_data,
                    storage_data=dict(storage.items()) if type(storage) is StreamedDict else storage,
                    storage_meta=md.storage_meta, version=md.version)


def dump(md: Metadata, file: BinaryIO) -> None:
    """`torch_pickle.dumps(md)`'s bytes written into `file` (a seekable one) a frame at a time, so no
    copy of the whole pickle is ever held."""
    start = file.tell()
    try:
        _Emitter(file.write).dump(md)
    except _Outside:
        file.seek(start)
        file.truncate()
        file.write(torch_pickle.dumps(materialized(md), protocol=PROTOCOL))


def dumps(md: Metadata) -> bytes:
    """`torch_pickle.dumps(md)`, the same bytes, written directly."""
    buffer = io.BytesIO()
    dump(md, buffer)
    return buffer.getvalue()


def _encode_int(value: int) -> bytes:
    """pickle's opcode for an int (ints are never memoized)."""
    if 0 <= value <= 0xff:
        return pickle.BININT1 + bytes((value,))
    if 0 <= value <= 0xffff:
        return pickle.BININT2 + _U16.pack(value)
    if -0x80000000 <= value <= 0x7fffffff:
        return pickle.BININT + _I32.pack(value)
    encoded = pickle.encode_long(value)
    if len(encoded) < 256:
        return pickle.LONG1 + bytes((len(encoded),)) + encoded
    return pickle.LONG4 + _I32.pack(len(encoded)) + encoded


_SMALL_INTS = [_encode_int(v) for v in range(4096)]


def _int_code(value: int) -> bytes:
    return _SMALL_INTS[value] if 0 <= value < 4096 else _encode_int(value)


SIZE_CODES = STR_CODES = 1 << 16
"""How many distinct Sizes and strs a dump remembers the bytes of (chunks repeat few)."""


class _Emitter:
    """One dump: where committed frames go (`write`), the current frame and the memo."""

    def __init__(self, write: Callable[[bytes], Any]) -> None:
        self.write = write
        write(pickle.PROTO + bytes((PROTOCOL,)))
        self.frame = bytearray()
        self.memo: dict[int, tuple[int, Any]] = {}
        """id → (memo index, the object), as pickle's own memo: holding the object keeps its id from
        being reused by another while the dump runs (a freed temporary's id taken by the next one
        would fetch the wrong value)."""
        self.count = 0
        """Memo entries so far, `torch_pickle`'s temporaries included."""
        self.chunk_template: tuple[bytes, bytes] | None = None
        self.storage_template: tuple[bytes, ...] | None = None
        self.size_fetch: bytes | None = None
        self.size_codes: dict[Size, bytes] = {}
        self.str_codes: dict[str, bytes] = {}
        self.index_heads: dict[int, bytes] = {}
        """id(fqn) → a storage entry's bytes up to its fqn, for fqns memoized before (all chunks of a tensor)."""

    def dump(self, obj: Any) -> None:
        self.save(obj)
        self.frame += pickle.STOP
        self.commit()

    # The pickler's bookkeeping ------------------------------------------------------------

    def commit(self) -> None:
        """End the current frame (a FRAME opcode unless it is tiny), as `_Framer.commit_frame` does."""
        if len(self.frame) >= FRAME_MIN:
            self.write(pickle.FRAME + _U64.pack(len(self.frame)))
        self.write(self.frame)
        self.frame = bytearray()

    def check(self) -> None:
        """A save starts here: the pickler commits a frame that reached its target size."""
        if len(self.frame) >= FRAME_TARGET:
            self.commit()

    def memoize(self, obj: Any = None) -> None:
        """MEMOIZE; `obj` when it outlives the dump, None for a `torch_pickle` temporary (never fetched)."""
        self.frame += pickle.MEMOIZE
        if obj is not None:
            self.memo[id(obj)] = (self.count, obj)
        self.count += 1

    def rollback(self, count: int) -> None:
        """Forget the memo entries from index `count` on (a template that did not fit, to be redone)."""
        memo = self.memo
        while memo and next(reversed(memo.values()))[0] >= count:
            memo.popitem()
        self.count = count

    get = staticmethod(memo_fetch)

    def gets(self, *objs: Any) -> list[bytes] | None:
        """The fetch of each of `objs`, or None while one is not memoized yet."""
        found = [self.memo.get(id(o)) for o in objs]
        return None if None in found else [self.get(i) for i, _ in found]

    # One save per value, as torch_pickle's pickler does ----------------------------------------

    def save(self, obj: Any) -> None:
        self.check()
        kind = type(obj)
        if kind in _MEMOIZED:
            known = self.memo.get(id(obj))
            if known is not None:
                self.frame += self.get(known[0])
                return
        saver = _SAVERS.get(kind)
        if saver is None:
            raise _Outside(kind)
        saver(self, obj)

    def save_none(self, _: None) -> None:
        self.frame += pickle.NONE

    def save_bool(self, value: bool) -> None:
        self.frame += pickle.NEWTRUE if value else pickle.NEWFALSE

    def save_int(self, value: int) -> None:
        self.frame += _int_code(value)

    def save_str(self, text: str, keep: bool = True) -> None:
        encoded = text.encode("utf-8", "surrogatepass")
        n = len(encoded)
        if n <= 0xff:
            self.frame += pickle.SHORT_BINUNICODE + bytes((n,)) + encoded
        elif n > 0xffffffff or n >= FRAME_TARGET:  # `_Framer.write_large_bytes`: outside any frame
            self.commit()
            self.write(pickle.BINUNICODE8 + _U64.pack(n) if n > 0xffffffff else pickle.BINUNICODE + _U32.pack(n))
            self.write(encoded)
        else:
            self.frame += pickle.BINUNICODE + _U32.pack(n) + encoded
        self.memoize(text if keep else None)

    def save_tuple(self, values: tuple, keep: bool = True) -> None:
        """A tuple; `keep` False for one `torch_pickle` builds on the way (memoized but never fetched)."""
        if not values:
            self.frame += pickle.EMPTY_TUPLE
            return
        short = len(values) <= 3
        if not short:
            self.frame += pickle.MARK
        for v in values:
            self.save(v)
        if keep and id(values) in self.memo:  # it contains itself (through a list or dict)
            fetch = self.get(self.memo[id(values)][0])
            self.frame += (pickle.POP * len(values) if short else pickle.POP_MARK) + fetch
            return
        self.frame += _TUPLE_CODES[len(values)] if short else pickle.TUPLE
        self.memoize(values if keep else None)

    def save_list(self, items: list | StreamedList) -> None:
        self.frame += pickle.EMPTY_LIST
        self.memoize(items)
        for batch in _batches(items):
            if len(batch) > 1:
                self.frame += pickle.MARK
            for item in batch:
                count = self.count
                if type(item) is not ChunkStorageMetadata or not self.put(self.chunk_code(item), count):
                    self.save(item)
            self.frame += pickle.APPENDS if len(batch) > 1 else pickle.APPEND

    def save_dict(self, mapping: dict | StreamedDict) -> None:
        self.frame += pickle.EMPTY_DICT
        self.memoize(mapping)
        self.save_items(mapping)

    def save_items(self, mapping: dict) -> None:
        """SETITEMS of `mapping`'s items, in batches."""
        for batch in _batches(mapping.items()):
            if len(batch) > 1:
                self.frame += pickle.MARK
            for key, value in batch:
                count = self.count
                if (type(key) is not MetadataIndex or type(value) is not StorageInfo
                        or not self.put(self.storage_code(key, value), count)):
                    self.save(key)
                    self.save(value)
            self.frame += pickle.SETITEMS if len(batch) > 1 else pickle.SETITEM

    def save_global(self, g: Global) -> None:
        self.save(g.module)
        self.save(g.name)
        self.frame += pickle.STACK_GLOBAL
        self.memoize(g)

    def save_dtype(self, dtype: DType) -> None:
        self.save(ref("torch", dtype.name))

    def save_call(self, func: Global, save_arg: Callable[[], None]) -> None:
        """A one-argument call as `torch_pickle` writes it: the function, the argument, then the
        args tuple and REDUCE, both memoized (temporaries nothing fetches again)."""
        self.save(func)
        self.check()  # the args tuple; its one element starts at the same byte
        save_arg()
        self.frame += _CALL_END
        self.count += 2

    def save_size(self, size: Size) -> None:
        """`torch.Size(tuple(size))`: the tuple of dims is a temporary too."""
        self.save_call(SIZE, lambda: self.save_tuple(tuple(size), keep=False))

    def save_layout(self, layout: Layout) -> None:
        """`_get_layout(str(layout))`: that str is a fresh copy, memoized but never fetched."""
        self.save_call(LAYOUT, lambda: self.save_str(str(layout), keep=False))

    def save_memory_format(self, memory_format: MemoryFormat) -> None:
        self.save_call(MEMORY_FORMAT, lambda: self.save_int(int(memory_format)))

    def save_record(self, record: Any) -> None:
        """A DCP record: its class, NEWOBJ, then a copy of its `__dict__` and BUILD."""
        self.save(RECORD_CLASSES[type(record)])
        self.frame += pickle.EMPTY_TUPLE + pickle.NEWOBJ
        self.memoize()
        self.check()
        self.frame += pickle.EMPTY_DICT
        self.memoize()
        self.save_items(record.pickled_state())
        self.frame += pickle.BUILD

    def save_properties(self, properties: TensorProperties) -> None:
        """TensorProperties' state is a tuple of its fields (a temporary)."""
        self.save(PROPERTIES)
        self.frame += pickle.EMPTY_TUPLE + pickle.NEWOBJ
        self.memoize()
        self.check()
        self.save_tuple(tuple(getattr(properties, f) for f in TensorProperties.FIELDS), keep=False)
        self.frame += pickle.BUILD

    # Templates: one chunk or storage entry as one piece of bytes ----------------------------

    def put(self, piece: bytes | None, count: int) -> bool:
        """Append a template's `piece` if there is one and no frame can start inside it; else
        forget what making it memoized (from index `count` on) and say so: it is saved one by one."""
        if piece is not None and len(self.frame) + len(piece) <= FRAME_TARGET:
            self.frame += piece
            return True
        self.rollback(count)
        return False

    def size_code(self, size: Any) -> bytes | None:
        """`save_size`'s bytes, or None unless `size` is a Size of ints (and torch.Size is memoized)."""
        if type(size) is not Size:
            return None
        for v in size:
            if type(v) is not int:
                return None
        self.count += 3 if size else 2
        code = self.size_codes.get(size)
        if code is None:
            if self.size_fetch is None:
                fetch = self.gets(SIZE)
                if fetch is None:
                    return None
                self.size_fetch = fetch[0]
            codes = b"".join(map(_int_code, size))
            if not size:
                code = self.size_fetch + pickle.EMPTY_TUPLE + _CALL_END
            elif len(size) <= 3:
                code = self.size_fetch + codes + _TUPLE_CODES[len(size)] + pickle.MEMOIZE + _CALL_END
            else:
                code = self.size_fetch + pickle.MARK + codes + pickle.TUPLE + pickle.MEMOIZE + _CALL_END
            if len(self.size_codes) < SIZE_CODES:
                self.size_codes[size] = code
        return code

    def str_code(self, text: Any) -> bytes | None:
        """A str's fetch, or its bytes (memoizing it); None for a non-str or a long one."""
        if type(text) is not str:
            return None
        known = self.memo.get(id(text))
        if known is not None:
            return self.get(known[0])
        code = self.str_codes.get(text)
        if code is None:
            encoded = text.encode("utf-8", "surrogatepass")
            if len(encoded) > 0xff:
                return None
            code = pickle.SHORT_BINUNICODE + bytes((len(encoded),)) + encoded + pickle.MEMOIZE
            if len(self.str_codes) < STR_CODES:
                self.str_codes[text] = code
        self.memo[id(text)] = (self.count, text)
        self.count += 1
        return code

    def chunk_code(self, chunk: ChunkStorageMetadata) -> bytes | None:
        """A ChunkStorageMetadata {offsets, sizes}, once its class and field names are memoized."""
        template = self.chunk_template
        if template is None:
            fetches = self.gets(RECORD_CLASSES[ChunkStorageMetadata], OFFSETS, SIZES)
            if fetches is None:
                return None
            cls, offsets_key, sizes_key = fetches
            template = self.chunk_template = (cls + _NEW_STATE + offsets_key, sizes_key)
        state = chunk.__dict__
        if len(state) != 2:
            return None
        (k_offsets, offsets), (k_sizes, sizes) = state.items()
        if k_offsets is not OFFSETS or k_sizes is not SIZES:
            return None
        self.count += 2
        offsets_code = self.size_code(offsets)
        sizes_code = self.size_code(sizes)
        if offsets_code is None or sizes_code is None:
            return None
        return template[0] + offsets_code + template[1] + sizes_code + _END_STATE

    def storage_code(self, key: MetadataIndex, info: StorageInfo) -> bytes | None:
        """A storage entry as torch pickles it: MetadataIndex {fqn, index, offset (a tensor's
        only)} → StorageInfo {relative_path, offset, length} (its transform descriptors left out,
        as torch leaves out a None field), once the classes and field names are memoized."""
        template = self.storage_template
        if template is None:
            fetches = self.gets(RECORD_CLASSES[MetadataIndex], FQN, INDEX, OFFSET, RECORD_CLASSES[StorageInfo], PATH,
                                LENGTH)
            if fetches is None:
                return None
            index_cls, fqn_key, index_key, offset_key, info_cls, path_key, length_key = fetches
            template = self.storage_template = (
                index_cls + _NEW_STATE + fqn_key, index_key, offset_key,
                _END_STATE + info_cls + _NEW_STATE + path_key, offset_key, length_key, _END_STATE)
        key_state, info_state = key.__dict__, info.__dict__
        if len(info_state) != 4 or info.transform_descriptors is not None:
            return None
        if len(key_state) == 3:
            (k_fqn, fqn), (k_index, index), (k_offset, offset) = key_state.items()
        elif len(key_state) == 2:  # a bytes entry's key
            (k_fqn, fqn), (k_index, index) = key_state.items()
            k_offset, offset = OFFSET, None
        else:
            return None
        (k_path, path), (k_offset2, at), (k_length, length), _ = info_state.items()
        if (k_fqn is not FQN or k_offset is not OFFSET or k_index is not INDEX or k_path is not PATH
                or k_offset2 is not OFFSET or k_length is not LENGTH or type(at) is not int
                or type(length) is not int or type(index) not in (int, type(None))):
            return None
        self.count += 2
        head = self.index_heads.get(id(fqn))
        if head is None:
            known = id(fqn) in self.memo
            fqn_code = self.str_code(fqn)
            if fqn_code is None:
                return None
            head = template[0] + fqn_code + template[1]
            if known:  # a rollback keeps it
                self.index_heads[id(fqn)] = head
        index_code = pickle.NONE if index is None else _int_code(index)
        if offset is None:
            offset_code = b""
        else:
            size = self.size_code(offset)
            if size is None:
                return None
            offset_code = template[2] + size
        self.count += 2
        path_code = self.str_code(path)
        if path_code is None:
            return None
        return b"".join((head, index_code, offset_code, template[3], path_code, template[4], _int_code(at),
                         template[5], _int_code(length), template[6]))


def _batches(items: Any) -> Any:
    """Runs of up to BATCH items, as the pickler's `_batch_appends`/`_batch_setitems` cut them."""
    it = iter(items)
    while True:
        batch = list(islice(it, BATCH))
        if batch:
            yield batch
        if len(batch) < BATCH:
            return


_MEMOIZED = frozenset({str, tuple, list, dict, Global})
_SAVERS: dict[type, Callable[[_Emitter, Any], None]] = {
    type(None): _Emitter.save_none,
    bool: _Emitter.save_bool,
    int: _Emitter.save_int,
    str: _Emitter.save_str,
    tuple: _Emitter.save_tuple,
    list: _Emitter.save_list,
    dict: _Emitter.save_dict,
    Global: _Emitter.save_global,
    DType: _Emitter.save_dtype,
    Size: _Emitter.save_size,
    Layout: _Emitter.save_layout,
    MemoryFormat: _Emitter.save_memory_format,
    TensorProperties: _Emitter.save_properties,
    **{cls: _Emitter.save_record for cls in RECORD_CLASSES},
    StreamedList: _Emitter.save_list,
    StreamedDict: _Emitter.save_dict,
}
