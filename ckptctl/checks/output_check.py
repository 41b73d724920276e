"""The check every output passes before it takes its name, whatever the options.

`--verify` compares every byte; this is what no run skips. The output is re-read by readers
that are not the writer — the project's `.metadata` reader, the safetensors header as JSON,
Python's `zipfile` over a torch.save archive — and checked as a structure: every entry
inside its file, a file's entries tiling it exactly, every tensor's chunks covering it, the
names, shapes and dtypes those of the plan. A structure can be perfect and its bytes wrong
(a source item read at another item's place, a shard written at another's), so each tensor's
first and last elements, and the first element of a DCP output's chunks, are compared too: the
source's read by `ItemElements` (Python's own `zipfile` and `pickle` locate
an item's bytes, not ckptctl's item reader that the copy used), the output's by the project's
reader (a DCP output), its header's offsets (safetensors) or its central directory (torch.save).
"""

from __future__ import annotations

import functools
import io
import json
import math
import operator
import pickle
import pickletools
import struct
import threading
import time
import zipfile
from array import array
from collections import OrderedDict
from itertools import repeat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Container, Iterable, Mapping, Sequence

from ckptctl.core.dtypes import BY_SAFETENSORS, BY_STORAGE, DTYPES, DType
from ckptctl.engine.cpu import ChunkSource, assemble_bytes
from ckptctl.util.errors import CheckpointError
from ckptctl.formats.dcp.block_scaled import BLOCKWISE, MXFP8, NVFP4, BlockScaling, dequantize
from ckptctl.formats.dcp.items import MAX_ZIP_READ
from ckptctl.formats.dcp.metadata import open_checkpoint
from ckptctl.formats.dcp.te_float8 import as_values, float8_of, stored_dtype, value_view
from ckptctl.formats.dcp.writer import DcpOutput, metadata_load
from ckptctl.storage.file_window import window
from ckptctl.formats.safetensors.quantized import DEQUANT
from ckptctl.checks.quantized_output import expected_bytes, is_quantized
from ckptctl.formats.safetensors.reader import MAX_HEADER_BYTES, blob_header
from ckptctl.core.geometry import Box, flat_index, strides
from ckptctl.core.analysis import Coverage, coverage
from ckptctl.core.checkpoint import Checkpoint, Chunk, ChunkTable, TensorEntry
from ckptctl.core.plan import SourceTensor, StreamItem, TargetTensor, plan_box
from ckptctl.storage.store import ReadHandle, store_for

MAX_PICKLE = 1 << 16
"""Largest `data.pkl` of an item read here (one tensor's: about 200 bytes)."""
MAX_TENSOR_VIEWS = 4096
"""Distinct `data.pkl`s remembered (with what they say) by one reader."""
SMALL_ITEM = 1 << 16
"""Items up to this size are read whole to be located (one read instead of a few per record)."""
BYTES_SAMPLE = 4096
"""Bytes of a bytes entry compared at each end."""
_PICKLE_OPS = frozenset({
    "PROTO", "FRAME", "GLOBAL", "STACK_GLOBAL", "BINPUT", "LONG_BINPUT", "MEMOIZE", "BINGET", "LONG_BINGET",
    "MARK", "BINUNICODE", "SHORT_BINUNICODE", "BININT", "BININT1", "BININT2", "LONG1", "TUPLE", "TUPLE1",
    "TUPLE2", "TUPLE3", "EMPTY_TUPLE", "BINPERSID", "NEWFALSE", "NEWTRUE", "NONE", "REDUCE", "STOP"})
"""The opcodes a tensor's `data.pkl` is made of: no dict or set is built, so no key is hashed."""


@dataclass(frozen=True)
class _StorageRef:
    key: str
    dtype: DType | None
    numel: int
    """Elements of a typed storage; bytes of an `UntypedStorage` (torch names new dtypes so)."""
    untyped: bool


@dataclass(frozen=True)
class _TensorView:
    """A tensor as its `data.pkl` describes it: a view of storage record `key`."""

    key: str
    dtype: DType
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    storage_bytes: int


def _rebuild(storage: Any, offset: Any, size: Any, stride: Any, *rest: Any) -> _TensorView:
    dtype = rest[2] if len(rest) >= 3 and isinstance(rest[2], DType) else getattr(storage, "dtype", None)
    if not (isinstance(storage, _StorageRef) and isinstance(dtype, DType) and _ints(offset, *size, *stride)
            and len(size) == len(stride)):
        raise ValueError("not a tensor record")
    nbytes = storage.numel if storage.untyped else storage.numel * dtype.itemsize
    return _TensorView(storage.key, dtype, offset, tuple(size), tuple(stride), nbytes)


def _ints(*values: Any) -> bool:
    return all(type(v) is int and v >= 0 for v in values)


_STORAGE_CLASS = "storage class"


def _empty_ordered_dict(*args: Any) -> OrderedDict:
    """A tensor record's backward hooks: always empty. Items to fill it with would be hashed, in C,
    whatever they cost (a key of 2^61 tuples shared through the memo never finishes)."""
    if args:
        raise pickle.UnpicklingError("OrderedDict built with arguments")
    return OrderedDict()


class _TensorPickle(pickle.Unpickler):
    """Python's own unpickler, told torch's names for what they are: a view of a record, never a tensor."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch._utils" and name in ("_rebuild_tensor_v2", "_rebuild_tensor_v3"):
            return _rebuild
        if module == "collections" and name == "OrderedDict":
            return _empty_ordered_dict
        if module in ("torch", "torch.storage") and name.endswith("Storage"):
            return (_STORAGE_CLASS, name)
        if module == "torch" and name in DTYPES:
            return DTYPES[name]
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a tensor record")

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[2], str)
                and type(pid[4]) is int and isinstance(pid[1], tuple) and pid[1][0] == _STORAGE_CLASS):
            raise pickle.UnpicklingError("not a storage reference")
        untyped = pid[1][1] == "UntypedStorage"
        return _StorageRef(pid[2], None if untyped else BY_STORAGE.get(pid[1][1]), pid[4], untyped)


@dataclass(frozen=True)
class _Float8View:
    """Transformer Engine's Float8Tensor as its `data.pkl` describes it: FP8 codes (a uint8
    view) × one float32 `scale_inv`, of logical dtype `dtype`."""

    data: _TensorView
    scale_inv: _TensorView
    fp8: DType
    dtype: DType
    size: tuple[int, ...]


@dataclass(frozen=True)
class _BlockView:
    """A Transformer Engine block-scaled tensor (MXFP8, blockwise FP8, NVFP4) as its `data.pkl`
    describes it: rowwise codes, padded rowwise scales, NVFP4's amax (`formats.dcp.block_scaled`)."""

    scaling: BlockScaling
    data: _TensorView
    scales: _TensorView
    amax: _TensorView | None
    dtype: DType
    size: tuple[int, ...]


class _Built:
    """An object a pickle makes by NEWOBJ + BUILD (a TE quantizer, TE ≤ 2.15's pybind DType, a
    torchao config): inert, its class's name and the state BUILD gave it."""

    name = ""

    def __setstate__(self, state: Any) -> None:
        if self.state is not None:
            raise ValueError("state set twice")
        self.state = state

    state: Any = None


def _built(name: str) -> type:
    return type(name, (_Built,), {"name": name})


_WRAPPER = ("wrapper", "torch._utils._rebuild_wrapper_subclass")
_TORCHAO = ("class", "torchao.float8.fsdp_utils.WeightWithDynamicFloat8CastTensor")
_TORCHAO_MOE = ("class", "torchao.prototype.moe_training.tensor.Float8TrainingWeightWrapperTensor")
_TORCHAO_CONFIGS = {"torchao.prototype.moe_training.config": ("Float8TrainingOpConfig",),
                    "torchao.float8.config": ("Float8LinearConfig", "CastConfig", "Float8GemmConfig")}
_TORCHAO_ENUMS = ("ScalingType", "ScalingGranularity")
_TE = "transformer_engine.pytorch.tensor."
_TE_QUANTIZERS = {f"{_TE}mxfp8_tensor": "MXFP8Quantizer", f"{_TE}float8_blockwise_tensor": "Float8BlockQuantizer",
                  f"{_TE}nvfp4_tensor": "NVFP4Quantizer"}
_TE_FP8 = {7: DTYPES["float8_e4m3fn"], 8: DTYPES["float8_e5m2"]}  # TE's DType.kFloat8E4M3 / kFloat8E5M2


def _from_type_v2(func: Any, cls: Any, args: Any, state: Any) -> _TensorView:
    """torchao's wrappers (torch's pickling of a wrapper subclass): the value is `state["_tensor"]`
    (WeightWithDynamicFloat8CastTensor) or `state["_data"]` (Float8TrainingWeightWrapperTensor)."""
    if func != _WRAPPER or type(state) is not dict:
        raise ValueError("not a torchao wrapper")
    if cls == _TORCHAO_MOE:
        config = state.get("config")
        if set(state) != {"_data", "config"} or not isinstance(config, _Built) \
                or config.name != "Float8TrainingOpConfig":
            raise ValueError("not torchao's Float8TrainingWeightWrapperTensor")
        state = {"_tensor": state["_data"]}
    elif cls != _TORCHAO or state.get("_precomputed_scale") is not None:
        raise ValueError("not torchao's WeightWithDynamicFloat8CastTensor")
    inner = state.get("_tensor")
    if not isinstance(inner, _TensorView):
        raise ValueError("torchao wrapper without its tensor")
    if type(args) is not tuple or len(args) != 8 or args[1] != inner.dtype or tuple(args[2]) != inner.size:
        raise ValueError("wrapper and wrapped tensor disagree")
    return inner


class _MMConfig:
    """torchao's ScaledMMConfig / LinearMMConfig NamedTuples (NEWOBJ): their fields, inert."""

    def __new__(cls, *fields: Any) -> Any:
        return ("mm-config", fields)


def _te_float8(data: Any, fp8: Any, scale_inv: Any, dtype: Any, shape: Any, transpose: Any = None) -> _Float8View:
    if not (isinstance(data, _TensorView) and isinstance(scale_inv, _TensorView) and isinstance(dtype, DType)
            and transpose is None and _te_dtype(fp8) in _TE_FP8
            and data.dtype == DTYPES["uint8"] and tuple(shape) == data.size
            and scale_inv.dtype == DTYPES["float32"] and math.prod(scale_inv.size) == 1):
        raise ValueError("not a Transformer Engine Float8Tensor record")
    return _Float8View(data, scale_inv, _TE_FP8[_te_dtype(fp8)], dtype, data.size)


def _te_dtype(value: Any) -> int | None:
    """TE's DType as pickled: `DType(int)` (2.16 on) or a pybind enum NEWOBJ + BUILD (≤ 2.15)."""
    if isinstance(value, _Built) and value.name == "DType":
        value = ("te-dtype", value.state)
    return value[1] if type(value) is tuple and len(value) == 2 and value[0] == "te-dtype" else None


def _block_view(scaling: BlockScaling, shape: Any, row: Any, row_scale: Any, dtype: Any, quantizer: Any,
                swizzled: Any, amax: Any = None) -> _BlockView:
    if not (isinstance(row, _TensorView) and isinstance(row_scale, _TensorView) and isinstance(dtype, DType)
            and swizzled is False and (quantizer is None or isinstance(quantizer, _Built))
            and scaling.unfit(tuple(shape)) is None and row.dtype == DTYPES["uint8"]
            and row.size == scaling.data_shape(tuple(shape)) and row_scale.size == scaling.scale_shape(tuple(shape))
            and (amax is None or isinstance(amax, _TensorView) and amax.dtype == DTYPES["float32"])):
        raise ValueError(f"not a Transformer Engine {scaling.kind} record this check reads")
    return _BlockView(scaling, row, row_scale, amax, dtype, tuple(shape))


def _te_mxfp8(row: Any, row_scale: Any, _col: Any, _col_scale: Any, fp8: Any, dtype: Any, shape: Any,
              quantizer: Any = None, swizzled: Any = False) -> _BlockView:
    codes = _TE_FP8.get(_te_dtype(fp8))
    if codes is None:
        raise ValueError("not an MXFP8Tensor record")
    return _block_view(BlockScaling(MXFP8, codes.name, (1, 32), "E8M0"), shape, row, row_scale, dtype, quantizer,
                       swizzled)


def _te_blockwise(shape: Any, row: Any, row_scale: Any, _col: Any, _col_scale: Any, fp8: Any, dtype: Any,
                  quantizer: Any, two_d: Any, data_format: Any = None) -> _BlockView:
    codes = _TE_FP8.get(_te_dtype(fp8))
    if codes is None or type(two_d) is not bool or data_format is not None:
        raise ValueError("not a Float8BlockwiseQTensor record this check reads")
    scaling = BlockScaling(BLOCKWISE, codes.name, (128, 128) if two_d else (1, 128), "float32")
    return _block_view(scaling, shape, row, row_scale, dtype, quantizer, False)


def _te_nvfp4(shape: Any, row: Any, row_scale: Any, _col: Any, _col_scale: Any, amax: Any, _col_amax: Any,
              fp4: Any, dtype: Any, quantizer: Any, swizzled: Any = False, row_scaled: Any = False,
              _four_over_six: Any = False, e4m3_max: Any = 448) -> _BlockView:
    if _te_dtype(fp4) != 10 or type(row_scaled) is not bool or e4m3_max not in (448, 256) or amax is None:
        raise ValueError("not an NVFP4Tensor record this check reads")
    scaling = BlockScaling(NVFP4, "e2m1", (1, 16), "E4M3", e4m3_max, row_scaled)
    return _block_view(scaling, shape, row, row_scale, dtype, quantizer, swizzled, amax)


_TE_RECONSTRUCTORS = {("mxfp8_tensor", "_make_mxfp8_tensor_in_reduce_ex"): _te_mxfp8,
                      ("mxfp8_tensor", "MXFP8Tensor"): _te_mxfp8,
                      ("float8_blockwise_tensor", "_make_float8_blockwise_tensor_in_reduce_ex"): _te_blockwise,
                      ("float8_blockwise_tensor", "Float8BlockwiseQTensor"): _te_blockwise,
                      ("nvfp4_tensor", "_make_nvfp4_tensor_in_reduce_ex"): _te_nvfp4,
                      ("nvfp4_tensor", "NVFP4Tensor"): _te_nvfp4}
"""TE's reconstructors, and its classes whose `_make_in_reduce_ex` (TE ≤ 2.15, through getattr)
is the same function; Float8Tensor's own is `_te_float8` (five arguments there)."""


class _TeClass:
    """A TE tensor class named as a value: only `getattr(cls, "_make_in_reduce_ex")` is asked of it."""

    def __init__(self, reconstructor: Callable[..., Any]) -> None:
        self._make_in_reduce_ex = reconstructor


def _getattr(obj: Any, name: Any) -> Any:
    if type(obj) is not _TeClass or name != "_make_in_reduce_ex":
        raise ValueError("getattr of anything but a Transformer Engine tensor's _make_in_reduce_ex")
    return obj._make_in_reduce_ex


def _te_float8_old(data: Any, fp8: Any, scale_inv: Any, dtype: Any, shape: Any) -> _Float8View:
    return _te_float8(data, fp8, scale_inv, dtype, shape)


class _SubclassPickle(pickle._Unpickler):  # type: ignore[name-defined]
    """Python's pure-Python unpickler for the FP8 training subclasses' records: `_TensorPickle`'s
    names plus theirs, and dict keys checked to be names before they are hashed."""

    dispatch = dict(pickle._Unpickler.dispatch)  # type: ignore[attr-defined]

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._tensor", "_rebuild_from_type_v2"):
            return _from_type_v2
        if (module, name) == ("torch._utils", "_rebuild_wrapper_subclass"):
            return _WRAPPER
        if f"{module}.{name}" == _TORCHAO[1]:
            return _TORCHAO
        if module == "torchao.float8.float8_training_tensor" and name in ("ScaledMMConfig", "LinearMMConfig"):
            return _MMConfig
        if (module, name) == ("torch", "device"):
            return str
        if (module, name) == ("torch.serialization", "_get_layout"):
            return str
        if (module, name) == ("torch", "Size"):
            return tuple
        if (module, name) == ("transformer_engine.pytorch.tensor.float8_tensor", "_make_float8_tensor_in_reduce_ex"):
            return _te_float8
        if name == "DType" and module in ("transformer_engine.pytorch.constants", "transformer_engine_torch"):
            return _PybindDType if module == "transformer_engine_torch" else lambda value: ("te-dtype", value)
        if module.startswith(_TE) and (module[len(_TE):], name) in _TE_RECONSTRUCTORS:
            make = _TE_RECONSTRUCTORS[(module[len(_TE):], name)]
            return _TeClass(make) if name[0].isupper() else make
        if (module, name) == ("transformer_engine.pytorch.tensor.float8_tensor", "Float8Tensor"):
            return _TeClass(_te_float8_old)
        if _TE_QUANTIZERS.get(module) == name or (module == f"{_TE}float8_tensor" and name in (
                "Float8Quantizer", "Float8CurrentScalingQuantizer")):
            return _built(name)
        if (module, name) in (("builtins", "getattr"), ("__builtin__", "getattr")):
            return _getattr
        if f"{module}.{name}" == _TORCHAO_MOE[1]:
            return _TORCHAO_MOE
        if name in _TORCHAO_CONFIGS.get(module, ()):
            return _built(name)
        if module == "torchao.float8.config" and name in _TORCHAO_ENUMS:
            return lambda value: (name, value)
        return _TensorPickle.find_class(self, module, name)  # type: ignore[arg-type]

    persistent_load = _TensorPickle.persistent_load

    def _set_items(self) -> None:
        items = self.pop_mark()
        target = self.stack[-1]
        if type(target) is not dict or any(type(k) is not str for k in items[::2]):
            raise pickle.UnpicklingError("dict key that is not a name")
        for i in range(0, len(items), 2):
            target[items[i]] = items[i + 1]

    dispatch[pickle.SETITEMS[0]] = _set_items

    def _set_item(self) -> None:
        value, key = self.stack.pop(), self.stack.pop()
        if type(self.stack[-1]) is not dict or type(key) is not str:
            raise pickle.UnpicklingError("dict key that is not a name")
        self.stack[-1][key] = value

    dispatch[pickle.SETITEM[0]] = _set_item

    def _build(self) -> None:
        state, target = self.stack.pop(), self.stack[-1]
        if not isinstance(target, _Built):
            raise pickle.UnpicklingError("BUILD of something but a new quantizer, DType or config")
        target.__setstate__(state)

    dispatch[pickle.BUILD[0]] = _build


class _PybindDType(_Built):
    """`transformer_engine_torch.DType`: called with its integer (2.16 on), or NEWOBJ then BUILD
    with it (≤ 2.15's plain pybind11 enum)."""

    name = "DType"

    def __new__(cls, *value: Any) -> Any:
        return ("te-dtype", *value) if value else object.__new__(cls)


_SUBCLASS_OPS = _PICKLE_OPS | {"EMPTY_DICT", "SETITEMS", "SETITEM", "NEWOBJ", "BUILD", "BINFLOAT"}


def tensor_view(pickled: bytes) -> _TensorView | _Float8View | _BlockView:
    """What a torch.save item's `data.pkl` says of its tensor, by Python's unpickler over the
    opcodes a tensor record uses (checked first: nothing else is built); torchao's wrapper as the
    tensor it wraps, TE's Float8Tensor as its codes and scale."""
    if len(pickled) > MAX_PICKLE:
        raise ValueError(f"data.pkl of {len(pickled)} bytes")
    subclass = b"torch._tensor\n_rebuild_from_type_v2" in pickled or b"transformer_engine" in pickled
    allowed = _SUBCLASS_OPS if subclass else _PICKLE_OPS
    for op, _, _ in pickletools.genops(pickled):
        if op.name not in allowed:
            raise ValueError(f"opcode {op.name} in a tensor record")
    view = (_SubclassPickle if subclass else _TensorPickle)(io.BytesIO(pickled)).load()
    if not isinstance(view, (_TensorView, _Float8View, _BlockView)):
        raise ValueError("data.pkl holds no tensor")
    return view


@dataclass(frozen=True)
class _Dense:
    """Where a chunk's elements lie: `start` is element 0's byte in the file, row-major from there."""

    start: int


@dataclass(frozen=True)
class _Strided:
    """A chunk saved as a strided view of its storage: element (i, j, …) at byte `start` +
    (i·stride[0] + j·stride[1] + …) × itemsize."""

    start: int
    size: tuple[int, ...]
    stride: tuple[int, ...]

    def byte(self, index: int, itemsize: int) -> int:
        at = 0
        for n, step in zip(reversed(self.size), reversed(self.stride)):
            index, i = divmod(index, n)
            at += i * step
        return self.start + at * itemsize


class ItemElements:
    """A checkpoint's chunks read element by element, located without ckptctl's item reader:
    torch.save items by `zipfile` and Python's unpickler, SAFETENSORS-format items and
    safetensors folders by their JSON header, transformed items decoded by torch. It serves
    `read_into` as the engine's `ChunkSource` does, so a sample is assembled (cast, shifted,
    transposed) by the same steps as the copy from reads that are not the copy's."""

    def __init__(self, ckpt: Checkpoint) -> None:
        self.ckpt = ckpt
        self._store = store_for(ckpt.path)
        self._handles: dict[str, ReadHandle] = {}
        self._readers: dict[str, Callable[[int, int], bytes]] = {}
        self._places: dict[tuple[str, str, int], _Dense | _Strided | bytes] = {}
        self._tensor_views: dict[bytes, _TensorView] = {}
        self._scales: dict[tuple[str, str, int], bytes] = {}  # a TE Float8Tensor chunk → its scale_inv

    def float8_scale(self, fqn: str, chunk: Chunk) -> bytes | None:
        """The scale_inv (four bytes) of a chunk this reader read as a TE Float8Tensor item; None for any other."""
        return self._scales.get((fqn, chunk.file, chunk.offset))

    def close(self) -> None:
        for handle in self._handles.values():
            handle.close()
        self._handles.clear()
        self._readers.clear()

    def take_places(self, located: bytes) -> int:
        """Take the places `located_ends` found (in a process forked from this run); how many."""
        places = pickle.loads(located)  # noqa: S301 - this run's own fork wrote it
        self._places.update(places)
        return len(places)

    def handle(self, file: str) -> ReadHandle:
        """`file` opened through the store once."""
        if file not in self._handles:
            handle = self._handles[file] = self._store.open_read(self.ckpt.path / file)
            self._readers[file] = handle.positioned_reader()
        return self._handles[file]

    def positioned_reader(self, file: str) -> Callable[[int, int], bytes]:
        """`file`'s (length, offset) → bytes, for loops of positioned reads."""
        if file not in self._readers:
            self.handle(file)
        return self._readers[file]

    def read_into(self, fqn: str, chunk: Chunk, byte_start: int, out: memoryview) -> None:
        if DEQUANT in chunk.transforms:  # a quantized weight's: the sampled rows decoded, nothing kept
            from ckptctl.checks.verify import dequantized_elements

            isz = self.ckpt.tensors[fqn].itemsize
            out[:] = dequantized_elements(self.ckpt.tensors[fqn], chunk, byte_start // isz, len(out) // isz)
            return
        place = self._place(self.ckpt.tensors[fqn], chunk)
        if isinstance(place, bytes):
            out[:] = place[byte_start:byte_start + len(out)]
            return
        read, isz = self.positioned_reader(chunk.file), self.ckpt.tensors[fqn].itemsize
        if isinstance(place, _Strided):  # element by element: a sample is a few
            data = b"".join(read(isz, place.byte(k, isz)) for k in range(byte_start // isz,
                                                                        (byte_start + len(out)) // isz))
        else:
            data = read(len(out), place.start + byte_start)
        if len(data) != len(out):
            raise CheckpointError(self.ckpt.path / chunk.file, f"{fqn}: short read at byte {byte_start}")
        out[:] = data

    def _place(self, entry: TensorEntry, chunk: Chunk) -> _Dense | _Strided | bytes:
        key = (entry.fqn, chunk.file, chunk.offset)
        place = self._places.get(key)
        if place is None:
            try:
                place = self._places[key] = self._locate(entry, chunk)
            except (ValueError, KeyError, TypeError, IndexError, struct.error, zipfile.BadZipFile,
                    pickle.UnpicklingError, EOFError, RecursionError) as exc:
                raise CheckpointError(self.ckpt.path / chunk.file, f"item at byte {chunk.offset}: {entry.fqn}: "
                                                                   f"cannot be read back ({exc})") from None
        return place

    def _locate(self, entry: TensorEntry, chunk: Chunk) -> _Dense | _Strided | bytes:
        if chunk.transforms:
            from ckptctl.checks.verify import decode_source_item, raw_bytes

            return raw_bytes(decode_source_item(self.ckpt, entry, chunk))
        handle = self.handle(chunk.file)
        read = self.positioned_reader(chunk.file)
        if chunk.file in self.ckpt.dense_files:  # rows of a joined folder's tensor (`hf_base`), checked there
            return _Dense(chunk.offset)
        if self.ckpt.safetensors_folder:  # a model file: the chunk is rows of its tensor
            start, info = _safetensors_record(handle, 0, entry.stored_name)
            if BY_SAFETENSORS.get(info["dtype"]) != entry.dtype or tuple(info["shape"]) != entry.shape:
                raise ValueError("its safetensors record is another tensor")
            row = entry.itemsize * math.prod(entry.shape[1:])
            return _Dense(start + (chunk.offsets[0] * row if entry.shape else 0))
        if read(4, chunk.offset) != b"PK\x03\x04":  # a SAFETENSORS-format item: its blob's record
            start, info = _safetensors_record(handle, chunk.offset, entry.fqn)
            if BY_SAFETENSORS.get(info["dtype"]) != entry.dtype or tuple(info["shape"]) != chunk.sizes:
                raise ValueError("its safetensors record is another tensor")
            return _Dense(start)
        item = io.BytesIO(read(chunk.length, chunk.offset)) if chunk.length <= SMALL_ITEM \
            else window(read, chunk.offset, chunk.length, MAX_ZIP_READ)  # a small item read at once, not record by record
        with zipfile.ZipFile(item) as archive:
            pkl = next(i for i in archive.infolist() if i.filename.endswith("data.pkl"))
            pickled = archive.read(pkl)
            view = self._tensor_views.get(pickled)
            if view is None:
                view = tensor_view(pickled)
                if len(self._tensor_views) < MAX_TENSOR_VIEWS:  # a sharded tensor's items repeat a few pickles
                    self._tensor_views[pickled] = view
            prefix = pkl.filename[:-len("data.pkl")]
            if isinstance(view, _Float8View):
                values, self._scales[(entry.fqn, chunk.file, chunk.offset)] = _dequantized(archive, prefix, entry,
                                                                                           chunk, view)
                return values
            if isinstance(view, _BlockView):
                return _block_dequantized(archive, prefix, entry, chunk, view)
            record = archive.getinfo(prefix + f"data/{view.key}")
            little = prefix + "byteorder" not in archive.namelist() or archive.read(prefix + "byteorder") == b"little"
        if view.dtype != entry.dtype or view.size != chunk.sizes or record.compress_type != zipfile.ZIP_STORED \
                or record.file_size != view.storage_bytes:
            raise ValueError("its record is another tensor")
        data, _ = _local_record(read, chunk.offset, record)
        if data + record.file_size > chunk.offset + chunk.length:
            raise ValueError("its record runs past the item")
        last = view.offset + sum((n - 1) * step for n, step in zip(view.size, view.stride))
        if math.prod(view.size) and (last + 1) * entry.itemsize > record.file_size:
            raise ValueError("its view runs past its storage")
        if little and (view.stride == strides(view.size) or math.prod(view.size) <= 1):
            return _Dense(data + view.offset * entry.itemsize)
        if little:
            return _Strided(data + view.offset * entry.itemsize, view.size, view.stride)
        from ckptctl.checks.verify import decode_source_item, raw_bytes  # big-endian: torch swaps its bytes

        return raw_bytes(decode_source_item(self.ckpt, entry, chunk))


def _dequantized(archive: zipfile.ZipFile, prefix: str, entry: TensorEntry, chunk: Chunk, view: _Float8View
                 ) -> tuple[bytes, bytes]:
    """A TE Float8Tensor item's value, row-major bytes of the logical dtype, as TE dequantizes:
    float32(code) × scale_inv, rounded (read here by `zipfile`, not by the item reader); and its
    scale_inv's four bytes."""
    import torch

    if view.dtype != entry.dtype or view.size != chunk.sizes:
        raise ValueError("its record is another tensor")
    if "little" != (archive.read(prefix + "byteorder").decode() if prefix + "byteorder" in archive.namelist()
                    else "little"):
        raise ValueError("big-endian FP8 scale")
    codes = archive.read(prefix + f"data/{view.data.key}")
    scale = archive.read(prefix + f"data/{view.scale_inv.key}")
    numel = math.prod(view.size)
    if view.data.stride != strides(view.size) and numel > 1 or len(codes) < view.data.offset + numel \
            or len(scale) < 4 * (view.scale_inv.offset + 1):
        raise ValueError("its FP8 records do not hold its view")
    values = torch.frombuffer(bytearray(codes[view.data.offset:view.data.offset + numel]) or bytearray(1),
                              dtype=torch.uint8)[:numel].view(view.fp8.torch)
    scale_inv = torch.frombuffer(bytearray(scale[4 * view.scale_inv.offset:4 * view.scale_inv.offset + 4]),
                                 dtype=torch.float32)
    dequantized = (values.float() * scale_inv).to(entry.dtype.torch)
    return dequantized.view(torch.uint8).numpy().tobytes(), bytes(scale_inv.numpy())


def _block_dequantized(archive: zipfile.ZipFile, prefix: str, entry: TensorEntry, chunk: Chunk,
                       view: _BlockView) -> bytes:
    """A TE block-scaled item's value, row-major bytes of the logical dtype, as TE dequantizes
    (`formats.dcp.block_scaled.dequantize`), its records read here by `zipfile`."""
    import torch

    if view.dtype != entry.dtype or view.size != chunk.sizes:
        raise ValueError("its record is another tensor")
    if prefix + "byteorder" in archive.namelist() and archive.read(prefix + "byteorder") != b"little":
        raise ValueError("big-endian block-scaled records")
    records = []
    for record in (view.data, view.scales) + ((view.amax,) if view.amax is not None else ()):
        raw = archive.read(prefix + f"data/{record.key}")
        numel, itemsize = math.prod(record.size), record.dtype.itemsize
        if record.stride != strides(record.size) and numel > 1 \
                or len(raw) < (record.offset + numel) * itemsize:
            raise ValueError("its block-scaled records do not hold their views")
        window_ = bytearray(raw[record.offset * itemsize:(record.offset + numel) * itemsize]) or bytearray(itemsize)
        records.append(torch.frombuffer(window_, dtype=record.dtype.torch)[:numel])
    value = dequantize(view.scaling, view.size, entry.dtype.torch, *records)
    return value.contiguous().view(torch.uint8).numpy().tobytes()


def located_ends(ckpt: Checkpoint) -> bytes:
    """Where the items that hold each tensor's first and last elements keep them, located as
    `ItemElements` locates them, pickled (a few bytes an item): what a check's samples read first,
    found by a process forked while the run plans (a core that is idle then), so that the check
    does not parse their archives while the output is written. Items stored transformed, and any
    that cannot be read back, are left to the check (which names what is wrong with them)."""
    elements = ItemElements(ckpt)
    try:
        for entry in ckpt.tensors.values():
            for box in _ends(entry.shape):
                try:
                    chunk = _chunk_holding(entry, box.offsets)
                    if not chunk.transforms:
                        elements._place(entry, chunk)
                except CheckpointError:
                    continue
        return pickle.dumps({key: place for key, place in elements._places.items() if not isinstance(place, bytes)})
    finally:
        elements.close()


def _safetensors_record(handle: ReadHandle, at: int, name: str) -> tuple[int, dict]:
    """Where tensor `name`'s data starts in the safetensors blob at byte `at`, and its header entry."""
    header, data = blob_header(handle, at)
    info = header[name]
    begin, _ = info["data_offsets"]
    return data + int(begin), info


# --------------------------------------------------------------------------------------
# Samples: each tensor's first and last elements
# --------------------------------------------------------------------------------------


def _ends(shape: tuple[int, ...]) -> list[Box]:
    """One-element boxes at a tensor's first and last elements (none for an empty tensor)."""
    if math.prod(shape) == 0:
        return []
    first = Box(tuple(0 for _ in shape), tuple(1 for _ in shape))
    last = Box(tuple(n - 1 for n in shape), tuple(1 for _ in shape))
    return [first] if first == last else [first, last]


def _sample(target: TargetTensor, box: Box, sources: Mapping[str, SourceTensor], elements: ItemElements) -> bytes:
    if is_quantized(target):  # a code or scale is its whole block's: the block rows quantized again
        return expected_bytes(target, box, sources, elements)
    return bytes(assemble_bytes(StreamItem("", 0, b"", target, box, plan_box(target, box, sources)), elements))


def compare_samples(targets: Iterable[TargetTensor], sources: Mapping[str, SourceTensor], source: ItemElements,
                    written: Callable[[TargetTensor, Box], bytes], shown: Callable[[str], Path]) -> None:
    """Compare each target's first and last elements, assembled from `sources` read by `source`,
    with `written(target, box)`; raise naming `shown(fqn)` (the file that holds it)."""
    for target in targets:
        for box in _ends(target.shape):
            if written(target, box) != _sample(target, box, sources, source):
                raise CheckpointError(shown(target.fqn), f"{target.fqn}: element {list(box.offsets)} of "
                                                         f"{list(target.shape)} differs from the source's")


# --------------------------------------------------------------------------------------
# DCP outputs (reshard, import-hf)
# --------------------------------------------------------------------------------------


def check_dcp(src: Checkpoint, out: DcpOutput, written: Path, views: Mapping[str, SourceTensor] | None = None) -> None:
    """Raise CheckpointError unless the DCP directory `written` is the checkpoint `out` plans,
    read back by the project's `.metadata` reader and the independent item reads."""
    DcpCheck(src, out, views)(written)


class DcpCheck:
    """`check_dcp` in parts (`engine.output.OverlappedCheck`). What the structure check needs is
    `.metadata` alone, and what the output's samples must hold comes from the source alone, so
    where a helper process writes `.metadata` while the run writes the data files, the helper
    runs `early` next: it re-reads `.metadata` (a million chunks' take seconds) against the files'
    planned sizes and reads the samples' source elements, and sends those and where the samples
    lie as read back. Each process then compares the files it wrote with their planned sizes, and
    the samples they hold, as soon as they are written (`within`); calling the check with the
    written directory and those results compares the rest. Without a helper, `start` reads the
    source's elements in a thread while the output is written, and the call does the rest
    (without `start`, all of it)."""

    def __init__(self, src: Checkpoint, out: DcpOutput, views: Mapping[str, SourceTensor] | None = None,
                 located: bytes | None = None) -> None:
        if views is None:
            from ckptctl.core.analysis import source_tensors

            views = out.sources or source_tensors(src)
        self.out = out
        self.views = {**views, **{p.src: value_view(views[p.src], t) for t in out.targets.values()
                                  if float8_of(t) is not None for p in t.pieces}}
        """The views, a TE Float8Tensor target's as its values: its samples compare values, each side
        dequantized as TE does, so its codes and its scale are checked together."""
        self.samples = [(as_values(t), box, i) for t, box, i in _planned_samples(out, CHUNK_SAMPLES)]
        self._source = ItemElements(src)
        ends = sum(index is None for _, _, index in self.samples) if located and self._source.take_places(located) else 0
        records = len(out.records)
        seconds = (records * READ_BACK_RECORD_SECONDS + (len(self.samples) - ends) * SOURCE_SAMPLE_SECONDS
                   + ends * LOCATED_SAMPLE_SECONDS)
        self.early_load = metadata_load(records, out.total_bytes, seconds / max(1, records))
        """What `early` costs the helper in bytes of files that take as long to write: the helper's
        share of the files is that much smaller."""
        self._wants: list[bytes] = []  # the samples' source elements read so far, in their order
        self._thread: threading.Thread | None = None
        self._stopping = self._closed = False
        self._lock = threading.Lock()
        self._failure: BaseException | None = None
        self._found: _ReadBack | None = None  # what `early` found
        self.within_seconds = 0.0
        """The seconds `within` took in this process."""

    def start(self) -> None:
        """Read the samples' source elements in a background thread (after any fork of the run)."""
        self._thread = threading.Thread(target=self._read_wants, name="ckptctl-check", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop the thread, without waiting for a sample it is reading (a run stopped by Ctrl-C or
        an error answers at once), and close the source files: now, or as the thread ends."""
        self._stopping = True
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._close_source()

    def _close_source(self) -> None:
        if not self._closed:
            self._closed = True
            self._source.close()

    def _read_wants(self) -> None:
        try:
            self._read_source()
        except BaseException as exc:  # noqa: BLE001 - raised by the check, in the run's thread
            self._failure = exc
        finally:
            with self._lock:
                if self._stopping:
                    self._close_source()

    def _read_source(self) -> None:
        """Read the samples' source elements not read yet, in order, until the check is closed."""
        for target, box, _ in self.samples[len(self._wants):]:
            if self._stopping:
                return
            self._wants.append(_sample(target, box, self.views, self._source))

    def early(self, written: Path) -> bytes:
        """The samples' source elements, the structure of `written`'s `.metadata` checked while its
        data files are still being written (their planned sizes taken for theirs), and each
        sample's chunk as read back; or the line of the fault found. Pickled for the run: a few
        thousand elements and chunks (kept here too, for `within`)."""
        try:
            self._read_source()
            found = self._read_back(written, self.out.files)
            found.wants = self._wants
        except CheckpointError as exc:
            found = _ReadBack(None, [], (exc.path, exc.reason))
        self._found = found
        return pickle.dumps(found)

    def within(self, written: Path, early: bytes | None, names: frozenset[str]) -> bytes:
        """The data files `names` compared, once written, with their planned sizes, and the samples
        they hold with the source's (`early`: what `early` found, None in the process that ran it);
        pickled for the run's last call: the files compared, or the line of the fault found."""
        began = time.perf_counter()
        found = self._early(early)
        try:
            if found.failure is not None:  # the run's last call raises it
                return pickle.dumps((frozenset(), None))
            self._files_as_planned(written, names)
            self._compare(written, found, skip=lambda file: file not in names, entries=False)
        except CheckpointError as exc:
            return pickle.dumps((frozenset(), (exc.path, exc.reason)))
        finally:
            self.within_seconds += time.perf_counter() - began
        return pickle.dumps((frozenset(names), None))

    def __call__(self, written: Path, early: bytes | None = None, within: Sequence[bytes] = ()) -> None:
        try:
            if self._thread is not None:
                self._thread.join()
                if self._failure is not None:
                    raise self._failure
            if early is None:
                found = self._read_back(written)
            else:
                found = self._early(early)
                if found.failure is not None:
                    raise CheckpointError(*found.failure)
                compared: set[str] = set()
                for part in within:
                    files, failure = pickle.loads(part)  # noqa: S301 - this run's own processes wrote it
                    if failure is not None:
                        raise CheckpointError(*failure)
                    compared |= files
                self._files_as_planned(written)
                self._compare(written, found, skip=compared.__contains__)
                return
            self._compare(written, found)
        finally:
            self.close()

    def _early(self, early: bytes | None) -> _ReadBack:
        """What `early` found: kept in the process that ran it, else unpickled (once: a check serves one run)."""
        if self._found is None:
            self._found = pickle.loads(early)  # noqa: S301 - this run's own helper wrote it
        return self._found

    def _read_back(self, written: Path, planned: Mapping[str, int] | None = None) -> _ReadBack:
        """`written` re-read by the project's reader and checked as a structure (against the
        `planned` sizes of its files where given), and the chunk that holds each sample."""
        dst = open_checkpoint(written, written_here=True, planned=planned)
        _check_dcp_structure(dst, self.out, written)
        chunks = []
        for target, box, index in self.samples:
            entry = dst.tensors[target.fqn]
            chunk = entry.chunks[index] if index is not None and index < len(entry.chunks) else None
            if chunk is None or chunk.offsets != box.offsets:  # not the planned chunk, as read back
                chunk = _chunk_holding(entry, box.offsets)
            chunks.append(chunk)
        sampled = {target.fqn for target, _, _ in self.samples}
        tensors = {f: TensorEntry(f, e.shape, e.dtype, ()) for f, e in dst.tensors.items() if f in sampled}
        return _ReadBack(Checkpoint(written, tensors, dst.bytes_entries, dst.files), chunks)

    def _files_as_planned(self, written: Path, names: Container[str] | None = None) -> None:
        """Raise unless the data files on disk (the named ones, where given) are those the early
        structure check took: the planned ones, of their planned sizes (the reader, re-run, names
        the entry a fault cuts)."""
        if names is None:
            planned = dict(self.out.files)
            store = store_for(written)
            on_disk = {name: store.size(written / name) for name in store.list(written) if name.endswith(".distcp")}
        else:
            planned = {name: self.out.files[name] for name in names}
            on_disk = {name: _size(written / name) for name in names}
        if on_disk != planned:
            self._read_back(written)
            name = next(n for n in sorted({*planned, *on_disk}) if planned.get(n) != on_disk.get(n))
            raise CheckpointError(written / name, f"is {on_disk.get(name)} bytes on disk, planned {planned.get(name)}")

    def _compare(self, written: Path, found: _ReadBack, skip: Callable[[str], bool] = lambda file: False,
                 entries: bool = True) -> None:
        """Compare the samples, but those in the files `skip` names, and (with `entries`) the bytes entries."""
        output = ChunkSource(found.ckpt)  # the output at its places as read back by the project's reader
        output.reader.dequantize_fp8 = True  # a TE Float8Tensor's elements: its values, as the samples hold them
        try:
            wants = found.wants or self._wants
            for i, ((target, box, _), chunk) in enumerate(zip(self.samples, found.chunks)):
                if skip(chunk.file):
                    continue
                want = wants[i] if i < len(wants) else _sample(target, box, self.views, self._source)
                if _written_element(output, found.ckpt.tensors[target.fqn], chunk, box.offsets) != want:
                    raise CheckpointError(written / chunk.file, f"{target.fqn}: element {list(box.offsets)} of "
                                                                f"{list(target.shape)} differs from the source's")
            for fqn, copy in self.out.bytes_entries.items() if entries else ():
                _check_bytes_entry(copy, found.ckpt, fqn, self._source, output, written)
        finally:
            output.close()


def _written_element(output: ChunkSource, entry: TensorEntry, chunk: Chunk, point: tuple[int, ...]) -> bytes:
    """The output's element at `point` of `entry`, read by the project's reader from `chunk`, which
    holds it, at its row-major place there."""
    index = flat_index(map(operator.sub, point, chunk.offsets), chunk.sizes)
    element = bytearray(entry.itemsize)
    output.read_into(entry.fqn, chunk, index * entry.itemsize, memoryview(element))
    return bytes(element)


def _size(path: Path) -> int | None:
    """A file's size, None when it is not there."""
    try:
        return store_for(path).size(path)
    except FileNotFoundError:
        return None


@dataclass
class _ReadBack:
    """What the early check read back: the output's sampled tensors and bytes entries (`ckpt`) with
    the chunk of each sample, or the fault it found (path, reason)."""

    ckpt: Checkpoint | None
    chunks: list[Chunk]
    failure: tuple[str, str] | None = None
    wants: list[bytes] = field(default_factory=list)
    """The samples' source elements, in order, as the helper read them."""


READ_BACK_RECORD_SECONDS, SOURCE_SAMPLE_SECONDS, LOCATED_SAMPLE_SECONDS = 2.7e-6, 160e-6, 60e-6
"""What re-reading and checking `.metadata` costs a record, and reading a sample's source element
costs (located beforehand by `located_ends`, or not), in the seconds of `formats.dcp.writer`'s
estimates (which `early_load` is weighed against). Measured on one core: 1.68 s for 1.28 million
chunks (batches of storage entries alike taken by their bytes), 0.46 s for their 6,020 samples
unlocated and 29 µs a sample located, where that `.metadata` took 6.9 s to write (estimated
10.2 s). Set about 1.4 times those figures scaled, so that the helper and the run end their
writing together on that benchmark (two processes writing slow each other down: the helper's
share costs more than its CPU seconds)."""


CHUNK_SAMPLES = 1024
"""Output chunks whose first element the check compares besides each tensor's ends: all of them
up to this many, else this many spread evenly over the output (a shard written at another's
place, or read from another source item, shows at its first element). Each costs about 0.1 ms."""


def _planned_samples(out: DcpOutput, budget: int) -> list[tuple[TargetTensor, Box, int | None]]:
    """The one-element boxes compared: each target's first and last elements, and the first
    element of every `stride`-th planned chunk (all of them when the plan has at most `budget`),
    with that chunk's index among its target's (None for an end: its chunk is searched)."""
    placements = out.records.placements()
    total = sum(len(placements.get(fqn, ())) for fqn, t in out.targets.items() if math.prod(t.shape))
    stride = max(1, -(-total // budget))
    samples: list[tuple[TargetTensor, Box, int | None]] = []
    seen = 0
    for fqn, target in out.targets.items():
        samples += [(target, box, None) for box in _ends(target.shape)]
        if not math.prod(target.shape):
            continue
        placed = placements.get(fqn, ())
        ones = tuple(1 for _ in target.shape)
        samples += [(target, Box(p.box.offsets, ones), i) for i in range((-seen) % stride, len(placed), stride)
                    if math.prod((p := placed[i]).box.sizes) and any(p.box.offsets)]  # (0, …) is an end
        seen += len(placed)
    return samples


def _chunk_holding(entry: TensorEntry, point: tuple[int, ...]) -> Chunk:
    """The chunk of `entry` whose box holds element `point` (the structure check proved there is
    one). A tensor's first and last elements are usually in its first and last chunks: those are
    tried first, then every chunk (a scan per sample of every tensor is millions of boxes at scale)."""
    chunks = entry.chunks
    for chunk in (chunks[0], chunks[-1]) if len(chunks) else ():
        if all(o <= p < o + n for o, p, n in zip(chunk.offsets, point, chunk.sizes)):
            return chunk
    for i, (offsets, sizes) in enumerate(entry.boxes()):
        if all(o <= p < o + n for o, p, n in zip(offsets, point, sizes)):
            return chunks[i]
    raise CheckpointError(entry.fqn, f"no chunk holds element {list(point)}")


COVERAGES_KEPT = 256
"""Distinct chunkings whose coverage one structure check remembers."""


def _check_dcp_structure(dst: Checkpoint, out: DcpOutput, written: Path) -> None:
    planned = {**{f: (t.shape, stored_dtype(t)) for f, t in out.targets.items()},
               **{f: (shape, dtype) for f, (dtype, shape, _) in out.literal_tensors.items()}}
    for fqn, (shape, dtype) in planned.items():
        entry = dst.tensors.get(fqn)
        if entry is None:
            raise CheckpointError(written / ".metadata", f"{fqn}: missing")
        if entry.shape != tuple(shape) or entry.dtype != dtype:
            raise CheckpointError(written / ".metadata", f"{fqn}: {entry.dtype_name} {list(entry.shape)} instead of "
                                                         f"{dtype.name} {list(shape)}")
    extra = next((f for f in (*dst.tensors, *dst.bytes_entries) if f not in planned and f not in out.bytes_entries),
                 None)
    if extra is not None:
        raise CheckpointError(written / ".metadata", f"{extra}: not in the plan")
    lost = next((f for f in out.bytes_entries if f not in dst.bytes_entries), None)
    if lost is not None:
        raise CheckpointError(written / ".metadata", f"{lost}: bytes entry missing")
    judged: dict[tuple, Coverage] = {}  # tensors of one shape chunked alike: their coverage, worked out once
    for fqn, entry in dst.tensors.items():
        chunks = entry.chunks
        key = (entry.shape, tuple(chunks.offsets), tuple(chunks.sizes)) if type(chunks) is ChunkTable else None
        cov = judged.get(key) if key is not None else None
        if cov is None:
            cov = coverage(entry)
            if key is not None and len(judged) < COVERAGES_KEPT:
                judged[key] = cov
        if not cov.complete:
            raise CheckpointError(written / ".metadata", f"{fqn}: its chunks do not cover it exactly "
                                                         f"({cov.gaps} elements missing, {cov.overlaps} twice)")
    ends = _ends_in_order(dst)
    if ends is None or any(ends.get(name) != size for name, size in dst.files.items()) or len(ends) != len(dst.files):
        check_tiling(written, dst.files, _extents(dst))  # finds and names the fault, or passes another order


def _ends_in_order(ckpt: Checkpoint) -> dict[str, int] | None:
    """Each file's end when, in `.metadata`'s order, every storage entry starts where its file's
    previous one ended (from 0), as the writer places them; None at the first that does not
    (`check_tiling` then sorts them all). One pass over the columns, no tuple per entry."""
    tables = [entry.chunks for entry in ckpt.tensors.values()]
    names = tables[0].columns()[0] if tables and type(tables[0]) is ChunkTable else None
    shared = names is not None and all(type(t) is ChunkTable and t.columns()[0] is names for t in tables)
    ends = _ends_by_number(tables, names) if shared else _ends_by_name(ckpt)  # the reader's: one list of names
    if ends is None:
        return None
    for entry in ckpt.bytes_entries.values():
        if ends.get(entry.file, 0) != entry.offset:
            return None
        ends[entry.file] = entry.offset + entry.length
    return ends


def _ends_by_number(tables: list[ChunkTable], names: list[str]) -> dict[str, int] | None:
    """`_ends_in_order` of tables sharing one list of file `names`: ends held by file number, a
    tensor whose chunks lie in consecutive files (a chunk a rank's file) compared a slice at a time."""
    ends = array("q", bytes(8 * len(names)))
    for table in tables:
        _, files, places = table.columns()
        n = len(files)
        if not n:
            continue
        starts, first = places[::2], files[0]
        if files == array("I", range(first, first + n)):
            if ends[first:first + n] != starts:
                return None
            ends[first:first + n] = array("q", map(operator.add, starts, places[1::2]))
            continue
        for file, at, length in zip(files, starts, places[1::2]):
            if ends[file] != at:
                return None
            ends[file] = at + length
    return dict(zip(names, ends))  # every name is some chunk's file


def _ends_by_name(ckpt: Checkpoint) -> dict[str, int] | None:
    """`_ends_in_order` of the tensors' chunks, by file name."""
    ends: dict[str, int] = {}
    for entry in ckpt.tensors.values():
        chunks = entry.chunks
        if type(chunks) is not ChunkTable:
            spans = [(c.file, c.offset, c.length) for c in chunks]
        else:
            names, files, places = chunks.columns()
            starts = places[::2]
            held = list(map(names.__getitem__, files))
            if len(set(files)) == len(files):  # a chunk a file (each rank's): compared a column at a time
                if list(map(ends.get, held, repeat(0))) != starts.tolist():
                    return None
                ends.update(zip(held, map(operator.add, starts, places[1::2])))
                continue
            spans = zip(held, starts, places[1::2])
        for file, offset, length in spans:
            if ends.get(file, 0) != offset:
                return None
            ends[file] = offset + length
    return ends


def _extents(ckpt: Checkpoint) -> dict[str, list[tuple[int, int, str]]]:
    """Every storage entry's (offset, end, fqn), by file."""
    by_file: dict[str, list[tuple[int, int, str]]] = {}
    for fqn, entry in ckpt.tensors.items():
        chunks = entry.chunks
        if type(chunks) is ChunkTable:
            names, files, places = chunks.columns()
            for i, f in enumerate(files):
                at = places[2 * i]
                by_file.setdefault(names[f], []).append((at, at + places[2 * i + 1], fqn))
        else:
            for c in chunks:
                by_file.setdefault(c.file, []).append((c.offset, c.offset + c.length, fqn))
    for fqn, b in ckpt.bytes_entries.items():
        by_file.setdefault(b.file, []).append((b.offset, b.offset + b.length, fqn))
    return by_file


def check_tiling(folder: Path, sizes: Mapping[str, int], extents: Mapping[str, list[tuple[int, int, str]]],
                 start: Mapping[str, int] | None = None) -> None:
    """Raise unless each file's entries, sorted, follow one another from `start` (0) to its size,
    without gap or overlap, and every file holds some. Entries that share one place (tensors of
    a SAFETENSORS-format file recorded at its blob) count once."""
    for name, size in sizes.items():
        spans = sorted(set((a, b) for a, b, _ in extents.get(name, ())))
        if not spans:
            raise CheckpointError(folder / name, "no entry lies in it")
        at = (start or {}).get(name, 0)
        for a, b in spans:
            if a != at:
                fqn = next(f for x, y, f in extents[name] if (x, y) == (a, b))
                what = "overlaps the entry before it" if a < at else f"leaves bytes {at}..{a} unused"
                raise CheckpointError(folder / name, f"{fqn} at bytes {a}..{b} {what}")
            at = b
        if at != size:
            raise CheckpointError(folder / name, f"is {size} bytes but its entries end at byte {at}")


def _check_bytes_entry(copy: Any, dst: Checkpoint, fqn: str, source: ItemElements, output: ChunkSource,
                       written: Path) -> None:
    entry = dst.bytes_entries[fqn]
    if entry.length != copy.length:
        raise CheckpointError(written / entry.file, f"{fqn}: {entry.length} bytes instead of {copy.length}")
    n = min(BYTES_SAMPLE, copy.length)
    spans = [(0, n), (copy.length - n, n)]
    for at, length in spans:
        want = copy.data[at:at + length] if copy.data is not None else \
            source.positioned_reader(copy.src_file)(length, copy.src_offset + at)
        if output.reader.positioned_reader(entry.file)(length, entry.offset + at) != want:
            raise CheckpointError(written / entry.file, f"{fqn}: bytes entry differs from the source's")


# --------------------------------------------------------------------------------------
# safetensors outputs (export-hf)
# --------------------------------------------------------------------------------------


def check_safetensors(src: Checkpoint, folder: Path, files: Mapping[str, Iterable[TargetTensor]],
                      sources: Mapping[str, SourceTensor], weight_map: Mapping[str, str] | None,
                      index_name: str) -> None:
    """Raise CheckpointError unless each written safetensors file's header, re-parsed, names its
    planned tensors with their dtypes and shapes at offsets that tile its data, the index (when
    sharded) names every tensor once in the file that holds it, and each tensor's first and last
    elements are the source's."""
    source = ItemElements(src)
    try:
        for name, targets in files.items():
            path = folder / name
            with store_for(path).open_read(path) as handle:
                _check_safetensors_file(path, handle, list(targets), sources, source)
        if weight_map is not None:
            _check_index(folder / index_name, files)
    finally:
        source.close()


def _check_safetensors_file(path: Path, handle: ReadHandle, targets: list[TargetTensor],
                            sources: Mapping[str, SourceTensor], source: ItemElements) -> None:
    read, size = handle.positioned_reader(), handle.size
    try:
        header, data = blob_header(handle, 0)
        if (header.get("__metadata__") or {}).get("format") != "pt":
            raise ValueError("its header metadata lacks format=pt")
        records = {k: v for k, v in header.items() if k != "__metadata__"}
        if sorted(records) != sorted(t.fqn for t in targets):
            raise ValueError("its header names other tensors than planned")
        extents, places = [], {}
        for target in targets:
            info = records[target.fqn]
            begin, end = (int(v) for v in info["data_offsets"])
            if BY_SAFETENSORS.get(info["dtype"]) != target.dtype or tuple(info["shape"]) != target.shape \
                    or end - begin != target.nbytes:
                raise ValueError(f"{target.fqn}: header says {info['dtype']} {info['shape']}, planned "
                                 f"{target.dtype.name} {list(target.shape)}")
            extents.append((data + begin, data + end, target.fqn))
            places[target.fqn] = data + begin
    except (ValueError, KeyError, TypeError, struct.error, RecursionError) as exc:
        raise CheckpointError(path, f"cannot be read back ({exc})") from None
    check_tiling(path.parent, {path.name: size}, {path.name: extents}, {path.name: data})

    compare_samples(targets, sources, source, functools.partial(_dense_element, read, places), lambda _: path)


def _dense_element(read: Callable[[int, int], bytes], starts: Mapping[str, int], target: TargetTensor,
                   box: Box) -> bytes:
    """The element at `box` of a tensor stored whole, row-major, from byte `starts[target.fqn]` of the
    file `read` reads."""
    index = sum(o * s for o, s in zip(box.offsets, strides(target.shape)))
    return read(target.dtype.itemsize, starts[target.fqn] + index * target.dtype.itemsize)


def _check_index(path: Path, files: Mapping[str, Iterable[TargetTensor]]) -> None:
    try:
        with store_for(path).open_read(path) as handle:
            doc = json.loads(handle.read_at(min(handle.size, MAX_HEADER_BYTES), 0))
        weight_map = doc["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError("weight_map is not an object")
    except CheckpointError as exc:  # not there, or not a regular file
        raise CheckpointError(path, f"cannot be read back ({exc.reason})") from None
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as exc:
        raise CheckpointError(path, f"cannot be read back ({exc})") from None
    held = {t.fqn: name for name, targets in files.items() for t in targets}
    if weight_map != held:
        fqn = next(f for f in sorted({*held, *weight_map}) if weight_map.get(f) != held.get(f))
        raise CheckpointError(path, f"{fqn}: mapped to {weight_map.get(fqn)!r}, held by {held.get(fqn)!r}")


# --------------------------------------------------------------------------------------
# torch.save outputs (export-torch)
# --------------------------------------------------------------------------------------


def check_torch_save(src: Checkpoint, path: Path, shown: Path, records: Mapping[str, TargetTensor],
                     sources: Mapping[str, SourceTensor]) -> None:
    """Raise CheckpointError (naming `shown`) unless the archive's central directory, read by
    `zipfile`, matches its local records, which follow one another up to the directory, and each
    tensor's record (`records`: record name → its tensor) holds its planned bytes with the
    source's first and last elements."""
    handle = store_for(path).open_read(path)
    read, size = handle.positioned_reader(), handle.size
    source = ItemElements(src)
    try:
        try:
            with zipfile.ZipFile(window(read, 0, size, MAX_ZIP_READ)) as archive:
                infos = archive.infolist()
                directory = archive.start_dir
            extents, places = [], {}
            for info in infos:
                if info.compress_type != zipfile.ZIP_STORED:
                    raise ValueError(f"{info.filename}: compressed")
                data, extra = _local_record(read, 0, info)
                end = data + info.file_size
                if info.flag_bits & 0x8:
                    end += _descriptor(read, end, _has_zip64(extra))
                extents.append((info.header_offset, end, info.filename))
                places[info.filename] = (data, info.file_size)
        except (ValueError, zipfile.BadZipFile, struct.error, OSError, EOFError) as exc:
            raise CheckpointError(shown, f"cannot be read back ({exc})") from None
        spans = {shown.name: extents + [(directory, size, "the central directory")]}
        check_tiling(shown.parent, {shown.name: size}, spans)
        for name, target in records.items():
            place = places.get(name)
            if place is None or place[1] != target.nbytes:
                raise CheckpointError(shown, f"{target.fqn}: record {name} missing or of another size")

        by_fqn = {t.fqn: places[name][0] for name, t in records.items()}
        compare_samples(records.values(), sources, source, functools.partial(_dense_element, read, by_fqn),
                        lambda _: shown)
    finally:
        source.close()
        handle.close()


def _local_record(read: Callable[[int, int], bytes], base: int, info: zipfile.ZipInfo) -> tuple[int, bytes]:
    """Where record `info`'s data starts in the file (its archive begins at byte `base`), as its
    local header, which must name it, places it; and that header's extra field."""
    head = read(30, base + info.header_offset)
    if head[:4] != b"PK\x03\x04":
        raise ValueError(f"{info.filename}: no local header where the central directory says")
    name_len, extra_len = struct.unpack("<HH", head[26:30])
    local = read(name_len + extra_len, base + info.header_offset + 30)
    if local[:name_len].decode("utf-8", "replace") != info.filename:
        raise ValueError(f"{info.filename}: its local header names another record")
    return base + info.header_offset + 30 + name_len + extra_len, local[name_len:]


def _descriptor(read: Callable[[int, int], bytes], at: int, zip64: bool) -> int:
    """The length of the data descriptor at byte `at`: CRC and both sizes, after an optional signature."""
    signed = read(4, at) == b"PK\x07\x08"
    return (4 if signed else 0) + (20 if zip64 else 12)


def _has_zip64(extra: bytes) -> bool:
    """Whether a local header's extra field holds a zip64 record (its sizes are then 8 bytes)."""
    at = 0
    while at + 4 <= len(extra):
        kind, length = struct.unpack("<HH", extra[at:at + 4])
        if kind == 0x0001:
            return True
        at += 4 + length
    return False
