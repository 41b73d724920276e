"""A small pickle interpreter that can only build fresh, validated values: the slow path that names a fault.

`unpickle` runs pickles through C's `pickle.Unpickler` with inert stand-ins for every
global; when C gives up on a pickle by itself (a bad opcode, a truncation, a length
beyond the data), its message has no position or declared length, so the same pickle is
run again here, against the same `Constructor` tables, for the one-line reason to report.

`pickle.Unpickler` (C or Python) hands the objects `find_class` returns to BUILD, which
writes into whatever is on the stack: a class, a function, a shared dtype. An allow-list
of globals is therefore not enough to keep a pickle from changing the process. This
interpreter knows the binary opcodes real DCP and `torch.save` pickles use and nothing
else: a global is a `Constructor` (never the object itself), REDUCE calls its explicit,
validating constructor, NEWOBJ + BUILD give a constructor its state once, for a fresh
object only, and containers are plain lists, dicts and tuples the interpreter made itself.

It also bounds what a pickle can cost. Lengths are checked against the bytes that are
left before anything is read; every value built costs one unit of a budget, and a memo
reference costs what the referenced value would cost written out again, so a pickle that
repeats one chunk two million times by reference is as expensive as two million chunks.
Values waiting on the stack are bounded too (`MAX_STACK`): a real pickle holds one batch of
items there, a padded one millions. It never recurses, whatever the nesting, and hashes a dict
key only after the caller's `keys` check has passed it (`hash_guard.KeyGuard`).
"""

from __future__ import annotations

import pickle
import pickletools
import struct
from dataclasses import dataclass
from typing import Any, Callable


class UnsafePickleError(pickle.UnpicklingError):
    """A pickle asked for something outside the allow-list: a global, an opcode, a persistent reference."""


class MalformedPickleError(pickle.UnpicklingError):
    """A pickle is truncated, inconsistent, over a budget, or builds values of the wrong shape."""


@dataclass(frozen=True, slots=True)
class Constructor:
    """An allowed global: `call` builds a value from REDUCE arguments; `from_state` builds one from
    NEWOBJ + BUILD state (None when the pickle sends no state). Either may be missing."""

    name: str
    call: Callable[[tuple], Any] | None = None
    from_state: Callable[[Any], Any] | None = None


class _Pending:
    """The object NEWOBJ announced; BUILD (or the first use without state) makes it."""

    __slots__ = ("ctor", "value")

    def __init__(self, ctor: Constructor) -> None:
        self.ctor, self.value = ctor, None


_MARK = object()
_KNOWN_OPCODES = frozenset(ord(op.code) for op in pickletools.opcodes)
_CONTAINERS = (tuple, list, dict)
MAX_STRING = 1 << 20
"""Longest str or bytes value accepted (a relative path, a name; never tensor data)."""
MAX_LONG_BYTES = 16
MAX_MEMO = 1 << 26
MAX_STACK = 1 << 17
"""Values the stack may hold at once, below every MARK included: pickle's own writer batches
1,000 items, and nesting adds one a level."""
GET_WEIGHT = 2
"""A memo reference is charged as writing its value out again would cost: at least two bytes a value."""


class PickleMachine:
    """Runs one pickle held in `data` (bytes, or an mmap of a regular file, so a huge or sparse
    file costs no memory until read). `globals_` maps (module, name) to Constructors or immutable
    constants; `persistent` resolves BINPERSID ids (None: refused); memo references may cost
    `budget` values in all; `keys` checks each dict key before it is hashed (raising to refuse it)."""

    def __init__(self, data: Any, globals_: dict[tuple[str, str], Any], budget: int,
                 persistent: Callable[[Any], Any] | None = None, record_types: tuple[type, ...] = (),
                 keys: Callable[[Any], None] | None = None) -> None:
        self._data, self._pos, self._end = data, 0, len(data)
        self._globals, self._persistent = globals_, persistent
        self._budget = budget
        self._records = record_types
        self._stack: list[Any] = []
        self._marks: list[list[Any]] = []
        self._held = 0  # values on the stacks below the MARKs
        self._keys = keys
        self._proto = 0
        self._memo: dict[int, Any] = {}
        self._sealed: set[int] = set()
        self._costs: dict[int, int] = {}

    _opcodes: dict[int, Callable[[PickleMachine], Any]]

    # -- reading ---------------------------------------------------------------------------

    def _read(self, n: int) -> bytes:
        pos = self._pos
        if n > self._end - pos:
            raise MalformedPickleError(f"pickle data truncated (needs {n} bytes, {self._end - pos} left)")
        self._pos = pos + n
        return self._data[pos:pos + n]

    def _read_text(self, n: int) -> str:
        if n > MAX_STRING:
            raise MalformedPickleError(f"string of {n} bytes is over the {MAX_STRING}-byte limit")
        try:
            return str(self._read(n), "utf-8")
        except UnicodeDecodeError:
            raise MalformedPickleError("string is not UTF-8") from None

    def _read_line(self) -> str:
        end = self._data.find(b"\n", self._pos, min(self._end, self._pos + 257))
        if end < 0:
            raise MalformedPickleError("global name too long or truncated")
        line = self._read(end - self._pos + 1)[:-1]
        try:
            return line.decode("ascii")
        except UnicodeDecodeError:
            raise MalformedPickleError("global name is not ASCII") from None

    # -- accounting ------------------------------------------------------------------------

    def _charge(self, n: int) -> None:
        """Opcodes build at most one value per byte; only memo references can multiply values, so they pay."""
        self._budget -= n
        if self._budget < 0:
            raise MalformedPickleError("pickle builds more values than its size allows (memo amplification?)")

    def _cost(self, obj: Any) -> int:
        """Values `obj` stands for when written out, children included (computed without recursion)."""
        if not isinstance(obj, _CONTAINERS) and not isinstance(obj, self._records):
            return 1
        cached = self._costs.get(id(obj))
        if cached is not None:
            return cached
        total, todo, limit = 0, [obj], self._budget + 1
        while todo:
            item = todo.pop()
            known = self._costs.get(id(item)) if item is not obj else None
            if known is not None:
                total += known
            elif isinstance(item, dict):
                total += 1
                todo.extend(item.keys())
                todo.extend(item.values())
            elif isinstance(item, (tuple, list)):
                total += 1
                todo.extend(item)
            elif isinstance(item, self._records):
                total += 1
                todo.extend(vars(item).values())
            else:
                total += 1
            if total > limit:
                break
        self._costs[id(obj)] = total
        return total

    # -- stack -----------------------------------------------------------------------------

    def _pop_mark(self) -> list[Any]:
        if not self._marks:
            raise MalformedPickleError("pickle pops a mark that is not there")
        items = self._stack
        self._stack = self._marks.pop()
        self._held -= len(self._stack)
        return items

    def _pop(self) -> Any:
        if not self._stack:
            raise MalformedPickleError("pickle stack underflow")
        return self._stack.pop()

    def _top(self) -> Any:
        if not self._stack:
            raise MalformedPickleError("pickle stack underflow")
        return self._stack[-1]

    def _push(self, value: Any) -> None:
        if len(self._stack) + self._held >= MAX_STACK:
            raise _stack_full()
        self._stack.append(value)

    @staticmethod
    def _finished(value: Any) -> Any:
        """A value as containers and constructors see it: a NEWOBJ without BUILD is made now."""
        if type(value) is _Pending:
            if value.value is None:
                if value.ctor.from_state is None:
                    raise MalformedPickleError(f"{value.ctor.name} cannot be made without state")
                value.value = value.ctor.from_state(None)
            return value.value
        if type(value) is Constructor:
            raise MalformedPickleError(f"global {value.name} used as a value")
        return value

    def _mutable(self, target: Any, kind: type) -> Any:
        if type(target) is not kind:
            raise MalformedPickleError(f"pickle adds items to a {type(target).__name__}, not a {kind.__name__}")
        if id(target) in self._sealed:
            raise MalformedPickleError(f"pickle changes a {kind.__name__} after referencing it")
        return target

    # -- the loop --------------------------------------------------------------------------

    def load(self) -> Any:
        """Run the pickle to its STOP and return the (finished) value it leaves."""
        data, end, dispatch = self._data, self._end, self._opcodes
        while True:
            pos = self._pos
            if pos >= end:
                raise MalformedPickleError("pickle data truncated (no STOP)")
            op = data[pos]
            self._pos = pos + 1
            handler = dispatch.get(op)
            if handler is None:
                if op in _KNOWN_OPCODES:
                    raise UnsafePickleError(f"refuses pickle opcode {bytes([op])!r}")
                raise MalformedPickleError(f"invalid pickle opcode {bytes([op])!r} at byte {pos}")
            if handler(self):
                if self._marks:
                    raise MalformedPickleError("pickle stops inside a mark")
                value = self._finished(self._pop())
                if self._stack:
                    raise MalformedPickleError(f"pickle leaves {len(self._stack)} values beside the one it returns")
                return value

    # -- opcodes ---------------------------------------------------------------------------

    def _op_proto(self) -> None:
        self._proto = self._read(1)[0]
        if self._proto > 5:
            raise MalformedPickleError("unsupported pickle protocol")

    def _op_frame(self) -> None:
        (n,) = struct.unpack("<Q", self._read(8))
        if n > self._end - self._pos:
            raise MalformedPickleError("pickle frame runs past the data")

    def _op_stop(self) -> bool:
        return True

    def _op_mark(self) -> None:
        self._held += len(self._stack)
        if self._held + len(self._marks) >= MAX_STACK:
            raise _stack_full()
        self._marks.append(self._stack)
        self._stack = []

    def _op_pop(self) -> None:
        self._pop()

    def _op_pop_mark(self) -> None:
        self._pop_mark()

    def _op_none(self) -> None:
        self._push(None)

    def _op_true(self) -> None:
        self._push(True)

    def _op_false(self) -> None:
        self._push(False)

    def _op_binint(self) -> None:
        self._push(struct.unpack("<i", self._read(4))[0])

    def _op_binint1(self) -> None:
        self._push(self._read(1)[0])

    def _op_binint2(self) -> None:
        self._push(struct.unpack("<H", self._read(2))[0])

    def _op_long1(self) -> None:
        self._long(self._read(1)[0])

    def _op_long4(self) -> None:
        self._long(struct.unpack("<i", self._read(4))[0])

    def _long(self, n: int) -> None:
        if not 0 <= n <= MAX_LONG_BYTES:
            raise MalformedPickleError(f"integer of {n} bytes")
        self._push(int.from_bytes(self._read(n), "little", signed=True))

    def _op_binfloat(self) -> None:
        self._push(struct.unpack(">d", self._read(8))[0])

    def _op_short_binunicode(self) -> None:
        self._push(self._read_text(self._read(1)[0]))

    def _op_binunicode(self) -> None:
        self._push(self._read_text(struct.unpack("<I", self._read(4))[0]))

    def _op_binunicode8(self) -> None:
        self._push(self._read_text(struct.unpack("<Q", self._read(8))[0]))

    def _bytes(self, n: int) -> None:
        if n > MAX_STRING:
            raise MalformedPickleError(f"bytes value of {n} bytes is over the {MAX_STRING}-byte limit")
        self._push(self._read(n))

    def _op_short_binbytes(self) -> None:
        self._bytes(self._read(1)[0])

    def _op_binbytes(self) -> None:
        self._bytes(struct.unpack("<I", self._read(4))[0])

    def _op_binbytes8(self) -> None:
        self._bytes(struct.unpack("<Q", self._read(8))[0])

    def _op_empty_tuple(self) -> None:
        self._push(())

    def _tuple(self, n: int) -> None:
        if len(self._stack) < n:
            raise MalformedPickleError("pickle stack underflow")
        items = tuple(self._finished(v) for v in self._stack[len(self._stack) - n:])
        del self._stack[len(self._stack) - n:]
        self._push(items)

    def _op_tuple1(self) -> None:
        self._tuple(1)

    def _op_tuple2(self) -> None:
        self._tuple(2)

    def _op_tuple3(self) -> None:
        self._tuple(3)

    def _op_tuple(self) -> None:
        items = self._pop_mark()
        self._push(tuple(self._finished(v) for v in items))

    def _op_empty_list(self) -> None:
        self._push([])

    def _op_list(self) -> None:
        items = self._pop_mark()
        self._push([self._finished(v) for v in items])

    def _op_append(self) -> None:
        value = self._finished(self._pop())
        self._mutable(self._top(), list).append(value)

    def _op_appends(self) -> None:
        items = self._pop_mark()
        self._mutable(self._top(), list).extend(self._finished(v) for v in items)

    def _op_empty_dict(self) -> None:
        self._push({})

    def _set_items(self, target: dict, items: list[Any]) -> None:
        if len(items) % 2:
            raise MalformedPickleError("odd number of dict items")
        keys = self._keys
        for i in range(0, len(items), 2):
            key = self._finished(items[i])
            if keys is not None:
                keys(key)
            try:
                target[key] = self._finished(items[i + 1])
            except TypeError:
                raise MalformedPickleError(f"unhashable dict key of type {type(key).__name__}") from None

    def _op_dict(self) -> None:
        items = self._pop_mark()
        out: dict = {}
        self._set_items(out, items)
        self._push(out)

    def _op_setitem(self) -> None:
        value = self._pop()
        key = self._pop()
        self._set_items(self._mutable(self._top(), dict), [key, value])

    def _op_setitems(self) -> None:
        items = self._pop_mark()
        self._set_items(self._mutable(self._top(), dict), items)

    def _global(self, module: str, name: str) -> None:
        ctor = self._globals.get((module, name))  # a Constructor, or an immutable constant (a dtype)
        if ctor is None:
            raise UnsafePickleError(f"refuses to load global {module}.{name}")
        self._push(ctor)

    def _op_global(self) -> None:
        self._global(self._read_line(), self._read_line())

    def _op_stack_global(self) -> None:
        name, module = self._pop(), self._pop()
        if type(module) is not str or type(name) is not str:
            raise MalformedPickleError("STACK_GLOBAL needs two strings")
        self._global(module, name)

    def _op_reduce(self) -> None:
        args = self._pop()
        ctor = self._pop()
        if type(ctor) is not Constructor or ctor.call is None:
            raise MalformedPickleError(f"pickle calls {_what(ctor)}, which cannot be called")
        if type(args) is not tuple:
            raise MalformedPickleError(f"{ctor.name} called with {_what(args)} instead of an argument tuple")
        self._push(ctor.call(args))

    def _op_newobj(self) -> None:
        args = self._pop()
        ctor = self._pop()
        if type(ctor) is not Constructor or ctor.from_state is None:
            raise MalformedPickleError(f"pickle creates an instance of {_what(ctor)}, which is not allowed")
        if args != ():
            raise MalformedPickleError(f"{ctor.name} created with arguments")
        self._push(_Pending(ctor))

    def _op_build(self) -> None:
        state = self._finished(self._pop())
        target = self._top()
        if type(target) is not _Pending or target.value is not None:
            raise UnsafePickleError(f"refuses to set the state of {_what(target)} (only of a new object)")
        target.value = target.ctor.from_state(state)
        self._stack[-1] = target.value

    def _put(self, index: int) -> None:
        if len(self._memo) >= MAX_MEMO:
            raise MalformedPickleError("pickle memo too large")
        self._memo[index] = self._top()

    def _op_binput(self) -> None:
        self._put(self._read(1)[0])

    def _op_long_binput(self) -> None:
        self._put(struct.unpack("<I", self._read(4))[0])

    def _op_memoize(self) -> None:
        self._put(len(self._memo))

    def _get(self, index: int) -> None:
        value = self._memo.get(index, _MARK)
        kind = type(value)
        if kind is str or kind is int:  # the common case: a shared name or number
            self._budget -= GET_WEIGHT
        elif value is _MARK:
            raise MalformedPickleError(f"pickle refers to memo entry {index}, which is not there")
        else:
            if kind is _Pending:
                if value.value is None:
                    raise MalformedPickleError(f"pickle refers to an unfinished {value.ctor.name}")
                value = value.value
            if isinstance(value, (list, dict)):
                self._sealed.add(id(value))
            self._charge(GET_WEIGHT * self._cost(value))
        if len(self._stack) + self._held >= MAX_STACK:
            raise _stack_full()
        self._stack.append(value)

    def _op_binget(self) -> None:
        self._get(self._read(1)[0])

    def _op_long_binget(self) -> None:
        self._get(struct.unpack("<I", self._read(4))[0])

    def _op_binpersid(self) -> None:
        pid = self._finished(self._pop())
        if self._persistent is None:
            raise UnsafePickleError("refuses persistent references")
        self._push(self._persistent(pid))


def _stack_full() -> MalformedPickleError:
    return MalformedPickleError(f"pickle holds more than {MAX_STACK} values on its stack at once")


def _what(value: Any) -> str:
    """A short, bounded description of a value for an error message (never its repr)."""
    if type(value) is Constructor:
        return value.name
    if type(value) is _Pending:
        return f"a {value.ctor.name}"
    return f"a {type(value).__name__}"


_DISPATCH: dict[int, Callable[[PickleMachine], Any]] = {
    pickle.PROTO[0]: PickleMachine._op_proto,
    pickle.FRAME[0]: PickleMachine._op_frame,
    pickle.STOP[0]: PickleMachine._op_stop,
    pickle.MARK[0]: PickleMachine._op_mark,
    pickle.POP[0]: PickleMachine._op_pop,
    pickle.POP_MARK[0]: PickleMachine._op_pop_mark,
    pickle.NONE[0]: PickleMachine._op_none,
    pickle.NEWTRUE[0]: PickleMachine._op_true,
    pickle.NEWFALSE[0]: PickleMachine._op_false,
    pickle.BININT[0]: PickleMachine._op_binint,
    pickle.BININT1[0]: PickleMachine._op_binint1,
    pickle.BININT2[0]: PickleMachine._op_binint2,
    pickle.LONG1[0]: PickleMachine._op_long1,
    pickle.LONG4[0]: PickleMachine._op_long4,
    pickle.BINFLOAT[0]: PickleMachine._op_binfloat,
    pickle.SHORT_BINUNICODE[0]: PickleMachine._op_short_binunicode,
    pickle.BINUNICODE[0]: PickleMachine._op_binunicode,
    pickle.BINUNICODE8[0]: PickleMachine._op_binunicode8,
    pickle.SHORT_BINBYTES[0]: PickleMachine._op_short_binbytes,
    pickle.BINBYTES[0]: PickleMachine._op_binbytes,
    pickle.BINBYTES8[0]: PickleMachine._op_binbytes8,
    pickle.EMPTY_TUPLE[0]: PickleMachine._op_empty_tuple,
    pickle.TUPLE1[0]: PickleMachine._op_tuple1,
    pickle.TUPLE2[0]: PickleMachine._op_tuple2,
    pickle.TUPLE3[0]: PickleMachine._op_tuple3,
    pickle.TUPLE[0]: PickleMachine._op_tuple,
    pickle.EMPTY_LIST[0]: PickleMachine._op_empty_list,
    pickle.LIST[0]: PickleMachine._op_list,
    pickle.APPEND[0]: PickleMachine._op_append,
    pickle.APPENDS[0]: PickleMachine._op_appends,
    pickle.EMPTY_DICT[0]: PickleMachine._op_empty_dict,
    pickle.DICT[0]: PickleMachine._op_dict,
    pickle.SETITEM[0]: PickleMachine._op_setitem,
    pickle.SETITEMS[0]: PickleMachine._op_setitems,
    pickle.GLOBAL[0]: PickleMachine._op_global,
    pickle.STACK_GLOBAL[0]: PickleMachine._op_stack_global,
    pickle.REDUCE[0]: PickleMachine._op_reduce,
    pickle.NEWOBJ[0]: PickleMachine._op_newobj,
    pickle.BUILD[0]: PickleMachine._op_build,
    pickle.BINPUT[0]: PickleMachine._op_binput,
    pickle.LONG_BINPUT[0]: PickleMachine._op_long_binput,
    pickle.MEMOIZE[0]: PickleMachine._op_memoize,
    pickle.BINGET[0]: PickleMachine._op_binget,
    pickle.LONG_BINGET[0]: PickleMachine._op_long_binget,
    pickle.BINPERSID[0]: PickleMachine._op_binpersid,
}


PickleMachine._opcodes = _DISPATCH
"""The opcode table `load` runs (a subclass that knows more opcodes sets its own)."""


def memo_fetch(index: int) -> bytes:
    """The opcode CPython's pickler writes to fetch memo entry `index` (BINGET, or LONG_BINGET past 255)."""
    return pickle.BINGET + bytes((index,)) if index < 256 else pickle.LONG_BINGET + struct.pack("<I", index)


def opcode_table(cls: type[PickleMachine]) -> dict[int, Callable[[PickleMachine], Any]]:
    """The opcode → handler table of `cls`: a subclass's overriding handlers in place of the base's."""
    return {op: getattr(cls, handler.__name__) for op, handler in _DISPATCH.items()}
