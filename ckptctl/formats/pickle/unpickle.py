"""Restricted unpicklers: a checkpoint is untrusted input, and a pickle can run any code.

`.metadata` and every item's `data.pkl` are pickles. torch reads `.metadata` with a plain
`pickle.load`; ckptctl only lets through the globals real DCP files reference (an
allow-list) and builds ckptctl's own stand-ins for them (`dcp.classes`, `dtypes`: no torch
import). A tensor record's `data.pkl` is read into a plain description instead of a
tensor, so nothing from a checkpoint is ever executed or allocated on its say-so.

The tables below (`METADATA_GLOBALS`, `TENSOR_RECORD_GLOBALS`: `Constructor`s and
constants) are the one statement of what is allowed. C's `pickle.Unpickler` runs the
pickle, but `find_class` never hands it a real class, function or shared object, because
BUILD writes into whatever the pickle puts on the stack (a global fetched again from the
memo included), NEWOBJ calls `cls.__new__`, and REDUCE calls anything callable:

* a REDUCE-style global is a `_Call`: immutable, its `__call__` runs the validating
  constructor; a result BUILD could write into (a path, a tensor spec) comes back sealed;
* a NEWOBJ-style global is a per-load shell type (`_ShellType`): it refuses attribute
  writes, calls and BUILD on itself; its instances (`_Shell`) only record the state BUILD
  gives them, and are turned into validated records after `load()`;
* a constant (a dtype, a storage type) is a `_Sealed` token.

Every one of these refuses `__setstate__` and `__setattr__`, so nothing a pickle does can
change a class, a singleton or a validated value. After `load()` one pass builds the
records from their shells, top down, through the same validators; the schema, not the
data, bounds its depth, and a record a pickle references again through the memo costs
what it would cost written out again, against a budget of the pickle's size.

C's unpickler says little about a broken pickle (no positions, no declared lengths), so
when it fails on its own (not on one of ckptctl's checks) the pickle is run again through
`pickle.vm.PickleMachine`, the pure-Python interpreter, which names the fault. Its reads are
capped (`_Source`), so a declared length never makes C read or copy more than a frame.

Every other pickled value a checkpoint holds (`common.pt`, the `common_state` item, Megatron's
`args`, any bytes entry) is read by the interpreter itself (`load_value_pickle`): plain
containers and the few value types `VALUE_GLOBALS` allows, each dict key and set member checked
by `hash_guard.KeyGuard` before it is hashed, the stack and memo references within the budget,
and the value's nesting within `MAX_DEPTH`.
"""

from __future__ import annotations

import _compat_pickle
import argparse
import collections
import contextvars
import pathlib
import pickle
from dataclasses import dataclass
from typing import Any, Callable

from ckptctl.core.dtypes import BY_STORAGE, DTYPES, DType
from ckptctl.formats.dcp import classes as dc
from ckptctl.formats.dcp.classes import Layout, MemoryFormat
from ckptctl.util.gc_pause import gc_paused
from ckptctl.formats.pickle.hash_guard import KeyGuard, PickleTooCostly, check_key_hashing
from ckptctl.formats.pickle.vm import (
    GET_WEIGHT,
    MAX_STRING,
    Constructor,
    MalformedPickleError,
    PickleMachine,
    UnsafePickleError,
    opcode_table,
)
from ckptctl.formats.pickle.torch_pickle import Size
from ckptctl.formats.pickle.subclass import (Float8RecordSpec, SubclassMachine, WrappedRecordSpec, names_subclass,
                                             subclass_globals)
from ckptctl.formats.pickle.te_blocks import BlockScaledRecordSpec, te_block_globals

__all__ = ["MalformedPickleError", "UnsafePickleError", "load_metadata_pickle", "load_tensor_record_spec",
           "TensorRecordSpec", "load_value_pickle"]

MAX_DIMS = 64
MAX_INT = 1 << 62
MAX_PATH = 4096
MAX_NAME = 65536
BUDGET_SLACK = 1 << 16
"""Values a pickle may build beyond one per byte of it (see `PickleMachine`)."""

_LAYOUTS = frozenset(f"torch.{n}" for n in ("strided", "sparse_coo", "sparse_csr", "sparse_csc", "sparse_bsr",
                                             "sparse_bsc", "_mkldnn", "jagged"))


def _bad(what: str, value: Any) -> MalformedPickleError:
    return MalformedPickleError(f"{what} is a {_kind(value)}")


def _kind(value: Any) -> str:
    """A value's type as a pickle would name it: a sealed constant or result by its value's type."""
    return type(_open(value)).__name__


def _open(value: Any) -> Any:
    """A sealed constant or constructor result as the value itself (other values as they are)."""
    return value.value if type(value) is _Sealed else value


def _int(value: Any, what: str, low: int = 0) -> int:
    if type(value) is not int:
        raise _bad(f"{what} should be an integer but", value)
    if not low <= value < MAX_INT:
        raise MalformedPickleError(f"{what} is out of range ({value})")
    return value


def _str(value: Any, what: str, limit: int = MAX_NAME) -> str:
    if type(value) is not str:
        raise _bad(f"{what} should be a string but", value)
    if len(value) > limit or "\0" in value:
        raise MalformedPickleError(f"{what} is not a usable name ({len(value)} characters)")
    if not value.isascii():
        try:
            value.encode()
        except UnicodeEncodeError:
            raise MalformedPickleError(f"{what} is not UTF-8") from None
    return value


_TRIVIAL: dict[Callable[[Any, str], Any], frozenset[type]] = {}
"""A validator → the types it passes through unchanged without looking (a record skips calling it for them)."""


def _optional(check: Callable[[Any, str], Any]) -> Callable[[Any, str], Any]:
    def optional(value: Any, what: str) -> Any:
        return None if value is None else check(value, what)
    _TRIVIAL[optional] = _TRIVIAL.get(check, frozenset()) | {type(None)}
    return optional


def _bool(value: Any, what: str) -> bool:
    if type(value) is not bool:
        raise _bad(f"{what} should be a bool but", value)
    return value


def _size(value: Any, what: str) -> Size:
    if type(value) is Size:  # made by the torch.Size constructor: already checked
        return value
    if type(value) is not tuple or len(value) > MAX_DIMS:
        raise _bad(f"{what} should be a torch.Size but", value)
    return Size(_int(v, what) for v in value)


_TRIVIAL[_size] = frozenset({Size})


def _of(kind: type, label: str) -> Callable[[Any, str], Any]:
    check = _either(kind, label=label)
    _TRIVIAL[check] = frozenset((kind,))
    return check


def _dtype(value: Any, what: str) -> DType:
    value = _open(value)
    if type(value) is not DType:
        raise _bad(f"{what} should be a torch dtype but", value)
    return value


def _list_of(check: Callable[[Any, str], Any]) -> Callable[[Any, str], list]:
    def each(value: Any, what: str) -> list:
        if type(value) not in (list, tuple):
            raise _bad(f"{what} should be a list but", value)
        _spend(len(value))
        return [check(v, what) for v in value]
    return each


def _torch_size(args: tuple) -> Size:
    if len(args) == 1 and type(args[0]) is tuple and len(args[0]) <= MAX_DIMS:
        for v in args[0]:
            if type(v) is not int or not 0 <= v < MAX_INT:
                break
        else:
            return Size(args[0])
    if len(args) != 1 or type(args[0]) not in (tuple, list) or len(args[0]) > MAX_DIMS:
        raise MalformedPickleError("torch.Size needs one tuple of at most 64 integers")
    return Size(_int(v, "a torch.Size dimension") for v in args[0])


def _get_layout(args: tuple) -> Layout:
    """Stand-in for `torch.serialization._get_layout` that only maps known layout names."""
    if len(args) != 1 or type(args[0]) is not str:
        raise MalformedPickleError("_get_layout needs one layout name")
    if args[0] not in _LAYOUTS:
        raise UnsafePickleError(f"unknown tensor layout {args[0][:64]!r}")
    return Layout(args[0])


def _memory_format(args: tuple) -> MemoryFormat:
    if len(args) != 1 or type(args[0]) is not int or not 0 <= args[0] <= 3:
        raise MalformedPickleError("_MEM_FORMAT_ENCODING needs a value 0..3")
    return MemoryFormat(args[0])


def _posix_path(args: tuple) -> pathlib.PurePosixPath:
    if len(args) > MAX_DIMS:
        raise MalformedPickleError("path has too many parts")
    parts = [_str(a, "a path part", MAX_PATH) for a in args]
    if sum(map(len, parts)) > MAX_PATH:
        raise MalformedPickleError("path is longer than 4096 characters")
    return pathlib.PurePosixPath(*parts)


def _empty_dict(args: tuple) -> dict:
    if args not in ((), ([],)):
        raise MalformedPickleError("OrderedDict built with arguments")
    return {}


_RECORD_KINDS: dict[Constructor, type] = {}
"""Each DCP record's Constructor → the stand-in class it builds (what a shell of it turns into)."""


def _record(cls: type, fields: dict[str, Callable[[Any, str], Any]], tuple_state: bool = False) -> Constructor:
    """A DCP record built fresh from its pickled state, each field checked by its validator.

    Fields torch's class has and ours does not (a newer torch) are ignored; missing ones are None.
    """
    label = cls.torch_global()[1]
    checks = [(name, check, f"{label}.{name}", _TRIVIAL.get(check, frozenset())) for name, check in fields.items()]
    new = object.__new__

    def from_state(state: Any) -> Any:
        if state is None:
            state = {}
        if tuple_state and type(state) is tuple:
            state = dict(zip(fields, state))
        if type(state) is not dict:
            raise _bad(f"{label} state should be a dict but", state)
        record = new(cls)
        values = record.__dict__
        get = state.get
        for name, check, what, trivial in checks:
            value = get(name)
            values[name] = value if type(value) in trivial else check(value, what)
        return record

    ctor = Constructor(".".join(cls.torch_global()), from_state=from_state)
    _RECORD_KINDS[ctor] = cls
    return ctor


def _planner_data(value: Any, what: str) -> dict | None:
    """DCP's planner_data: each key's path of nested keys, `{fqn: (key, key, ...)}`."""
    if value is None:
        return None
    if type(value) is not dict:
        raise _bad(f"{what} should be a dict but", value)
    _spend(len(value))
    out = {}
    for fqn, path in value.items():
        _str(fqn, f"{what} key")
        if type(path) not in (tuple, list) or len(path) > MAX_DIMS:
            raise _bad(f"{what}[{fqn[:200]}] should be a key path but", path)
        _spend(len(path))
        for part in path:
            if type(part) is not int:
                _str(part, f"{what}[{fqn[:200]}] part")
        out[fqn] = type(path)(path)
    return out


def _mapping(key: Callable[[Any, str], Any], value: Callable[[Any, str], Any]) -> Callable[[Any, str], dict]:
    def check(v: Any, what: str) -> dict:
        if type(v) is not dict:
            raise _bad(f"{what} should be a dict but", v)
        _spend(len(v))
        what_key, what_value = f"{what} key", f"{what} value"
        return {key(k, what_key): value(x, what_value) for k, x in v.items()}
    return check


def _either(*kinds: type, label: str | None = None) -> Callable[[Any, str], Any]:
    names = label or " or ".join(k.__name__ for k in kinds)

    def check(value: Any, what: str) -> Any:
        if type(value) not in kinds:
            value = _finished(value, kinds)
            if type(value) not in kinds:
                raise _bad(f"{what} should be a {names} but", value)
        return value
    return check


def _or_columns(columns: type, check: Callable[[Any, str], Any]) -> Callable[[Any, str], Any]:
    """`check`, or a table `dcp.templates` built in the container's place (it checked each value)."""
    def either(value: Any, what: str) -> Any:
        return value if type(value) is columns else check(value, what)
    _TRIVIAL[either] = frozenset((columns,))
    return either


def _checkpoint_id(value: Any, what: str) -> Any:
    value = _open(value)
    if value is None or type(value) is pathlib.PurePosixPath:
        return value
    return _str(value, what, MAX_PATH)


_TENSOR_PROPERTIES = _record(dc.TensorProperties, {
    "dtype": _dtype, "layout": _optional(_of(Layout, "tensor layout")),
    "requires_grad": _optional(_bool), "memory_format": _optional(_of(MemoryFormat, "memory format")),
    "pin_memory": _optional(_bool)}, tuple_state=True)

_METADATA_RECORDS: dict[tuple[str, str], Constructor] = {
    dc.ChunkStorageMetadata.torch_global(): _record(dc.ChunkStorageMetadata, {"offsets": _size, "sizes": _size}),
    dc.TensorStorageMetadata.torch_global(): _record(dc.TensorStorageMetadata, {
        "properties": _of(dc.TensorProperties, "TensorProperties"), "size": _size,
        "chunks": _or_columns(dc.ChunkColumns, _list_of(_of(dc.ChunkStorageMetadata, "ChunkStorageMetadata")))}),
    dc.BytesStorageMetadata.torch_global(): _record(dc.BytesStorageMetadata, {}),
    dc.MetadataIndex.torch_global(): _record(dc.MetadataIndex, {
        "fqn": _str, "offset": _optional(_size), "index": _optional(_int)}),
    dc.StorageInfo.torch_global(): _record(dc.StorageInfo, {
        "relative_path": lambda v, what: _str(v, what, MAX_PATH), "offset": _int, "length": _int,
        "transform_descriptors": _optional(_list_of(_str))}),
    dc.StorageMeta.torch_global(): _record(dc.StorageMeta, {
        "checkpoint_id": _checkpoint_id, "save_id": _optional(_str), "load_id": _optional(_str),
        "modules": _optional(_list_of(_str))}),
    dc.TensorProperties.torch_global(): _TENSOR_PROPERTIES,
}
_PLAN_RECORDS: dict[tuple[str, str], Constructor] = {
    kind.torch_global(): _record(kind, {}) for kind in (dc.SavePlan, dc.WriteItem, dc.TensorWriteData)}
"""The save plans Megatron-Core's torch_dist pickles in `all_local_plans`: built with no fields
(their state is dropped), in a Metadata field no one reads."""
_METADATA_FIELDS = {
    "state_dict_metadata": _mapping(_str, _either(dc.TensorStorageMetadata, dc.BytesStorageMetadata)),
    "planner_data": _planner_data,
    "storage_data": _optional(_or_columns(dc.StorageColumns, _mapping(_of(dc.MetadataIndex, "MetadataIndex"),
                                                                     _of(dc.StorageInfo, "_StorageInfo")))),
    "storage_meta": _optional(_of(dc.StorageMeta, "StorageMeta")),
    "version": _optional(_str)}
_METADATA_RECORDS[dc.Metadata.torch_global()] = _record(dc.Metadata, _METADATA_FIELDS)
_MCORE_RECORDS: dict[tuple[str, str], Constructor] = {
    dc.MCoreMetadata.torch_global(): _record(dc.MCoreMetadata, _METADATA_FIELDS),
    (dc.MCORE_TORCH, "MCoreSavePlan"): _PLAN_RECORDS[dc.SavePlan.torch_global()],
}
"""megatron-core ≤ 0.15's subclasses of DCP's Metadata and SavePlan (their `mcore_data`, the
original shapes of flattened optimizer states, and `all_local_plans`): read as DCP's own (the
Metadata as `dc.MCoreMetadata`, whose name tells who saved it), their extra fields dropped like
any field ckptctl's records do not have."""
_METADATA_KINDS = (dc.Metadata, dc.MCoreMetadata)

_DTYPE_GLOBALS: dict[tuple[str, str], DType] = {("torch", name): d for name, d in DTYPES.items()}
"""Referencing a dtype pushes the shared DType itself: the machine never calls, builds or changes a value."""

METADATA_GLOBALS: dict[tuple[str, str], Any] = {
    **_METADATA_RECORDS,
    **_PLAN_RECORDS,
    **_MCORE_RECORDS,
    (dc.DCP_PLANNER, "WriteItemType"): Constructor("WriteItemType", call=lambda args: None),
    (dc.DCP_METADATA, "_MEM_FORMAT_ENCODING"): Constructor("_MEM_FORMAT_ENCODING", call=_memory_format),
    ("torch", "Size"): Constructor("torch.Size", call=_torch_size),
    ("torch.serialization", "_get_layout"): Constructor("torch.serialization._get_layout", call=_get_layout),
    ("pathlib", "PosixPath"): Constructor("pathlib.PosixPath", call=_posix_path),
    ("pathlib", "PurePosixPath"): Constructor("pathlib.PurePosixPath", call=_posix_path),
    ("collections", "OrderedDict"): Constructor("collections.OrderedDict", call=_empty_dict),
    **_DTYPE_GLOBALS,
}
"""What a `.metadata` pickle may name: DCP's classes, built through validating constructors."""

_RECORD_TYPES = (dc._DcpRecord,)


def _budget(size: int) -> int:
    return size + BUDGET_SLACK


def _refuse_state(label: str) -> UnsafePickleError:
    return UnsafePickleError(f"refuses to set the state of {label} (only of a new object)")


class _Inert:
    """What `find_class` and the constructors hand the C unpickler: BUILD and attribute writes are refused."""

    __slots__ = ()

    def _label(self) -> str:
        raise NotImplementedError

    def __setstate__(self, state: Any) -> None:
        raise _refuse_state(self._label())

    def __setattr__(self, name: str, value: Any) -> None:
        raise _refuse_state(self._label())

    def __delattr__(self, name: str) -> None:
        raise _refuse_state(self._label())


class _Sealed(_Inert):
    """A constant (a dtype, a storage type) or a constructor's result that BUILD could otherwise
    write into (a path, a tensor spec, a storage reference); validators open it (`_open`)."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        _SEAL(self, value)

    def _label(self) -> str:
        return f"a {type(self.value).__name__}"


_SEAL = _Sealed.value.__set__  # type: ignore[attr-defined]
_UNSEALED = frozenset({Size, Layout, MemoryFormat, dict, str, int, bool, type(None)})
"""Results BUILD cannot write into (no `__dict__`, no slots, no `__setstate__`): handed over as they are."""


def _sealed(value: Any) -> Any:
    return value if type(value) in _UNSEALED else _Sealed(value)


class _Call(_Inert):
    """A REDUCE-style global: calling it runs the Constructor's validating `call`."""

    __slots__ = ("ctor",)

    def __init__(self, ctor: Constructor) -> None:
        _CALL_CTOR(self, ctor)

    def _label(self) -> str:
        return self.ctor.name

    def __call__(self, *args: Any) -> Any:
        return _sealed(self.ctor.call(args))


_CALL_CTOR = _Call.ctor.__set__  # type: ignore[attr-defined]


class _ShellType(type):
    """The type of a record's shell class: NEWOBJ may instantiate it (`object.__new__`, no
    arguments); nothing may call it, write to it, or BUILD on it."""

    ctor: Constructor
    kind: type

    @property
    def __setstate__(cls) -> Any:  # BUILD on the class itself looks this up and is refused
        raise _refuse_state(cls.ctor.name)

    def __setattr__(cls, name: str, value: Any) -> None:
        raise _refuse_state(cls.ctor.name)

    def __delattr__(cls, name: str) -> None:
        raise _refuse_state(cls.ctor.name)

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        raise MalformedPickleError(f"pickle calls {cls.ctor.name}, which cannot be called")


class _Shell:
    """An object NEWOBJ created: it keeps the state BUILD gives it (the last one) and nothing else;
    `_finished` turns it into a validated record after `load()`, and keeps the record in its place."""

    __slots__ = ("state",)

    def __setstate__(self, state: Any) -> None:
        _SHELL_STATE(self, state)

    def __setattr__(self, name: str, value: Any) -> None:
        raise _refuse_state(f"a {type(self).ctor.name}")

    def __delattr__(self, name: str) -> None:
        raise _refuse_state(f"a {type(self).ctor.name}")


_SHELL_STATE = _Shell.state.__set__  # type: ignore[attr-defined]
_SHELLS: dict[Constructor, _ShellType] = {
    ctor: _ShellType(kind.__name__, (_Shell,), {"__slots__": (), "__module__": __name__, "ctor": ctor, "kind": kind})
    for ctor, kind in _RECORD_KINDS.items()}
"""One shell class per record kind, shared by all loads: they hold nothing a load could change."""
_SIZED = (tuple, list, dict)


class _Budget:
    """Values one load may stand for, beyond one per NEWOBJ: containers validated, records referenced again."""

    def __init__(self, size: int) -> None:
        self.left = _budget(size)


_CURRENT: contextvars.ContextVar[_Budget | None] = contextvars.ContextVar("ckptctl_unpickle_budget", default=None)


def _spend(n: int) -> None:
    budget = _CURRENT.get()
    if budget is not None:  # the interpreter (`PickleMachine`) keeps its own account
        budget.left -= n
        if budget.left < 0:
            raise MalformedPickleError("pickle builds more values than its size allows (memo amplification?)")


def _finished(value: Any, kinds: tuple[type, ...]) -> Any:
    """`value` as a record when it is a shell of one of `kinds` (other values as they are).

    The record replaces the shell's state, so a shell the memo put in several places is built
    once and each further use costs what writing the record out again would. Only a field's
    own kinds are built, so the schema (Metadata → tensor → chunk), not the pickle, bounds
    how deep records are built inside records.
    """
    shell_type = type(value)
    if shell_type.__class__ is not _ShellType:
        return value
    kind = shell_type.kind
    if kind not in kinds:
        return value
    try:
        state = value.state
    except AttributeError:  # NEWOBJ without BUILD
        state = None
    if type(state) is kind:
        _spend(GET_WEIGHT * (1 + sum(1 + len(v) for v in vars(state).values() if isinstance(v, _SIZED))))
        return state
    record = shell_type.ctor.from_state(state)
    _SHELL_STATE(value, record)
    return record


MAX_READ = MAX_STRING + (1 << 16)
"""Most bytes the C unpickler may ask for at once: a string at the limit, or a frame (64 KiB by pickle's framing)."""


class _OverRead(Exception):
    """The C unpickler asked for more than `MAX_READ` bytes (a declared length beyond any real value)."""


class _Source:
    """`data` (bytes, or an mmap of a regular file) as the file C's unpickler reads: slices of at
    most `MAX_READ` bytes, so a declared length never makes it copy a huge or sparse file."""

    __slots__ = ("data", "pos", "end")

    def __init__(self, data: Any) -> None:
        self.data, self.pos, self.end = data, 0, len(data)

    def read(self, n: int = -1) -> bytes:
        if not 0 <= n <= MAX_READ:
            raise _OverRead
        pos = self.pos
        self.pos = min(pos + n, self.end)
        return self.data[pos:self.pos]

    def peek(self, n: int = 1) -> bytes:
        return self.data[self.pos:self.pos + min(max(n, 1), MAX_READ)]

    def readline(self) -> bytes:
        stop = self.data.find(b"\n", self.pos, min(self.end, self.pos + MAX_READ))
        if stop < 0:
            if self.end - self.pos > MAX_READ:
                raise _OverRead
            stop = self.end - 1
        return self.read(stop + 1 - self.pos)


_CALLS: dict[Constructor, _Call] = {}
_CONSTANTS: dict[int, _Sealed] = {}
"""`_Call`s and sealed constants, made on first use and shared by all loads (nothing can change them)."""


class _Unpickler(pickle.Unpickler):
    """C's unpickler, seeing only inert stand-ins for the allowed globals (see the module docstring)."""

    def __init__(self, data: Any, globals_: dict[tuple[str, str], Any],
                 persistent: Callable[[Any], Any] | None) -> None:
        super().__init__(_Source(data), fix_imports=False)
        self._globals, self._persistent = globals_, persistent

    def find_class(self, module: str, name: str) -> Any:
        found = self._globals.get((module, name))
        if found is None:
            raise UnsafePickleError(f"refuses to load global {module}.{name}")
        if type(found) is not Constructor:
            return _CONSTANTS.get(id(found)) or _CONSTANTS.setdefault(id(found), _Sealed(found))
        if found.from_state is not None:
            return _SHELLS[found]
        return _CALLS.get(found) or _CALLS.setdefault(found, _Call(found))

    def persistent_load(self, pid: Any) -> Any:
        if self._persistent is None:
            raise UnsafePickleError("refuses persistent references")
        return _sealed(self._persistent(pid))


def _run(data: Any, globals_: dict[tuple[str, str], Any],
         persistent: Callable[[Any], Any] | None = None, guard: bool = True) -> Any:
    """The value the pickle leaves, from C's unpickler; a pickle it cannot run is diagnosed by the interpreter.

    `hash_guard` first refuses a pickle whose dict keys C's own hashing could not survive (unless
    `guard` is False: a pickle this process wrote itself, its keys names and DCP's own records)."""
    try:
        if guard:
            check_key_hashing(data, globals_, _Source)
    except PickleTooCostly:  # C would build more than the size allows: never handed to it
        fault = None
    else:
        unpickler = _Unpickler(data, globals_, persistent)
        try:
            return unpickler.load()
        except (UnsafePickleError, MalformedPickleError):
            raise
        except Exception as exc:  # C's own complaint (UnpicklingError, EOFError, OverflowError, ...) or _OverRead
            fault = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
        finally:
            del unpickler  # lets go of the input (an mmap cannot close while C holds a slice of it)
    try:
        PickleMachine(data, globals_, _budget(len(data)), persistent=persistent, record_types=_RECORD_TYPES,
                      keys=KeyGuard(len(data)).check).load()
    except (UnsafePickleError, MalformedPickleError) as exc:
        raise exc from None
    if fault is None:
        raise MalformedPickleError("pickle needs more memory to unpickle than its size allows")
    raise MalformedPickleError(f"pickle rejected ({fault})")


def load_metadata_pickle(data: Any, written_here: bool = False) -> dc.Metadata:
    """Unpickle `.metadata` (bytes, or an mmap of the file) allowing only DCP's own metadata classes;
    `written_here` skips the hash-bomb scan for a `.metadata` this process has just written."""
    token = _CURRENT.set(_Budget(len(data)))
    try:
        with gc_paused():
            md = _finished(_run(data, METADATA_GLOBALS, guard=not written_here), _METADATA_KINDS)
    finally:
        _CURRENT.reset(token)
    if type(md) not in _METADATA_KINDS:
        raise MalformedPickleError(f"pickle holds a {_kind(md)}, not a DCP Metadata")
    return md


@dataclass(frozen=True)
class TensorRecordSpec:
    """What an item's `data.pkl` says about its tensor: where in the storage record it lives."""

    storage_key: str
    dtype: DType
    storage_numel: int
    storage_offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]

    @property
    def is_dense(self) -> bool:
        """True when the tensor is the row-major run starting at storage_offset."""
        expected = 1
        for dim, stride in zip(reversed(self.size), reversed(self.stride)):
            if dim != 1 and stride != expected:
                return False
            expected *= dim
        return True


@dataclass(frozen=True, slots=True)
class _StorageRef:
    key: str
    dtype: DType | None
    numel: int


@dataclass(frozen=True, slots=True)
class _StorageType:
    """`torch.FloatStorage` (dtype float32), `torch.UntypedStorage` (dtype None): only named in storage references."""

    dtype: DType | None


MAX_STORAGE_NUMEL = 1 << 50


def _storage_ref(pid: Any) -> _StorageRef:
    if not (type(pid) is tuple and len(pid) == 5 and pid[0] == "storage" and type(_open(pid[1])) is _StorageType):
        raise MalformedPickleError("malformed storage reference")
    _, storage_type, key, _location, numel = pid
    return _StorageRef(_str(key, "storage key", 256), _open(storage_type).dtype, _int(numel, "storage size"))


def _tensor_args(args: tuple, least: int) -> tuple[_StorageRef, int, tuple[int, ...], tuple[int, ...]]:
    if not least <= len(args) <= least + 1 or type(_open(args[0])) is not _StorageRef:
        raise MalformedPickleError("tensor rebuild called with the wrong arguments")
    storage, offset, size, stride = _open(args[0]), *args[1:4]
    if type(size) is not tuple or type(stride) is not tuple or len(size) != len(stride) or len(size) > MAX_DIMS:
        raise MalformedPickleError("tensor rebuild called with a malformed size or stride")
    _bool(args[4], "requires_grad")
    if type(args[5]) is not dict:
        raise _bad("backward hooks should be a dict but", args[5])
    return (storage, _int(offset, "storage offset"), tuple(_int(v, "tensor size") for v in size),
            tuple(_int(v, "tensor stride") for v in stride))


def _rebuild_v2(args: tuple) -> TensorRecordSpec:
    storage, offset, size, stride = _tensor_args(args, 6)
    if storage.dtype is None:
        raise MalformedPickleError("untyped storage without a dtype")
    return _spec(storage, storage.dtype, storage.numel, offset, size, stride)


def _rebuild_v3(args: tuple) -> TensorRecordSpec:
    storage, offset, size, stride = _tensor_args(args, 7)
    dtype = _open(args[6])
    if type(dtype) is not DType:
        raise _bad("tensor dtype should be a torch dtype but", dtype)
    if storage.dtype is not None:
        raise MalformedPickleError("_rebuild_tensor_v3 needs an untyped storage")
    if storage.numel % dtype.itemsize:
        raise MalformedPickleError(f"storage of {storage.numel} bytes is not a whole number of {dtype.name}")
    return _spec(storage, dtype, storage.numel // dtype.itemsize, offset, size, stride)


def _spec(storage: _StorageRef, dtype: DType, numel: int, offset: int, size: tuple[int, ...],
          stride: tuple[int, ...]) -> TensorRecordSpec:
    if numel > MAX_STORAGE_NUMEL:
        raise MalformedPickleError(f"storage of {numel} elements is implausibly large")
    return TensorRecordSpec(storage.key, dtype, numel, offset, size, stride)


def _storage_types() -> dict[tuple[str, str], _StorageType]:
    untyped = _StorageType(None)
    return {("torch", "UntypedStorage"): untyped, ("torch.storage", "UntypedStorage"): untyped,
            **{("torch", name): _StorageType(d) for name, d in BY_STORAGE.items()}}


TENSOR_RECORD_GLOBALS: dict[tuple[str, str], Any] = {
    ("torch._utils", "_rebuild_tensor_v2"): Constructor("torch._utils._rebuild_tensor_v2", call=_rebuild_v2),
    ("torch._utils", "_rebuild_tensor_v3"): Constructor("torch._utils._rebuild_tensor_v3", call=_rebuild_v3),
    ("collections", "OrderedDict"): Constructor("collections.OrderedDict", call=_empty_dict),
    **_storage_types(),
    **_DTYPE_GLOBALS,
}
"""What a tensor item's `data.pkl` may name: the rebuild functions, storage types and dtypes."""


_SUBCLASS_GLOBALS = {**subclass_globals(TENSOR_RECORD_GLOBALS, TensorRecordSpec,
                                        METADATA_GLOBALS[("torch.serialization", "_get_layout")],
                                        METADATA_GLOBALS[("torch", "Size")]),
                     **te_block_globals(TensorRecordSpec)}
"""What a tensor subclass item's `data.pkl` may name besides (see `pickle.subclass`)."""


def load_tensor_record_spec(data: bytes
                            ) -> TensorRecordSpec | WrappedRecordSpec | Float8RecordSpec | BlockScaledRecordSpec:
    """Describe the tensor inside a torch.save archive's data.pkl without building it: a plain
    tensor record, or one of the FP8 training subclasses `pickle.subclass` knows."""
    if names_subclass(data):
        spec = SubclassMachine(data, _SUBCLASS_GLOBALS, _budget(len(data)), _storage_ref).load()
        if type(spec) not in (TensorRecordSpec, WrappedRecordSpec, Float8RecordSpec, BlockScaledRecordSpec):
            raise UnsafePickleError("item is not a single tensor")
        return spec
    spec = _open(_run(data, TENSOR_RECORD_GLOBALS, _storage_ref))
    if type(spec) is not TensorRecordSpec:
        raise UnsafePickleError("item is not a single tensor")
    return spec


# Non-tensor values -------------------------------------------------------------------------------

MAX_DEPTH = 100
"""Containers a non-tensor value may nest (Megatron's args and common state: a handful); what
reads a value (a repr, the pickler that writes it again) recurses once a level."""
_KEYS: contextvars.ContextVar[KeyGuard | None] = contextvars.ContextVar("ckptctl_value_keys", default=None)


def _hashed(members: Any, what: str) -> list:
    """`members` (a list or tuple) once each has passed the load's key guard: about to be hashed."""
    if type(members) not in (list, tuple):
        raise MalformedPickleError(f"{what} needs a list, not {_what_type(members)}")
    guard = _KEYS.get()
    for member in members:
        guard.check(member)
    return list(members)


def _what_type(value: Any) -> str:
    return f"a {type(value).__name__}"


def _set_of(kind: type) -> Callable[[tuple], Any]:
    def make(args: tuple) -> Any:
        if args == ():
            return kind()
        if len(args) != 1:
            raise MalformedPickleError(f"builtins.{kind.__name__} called with {len(args)} arguments")
        try:
            return kind(_hashed(args[0], f"builtins.{kind.__name__}"))
        except TypeError:
            raise MalformedPickleError(f"unhashable member of a {kind.__name__}") from None
    return make


def _ordered_dict(args: tuple) -> collections.OrderedDict:
    if args in ((), ([],)):
        return collections.OrderedDict()
    if len(args) != 1 or type(args[0]) is not list or not all(type(p) in (list, tuple) and len(p) == 2
                                                             for p in args[0]):
        raise MalformedPickleError("collections.OrderedDict needs a list of pairs")
    _hashed([p[0] for p in args[0]], "collections.OrderedDict")
    try:
        return collections.OrderedDict(args[0])
    except TypeError:
        raise MalformedPickleError("unhashable dict key of an OrderedDict") from None


def _complex(args: tuple) -> complex:
    if len(args) > 2 or any(type(a) not in (int, float) for a in args):
        raise UnsafePickleError("refuses builtins.complex other than of numbers")
    return complex(*args)


def _encode(args: tuple) -> bytes:
    """`_codecs.encode(str, 'latin1')`: how protocol-2 pickles spell a bytes object."""
    if len(args) not in (1, 2) or type(args[0]) is not str or args[1:] not in ((), ("latin1",), ("latin-1",)):
        raise UnsafePickleError("refuses _codecs.encode other than str to latin1")
    try:
        return args[0].encode("latin1")
    except UnicodeEncodeError:
        raise MalformedPickleError("_codecs.encode of a string that is not latin1") from None


def _bytes(args: tuple) -> bytes:
    if args:  # `bytes(n)` would allocate n bytes on the pickle's say-so
        raise UnsafePickleError("refuses builtins.bytes with arguments")
    return b""


def _bytearray(args: tuple) -> bytearray:
    if args and type(args[0]) not in (bytes, bytearray):
        raise UnsafePickleError("refuses builtins.bytearray of a non-bytes argument")
    return bytearray(*args[:1])


def _namespace(state: Any) -> argparse.Namespace:
    if state is None:
        return argparse.Namespace()
    if type(state) is not dict or not all(type(k) is str for k in state):
        raise UnsafePickleError("refuses to set the state of a Namespace other than by a dict of names")
    out = argparse.Namespace()
    vars(out).update(state)
    return out


def _value_size(args: tuple) -> Size:
    if len(args) != 1 or type(args[0]) not in (tuple, list) or len(args[0]) > MAX_DIMS \
            or any(type(v) is not int for v in args[0]):
        raise MalformedPickleError("torch.Size needs one tuple of at most 64 integers")
    return Size(args[0])


VALUE_GLOBALS: dict[tuple[str, str], Any] = {
    ("collections", "OrderedDict"): Constructor("collections.OrderedDict", call=_ordered_dict),
    ("builtins", "set"): Constructor("builtins.set", call=_set_of(set)),
    ("builtins", "frozenset"): Constructor("builtins.frozenset", call=_set_of(frozenset)),
    ("builtins", "complex"): Constructor("builtins.complex", call=_complex),
    ("builtins", "bytes"): Constructor("builtins.bytes", call=_bytes),
    ("builtins", "bytearray"): Constructor("builtins.bytearray", call=_bytearray),
    ("_codecs", "encode"): Constructor("_codecs.encode", call=_encode),
    ("argparse", "Namespace"): Constructor("argparse.Namespace", from_state=_namespace),  # Megatron's `args`
    ("torch", "Size"): Constructor("torch.Size", call=_value_size),
    **_DTYPE_GLOBALS,
}
"""Globals a non-tensor value may name: the plain types torch's `weights_only` loader accepts,
and argparse.Namespace. Each builds a value and runs nothing else; dtypes and sizes are
ckptctl's stand-ins, which pickle again as torch's."""
STORAGE = "storage"
"""The name an `opaque` value of a tensor's storage gets (with no module)."""


class _ValueMachine(PickleMachine):
    """The interpreter for a non-tensor value: `VALUE_GLOBALS`, sets and frozensets (protocol 4's
    opcodes), an OrderedDict filled like a dict, and with `opaque` any other global as an inert
    call of it (REDUCE only) and a tensor's storage as an inert `opaque` storage."""

    def __init__(self, data: bytes, opaque: Any, guard: KeyGuard) -> None:
        super().__init__(data, VALUE_GLOBALS, _budget(len(data)), persistent=self._storage, keys=guard.check)
        self._opaque = opaque
        self._bare: dict[int, tuple[Constructor, str, str]] = {}  # an opaque global's Constructor → its names

    def _global(self, module: str, name: str) -> None:
        if self._proto < 3:  # protocol 2 spells `builtins` as `__builtin__`
            if (module, name) in _compat_pickle.NAME_MAPPING:
                module, name = _compat_pickle.NAME_MAPPING[(module, name)]
            elif module in _compat_pickle.IMPORT_MAPPING:
                module = _compat_pickle.IMPORT_MAPPING[module]
        found = VALUE_GLOBALS.get((module, name))
        if found is not None:
            self._push(found)
            return
        opaque = self._opaque
        if opaque is None:
            if module == "torch._utils" and name.startswith("_rebuild"):
                raise UnsafePickleError("holds a tensor")
            raise UnsafePickleError(f"refuses global {module[:200]}.{name[:200]}")
        ctor = Constructor(f"{module}.{name}", call=lambda args: opaque(module, name, args))
        self._bare[id(ctor)] = (ctor, module, name)
        self._push(ctor)

    def _finished(self, value: Any) -> Any:
        """A value as PickleMachine finishes it; an opaque global used as a value (a storage type in a
        tensor's storage reference, a function in args) becomes an inert `opaque` reference to it."""
        if type(value) is Constructor:
            bare = self._bare.get(id(value))
            if bare is not None:
                return self._opaque(bare[1], bare[2], None)
        return PickleMachine._finished(value)

    def _bytes(self, n: int) -> None:  # a value's strings and bytes are bounded by the pickle alone
        self._push(self._read(n))

    def _read_text(self, n: int) -> str:
        try:
            return str(self._read(n), "utf-8", "surrogatepass")  # as pickle writes a str
        except UnicodeDecodeError:
            raise MalformedPickleError("string is not UTF-8") from None

    def _storage(self, pid: Any) -> Any:
        if self._opaque is None:
            raise UnsafePickleError("holds a tensor")
        return self._opaque("", STORAGE, ())  # its bytes are never read

    def _op_newobj(self) -> None:
        ctor = self._stack[-2] if len(self._stack) >= 2 else None
        if type(ctor) is Constructor and ctor.from_state is None:
            raise UnsafePickleError(f"refuses to create an instance of {ctor.name[:400]}")
        super()._op_newobj()

    def _mutable(self, target: Any, kind: type) -> Any:
        if kind is dict and type(target) is collections.OrderedDict:
            return super()._mutable(target, collections.OrderedDict)
        return super()._mutable(target, kind)

    def _op_empty_set(self) -> None:
        self._push(set())

    def _op_additems(self) -> None:
        items = [self._finished(v) for v in self._pop_mark()]
        target = self._mutable(self._top(), set)
        try:
            target.update(_hashed(items, "a set"))
        except TypeError:
            raise MalformedPickleError("unhashable member of a set") from None

    def _op_frozenset(self) -> None:
        items = [self._finished(v) for v in self._pop_mark()]
        try:
            self._push(frozenset(_hashed(items, "a frozenset")))
        except TypeError:
            raise MalformedPickleError("unhashable member of a frozenset") from None


_ValueMachine._opcodes = {**opcode_table(_ValueMachine), pickle.EMPTY_SET[0]: _ValueMachine._op_empty_set,
                          pickle.ADDITEMS[0]: _ValueMachine._op_additems,
                          pickle.FROZENSET[0]: _ValueMachine._op_frozenset}


def _opaque_inside(opaque: Any) -> Callable[[Any], Any] | None:
    """What the key guard walks into for an `opaque` value (its arguments, hashed with it)."""
    if opaque is None:
        return None
    return lambda item: item.args if type(item) is opaque else None


def _check_depth(value: Any) -> None:
    """Refuse a value nested deeper than `MAX_DEPTH` (shared parts walked once: no cycles can be made)."""
    depth_of: dict[int, int] = {}
    todo: list[tuple[Any, bool]] = [(value, False)]
    while todo:
        item, done = todo.pop()
        key = id(item)
        if done:
            children = _children(item)
            depth = 1 + max((depth_of.get(id(c), 0) for c in children), default=0)
            if depth > MAX_DEPTH:
                raise MalformedPickleError(f"value nested more than {MAX_DEPTH} containers deep")
            depth_of[key] = depth
            continue
        if key in depth_of or not _children(item):
            continue
        todo.append((item, True))
        todo.extend((c, False) for c in _children(item) if id(c) not in depth_of)


def _children(item: Any) -> Any:
    kind = type(item)
    if kind in (list, tuple, set, frozenset):
        return item
    if kind is dict or kind is collections.OrderedDict:
        return [*item.keys(), *item.values()]
    if kind is argparse.Namespace:
        return list(vars(item).values())
    args = getattr(item, "args", None) if kind.__module__ != "builtins" else None
    return args if type(args) is tuple else ()


def load_value_pickle(data: bytes, opaque: Any = None) -> Any:
    """The value a non-tensor entry's `data.pkl` holds, built by the interpreter from `VALUE_GLOBALS`
    only (with `opaque`, a class taking a global's module, name and REDUCE arguments, any other global
    or tensor storage becomes an inert `opaque` value). Raises UnsafePickleError for a value that
    would need code to be built, MalformedPickleError for a damaged or hostile one (a key too costly
    to hash, nesting past `MAX_DEPTH`, more values than the size allows)."""
    guard = KeyGuard(len(data), inside=_opaque_inside(opaque))
    token = _KEYS.set(guard)
    try:
        with gc_paused():
            machine = _ValueMachine(data, opaque, guard)
            value = machine.load()
            _check_depth(value)
    finally:
        _KEYS.reset(token)
    return value
