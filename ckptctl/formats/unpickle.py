"""Restricted unpicklers: a checkpoint is untrusted input, and a pickle can run any code.

`.metadata` and every item's `data.pkl` are pickles. torch reads `.metadata` with a plain
`pickle.load`; ckptctl only lets through the globals real DCP files reference (an
allow-list), and reads a tensor record's `data.pkl` into a plain description instead of a
tensor, so nothing from a checkpoint is ever executed or allocated on its say-so.
"""

from __future__ import annotations

import collections
import io
import pathlib
import pickle
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint import metadata as dcp_metadata


class UnsafePickleError(pickle.UnpicklingError):
    """A pickle referenced a global outside the allow-list."""


def _dtype_globals() -> dict[tuple[str, str], Any]:
    return {("torch", str(d).removeprefix("torch.")): d for d in vars(torch).values() if isinstance(d, torch.dtype)}


def _get_layout(name: str) -> torch.layout:
    """Stand-in for `torch.serialization._get_layout` that only maps known layout names."""
    layouts = {f"torch.{n}": v for n, v in vars(torch).items() if isinstance(v, torch.layout)}
    if name not in layouts:
        raise UnsafePickleError(f"unknown tensor layout {name!r}")
    return layouts[name]


METADATA_GLOBALS: dict[tuple[str, str], Any] = {
    **{("torch.distributed.checkpoint.metadata", n): getattr(dcp_metadata, n) for n in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING",
    )},
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): dcp_filesystem._StorageInfo,
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): _get_layout,
    ("pathlib", "PosixPath"): pathlib.PosixPath,
    ("pathlib", "PurePosixPath"): pathlib.PurePosixPath,
    ("collections", "OrderedDict"): collections.OrderedDict,
    **_dtype_globals(),
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
    return MetadataUnpickler(io.BytesIO(data)).load()


@dataclass(frozen=True)
class TensorRecordSpec:
    """What an item's `data.pkl` says about its tensor: where in the storage record it lives."""

    storage_key: str
    dtype: torch.dtype
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
    dtype: torch.dtype | None
    numel: int


def _storage_type_dtype(name: str) -> torch.dtype:
    by_name = {v: k for k, v in torch.storage._dtype_to_storage_type_map().items()}
    if name not in by_name:
        raise UnsafePickleError(f"unknown storage type torch.{name}")
    return by_name[name]


class _StorageType:
    def __init__(self, dtype: torch.dtype | None) -> None:
        self.dtype = dtype


def _rebuild_v2(storage: _StorageRef, offset: int, size: tuple, stride: tuple, *_: Any) -> TensorRecordSpec:
    if storage.dtype is None:
        raise UnsafePickleError("untyped storage without a dtype")
    return _spec(storage, storage.dtype, storage.numel, offset, size, stride)


def _rebuild_v3(storage: _StorageRef, offset: int, size: tuple, stride: tuple, _rg: Any, _hooks: Any,
                dtype: torch.dtype, *_: Any) -> TensorRecordSpec:
    itemsize = dtype.itemsize
    return _spec(storage, dtype, storage.numel // itemsize, offset, size, stride)


def _spec(storage: _StorageRef, dtype: torch.dtype, numel: int, offset: int, size: tuple, stride: tuple) -> TensorRecordSpec:
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
        **_dtype_globals(),
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
