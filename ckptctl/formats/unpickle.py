"""Restricted unpicklers: a checkpoint is untrusted input, and a pickle can run any code.

`.metadata` and every item's `data.pkl` are pickles. torch reads `.metadata` with a plain
`pickle.load`; ckptctl only lets through the globals real DCP files reference (an
allow-list) and builds ckptctl's own stand-ins for them (`dcp_classes`, `dtypes`: no torch
import). A tensor record's `data.pkl` is read into a plain description instead of a
tensor, so nothing from a checkpoint is ever executed or allocated on its say-so.
"""

from __future__ import annotations

import collections
import io
import pathlib
import pickle
from dataclasses import dataclass
from typing import Any

from ckptctl.dtypes import BY_STORAGE, DTYPES, DType
from ckptctl.formats.dcp_classes import METADATA_CLASSES, Layout
from ckptctl.formats.gc_pause import gc_paused


class UnsafePickleError(pickle.UnpicklingError):
    """A pickle referenced a global outside the allow-list."""


_DTYPE_GLOBALS: dict[tuple[str, str], DType] = {("torch", name): d for name, d in DTYPES.items()}
_LAYOUTS = frozenset(f"torch.{n}" for n in ("strided", "sparse_coo", "sparse_csr", "sparse_csc", "sparse_bsr",
                                             "sparse_bsc", "_mkldnn", "jagged"))


def _get_layout(name: str) -> Layout:
    """Stand-in for `torch.serialization._get_layout` that only maps known layout names."""
    if name not in _LAYOUTS:
        raise UnsafePickleError(f"unknown tensor layout {name!r}")
    return Layout(name)


METADATA_GLOBALS: dict[tuple[str, str], Any] = {
    **METADATA_CLASSES,
    ("torch.serialization", "_get_layout"): _get_layout,
    ("pathlib", "PosixPath"): pathlib.PosixPath,
    ("pathlib", "PurePosixPath"): pathlib.PurePosixPath,
    ("collections", "OrderedDict"): collections.OrderedDict,
    **_DTYPE_GLOBALS,
}


class _AllowListUnpickler(pickle.Unpickler):
    allowed: dict[tuple[str, str], Any] = {}

    def find_class(self, module: str, name: str) -> Any:
        try:
            return self.allowed[(module, name)]
        except KeyError:
            raise UnsafePickleError(f"refuses to load global {module}.{name}") from None

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafePickleError("refuses persistent references")


class MetadataUnpickler(_AllowListUnpickler):
    allowed = METADATA_GLOBALS


def load_metadata_pickle(data: bytes) -> Any:
    """Unpickle `.metadata` bytes allowing only DCP's own metadata classes."""
    with gc_paused():
        return MetadataUnpickler(io.BytesIO(data)).load()


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


@dataclass(frozen=True)
class _StorageRef:
    key: str
    dtype: DType | None
    numel: int


def _storage_type_dtype(name: str) -> DType:
    if name not in BY_STORAGE:
        raise UnsafePickleError(f"unknown storage type torch.{name}")
    return BY_STORAGE[name]


class _StorageType:
    def __init__(self, dtype: DType | None) -> None:
        self.dtype = dtype


def _rebuild_v2(storage: _StorageRef, offset: int, size: tuple, stride: tuple, *_: Any) -> TensorRecordSpec:
    if storage.dtype is None:
        raise UnsafePickleError("untyped storage without a dtype")
    return _spec(storage, storage.dtype, storage.numel, offset, size, stride)


def _rebuild_v3(storage: _StorageRef, offset: int, size: tuple, stride: tuple, _rg: Any, _hooks: Any,
                dtype: DType, *_: Any) -> TensorRecordSpec:
    itemsize = dtype.itemsize
    return _spec(storage, dtype, storage.numel // itemsize, offset, size, stride)


def _spec(storage: _StorageRef, dtype: DType, numel: int, offset: int, size: tuple, stride: tuple) -> TensorRecordSpec:
    if not isinstance(offset, int) or not all(isinstance(v, int) and v >= 0 for v in (*size, *stride)):
        raise UnsafePickleError("malformed tensor geometry")
    return TensorRecordSpec(storage.key, dtype, numel, offset, tuple(size), tuple(stride))


class TensorRecordUnpickler(_AllowListUnpickler):
    """Reads a `torch.save(tensor)` data.pkl into a TensorRecordSpec, allocating nothing."""

    allowed = {
        ("torch._utils", "_rebuild_tensor_v2"): _rebuild_v2,
        ("torch._utils", "_rebuild_tensor_v3"): _rebuild_v3,
        ("torch.storage", "UntypedStorage"): _StorageType(None),
        ("torch", "UntypedStorage"): _StorageType(None),
        ("collections", "OrderedDict"): collections.OrderedDict,
        **_DTYPE_GLOBALS,
    }

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and name.endswith("Storage") and name != "UntypedStorage":
            return _StorageType(_storage_type_dtype(name))
        return super().find_class(module, name)

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], _StorageType)):
            raise UnsafePickleError("malformed storage reference")
        _, storage_type, key, _location, numel = pid
        if not isinstance(key, str) or not isinstance(numel, int) or numel < 0:
            raise UnsafePickleError("malformed storage reference")
        return _StorageRef(key, storage_type.dtype, numel)


def load_tensor_record_spec(data: bytes) -> TensorRecordSpec:
    """Describe the tensor inside a torch.save archive's data.pkl without building it."""
    spec = TensorRecordUnpickler(io.BytesIO(data)).load()
    if not isinstance(spec, TensorRecordSpec):
        raise UnsafePickleError("item is not a single tensor")
    return spec
