"""Restricted unpicklers: a checkpoint is untrusted input, and a pickle can run any code.

`.metadata` and every item's `data.pkl` are pickles. torch reads `.metadata` with a plain
`pickle.load`; ckptctl only lets through the globals real DCP files reference (an
allow-list) and builds ckptctl's own stand-ins for them (`dcp_classes`, `dtypes`: no torch
import). A tensor record's `data.pkl` is read into a plain description instead of a
tensor, so nothing from a checkpoint is ever executed or allocated on its say-so.
"""

from __future__ import annotations

import pathlib
from dataclasses import dataclass
from typing import Any, Callable

from ckptctl.dtypes import BY_STORAGE, DTYPES, DType
from ckptctl.formats import dcp_classes as dc
from ckptctl.formats.dcp_classes import Layout, MemoryFormat
from ckptctl.formats.gc_pause import gc_paused
from ckptctl.formats.pickle_vm import Constructor, MalformedPickleError, PickleMachine, UnsafePickleError
from ckptctl.formats.torch_pickle import Size

__all__ = ["MalformedPickleError", "UnsafePickleError", "load_metadata_pickle", "load_tensor_record_spec",
           "TensorRecordSpec"]

MAX_DIMS = 64
MAX_INT = 1 << 62
MAX_PATH = 4096
MAX_NAME = 65536
BUDGET_SLACK = 1 << 16
"""Values a pickle may build beyond one per byte of it (see `PickleMachine`)."""

_LAYOUTS = frozenset(f"torch.{n}" for n in ("strided", "sparse_coo", "sparse_csr", "sparse_csc", "sparse_bsr",
                                             "sparse_bsc", "_mkldnn", "jagged"))


def _bad(what: str, value: Any) -> MalformedPickleError:
    return MalformedPickleError(f"{what} is a {type(value).__name__}")


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
    return value


def _optional(check: Callable[[Any, str], Any]) -> Callable[[Any, str], Any]:
    return lambda value, what: None if value is None else check(value, what)


def _bool(value: Any, what: str) -> bool:
    if type(value) is not bool:
        raise _bad(f"{what} should be a bool but", value)
    return value


def _size(value: Any, what: str) -> Size:
    if type(value) is Size:
        return value
    if type(value) is not tuple or len(value) > MAX_DIMS:
        raise _bad(f"{what} should be a torch.Size but", value)
    return Size(_int(v, what) for v in value)


def _of(kind: type, label: str) -> Callable[[Any, str], Any]:
    def check(value: Any, what: str) -> Any:
        if type(value) is not kind:
            raise _bad(f"{what} should be a {label} but", value)
        return value
    return check


def _list_of(check: Callable[[Any, str], Any]) -> Callable[[Any, str], list]:
    def each(value: Any, what: str) -> list:
        if type(value) not in (list, tuple):
            raise _bad(f"{what} should be a list but", value)
        return [check(v, what) for v in value]
    return each


def _torch_size(args: tuple) -> Size:
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
    return pathlib.PurePosixPath(*(_str(a, "a path part", MAX_PATH) for a in args))


def _empty_dict(args: tuple) -> dict:
    if args not in ((), ([],)):
        raise MalformedPickleError("OrderedDict built with arguments")
    return {}


def _record(cls: type, fields: dict[str, Callable[[Any, str], Any]], tuple_state: bool = False) -> Constructor:
    """A DCP record built fresh from its pickled state, each field checked by its validator.

    Fields torch's class has and ours does not (a newer torch) are ignored; missing ones are None.
    """
    label = cls.torch_global()[1]

    def from_state(state: Any) -> Any:
        if state is None:
            state = {}
        if tuple_state and type(state) is tuple:
            state = dict(zip(fields, state))
        if type(state) is not dict:
            raise _bad(f"{label} state should be a dict but", state)
        values = {}
        for name, check in fields.items():
            values[name] = check(state.get(name), f"{label}.{name}")
        return cls(**values)

    return Constructor(".".join(cls.torch_global()), from_state=from_state)


def _planner_data(value: Any, what: str) -> dict | None:
    """DCP's planner_data: each key's path of nested keys, `{fqn: (key, key, ...)}`."""
    if value is None:
        return None
    if type(value) is not dict:
        raise _bad(f"{what} should be a dict but", value)
    out = {}
    for fqn, path in value.items():
        _str(fqn, f"{what} key")
        if type(path) not in (tuple, list) or len(path) > MAX_DIMS:
            raise _bad(f"{what}[{fqn[:200]}] should be a key path but", path)
        for part in path:
            if type(part) is not int:
                _str(part, f"{what}[{fqn[:200]}] part")
        out[fqn] = type(path)(path)
    return out


def _mapping(key: Callable[[Any, str], Any], value: Callable[[Any, str], Any]) -> Callable[[Any, str], dict]:
    def check(v: Any, what: str) -> dict:
        if type(v) is not dict:
            raise _bad(f"{what} should be a dict but", v)
        return {key(k, f"{what} key"): value(x, f"{what} value") for k, x in v.items()}
    return check


def _either(*kinds: type) -> Callable[[Any, str], Any]:
    names = " or ".join(k.__name__ for k in kinds)

    def check(value: Any, what: str) -> Any:
        if type(value) not in kinds:
            raise _bad(f"{what} should be a {names} but", value)
        return value
    return check


def _checkpoint_id(value: Any, what: str) -> Any:
    if value is None or type(value) is pathlib.PurePosixPath:
        return value
    return _str(value, what, MAX_PATH)


_TENSOR_PROPERTIES = _record(dc.TensorProperties, {
    "dtype": _of(DType, "torch dtype"), "layout": _optional(_of(Layout, "tensor layout")),
    "requires_grad": _optional(_bool), "memory_format": _optional(_of(MemoryFormat, "memory format")),
    "pin_memory": _optional(_bool)}, tuple_state=True)

_METADATA_RECORDS: dict[tuple[str, str], Constructor] = {
    dc.ChunkStorageMetadata.torch_global(): _record(dc.ChunkStorageMetadata, {"offsets": _size, "sizes": _size}),
    dc.TensorStorageMetadata.torch_global(): _record(dc.TensorStorageMetadata, {
        "properties": _of(dc.TensorProperties, "TensorProperties"), "size": _size,
        "chunks": _list_of(_of(dc.ChunkStorageMetadata, "ChunkStorageMetadata"))}),
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
_METADATA_RECORDS[dc.Metadata.torch_global()] = _record(dc.Metadata, {
    "state_dict_metadata": _mapping(_str, _either(dc.TensorStorageMetadata, dc.BytesStorageMetadata)),
    "planner_data": _planner_data,
    "storage_data": _optional(_mapping(_of(dc.MetadataIndex, "MetadataIndex"), _of(dc.StorageInfo, "_StorageInfo"))),
    "storage_meta": _optional(_of(dc.StorageMeta, "StorageMeta")),
    "version": _optional(_str)})


_DTYPE_GLOBALS: dict[tuple[str, str], DType] = {("torch", name): d for name, d in DTYPES.items()}
"""Referencing a dtype pushes the shared DType itself: the machine never calls, builds or changes a value."""

METADATA_GLOBALS: dict[tuple[str, str], Any] = {
    **_METADATA_RECORDS,
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


def load_metadata_pickle(data: Any) -> dc.Metadata:
    """Unpickle `.metadata` (bytes, or an mmap of the file) allowing only DCP's own metadata classes."""
    with gc_paused():
        md = PickleMachine(data, METADATA_GLOBALS, _budget(len(data)), record_types=_RECORD_TYPES).load()
    if type(md) is not dc.Metadata:
        raise MalformedPickleError(f"pickle holds a {type(md).__name__}, not a DCP Metadata")
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
    if not (type(pid) is tuple and len(pid) == 5 and pid[0] == "storage" and type(pid[1]) is _StorageType):
        raise MalformedPickleError("malformed storage reference")
    _, storage_type, key, _location, numel = pid
    return _StorageRef(_str(key, "storage key", 256), storage_type.dtype, _int(numel, "storage size"))


def _tensor_args(args: tuple, least: int) -> tuple[_StorageRef, int, tuple[int, ...], tuple[int, ...]]:
    if not least <= len(args) <= least + 1 or type(args[0]) is not _StorageRef:
        raise MalformedPickleError("tensor rebuild called with the wrong arguments")
    storage, offset, size, stride = args[:4]
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
    dtype = args[6]
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


def load_tensor_record_spec(data: bytes) -> TensorRecordSpec:
    """Describe the tensor inside a torch.save archive's data.pkl without building it."""
    machine = PickleMachine(data, TENSOR_RECORD_GLOBALS, _budget(len(data)), persistent=_storage_ref)
    spec = machine.load()
    if type(spec) is not TensorRecordSpec:
        raise UnsafePickleError("item is not a single tensor")
    return spec
