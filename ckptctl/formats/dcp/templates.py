"""Reads torch's own `.metadata` pickle a chunk at a time, keeping nothing per pickled value.

A `.metadata` of 2.5 million chunks is 360 MB of pickle. C's unpickler keeps every value it
builds in its memo until the load ends (≈ 2 KB a chunk: the chunk record, its two Sizes and
their argument tuples, its state dict, and the same again for its storage key and value), so
reading it costs gigabytes before a single record is checked.

`TemplateMachine` is `PickleMachine`, the validating interpreter, with three super-instructions
learned from the pickle itself. Once the interpreter has built one chunk record, one storage
entry, or one of megatron-core's save-plan items the ordinary way, the bytes torch's pickler
writes for every further one are known up to their integers and new strings: the class and the
field names are references to memo entries already there. Each later one is matched by one
compiled regular expression and becomes an (offsets, sizes) pair, a row of `StorageColumns` or
an inert WriteItem (its state dropped, as `unpickle` drops it); the memo entries it made are
counted, and only its new strings kept. A list of chunks and the storage dict become
`ChunkColumns` / `StorageColumns` when the first matched item arrives.

It is only a faster road to the same values. A pickle it does not know — another protocol,
unframed data, an explicit memo index, a reference to a value it did not keep, a dict key
that is not a name, more plain interpreting than matching — is declined (`None`), and the
caller reads it with `unpickle.load_metadata_pickle`, whose diagnostics name any fault. Its
dicts are keyed by names, validated MetadataIndex records and flat int tuples only, so it
needs no `hash_guard` probe. The file is read with `pread`, frame by frame, a few megabytes
held at a time.
"""

from __future__ import annotations

import operator
import re
import struct
from array import array
from bisect import bisect_left
from itertools import accumulate, compress, repeat
from typing import Any, Callable, Iterator, Sequence

from ckptctl.formats.dcp import classes as dc
from ckptctl.util.gc_pause import gc_paused
from ckptctl.formats.pickle.vm import GET_WEIGHT, MAX_MEMO, Constructor, MalformedPickleError, PickleMachine, \
    memo_fetch, opcode_table
from ckptctl.formats.pickle.unpickle import MAX_DIMS, MAX_INT, MAX_NAME, MAX_PATH, METADATA_GLOBALS, _budget, _str

LOOKAHEAD = 1 << 16
"""Bytes kept ahead of the interpreter: more than any matched record (its strings are at most 255 bytes)."""
BLOCK = 1 << 22
"""Bytes of frames joined per refill."""
MAX_FRAME = 1 << 24
PLAIN_ALLOWANCE = 200_000
PLAIN_PER_MATCH = 4
"""Opcodes interpreted plainly before the reader declines: beyond this allowance, four per matched record.
A tensor's header costs about 45, so a checkpoint of one chunk per tensor goes the C road, where each
opcode costs less than here."""
_CACHE_LIMIT = 1 << 18
"""Entries of each table of decoded bytes; a full table starts again (it only saves work and shares tuples)."""

_KEY_NAMES = frozenset({"offsets", "sizes", "fqn", "index", "offset", "relative_path", "length",
                        "type", "bytes_io_data", "tensor_data", "chunk", "properties", "size"})
_CTORS = {METADATA_GLOBALS[key]: key[1] for key in (
    dc.ChunkStorageMetadata.torch_global(), ("torch", "Size"), dc.MetadataIndex.torch_global(),
    dc.StorageInfo.torch_global(), dc.WriteItem.torch_global(), (dc.DCP_PLANNER, "WriteItemType"),
    dc.TensorWriteData.torch_global(), dc.TensorProperties.torch_global())}
"""The classes templates name, by their names in torch (`_StorageInfo` included)."""

_INT = (rb"(?:K.|M..|J....|\x8a(?:\x00|\x01.|\x02.{2}|\x03.{3}|\x04.{4}|\x05.{5}|\x06.{6}|\x07.{7}|\x08.{8}))")
_BODY = rb"(\)|" + _INT + rb"{1,3}[\x85\x86\x87]\x94|\(" + _INT + rb"{0,%d}t\x94)" % MAX_DIMS
"""A torch.Size's argument tuple as pickled: (), 1-3 integers and TUPLE1-3, or MARK … TUPLE; memoized."""
_SIZE_TAIL = rb"\x85\x94R\x94"
_NEW_OBJECT = rb"\)\x81\x94\}\x94\("
"""NEWOBJ of no arguments, memoized, then its state dict, memoized, and the MARK of its items."""
_STR = rb"(\x8c..{0,255}?\x94|h.|j.{4})"
"""A short new string (memoized), or a memo reference: one group, its bytes (`_string` decodes them)."""
_ONE_INT = re.compile(_INT, re.S)
_INT_CAPTURE = rb"(" + _INT + rb")"
_ANY = rb"(h.|j.{4})"
"""A memo reference to any value (one a dropped state holds)."""


class _Decline(Exception):
    """The pickle is not one this reader knows: the caller reads it the ordinary way."""


class _Consumed:
    """What a memo reference to a value a template consumed reads as. megatron-core's save plans refer to
    the chunk records; their state is dropped (`unpickle._PLAN_RECORDS`), and every field a record keeps
    is checked by type, so this value can only end where nothing is kept."""

    __slots__ = ()


_CONSUMED = _Consumed()


class _ChunkPair(tuple):
    """A matched chunk on the interpreter's stack: (offsets, sizes)."""

    __slots__ = ()


class _StorageKey(tuple):
    """A matched storage key on the stack: (fqn, offsets or None)."""

    __slots__ = ()


class _StorageRow(tuple):
    """A matched storage value on the stack: (file, byte offset, length)."""

    __slots__ = ()


def _integers(body: bytes) -> tuple[int, ...] | None:
    """The integers of a matched Size body; None when its tuple opcode disagrees with their count or one is
    out of range."""
    if body == b")":
        return ()
    marked = body[0] == 0x28  # MARK … TUPLE, else the integers then TUPLE1-3
    values = [_integer(m.group()) for m in _ONE_INT.finditer(body, 1 if marked else 0, len(body) - 2)]
    closing = body[-2]
    if None in values or (closing == 0x74) != marked or (closing != 0x74 and closing - 0x84 != len(values)):
        return None
    return tuple(values) if len(values) <= MAX_DIMS else None


class TemplateMachine(PickleMachine):
    """`PickleMachine` over a stream of deframed blocks, with learned chunk and storage-entry templates."""

    def __init__(self, blocks: Iterator[bytes], size: int) -> None:
        super().__init__(b"", METADATA_GLOBALS, _budget(size), record_types=(dc._DcpRecord,))
        self._blocks, self._more = blocks, True
        self._count = 0  # memo entries made, kept or not
        self._named: dict[str, int] = {}  # a template's class or field name → its memo index
        self._containers: dict[int, int] = {}  # id of a list or dict kept in the memo → its index
        self._bodies: dict[bytes, tuple[int, ...] | None] = {}
        self._ints: dict[bytes, int | None] = {}  # decoded indices and lengths of storage entries
        self._strings: dict[str, str] = {}
        self._texts: dict[int, dict[bytes, str]] = {MAX_NAME: {}, MAX_PATH: {}}  # by length limit: bytes → str
        self._text_at, self._texts_made = array("q"), []  # the strings templates memoized: index, value
        self._chunk: re.Pattern | None = None
        self._entry: re.Pattern | None = None
        self._chunks: re.Pattern | None = None  # a run of chunk records, one after the other
        self._entries: re.Pattern | None = None  # a run of storage entries
        self._plan: re.Pattern | None = None
        self._runs: dict[bytes, tuple[list, list, int]] = {}  # a batch of chunk records' bytes → what they read as
        self._run_bytes = 0
        self._entry_batches: dict[tuple, list[_EntryBatch]] = {}  # by their first entry's chunk offsets and file
        self._entry_keys: set[tuple] = set()  # the kinds of batches met once
        self._entry_batch_bytes = 0
        self._plain = self._matched = 0
        self._direct: list[int] = []  # the MARK depths matched items went straight in at, innermost last
        self._closing = False

    # -- input -----------------------------------------------------------------------------

    def _refill(self, need: int) -> None:
        pieces, have = [self._data[self._pos:]], self._end - self._pos
        while have < need + BLOCK and self._more:
            block = next(self._blocks, None)
            if block is None:
                self._more = False
            else:
                pieces.append(block)
                have += len(block)
        self._data, self._pos = b"".join(pieces), 0
        self._end = len(self._data)

    def _read(self, n: int) -> bytes:
        if n > self._end - self._pos and self._more:
            self._refill(n)
        return super()._read(n)

    def _read_line(self) -> str:
        raise _Decline  # GLOBAL: a protocol this reader does not expect

    def _op_frame(self) -> None:
        raise _Decline  # a FRAME inside a frame: `_blocks` took out every one where frames begin

    # -- the loop --------------------------------------------------------------------------

    def load(self) -> Any:
        dispatch = _OPCODES
        while True:
            if self._end - self._pos < LOOKAHEAD and self._more:
                self._refill(LOOKAHEAD)
            data, pos = self._data, self._pos
            if pos >= self._end:
                raise MalformedPickleError("pickle data truncated (no STOP)")
            op = data[pos]
            if (op == 0x68 or op == 0x6A) and self._template(data, pos):  # BINGET, LONG_BINGET
                continue
            self._plain += 1
            if self._plain > PLAIN_ALLOWANCE and self._plain > PLAIN_PER_MATCH * self._matched:
                raise _Decline
            self._pos = pos + 1
            handler = dispatch.get(op)
            if handler is None:
                raise _Decline
            if handler(self):
                if self._marks:
                    raise MalformedPickleError("pickle stops inside a mark")
                return self._finished(self._pop())

    # -- the memo: counted; kept only for values outside the templates ---------------------

    def _op_binput(self) -> None:
        raise _Decline

    def _op_long_binput(self) -> None:
        raise _Decline

    def _op_memoize(self) -> None:
        index = self._count
        self._count += 1
        if len(self._memo) >= MAX_MEMO:
            raise MalformedPickleError("pickle memo too large")
        value = self._memo[index] = self._top()
        kind = type(value)
        if kind is list or kind is dict:
            self._containers[id(value)] = index
            return
        name = value if kind is str and value in _KEY_NAMES else _CTORS.get(value) if kind is Constructor else None
        if name is not None:
            self._named[name] = index
            self._learn()

    def _get(self, index: int) -> None:
        if index in self._memo:
            super()._get(index)
        elif index < self._count:  # a value a template consumed: only state no record keeps may hold it
            self._charge(GET_WEIGHT)
            text = self._text(index)
            self._stack.append(_CONSUMED if text is None else text)
        else:
            raise _Decline

    def _text(self, index: int) -> str | None:
        """The string a template memoized at `index`, if it made one there."""
        at = bisect_left(self._text_at, index)
        return self._texts_made[at] if at < len(self._text_at) and self._text_at[at] == index else None

    # -- containers that take matched items ------------------------------------------------

    def _replace(self, old: Any, new: Any, holder: list) -> Any:
        """`new` in place of container `old`, the last value of `holder` (the stack, or the stack below a MARK)."""
        self._mutable(old, type(old))  # never referenced again since it was made
        holder[-1] = new
        index = self._containers.pop(id(old), None)
        if index is not None:
            self._memo[index] = new
        return new

    def _chunks_of(self, target: Any, holder: list | None = None) -> dc.ChunkColumns:
        if type(target) is dc.ChunkColumns:
            return target
        if type(target) is not list:
            raise MalformedPickleError(f"pickle adds chunks to a {type(target).__name__}")
        columns = self._replace(target, dc.ChunkColumns(), self._stack if holder is None else holder)
        for value in target:
            self._add_chunk(columns, value)
        return columns

    def _add_chunk(self, columns: dc.ChunkColumns, value: Any) -> None:
        if type(value) is _ChunkPair:
            offsets, sizes = value
        elif type(value) is dc.ChunkStorageMetadata:  # built plainly, its Sizes checked
            offsets, sizes = self._shared(value.offsets), self._shared(value.sizes)
        else:
            raise MalformedPickleError(f"a chunk list holds a {type(value).__name__}")
        columns.offsets.append(offsets)
        columns.sizes.append(sizes)

    def _shared(self, size: Any) -> tuple[int, ...]:
        """`size` as a plain tuple, equal ones shared (they live in the table of matched Size bodies)."""
        value = tuple(size)
        return self._bodies.setdefault(value, value)  # type: ignore[arg-type]

    def _op_append(self) -> None:
        value = self._finished(self._pop())
        target = self._top()
        if type(value) is _ChunkPair or type(target) is dc.ChunkColumns:
            self._add_chunk(self._chunks_of(target), value)
        else:
            self._mutable(target, list).append(value)

    def _op_appends(self) -> None:
        self._closing = True
        try:
            items = [self._finished(v) for v in self._pop_mark()]
        finally:
            self._closing = False
        target = self._top()
        if type(target) is dc.ChunkColumns or any(type(v) is _ChunkPair for v in items):
            columns = self._chunks_of(target)
            for value in items:
                self._add_chunk(columns, value)
        else:
            self._mutable(target, list).extend(items)

    def _set_items(self, target: Any, items: list[Any]) -> None:
        if len(items) % 2:
            raise MalformedPickleError("odd number of dict items")
        pairs = [(self._finished(items[i]), self._finished(items[i + 1])) for i in range(0, len(items), 2)]
        if type(target) is dc.StorageColumns or any(type(key) is _StorageKey for key, _ in pairs):
            if type(target) is dict:
                if not self._stack or self._stack[-1] is not target:
                    raise _Decline  # DICT's new dict: C's unpickler makes a dict of records of it
                target = self._storage(target)
            for key, value in pairs:
                self._add_entry(target, key, value)
            return
        for key, value in pairs:
            kind = type(key)
            if kind is not str and kind is not int and kind is not dc.MetadataIndex:
                raise _Decline  # C's hashing of anything else is what hash_guard probes
            target[key] = value

    def _storage(self, target: dict) -> dc.StorageColumns:
        columns = self._replace(target, dc.StorageColumns(), self._stack)
        for key, value in target.items():
            self._add_entry(columns, key, value)
        return columns

    def _add_entry(self, columns: dc.StorageColumns, key: Any, value: Any) -> None:
        if type(key) is _StorageKey and type(value) is _StorageRow:
            columns.add(key[0], key[1], *value)
        elif type(key) is dc.MetadataIndex and type(value) is dc.StorageInfo:
            offsets = None if key.offset is None else self._shared(key.offset)
            columns.add(key.fqn, offsets, value.relative_path, value.offset, value.length, value.transform_descriptors)
        else:
            raise MalformedPickleError(f"storage_data maps a {type(key).__name__} to a {type(value).__name__}")

    def _op_setitem(self) -> None:
        value = self._pop()
        key = self._pop()
        target = self._top()
        self._set_items(target if type(target) is dc.StorageColumns else self._mutable(target, dict), [key, value])

    def _op_setitems(self) -> None:
        self._closing = True
        try:
            items = self._pop_mark()
        finally:
            self._closing = False
        target = self._top()
        self._set_items(target if type(target) is dc.StorageColumns else self._mutable(target, dict), items)

    # -- templates -------------------------------------------------------------------------

    def _fetch(self, name: str) -> bytes:
        """The pattern of the memo fetch of `name` (a class or field name this pickle memoized)."""
        return re.escape(memo_fetch(self._named[name]))

    def _learn(self) -> None:
        """Compile each template once the names it fetches are all memoized."""
        named, get = self._named, self._fetch
        if self._chunk is None and _CHUNK_NAMES <= named.keys():
            size = get("Size")
            chunk = (get("ChunkStorageMetadata") + _NEW_OBJECT + get("offsets") + size + _BODY + _SIZE_TAIL
                     + get("sizes") + size + _BODY + _SIZE_TAIL + rb"ub")
            self._chunk, self._chunks = re.compile(chunk, re.S), re.compile(rb"(?:" + chunk + rb")+", re.S)
        if self._entry is None and _ENTRY_NAMES <= named.keys():
            entry = (self._index_pattern() + get("_StorageInfo") + _NEW_OBJECT + get("relative_path") + _STR
                     + get("offset") + _INT_CAPTURE + get("length") + _INT_CAPTURE + rb"ub")
            self._entry, self._entries = re.compile(entry, re.S), re.compile(rb"(?:" + entry + rb")+", re.S)
        if self._plan is None and _PLAN_NAMES <= named.keys():
            self._plan = self._plan_pattern()

    def _index_pattern(self) -> bytes:
        """A MetadataIndex {fqn, index, offset (absent for a bytes entry)}: a storage key, or a save-plan item's."""
        get = self._fetch
        return (get("MetadataIndex") + _NEW_OBJECT + get("fqn") + _STR + get("index") + rb"(N|" + _INT + rb")"
                + rb"(?:" + get("offset") + get("Size") + _BODY + _SIZE_TAIL + rb")?ub")

    def _plan_pattern(self) -> re.Pattern:
        """megatron-core's save plans (`all_local_plans`): a WriteItem, its MetadataIndex, its type and
        TensorWriteData, whose fields are memo references (the chunk among them is consumed)."""
        get = self._fetch
        return re.compile(
            get("WriteItem") + _NEW_OBJECT + get("index") + self._index_pattern()
            + get("type") + rb"(?:(" + get("WriteItemType") + _INT + _SIZE_TAIL + rb")|" + _ANY + rb")"
            + get("bytes_io_data") + rb"N" + get("tensor_data")
            + rb"(?:N|(" + get("TensorWriteData") + _NEW_OBJECT + get("chunk") + _ANY + get("properties")
            + rb"(?:" + _ANY + rb"|(" + get("TensorProperties") + rb"\)\x81\x94\(" + _ANY + _ANY + rb"[\x88\x89]" + _ANY
            + rb"[\x88\x89]t\x94b))" + get("size") + _ANY + rb"ub))ub", re.S)

    def _size(self, body: bytes) -> tuple[int, ...] | None:
        bodies = self._bodies
        found = bodies.get(body, bodies)
        if found is bodies:
            if len(bodies) > _CACHE_LIMIT:
                bodies.clear()
            value = _integers(body)
            found = bodies[body] = None if value is None else bodies.setdefault(value, value)
        return found

    def _string(self, raw: bytes, limit: int) -> str | None:
        """A matched string (its bytes `raw`: a new one, or a memo reference), None when the plain road must judge it.

        Equal bytes give the same answer (a memo entry never changes), so each is decoded and checked once."""
        texts = self._texts.setdefault(limit, {})
        known = texts.get(raw)
        if known is not None:
            return known
        if raw[0] == 0x8C:  # SHORT_BINUNICODE: its length byte, its text, MEMOIZE
            text = raw[2:-1]
            if len(text) != raw[1]:
                return None
            try:
                value = str(text, "utf-8")
            except UnicodeDecodeError:
                return None
        else:
            index = raw[1] if raw[0] == 0x68 else struct.unpack_from("<I", raw, 1)[0]
            value = self._memo[index] if index in self._memo else self._text(index)
            if type(value) is not str:
                return None
        try:
            _str(value, "", limit)
        except MalformedPickleError:
            return None
        if len(texts) > _CACHE_LIMIT:
            texts.clear()
        value = texts[raw] = self._strings.setdefault(value, value)
        return value

    def _batch_target(self) -> Any:
        """The container an APPENDS / SETITEMS batch under way will fill, while nothing of the batch
        is on the stack (a matched item then goes straight in, in order); else None."""
        if self._stack or not self._marks:
            return None
        below = self._marks[-1]
        return below[-1] if below else None

    def _went_in(self) -> None:
        """A matched item went straight into the batch's container: the MARK must close by APPENDS or
        SETITEMS (`_pop_mark` declines otherwise: another opcode would have made something else of it)."""
        depth = len(self._marks)
        if not self._direct or self._direct[-1] != depth:
            self._direct.append(depth)

    def _pop_mark(self) -> list[Any]:
        if self._direct and self._direct[-1] == len(self._marks):
            if not self._closing:
                raise _Decline
            self._direct.pop()
        return super()._pop_mark()

    def _template(self, data: bytes, pos: int) -> bool:
        """Match a chunk or a storage entry at `pos`; False (nothing consumed) when neither matches."""
        if self._chunk is not None:
            match = self._chunk.match(data, pos)
            if match is not None:
                return self._chunk_run(match)
        if self._entry is not None:
            match = self._entry.match(data, pos)
            if match is not None:
                return self._entry_run(match)
        if self._plan is not None:
            match = self._plan.match(data, pos)
            if match is not None:
                return self._plan_item(match)
        return False

    def _run(self, match: re.Match, into: bool, one: re.Pattern, many: re.Pattern, batch_end: bytes,
             variable: Callable[[list[tuple]], int]) -> tuple[list[tuple], int, int]:
        """The groups of the record `match` found and, going `into` a batch's columns, of every one
        right after it, found in C by `findall`, as columns; how many; and where they end. The batch's end is where its
        last record's `ub` meets the batch's `batch_end` opcode: its records are those `findall`
        finds up to there when their lengths (`variable`, the bytes of their groups, besides the
        bytes every record has) add up to it, none left out. Else (the bytes a field holds, or a
        batch past the bytes held) `many` finds the run's end first. A group that took no part is
        b"" (as `findall` gives it: none that takes part is empty)."""
        first = list(zip(match.groups(b"")))
        if not into:
            return first, 1, match.end()
        data, pos = self._data, self._pos
        fixed = match.end() - pos - variable(first)
        end = data.find(batch_end, pos, pos + BATCH_SPAN) + 2
        if end > pos:
            found = one.findall(data, pos, end)
            columns = list(zip(*found))
            if fixed * len(found) + variable(columns) == end - pos:
                return columns, len(found), end
        end = many.match(data, pos).end()
        found = one.findall(data, pos, end)
        return list(zip(*found)), len(found), end

    def _end_of(self, n: int, found: int, end: int, pattern: re.Pattern) -> int:
        """Where the first `n` of `found` records matched from `self._pos` by `pattern` end (`end`: all of them)."""
        if n == found:
            return end
        pos = self._pos
        for _ in range(n):  # a run cut short by a record the plain road must judge: rare
            pos = pattern.match(self._data, pos).end()
        return pos

    def _chunk_run(self, match: re.Match) -> bool:
        """The chunk record `match` found, and every one right after it while they go straight into a
        batch's chunk columns, decoded a column at a time (the per-record work is most of reading a
        big `.metadata`). Outside such a batch the one record goes onto the stack. False, nothing
        consumed, when the first is not a chunk this reader takes."""
        target = self._batch_target()
        into = type(target) is dc.ChunkColumns or (type(target) is list and not target)
        if into and self._repeated_chunks(target):
            return True
        (firsts, seconds), found, end = self._run(match, into, self._chunk, self._chunks, b"ube", _chunk_bytes)
        bodies = self._bodies
        offsets, n = _complete(list(map(bodies.get, firsts)), firsts, self._size)
        sizes, n_sizes = _complete(list(map(bodies.get, seconds)), seconds, self._size)
        n = min(n, n_sizes)
        if not n:
            return False
        if n < found:
            firsts, seconds, offsets, sizes = firsts[:n], seconds[:n], offsets[:n], sizes[:n]
        count = self._count + 8 * n - firsts.count(b")") - seconds.count(b")")
        end = self._end_of(n, found, end, self._chunk)
        if not into:
            self._stack.append(_ChunkPair((offsets[0], sizes[0])))
        else:
            self._extend_chunks(target, offsets, sizes)
            if n == found and self._data[end:end + 1] == b"e":  # the whole batch: its bytes say the same next time
                self._remember_run(self._data[self._pos:end], offsets, sizes, count - self._count)
        return self._consumed(n, 5, count, end, into)

    def _repeated_chunks(self, target: Any) -> bool:
        """Whether the batch of chunk records at the reading position is one read before, byte for
        byte (tensors of one shape have the same chunks: a model's layers, an optimizer's states),
        and was taken from what that reading found; the records are then consumed."""
        data, pos = self._data, self._pos
        end = data.find(b"ube", pos, pos + BATCH_SPAN) + 2
        known = self._runs.get(data[pos:end]) if end > pos else None
        if known is None:
            return False
        offsets, sizes, memo_entries = known
        self._extend_chunks(target, offsets, sizes)
        return self._consumed(len(offsets), 5, self._count + memo_entries, end, True)

    def _extend_chunks(self, target: Any, offsets: list, sizes: list) -> None:
        """Matched chunks into the batch's container (a list becomes the tensor's `ChunkColumns`)."""
        columns = self._chunks_of(target, self._marks[-1]) if type(target) is list else target
        columns.offsets += offsets
        columns.sizes += sizes

    def _remember_run(self, run: bytes, offsets: list, sizes: list, memo_entries: int) -> None:
        """Keep what a whole batch of chunk records read as, by its bytes (RUN_CACHE_BYTES of them at most)."""
        if self._run_bytes + len(run) > RUN_CACHE_BYTES:
            self._runs.clear()
            self._run_bytes = 0
        self._runs[run] = (offsets, sizes, memo_entries)
        self._run_bytes += len(run)

    def _strings_of(self, raws: tuple[bytes, ...], limit: int) -> tuple[list, int]:
        """A run's column of matched strings (`_string`, each new one decoded once); how many lead
        before the first that is not one this reader takes."""
        return _complete(list(map(self._texts.setdefault(limit, {}).get, raws)), raws,
                         lambda raw: self._string(raw, limit))

    def _entry_bytes(self, columns: list[tuple]) -> int:
        """The bytes of storage entries' groups (none inside another: fqn, index, chunk offsets, file,
        offset, length), and of the chunk offsets' fields where an entry has them."""
        named = self._named
        keyed = len(memo_fetch(named["offset"])) + len(memo_fetch(named["Size"])) + len(_SIZE_TAIL)
        bodies = columns[2]
        return sum(len(b"".join(column)) for column in columns) + keyed * (len(bodies) - bodies.count(b""))

    def _entry_run(self, match: re.Match) -> bool:
        """The storage entry `match` found, and every one right after it while they go straight into the
        storage columns, decoded a column at a time (as `_chunk_run`); outside such a batch the one
        entry goes onto the stack. False, nothing consumed, when the first is not an entry this reader
        takes."""
        target = self._batch_target()
        into = type(target) is dc.StorageColumns
        if into and self._repeated_entries(target, match):
            return True
        columns, found, end = self._run(match, into, self._entry, self._entries, b"ubu", self._entry_bytes)
        fqn_raws, indices, bodies, file_raws, places, lengths = columns
        fqns, n = self._strings_of(fqn_raws, MAX_NAME)
        files, n_files = self._strings_of(file_raws, MAX_PATH)
        offsets, n_offsets = _complete(list(map(self._bodies.get, bodies)), bodies, self._size, b"")
        byte_offsets = _offsets(places)
        ints = self._ints
        sizes, n_sizes = _complete(list(map(ints.get, lengths)), lengths, self._cached_integer)
        n_indices = _complete(list(map(ints.get, indices)), indices, self._cached_integer, b"N")[1]
        n = min(n, n_files, n_offsets, n_sizes, n_indices, byte_offsets.index(None) if None in byte_offsets else n)
        if not n:
            return False
        if n < found:
            fqns, files, offsets, byte_offsets, sizes = fqns[:n], files[:n], offsets[:n], byte_offsets[:n], sizes[:n]
            fqn_raws, file_raws, bodies = fqn_raws[:n], file_raws[:n], bodies[:n]
        # an entry's memo entries: its index record and state dict, a new fqn, a Size (its argument
        # tuple, none for an empty one, and its body), its storage record and state dict, a new file
        new_fqn, new_file = _new_strings(fqn_raws), _new_strings(file_raws)
        if new_fqn is not None or new_file is not None:  # each new string's memo index, as the entries before it counted
            new_fqn, new_file = new_fqn or [False] * n, new_file or [False] * n
            each = map(sum, zip(repeat(4), new_fqn, map(_SIZE_MEMO.get, bodies, repeat(3)), new_file))
            memo_at = list(accumulate(each, initial=self._count))  # each entry's first memo index
            made = sorted([*zip(map((2).__add__, compress(memo_at, new_fqn)), compress(fqns, new_fqn)),
                           *zip(map((-1).__add__, compress(memo_at[1:], new_file)), compress(files, new_file))])
            self._text_at.extend(index for index, _ in made)
            self._texts_made.extend(text for _, text in made)
            count = memo_at[-1]
        else:
            empty, keyless = bodies.count(b")"), bodies.count(b"")
            count = self._count + 4 * n + 2 * empty + 3 * (n - empty - keyless)
        end = self._end_of(n, found, end, self._entry)
        if not into:
            self._stack.append(_StorageKey((fqns[0], offsets[0])))
            self._stack.append(_StorageRow((files[0], byte_offsets[0], sizes[0])))
            return self._consumed(n, 12, count, end, into)
        _into_storage(target, fqns, offsets, files, byte_offsets, sizes)
        if n == found and new_fqn is None and new_file is None and self._data[end:end + 1] == b"u":
            self._remember_entries(target, end, offsets, files, sizes, count - self._count, match)
        return self._consumed(n, 12, count, end, into)

    def _repeated_entries(self, target: dc.StorageColumns, match: re.Match) -> bool:
        """Whether the batch of storage entries at the reading position is one read before but for
        its entries' fqn references and byte offsets (a layer's tensors, their optimizer states: each
        rank file holds a chunk of each, laid alike), and was taken from what that reading found;
        the entries are then consumed.

        Pickle opcodes alone decide how their bytes parse, so a batch whose bytes equal the one read
        before but for the arguments of those references and BININTs (the opcodes kept) holds the
        same records: only the references are looked up and the offsets unpacked."""
        data, pos = self._data, self._pos
        for known in self._entry_batches.get((match.group(3), match.group(4)), ()):
            end = pos + known.length
            if data[end - 2:end + 1] == b"ubu" and known.target is target:
                break
        else:
            return False
        batch = data[pos:end]
        if b"".join(known.constant_parts(batch)) != known.constant:
            return False
        args = known.fqn_args(batch)
        op = known.fqn_op
        names = {arg: self._string(op + arg, MAX_NAME) for arg in dict.fromkeys(args)}
        runs = _runs(args, names)
        if runs is None:  # a name this reader does not take, or tensors' entries interleaved: the plain road
            return False
        n = len(args)
        byte_offsets = struct.unpack(f"<{n}i", b"".join(known.byte_offsets(batch)))
        if min(byte_offsets) < 0:
            return False
        rows = array("q", known.rows)
        rows[1::3] = array("q", byte_offsets)
        offsets = known.offsets
        for fqn, a, b in runs:
            keys, columns = target.rows_for(fqn)
            keys += offsets[a:b]
            columns += rows[3 * a:3 * b]
        return self._consumed(n, 12, self._count + known.memo_entries, end, True)

    def _remember_entries(self, target: dc.StorageColumns, end: int, offsets: list, files: list, sizes: list,
                          memo_entries: int, first: re.Match) -> None:
        """Keep the whole batch of storage entries just read into `target` (from the reading position
        to `end`, no new string among them, their fqn references of one opcode, every byte offset a
        BININT) as an `_EntryBatch`, the second time a batch of its kind (its length, its `first`
        entry's chunk offsets and file) is met."""
        key = (first.group(3), first.group(4))
        length = end - self._pos
        alike = self._entry_batches.get(key, ())
        if any(known.length == length for known in alike):
            return
        if (length, key) not in self._entry_keys:
            if len(self._entry_keys) > _CACHE_LIMIT:
                self._entry_keys.clear()
            self._entry_keys.add((length, key))
            return
        data, pos = self._data, self._pos
        cuts, fqn_args, byte_offsets, ops = [0], [], [], set()
        at = pos
        for record in self._entry.finditer(data, pos, end):
            (fqn_start, fqn_end), (place_start, place_end) = record.span(1), record.span(5)
            if record.start() != at or data[place_start] != 0x4A:
                return
            at = record.end()
            ops.add(data[fqn_start:fqn_start + 1])
            cuts += [fqn_start + 1 - pos, fqn_end - pos, place_start + 1 - pos, place_end - pos]
            fqn_args.append(slice(fqn_start + 1 - pos, fqn_end - pos))
            byte_offsets.append(slice(place_start + 1 - pos, place_end - pos))
        n = len(offsets)
        if at != end or len(fqn_args) != n or n < 2 or len(ops) != 1:
            return
        cuts.append(length)
        constant_parts = operator.itemgetter(*[slice(a, b) for a, b in zip(cuts[0::2], cuts[1::2])])
        constant = b"".join(constant_parts(data[pos:end]))
        rows = array("q", bytes(24 * n))  # each entry's file and length; its byte offset filled in per batch
        rows[0::3], rows[2::3] = array("q", map(target.file_ids.__getitem__, files)), array("q", sizes)
        if self._entry_batch_bytes + 2 * len(constant) > RUN_CACHE_BYTES:
            self._entry_batches.clear()
            self._entry_batch_bytes = 0
        self._entry_batches.setdefault(key, []).append(_EntryBatch(
            length, constant_parts, constant, ops.pop(), operator.itemgetter(*fqn_args),
            operator.itemgetter(*byte_offsets), offsets, rows, target, memo_entries))
        self._entry_batch_bytes += 2 * len(constant)

    def _cached_integer(self, raw: bytes) -> int | None:
        """`_integer` of a field whose few values repeat (an index, a length), remembered."""
        ints = self._ints
        if len(ints) > _CACHE_LIMIT:
            ints.clear()
        value = ints[raw] = _integer(raw)
        return value

    def _consumed(self, n: int, fetches: int, count: int, pos: int, into: bool) -> bool:
        """Account for `n` matched records of `fetches` memo references each, the memo count after
        them and where they end; True when there was one."""
        if not n:
            return False
        self._charge(fetches * GET_WEIGHT * n)
        if into:
            self._went_in()
        self._count, self._pos = count, pos
        self._matched += n
        return True

    def _made(self, index: int, text: str) -> int:
        """A template's new string memoized at `index` (kept: a later fetch may read it); the next index."""
        self._text_at.append(index)
        self._texts_made.append(text)
        return index + 1

    def _index_memoized(self, index: int, fqn: str, new_fqn: bool, body: bytes | None) -> int:
        """The memo entries a matched MetadataIndex made from `index` on (its record, state dict, a new
        fqn, a Size and its argument tuples); the next index."""
        index += 2
        if new_fqn:
            index = self._made(index, fqn)
        if body is not None:
            index += 2 if body == b")" else 3
        return index

    def _plan_item(self, match: re.Match) -> bool:
        fqn_raw, index, body, type_call, type_get, tensor_data, chunk, properties, \
            new_properties, dtype, layout, memory_format, size = match.groups()
        fqn = self._string(fqn_raw, MAX_NAME)
        if fqn is None or (body is not None and self._size(body) is None) or (
                index != b"N" and _integer(index) is None):
            return False
        for raw in (type_get, chunk, properties, dtype, layout, memory_format, size):
            if raw is not None and (raw[1] if raw[0] == 0x68 else struct.unpack_from("<I", raw, 1)[0]) >= self._count:
                return False  # a reference to no value
        self._charge(16 * GET_WEIGHT)
        count = self._index_memoized(self._count + 2, fqn, fqn_raw[0] == 0x8C, body)  # after the item and its state dict
        count += (2 if type_call is not None else 0) + (2 if tensor_data is not None else 0) + (
            2 if new_properties is not None else 0)  # a call's argument and result; the other records
        self._count = count
        self._stack.append(_WRITE_ITEM)
        self._pos = match.end()
        self._matched += 1
        return True


_CHUNK_NAMES = frozenset({"ChunkStorageMetadata", "Size", "offsets", "sizes"})
_ENTRY_NAMES = frozenset({"MetadataIndex", "_StorageInfo", "Size", "fqn", "index", "offset", "relative_path",
                          "length"})
_PLAN_NAMES = frozenset({"WriteItem", "WriteItemType", "TensorWriteData", "TensorProperties", "MetadataIndex", "Size",
                         "fqn", "index",
                         "offset", "type", "bytes_io_data", "tensor_data", "chunk", "properties", "size"})
_WRITE_ITEM = dc.WriteItem()
"""What every matched save-plan item reads as: a record whose state is dropped, as `unpickle` drops it."""
_OPCODES = opcode_table(TemplateMachine)


class _EntryBatch:
    """A batch of storage entries read before: its `length` in bytes; its bytes but for each entry's
    fqn reference and byte offset arguments (`constant`, what `constant_parts` cuts from a batch's
    bytes); where those arguments lie (`fqn_args` after the one `fqn_op`, `byte_offsets`: 4-byte
    BININTs); each entry's chunk offsets, and its file and length in `target`'s numbering (`rows`,
    byte offsets left 0); and the memo entries the batch makes."""

    __slots__ = ("length", "constant_parts", "constant", "fqn_op", "fqn_args", "byte_offsets", "offsets", "rows",
                 "target", "memo_entries")

    def __init__(self, length: int, constant_parts: Callable[[bytes], tuple], constant: bytes, fqn_op: bytes,
                 fqn_args: Callable[[bytes], tuple], byte_offsets: Callable[[bytes], tuple], offsets: list,
                 rows: array, target: dc.StorageColumns, memo_entries: int) -> None:
        self.length, self.constant_parts, self.constant, self.fqn_op = length, constant_parts, constant, fqn_op
        self.fqn_args, self.byte_offsets, self.offsets, self.rows = fqn_args, byte_offsets, offsets, rows
        self.target, self.memo_entries = target, memo_entries


def _runs(args: tuple[bytes, ...], names: dict[bytes, str | None]) -> list[tuple[str, int, int]] | None:
    """The consecutive runs of a batch's fqn reference arguments `args`, each with its name (`names`:
    each distinct argument's), as (name, start, stop); None when a name is not one this reader
    takes or a reference comes back after another (entries interleaved)."""
    runs, start = [], 0
    for arg, name in names.items():
        if name is None:
            return None
        count = args.count(arg)
        if args[start:start + count].count(arg) != count:
            return None
        runs.append((name, start, start + count))
        start += count
    return runs


def _into_storage(target: dc.StorageColumns, fqns: list, offsets: list, files: list, byte_offsets: Sequence[int],
                  sizes: list) -> None:
    """A run of storage entries into the storage columns: a tensor's consecutive ones a column at a time."""
    n = len(fqns)
    file_ids = list(map(target.file_ids.get, files))
    if None in file_ids:  # a file met for the first time: numbered in the order met
        file_ids = list(map(target.file_id, files))
    starts = [0, *compress(range(1, n), map(operator.is_not, fqns[1:], fqns[:-1])), n]
    if len(starts) > n // 4:  # the tensors' entries interleaved (torch orders them by rank): one at a time
        fqn_now = keys = columns = None
        for fqn, key, row in zip(fqns, offsets, zip(file_ids, byte_offsets, sizes)):
            if fqn is not fqn_now:
                keys, columns = target.rows_for(fqn)
                fqn_now = fqn
            keys.append(key)
            columns.extend(row)
        return
    rows = array("q", bytes(24 * n))  # the places interleaved a column at a time
    rows[0::3], rows[1::3], rows[2::3] = array("q", file_ids), array("q", byte_offsets), array("q", sizes)
    for a, b in zip(starts, starts[1:]):  # one tensor's entries follow one another
        keys, columns = target.rows_for(fqns[a])
        keys += offsets[a:b]
        columns += rows[3 * a:3 * b]


def _integer(raw: bytes) -> int | None:
    """One matched integer opcode's value, None outside [0, MAX_INT)."""
    op = raw[0]
    if op == 0x4B:
        return raw[1]
    if op == 0x4D:
        return raw[1] | raw[2] << 8
    value = int.from_bytes(raw[1:] if op == 0x4A else raw[2:], "little", signed=True)
    return value if 0 <= value < MAX_INT else None


_SIZE_MEMO = {b"": 0, b")": 2}
"""The memo entries of a storage key's chunk offsets, by their Size body (any other: 3)."""
RUN_CACHE_BYTES = 1 << 25
"""Bytes of chunk-record batches kept with what they read as (a full cache starts again)."""
BATCH_SPAN = 1 << 18
"""How far a batch's end is looked for: 1,000 records (a pickler's batch) of up to 262 bytes."""


def _chunk_bytes(columns: list[tuple]) -> int:
    """The bytes of chunk records' groups (their two Size bodies)."""
    return len(b"".join(columns[0])) + len(b"".join(columns[1]))


def _complete(values: list, raws: tuple[bytes, ...], decode: Callable[[bytes], Any],
              absent: bytes | None = None) -> tuple[list, int]:
    """A run's column: `values` (its `raws` looked up in a table of decoded ones) with each raw the
    table lacked decoded once, the `absent` one (a field the record leaves out) left None; and how
    many lead before the first that decodes to None (not one this reader takes)."""
    if None not in values:
        return values, len(values)
    decoded = {raw: decode(raw) for raw in dict.fromkeys(compress(raws, map(operator.is_, values, repeat(None))))
               if raw != absent}
    bad = next((raw for raw, value in decoded.items() if value is None), None)
    return list(map(decoded.get, raws, values)), len(values) if bad is None else raws.index(bad)


def _new_strings(raws: tuple[bytes, ...]) -> list[bool] | None:
    """Which of a run's matched strings are new ones (SHORT_BINUNICODE, 0x8C), None when none is
    (a memo reference's index may hold that byte: then each is looked at)."""
    if b"\x8c" not in b"".join(raws):
        return None
    news = [raw[0] == 0x8C for raw in raws]
    return news if True in news else None


def _offsets(raws: tuple[bytes, ...]) -> list[int | None]:
    """The byte offsets of a run's storage entries (any integer opcode; None where negative or too
    large), unpacked at once where all are 4-byte BININTs (any entry past the first 64 KB of its file)."""
    joined = b"".join(raws)
    n = len(raws)
    if len(joined) == 5 * n and joined[::5] == b"J" * n:
        values = list(struct.unpack("<" + "xi" * n, joined))
        return values if min(values) >= 0 else [v if v >= 0 else None for v in values]
    return list(map(_integer, raws))


def _blocks(read: Callable[[int, int], bytes], size: int) -> Iterator[bytes]:
    """The pickle's opcodes with its FRAME headers left out, about BLOCK bytes at a time, by positioned
    reads (`read`: (length, offset) → bytes)."""
    head = read(2, 0)
    if len(head) < 2 or head[0] != 0x80 or head[1] < 4:
        raise _Decline
    pieces, held, pos = [head], 2, 2
    while pos < size:
        header = read(9, pos)
        if len(header) < 9 or header[0] != 0x95:
            if size - pos > 3:
                raise _Decline  # unframed data other than the pickler's last few bytes
            pieces.append(read(size - pos, pos))
            break
        (n,) = struct.unpack_from("<Q", header, 1)
        if n > MAX_FRAME or n > size - pos - 9:
            raise _Decline
        payload = read(n, pos + 9)
        if len(payload) != n:
            raise _Decline
        pieces.append(payload)
        held += n
        pos += 9 + n
        if held >= BLOCK:
            yield b"".join(pieces)
            pieces, held = [], 0
    yield b"".join(pieces)


def read_metadata(read: Callable[[int, int], bytes], size: int) -> dc.Metadata | None:
    """The Metadata the `.metadata` that `read` reads (`size` bytes) holds, or None: read it the ordinary way."""
    blocks = _blocks(read, size)
    try:
        with gc_paused():
            md = TemplateMachine(blocks, size).load()
    except Exception:  # declined, or a fault the ordinary reader names
        return None
    finally:
        blocks.close()
    return md if type(md) in (dc.Metadata, dc.MCoreMetadata) else None
