"""Transformer Engine's block-scaled tensors and older Float8Tensor form inside DCP items, as
allow-listed stand-ins for `SubclassMachine`.

What TE's `__reduce_ex__` writes (facts from its source, `transformer_engine/pytorch/tensor/`):

* 2.16 on, module-level reconstructors (`mxfp8_tensor._make_mxfp8_tensor_in_reduce_ex(
  rowwise_data, rowwise_scale_inv, columnwise_data, columnwise_scale_inv, fp8_dtype, dtype, shape,
  quantizer, with_gemm_swizzled_scales)`; `float8_blockwise_tensor.
  _make_float8_blockwise_tensor_in_reduce_ex(shape, rowwise_data, rowwise_scale_inv,
  columnwise_data, columnwise_scale_inv, fp8_dtype, dtype, quantizer, is_2D_scaled, data_format)`;
  `nvfp4_tensor._make_nvfp4_tensor_in_reduce_ex(shape, rowwise_data, rowwise_scale_inv,
  columnwise_data, columnwise_scale_inv, amax_rowwise, amax_columnwise, fp4_dtype, dtype,
  quantizer, with_gemm_swizzled_scales[, row_scaled_nvfp4, nvfp4_use_4over6, nvfp4_e4m3_max])`,
  the last three from 2.17);
* up to 2.15, the classmethods `<Class>._make_in_reduce_ex` with the same arguments (pickled as
  `getattr(<Class>, "_make_in_reduce_ex")`; 2.8's MXFP8 without the swizzle flag, its NVFP4
  without it too), and `Float8Tensor._make_in_reduce_ex(data, fp8_dtype, scale_inv, dtype, shape)`;
  there `transformer_engine_torch.DType` is a plain pybind11 enum, pickled as NEWOBJ + BUILD of
  its integer (its `__reduce_ex__` came with 2.16).

`quantizer` is the tensor's quantizer object (NEWOBJ + BUILD of its `__dict__`), or None: it only
says how to quantize again, so it is checked to hold plain values and otherwise ignored.
Columnwise buffers are checked to be tensors and ignored: the value is read from the rowwise ones,
as TE's dequantize does. Refused by name: a tensor holding only its columnwise data, scales in
the GEMM-swizzled layout (`with_gemm_swizzled_scales`, a GEMM-ready blockwise `data_format`),
shapes TE cannot quantize, and any scale tensor whose shape is not the one TE's quantizer allocates.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable

from ckptctl.core.dtypes import DTYPES, DType
from ckptctl.formats.dcp.block_scaled import BLOCKWISE, MXFP8, NVFP4, BlockScaling
from ckptctl.formats.pickle.subclass import LOGICAL, TE_FP8, TE_RECONSTRUCTOR, _TeDType, _te_dtype, _te_float8, _Token
from ckptctl.formats.pickle.torch_pickle import Size
from ckptctl.formats.pickle.vm import Constructor, MalformedPickleError, UnsafePickleError

TE_TENSOR = "transformer_engine.pytorch.tensor"
TE_FP4 = 10
"""TE's DType.kFloat4E2M1 (transformer_engine.h)."""
_MODULES = {MXFP8: f"{TE_TENSOR}.mxfp8_tensor", BLOCKWISE: f"{TE_TENSOR}.float8_blockwise_tensor",
            NVFP4: f"{TE_TENSOR}.nvfp4_tensor"}
_RECONSTRUCTORS = {MXFP8: "_make_mxfp8_tensor_in_reduce_ex", BLOCKWISE: "_make_float8_blockwise_tensor_in_reduce_ex",
                   NVFP4: "_make_nvfp4_tensor_in_reduce_ex"}
_QUANTIZERS = {(_MODULES[MXFP8], "MXFP8Quantizer"), (_MODULES[BLOCKWISE], "Float8BlockQuantizer"),
               (_MODULES[NVFP4], "NVFP4Quantizer"), (f"{TE_TENSOR}.float8_tensor", "Float8Quantizer"),
               (f"{TE_TENSOR}.float8_tensor", "Float8CurrentScalingQuantizer")}
MAX_QUANTIZER_FIELDS = 64


@dataclass(frozen=True)
class BlockScaledRecordSpec:
    """A TE block-scaled tensor: rowwise codes `data`, rowwise `scales` (padded, as allocated),
    NVFP4's `amax`, of logical `dtype` and `size`; `scaling` says how they make its value."""

    kind: str
    scaling: BlockScaling
    data: Any  # TensorRecordSpec, uint8
    scales: Any  # TensorRecordSpec
    amax: Any  # TensorRecordSpec (float32) or None
    dtype: DType
    size: tuple[int, ...]
    reduce: BlockReduce | None = None

    def describe(self) -> str:
        return self.scaling.describe(self.dtype.name, self.scales.size)

    def records(self) -> tuple[Any, ...]:
        """The tensor records the value is read from, in `dequantize`'s order."""
        return (self.data, self.scales) + ((self.amax,) if self.amax is not None else ())


@dataclass(frozen=True)
class BlockReduce:
    """How TE ≥ 2.16 pickled the tensor, for a reshard that writes it again: its module-level
    reconstructor's argument count, the module its DType was named under, its quantizer's state
    (None: no quantizer), whether it held a columnwise copy."""

    args: int
    dtype_module: str
    quantizer: Quantizer | None
    columnwise: bool


@dataclass(frozen=True)
class Quantizer:
    """A TE quantizer, inert: its class and the fields BUILD gave it (plain values), in order."""

    module: str
    name: str
    fields: tuple[tuple[str, Any], ...] = ()


_LEAVES = (type(None), bool, int, float, str, DType, _TeDType)


def _quantizer(module: str, name: str, spec_type: type) -> Callable[[Any], Quantizer]:
    def from_state(state: Any) -> Quantizer:
        if type(state) is not dict or len(state) > MAX_QUANTIZER_FIELDS:
            raise MalformedPickleError(f"{name} state is not a dict of its fields")
        for key, value in state.items():
            if type(key) is not str or (type(value) not in _LEAVES and type(value) is not spec_type):
                raise UnsafePickleError(f"{name} field {str(key)[:64]!r} holds a {type(value).__name__}")
        return Quantizer(module, name, tuple(state.items()))
    return from_state


def _tensor(value: Any, what: str, spec_type: type, dtype: str | None = None,
            size: tuple[int, ...] | None = None) -> Any:
    if type(value) is not spec_type:
        raise MalformedPickleError(f"{what} should be a tensor")
    if dtype is not None and value.dtype != DTYPES[dtype]:
        raise MalformedPickleError(f"{what} is {value.dtype.name}, not {dtype}")
    if size is not None and value.size != size:
        raise MalformedPickleError(f"{what} is {list(value.size)}, TE allocates {list(size)}")
    return value


def _optional_tensor(value: Any, what: str, spec_type: type) -> Any:
    return None if value is None else _tensor(value, what, spec_type)


def _flag(value: Any, what: str) -> bool:
    if type(value) is not bool:
        raise MalformedPickleError(f"{what} should be a bool")
    return value


def _common(kind: str, spec_type: type, shape: Any, row: Any, row_scale: Any, col: Any, col_scale: Any,
            codes: Any, dtype: Any, quantizer: Any, swizzled: Any) -> tuple[tuple[int, ...], int]:
    """The checks every block-scaled kind shares; returns (logical shape, TE DType of the codes)."""
    if type(shape) is not Size:
        raise MalformedPickleError(f"{kind} shape is not a torch.Size")
    if type(codes) is not _TeDType:
        raise MalformedPickleError(f"{kind} data type is not a Transformer Engine DType")
    if type(dtype) is not DType or dtype not in LOGICAL:
        raise MalformedPickleError(f"{kind} dtype is not bfloat16, float16 or float32")
    if quantizer is not None and type(quantizer) is not Quantizer:
        raise MalformedPickleError(f"{kind} quantizer is not a Transformer Engine quantizer")
    _optional_tensor(col, f"{kind} columnwise data", spec_type)
    _optional_tensor(col_scale, f"{kind} columnwise scale_inv", spec_type)
    if _flag(swizzled, f"{kind} with_gemm_swizzled_scales"):
        raise UnsafePickleError(f"Transformer Engine {kind} with GEMM-swizzled scales")
    if row is None:
        raise UnsafePickleError(f"Transformer Engine {kind} holding only its columnwise data")
    _tensor(row_scale, f"{kind} rowwise scale_inv", spec_type)
    return tuple(shape), codes.value


def _spec(kind: str, scaling: BlockScaling, spec_type: type, size: tuple[int, ...], row: Any, row_scale: Any,
          scale_dtype: str, dtype: DType, amax: Any = None) -> BlockScaledRecordSpec:
    unfit = scaling.unfit(size)
    if unfit is not None:
        raise UnsafePickleError(f"Transformer Engine {unfit}")
    data = _tensor(row, f"{kind} rowwise data", spec_type, "uint8", scaling.data_shape(size))
    scales = _tensor(row_scale, f"{kind} rowwise scale_inv", spec_type, scale_dtype, scaling.scale_shape(size))
    if amax is not None:
        amax = _tensor(amax, f"{kind} rowwise amax", spec_type, "float32")
        if amax.size != (scaling.amax_numel(size),) and (amax.size != () or scaling.row_amax):
            raise MalformedPickleError(f"{kind} rowwise amax is {list(amax.size)}, not {scaling.amax_numel(size)} "
                                       "float32")
    return BlockScaledRecordSpec(f"transformer_engine {kind}", scaling, data, scales, amax, dtype, size)


def _fp8(kind: str, codes: int) -> str:
    if codes not in TE_FP8:
        raise MalformedPickleError(f"{kind} fp8_dtype is not a Transformer Engine FP8 DType")
    return TE_FP8[codes].name


def _mxfp8(spec_type: type, module_level: bool) -> Callable[[tuple], BlockScaledRecordSpec]:
    def build(args: tuple) -> BlockScaledRecordSpec:
        if not 7 <= len(args) <= 9:
            raise MalformedPickleError("_make_mxfp8_tensor_in_reduce_ex called with the wrong arguments")
        row, row_scale, col, col_scale, codes, dtype, shape, *rest = args
        quantizer, swizzled = (rest + [None, False][len(rest):])[:2]
        size, codes = _common(MXFP8, spec_type, shape, row, row_scale, col, col_scale, codes, dtype, quantizer,
                              swizzled)
        scaling = BlockScaling(MXFP8, _fp8(MXFP8, codes), (1, 32), "E8M0")
        spec = _spec(MXFP8, scaling, spec_type, size, row, row_scale, "uint8", dtype)
        if not module_level:
            return spec
        return replace(spec, reduce=BlockReduce(len(args), args[4].module, quantizer, col is not None))
    return build


def _blockwise(spec_type: type, module_level: bool) -> Callable[[tuple], BlockScaledRecordSpec]:
    def build(args: tuple) -> BlockScaledRecordSpec:
        if len(args) not in (9, 10):
            raise MalformedPickleError("_make_float8_blockwise_tensor_in_reduce_ex called with the wrong arguments")
        shape, row, row_scale, col, col_scale, codes, dtype, quantizer, two_d, *rest = args
        if rest and rest[0] is not None:
            raise UnsafePickleError(f"Transformer Engine {BLOCKWISE} with a data_format (GEMM-ready scales)")
        size, codes = _common(BLOCKWISE, spec_type, shape, row, row_scale, col, col_scale, codes, dtype, quantizer,
                              False)
        block = (128, 128) if _flag(two_d, f"{BLOCKWISE} is_2D_scaled") else (1, 128)
        scaling = BlockScaling(BLOCKWISE, _fp8(BLOCKWISE, codes), block, "float32")
        spec = _spec(BLOCKWISE, scaling, spec_type, size, row, row_scale, "float32", dtype)
        if not module_level:
            return spec
        return replace(spec, reduce=BlockReduce(len(args), args[5].module, quantizer, col is not None))
    return build


def _nvfp4(spec_type: type, module_level: bool) -> Callable[[tuple], BlockScaledRecordSpec]:
    def build(args: tuple) -> BlockScaledRecordSpec:
        if not 10 <= len(args) <= 14:
            raise MalformedPickleError("_make_nvfp4_tensor_in_reduce_ex called with the wrong arguments")
        shape, row, row_scale, col, col_scale, amax, col_amax, codes, dtype, quantizer, *rest = args
        swizzled, row_scaled, four_over_six, e4m3_max = (rest + [False, False, False, 448][len(rest):])[:4]
        _optional_tensor(col_amax, f"{NVFP4} columnwise amax", spec_type)
        size, codes = _common(NVFP4, spec_type, shape, row, row_scale, col, col_scale, codes, dtype, quantizer,
                              swizzled)
        _flag(four_over_six, f"{NVFP4} nvfp4_use_4over6")  # a quantization choice: the scales carry it
        if codes != TE_FP4:
            raise MalformedPickleError(f"{NVFP4} fp4_dtype is not Transformer Engine's kFloat4E2M1")
        if type(e4m3_max) is not int or e4m3_max not in (448, 256):
            raise MalformedPickleError(f"{NVFP4} nvfp4_e4m3_max is not 448 or 256")
        if amax is None:
            raise UnsafePickleError(f"Transformer Engine {NVFP4} without its rowwise amax")
        scaling = BlockScaling(NVFP4, "e2m1", (1, 16), "E4M3", e4m3_max, _flag(row_scaled, f"{NVFP4} row_scaled_nvfp4"))
        return _spec(NVFP4, scaling, spec_type, size, row, row_scale, "uint8", dtype, amax)
    return build


_CLASSES = {MXFP8: _mxfp8, BLOCKWISE: _blockwise, NVFP4: _nvfp4}


def _getattr(constructors: dict[str, Constructor]) -> Callable[[tuple], Constructor]:
    def call(args: tuple) -> Constructor:
        """`getattr(<TE tensor class>, "_make_in_reduce_ex")`: TE ≤ 2.15's reconstructor."""
        if len(args) != 2 or type(args[0]) is not _Token or args[1] != "_make_in_reduce_ex" \
                or args[0].name not in constructors:
            raise UnsafePickleError("getattr of anything but a Transformer Engine tensor's _make_in_reduce_ex")
        return constructors[args[0].name]
    return call


def _old_float8(spec_type: type) -> Callable[[tuple], Any]:
    float8 = _te_float8(spec_type)

    def build(args: tuple) -> Any:
        if len(args) != 5:
            raise MalformedPickleError("Float8Tensor._make_in_reduce_ex called with the wrong arguments")
        return float8(args)
    return build


_PYBIND_DTYPE_MODULE = "transformer_engine_torch"
"""Where TE's pybind11 DType lives (≤ 2.15 pickle it by NEWOBJ + BUILD, 2.16 call it with its value)."""


def _pybind_dtype(state: Any) -> _TeDType:
    """TE ≤ 2.15's pybind11 DType: NEWOBJ, then BUILD with its integer (`__setstate__`)."""
    if state is None:
        raise MalformedPickleError("Transformer Engine DType created without its value")
    return _te_dtype(_PYBIND_DTYPE_MODULE)((state,))


def te_block_globals(spec_type: type) -> dict[tuple[str, str], Any]:
    """The stand-ins for TE's block-scaled reconstructors, its ≤ 2.15 classmethod form and its quantizers."""
    classes: dict[str, Constructor] = {}
    table: dict[tuple[str, str], Any] = {}
    for kind, make in _CLASSES.items():
        ctor = Constructor(f"{_MODULES[kind]}.{_RECONSTRUCTORS[kind]}", call=make(spec_type, True))
        table[(_MODULES[kind], _RECONSTRUCTORS[kind])] = ctor
        token = _Token(f"{_MODULES[kind]}.{kind}")
        table[(_MODULES[kind], kind)] = token
        classes[token.name] = Constructor(f"{token.name}._make_in_reduce_ex", call=make(spec_type, False))
    float8 = _Token(f"{TE_RECONSTRUCTOR[0]}.Float8Tensor")
    table[(TE_RECONSTRUCTOR[0], "Float8Tensor")] = float8
    classes[float8.name] = Constructor(f"{float8.name}._make_in_reduce_ex", call=_old_float8(spec_type))
    getattr_ = Constructor("getattr", call=_getattr(classes))
    table[("builtins", "getattr")] = table[("__builtin__", "getattr")] = getattr_
    for module, name in _QUANTIZERS:
        table[(module, name)] = Constructor(f"{module}.{name}", from_state=_quantizer(module, name, spec_type))
    table[(_PYBIND_DTYPE_MODULE, "DType")] = Constructor("transformer_engine DType",
                                                         call=_te_dtype(_PYBIND_DTYPE_MODULE), from_state=_pybind_dtype)
    return table


__all__ = ["BlockReduce", "BlockScaledRecordSpec", "Quantizer", "te_block_globals"]
