"""FP8 training tensor subclasses inside DCP items, decoded by allow-listed stand-ins.

FSDP2 + DCP save a parameter's local tensor with `torch.save`, so an item's `data.pkl` holds
whatever the tensor's class pickles as. Two producers are known (facts from their source):

* torchao's float8 training wraps the high-precision weight in
  `torchao.float8.fsdp_utils.WeightWithDynamicFloat8CastTensor`, which pickles through
  torch's own path for wrapper subclasses: `torch._tensor._rebuild_from_type_v2(
  torch._utils._rebuild_wrapper_subclass, <class>, (<class>, dtype, size, stride, offset,
  layout, device, requires_grad), state)` with the state `{"_tensor": <the weight>,
  "_linear_mm_config": LinearMMConfig(3 × ScaledMMConfig(4 bools)), "_dtype": <float8 dtype>,
  "_precomputed_scale": None}` (the namedtuples by NEWOBJ). The item's value is `_tensor`.
* Transformer Engine's `Float8Tensor` (release 2.16 on) pickles as
  `transformer_engine.pytorch.tensor.float8_tensor._make_float8_tensor_in_reduce_ex(data,
  fp8_dtype, scale_inv, dtype, shape[, data_transpose])`: `data` uint8 FP8 codes in the logical
  shape, `fp8_dtype` TE's `DType(int)` (7 e4m3, 8 e5m2: the pybind `transformer_engine_torch.DType`
  in 2.16, the Python `transformer_engine.pytorch.constants.DType` from 2.17), `scale_inv` float32
  with one element, `dtype` the logical dtype (what DCP's metadata records), `shape` a
  torch.Size, `data_transpose` (TE's current source only) None unless the tensor holds only its
  transpose (refused here). Its value is float32(code) × scale_inv rounded to `dtype` (TE's
  `dequantize_fp8.cuh`). Older releases' `Float8Tensor._make_in_reduce_ex` (through `getattr`),
  and TE's MXFP8, NVFP4 and blockwise tensors, are decoded by `pickle.te_blocks`' stand-ins.
* torchao's MoE training (`torchao.prototype.moe_training`) wraps the weight in
  `Float8TrainingWeightWrapperTensor` the same way, with the state `{"_data": <the weight>,
  "config": Float8TrainingOpConfig}` (a dataclass by NEWOBJ + BUILD, its nested torchao configs
  and enums likewise). The item's value is `_data`.

These pickles run in `SubclassMachine`, the pure-Python interpreter with a table of its own:
each global is a validating stand-in (a constructor of a plain record, or an inert token), so
nothing from the checkpoint runs and anything else is refused as before.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

from ckptctl.core.dtypes import DTYPES, DType
from ckptctl.formats.dcp.classes import Layout
from ckptctl.formats.pickle.hash_guard import KeyGuard
from ckptctl.formats.pickle.torch_pickle import Size
from ckptctl.formats.pickle.vm import Constructor, MalformedPickleError, PickleMachine, UnsafePickleError, opcode_table

TORCHAO_WRAPPER = "torchao.float8.fsdp_utils.WeightWithDynamicFloat8CastTensor"
TORCHAO_MOE_WRAPPER = "torchao.prototype.moe_training.tensor.Float8TrainingWeightWrapperTensor"
TE_FLOAT8 = "transformer_engine Float8Tensor"
TE_RECONSTRUCTOR = ("transformer_engine.pytorch.tensor.float8_tensor", "_make_float8_tensor_in_reduce_ex")
TE_DTYPE_MODULES = ("transformer_engine.pytorch.constants", "transformer_engine_torch")
"""Where TE's DType class lives, by release: the Python IntEnum (2.17 on), the pybind enum (2.16)."""
TE_FP8 = {7: DTYPES["float8_e4m3fn"], 8: DTYPES["float8_e5m2"]}
"""TE's DType values of its FP8 formats (transformer_engine.h: kFloat8E4M3 = 7, kFloat8E5M2 = 8)."""
LOGICAL = frozenset(DTYPES[n] for n in ("bfloat16", "float16", "float32"))
MARKERS = (b"torch._tensor\n_rebuild_from_type_v2", b"transformer_engine")
"""What a `data.pkl` names when it is one of these subclasses (GLOBAL spells module\\nname)."""


@dataclass(frozen=True)
class WrappedRecordSpec:
    """torchao's wrapper: the item's value is `inner`, a plain tensor record; `cast` is the FP8
    dtype the wrapper casts it to for its matmuls (nothing of it is stored)."""

    kind: str
    inner: Any  # TensorRecordSpec
    cast: DType


@dataclass(frozen=True)
class Float8RecordSpec:
    """TE's Float8Tensor: FP8 codes (`data`, uint8 records of the logical shape) times `scale_inv`
    (one float32), of logical dtype `dtype`."""

    kind: str
    data: Any  # TensorRecordSpec, dtype uint8
    scale_inv: Any  # TensorRecordSpec, float32, one element
    fp8: DType
    dtype: DType
    size: tuple[int, ...]
    dtype_module: str = "transformer_engine.pytorch.constants"
    """The module of the DType class the item names (see the module docstring): a rewrite names it again."""
    args: int = 6
    """How many arguments the item passes to the reconstructor (5 before TE's `data_transpose`, 6 after)."""

    def describe(self) -> str:
        return f"{self.fp8.name} data + float32 scale_inv, logical {self.dtype.name}"


@dataclass(frozen=True)
class _Token:
    """A global used as a value (a class, a function passed to another): inert, compared by name."""

    name: str


@dataclass(frozen=True)
class _TeDType:
    value: int
    module: str


_REBUILD_WRAPPER = _Token("torch._utils._rebuild_wrapper_subclass")
_TORCHAO_CLASS = _Token(TORCHAO_WRAPPER)
_TORCHAO_MOE_CLASS = _Token(TORCHAO_MOE_WRAPPER)
_SCALED = ("torchao.float8.float8_training_tensor", "ScaledMMConfig")
_LINEAR = ("torchao.float8.float8_training_tensor", "LinearMMConfig")


@dataclass(frozen=True)
class _MMConfig:
    """ScaledMMConfig (4 bools) or LinearMMConfig (3 ScaledMMConfig), as torchao's NamedTuples."""

    name: str
    fields: tuple


def _scaled(args: tuple) -> _MMConfig:
    if len(args) != 4 or any(type(a) is not bool for a in args):
        raise MalformedPickleError("ScaledMMConfig needs 4 bools")
    return _MMConfig("ScaledMMConfig", args)


def _linear(args: tuple) -> _MMConfig:
    if len(args) != 3 or any(type(a) is not _MMConfig or a.name != "ScaledMMConfig" for a in args):
        raise MalformedPickleError("LinearMMConfig needs 3 ScaledMMConfig")
    return _MMConfig("LinearMMConfig", args)


@dataclass(frozen=True, eq=False)
class _Config:
    """One of torchao's config dataclasses (NEWOBJ + BUILD of its fields), inert: its fields by name.
    Compared and hashed by identity: configs nest, and a pickle could nest them deep enough that
    hashing one (as a dict key) by its fields would recurse past Python's limit."""

    name: str
    fields: tuple[tuple[str, Any], ...]


@dataclass(frozen=True)
class _Enum:
    """One of torchao's config enums (`ScalingType("dynamic")`), inert."""

    name: str
    value: str


_TORCHAO_CONFIGS = {("torchao.prototype.moe_training.config", "Float8TrainingOpConfig"),
                    ("torchao.float8.config", "Float8LinearConfig"), ("torchao.float8.config", "CastConfig"),
                    ("torchao.float8.config", "Float8GemmConfig")}
_TORCHAO_ENUMS = {("torchao.float8.config", "ScalingType"), ("torchao.float8.config", "ScalingGranularity")}
_CONFIG_VALUES = (type(None), bool, int, float, str, DType, _Config, _Enum, _MMConfig)
MAX_CONFIG_FIELDS = 64


def _config(name: str) -> Callable[[Any], _Config]:
    def from_state(state: Any) -> _Config:
        if type(state) is not dict or len(state) > MAX_CONFIG_FIELDS:
            raise MalformedPickleError(f"{name} state is not a dict of its fields")
        for key, value in state.items():
            if type(key) is not str or type(value) not in _CONFIG_VALUES:
                raise UnsafePickleError(f"{name} field {str(key)[:64]!r} holds a {type(value).__name__}")
        return _Config(name, tuple(state.items()))
    return from_state


def _enum(name: str) -> Callable[[tuple], _Enum]:
    def call(args: tuple) -> _Enum:
        if len(args) != 1 or type(args[0]) is not str or len(args[0]) > 64:
            raise MalformedPickleError(f"{name} needs one short name")
        return _Enum(name, args[0])
    return call


_DEVICES = ("cpu", "cuda", "meta")


def _device(args: tuple) -> str:
    if len(args) not in (1, 2) or type(args[0]) is not str or len(args[0]) > 32:
        raise MalformedPickleError("torch.device needs a device name")
    kind, _, index = args[0].partition(":")
    if kind not in _DEVICES or (index and not index.isdigit()) or (len(args) == 2 and type(args[1]) is not int):
        raise UnsafePickleError(f"unknown device {args[0]!r}")
    return args[0]


def _te_dtype(module: str) -> Callable[[tuple], _TeDType]:
    def build(args: tuple) -> _TeDType:
        if len(args) != 1 or type(args[0]) is not int or not 0 <= args[0] <= 16:
            raise MalformedPickleError("Transformer Engine DType needs one small integer")
        return _TeDType(args[0], module)
    return build


def _record(value: Any, what: str, spec_type: type) -> Any:
    if type(value) is not spec_type:
        raise MalformedPickleError(f"{what} should be a tensor")
    return value


def _from_type_v2(spec_type: type) -> Callable[[tuple], WrappedRecordSpec]:
    def build(args: tuple) -> WrappedRecordSpec:
        """torch._tensor._rebuild_from_type_v2, for torchao's wrapper only."""
        if len(args) != 4 or args[0] != _REBUILD_WRAPPER:
            raise UnsafePickleError("_rebuild_from_type_v2 of anything but a wrapper subclass")
        if args[1] not in (_TORCHAO_CLASS, _TORCHAO_MOE_CLASS):
            raise UnsafePickleError("tensor subclass other than torchao's WeightWithDynamicFloat8CastTensor or "
                                    "Float8TrainingWeightWrapperTensor")
        outer, state = args[2], args[3]
        if type(outer) is not tuple or len(outer) != 8 or outer[0] != args[1]:
            raise MalformedPickleError("_rebuild_wrapper_subclass called with the wrong arguments")
        _, dtype, size, stride, offset, layout, device, requires_grad = outer
        if type(dtype) is not DType or type(size) is not tuple or type(stride) is not tuple or type(offset) is not int \
                or type(layout) is not Layout or layout != "torch.strided" or type(device) is not str \
                or type(requires_grad) is not bool:
            raise MalformedPickleError("_rebuild_wrapper_subclass called with the wrong arguments")
        if args[1] == _TORCHAO_MOE_CLASS:
            return _moe_wrapper(state, dtype, size, spec_type)
        if type(state) is not dict or not {"_tensor", "_linear_mm_config", "_dtype"} <= set(state) \
                or not set(state) <= {"_tensor", "_linear_mm_config", "_dtype", "_precomputed_scale"}:
            raise MalformedPickleError("WeightWithDynamicFloat8CastTensor state is not torchao's")
        inner = _record(state["_tensor"], "WeightWithDynamicFloat8CastTensor._tensor", spec_type)
        config, cast = state["_linear_mm_config"], state["_dtype"]
        if type(config) is not _MMConfig or config.name != "LinearMMConfig":
            raise MalformedPickleError("WeightWithDynamicFloat8CastTensor._linear_mm_config is not a LinearMMConfig")
        if cast not in TE_FP8.values():
            raise MalformedPickleError("WeightWithDynamicFloat8CastTensor._dtype is not a float8 dtype")
        if state.get("_precomputed_scale") is not None:
            raise UnsafePickleError("WeightWithDynamicFloat8CastTensor with a precomputed scale")
        if inner.dtype != dtype or inner.size != tuple(size):
            raise MalformedPickleError(f"wrapper says {dtype.name} {list(size)}, its tensor is "
                                       f"{inner.dtype.name} {list(inner.size)}")
        return WrappedRecordSpec(TORCHAO_WRAPPER, inner, cast)
    return build


def _moe_wrapper(state: Any, dtype: DType, size: tuple, spec_type: type) -> WrappedRecordSpec:
    """torchao's `Float8TrainingWeightWrapperTensor` (`TrainingWeightWrapperBaseTensor`): its state
    `{"_data": <the weight>, "config": Float8TrainingOpConfig}`; the item's value is `_data`."""
    if type(state) is not dict or set(state) != {"_data", "config"}:
        raise MalformedPickleError("Float8TrainingWeightWrapperTensor state is not torchao's")
    inner = _record(state["_data"], "Float8TrainingWeightWrapperTensor._data", spec_type)
    config = state["config"]
    if type(config) is not _Config or config.name != "Float8TrainingOpConfig":
        raise MalformedPickleError("Float8TrainingWeightWrapperTensor.config is not a Float8TrainingOpConfig")
    cast = dict(config.fields).get("float8_dtype")
    if cast not in TE_FP8.values():
        raise MalformedPickleError("Float8TrainingOpConfig.float8_dtype is not a float8 dtype")
    if inner.dtype != dtype or inner.size != tuple(size):
        raise MalformedPickleError(f"wrapper says {dtype.name} {list(size)}, its tensor is "
                                   f"{inner.dtype.name} {list(inner.size)}")
    return WrappedRecordSpec(TORCHAO_MOE_WRAPPER, inner, cast)


def _te_float8(spec_type: type) -> Callable[[tuple], Float8RecordSpec]:
    def build(args: tuple) -> Float8RecordSpec:
        """transformer_engine's _make_float8_tensor_in_reduce_ex."""
        if len(args) not in (5, 6):
            raise MalformedPickleError("_make_float8_tensor_in_reduce_ex called with the wrong arguments")
        data, fp8, scale_inv, dtype, shape = args[:5]
        if len(args) == 6 and args[5] is not None:
            raise UnsafePickleError("Transformer Engine Float8Tensor holding only its transpose (columnwise data)")
        if data is None:
            raise UnsafePickleError("Transformer Engine Float8Tensor without data")
        data = _record(data, "Float8Tensor data", spec_type)
        scale_inv = _record(scale_inv, "Float8Tensor scale_inv", spec_type)
        if type(fp8) is not _TeDType or fp8.value not in TE_FP8:
            raise MalformedPickleError("Float8Tensor fp8_dtype is not a Transformer Engine FP8 DType")
        if type(dtype) is not DType or dtype not in LOGICAL:
            raise MalformedPickleError("Float8Tensor dtype is not bfloat16, float16 or float32")
        if type(shape) is not Size:
            raise MalformedPickleError("Float8Tensor shape is not a torch.Size")
        if data.dtype != DTYPES["uint8"] or data.size != tuple(shape):
            raise MalformedPickleError(f"Float8Tensor data is {data.dtype.name} {list(data.size)}, "
                                       f"not uint8 {list(shape)}")
        if scale_inv.dtype != DTYPES["float32"] or math.prod(scale_inv.size) != 1:
            raise UnsafePickleError(f"Float8Tensor scale_inv is {scale_inv.dtype.name} {list(scale_inv.size)}, "
                                    "not one float32 (a per-tensor scale)")
        return Float8RecordSpec(TE_FLOAT8, data, scale_inv, TE_FP8[fp8.value], dtype, tuple(shape), fp8.module,
                                len(args))
    return build


def subclass_globals(base: dict[tuple[str, str], Any], spec_type: type,
                     get_layout: Constructor, torch_size: Constructor) -> dict[tuple[str, str], Any]:
    """`base` (what a plain tensor record may name) plus these subclasses' stand-ins."""
    return {
        **base,
        ("torch._tensor", "_rebuild_from_type_v2"): Constructor("torch._tensor._rebuild_from_type_v2",
                                                                call=_from_type_v2(spec_type)),
        ("torch._utils", "_rebuild_wrapper_subclass"): _REBUILD_WRAPPER,
        tuple(TORCHAO_WRAPPER.rsplit(".", 1)): _TORCHAO_CLASS,
        tuple(TORCHAO_MOE_WRAPPER.rsplit(".", 1)): _TORCHAO_MOE_CLASS,
        **{(m, n): Constructor(n, from_state=_config(n)) for m, n in _TORCHAO_CONFIGS},
        **{(m, n): Constructor(n, call=_enum(n)) for m, n in _TORCHAO_ENUMS},
        _SCALED: Constructor("ScaledMMConfig", call=_scaled),
        _LINEAR: Constructor("LinearMMConfig", call=_linear),
        ("torch", "device"): Constructor("torch.device", call=_device),
        ("torch.serialization", "_get_layout"): get_layout,
        ("torch", "Size"): torch_size,
        TE_RECONSTRUCTOR: Constructor(".".join(TE_RECONSTRUCTOR), call=_te_float8(spec_type)),
        **{(module, "DType"): Constructor("transformer_engine DType", call=_te_dtype(module))
           for module in TE_DTYPE_MODULES},
    }


_NAMEDTUPLES = frozenset({_SCALED[1], _LINEAR[1]})


class SubclassMachine(PickleMachine):
    """The interpreter for a subclass item's `data.pkl`: NEWOBJ only of torchao's two NamedTuples
    (their arguments validated as a call) and of the stand-ins BUILD makes (TE's quantizers,
    torchao's configs), every other opcode as `PickleMachine` runs it."""

    def __init__(self, data: bytes, globals_: dict[tuple[str, str], Any], budget: int,
                 persistent: Callable[[Any], Any]) -> None:
        super().__init__(data, globals_, budget, persistent=persistent, keys=KeyGuard(len(data)).check)

    def _op_newobj(self) -> None:
        ctor = self._stack[-2] if len(self._stack) > 1 else None
        if type(ctor) is Constructor and ctor.from_state is not None:  # an object BUILD makes (quantizer, config)
            return PickleMachine._op_newobj(self)
        args = self._finished(self._pop())
        ctor = self._pop()
        if type(ctor) is not Constructor or ctor.name not in _NAMEDTUPLES:
            raise UnsafePickleError(f"refuses to create an instance of {getattr(ctor, 'name', 'a value')[:200]}")
        if type(args) is not tuple:
            raise MalformedPickleError(f"{ctor.name} created without an argument tuple")
        self._push(ctor.call(tuple(self._finished(a) for a in args)))


SubclassMachine._opcodes = {**opcode_table(SubclassMachine)}


def names_subclass(data: bytes) -> bool:
    """Whether a `data.pkl` names one of the subclasses (then `SubclassMachine` reads it)."""
    return any(marker in data for marker in MARKERS)


__all__ = ["Float8RecordSpec", "SubclassMachine", "TE_FLOAT8", "TORCHAO_MOE_WRAPPER", "TORCHAO_WRAPPER", "WrappedRecordSpec",
           "names_subclass", "subclass_globals"]
