"""Stand-ins for the FP8 training subclasses, for torch's own `weights_only` loader.

`--verify` decodes source items with `torch.load(weights_only=True)`, not with ckptctl's item
reader. An item holding torchao's `WeightWithDynamicFloat8CastTensor` or Transformer Engine's
`Float8Tensor` names globals torch does not allow; these stand-ins are allowed under exactly
those names (`torch.serialization.safe_globals` with (object, name) pairs), so torch's
unpickler, with its own checks, builds the item: torchao's wrappers as inert wrapper subclasses
whose `_tensor` (`_data`) is the value, TE's reconstructors as the value TE's dequantize gives
(float32 code × scale_inv, rounded to the logical dtype; the block-scaled kinds by
`formats.dcp.block_scaled.dequantize`), TE's quantizers and torchao's configs as inert objects.
A second set (`load_float8_parts`, `load_block_parts`) builds TE's Float8Tensor, MXFP8Tensor and
Float8BlockwiseQTensor items as their reconstructor's arguments — codes, scales, FP8 format, DType
module, logical dtype, shape, quantizer fields — for the check of a reshard that keeps them. No
producer's code is imported or run. The pickled forms are described in
`ckptctl.formats.pickle.subclass` and `ckptctl.formats.pickle.te_blocks`.
"""

from __future__ import annotations

import collections
import io
import threading
from dataclasses import dataclass
from typing import Any

MARKERS = (b"torch._tensor\n_rebuild_from_type_v2", b"transformer_engine")
_TE_FP8 = {7: "float8_e4m3fn", 8: "float8_e5m2"}
_TE = "transformer_engine.pytorch.tensor"
_WRAPPERS = ("WeightWithDynamicFloat8CastTensor", "Float8TrainingWeightWrapperTensor")


def names_subclass(pickled: bytes) -> bool:
    return any(marker in pickled for marker in MARKERS)


def _te_dtype(value: Any) -> int:
    if type(value) is not int or not 0 <= value <= 16:
        raise ValueError("not a Transformer Engine DType")
    return value


def _fp8_name(value: Any) -> str:
    value = _dtype_value(value)
    if value not in _TE_FP8:
        raise ValueError("not a Transformer Engine FP8 DType")
    return _TE_FP8[value]


class _PybindDType:
    """`transformer_engine_torch.DType`: called with its value (2.16 on: the value itself), or
    NEWOBJ + BUILD of it (≤ 2.15's plain pybind11 enum: an instance holding it)."""

    value: int | None = None

    def __new__(cls, *value: Any) -> Any:
        return _te_dtype(*value) if value else object.__new__(cls)

    def __setstate__(self, state: Any) -> None:
        if self.value is not None or type(state) is not int or not 0 <= state <= 16:
            raise ValueError("not a Transformer Engine DType")
        self.value = state


def _dtype_value(value: Any) -> int:
    return value.value if type(value) is _PybindDType else value


class _Inert:
    """A quantizer or config object a pickle makes by NEWOBJ + BUILD: its state kept, never used."""

    def __setstate__(self, state: Any) -> None:
        if type(state) is not dict or not all(type(k) is str for k in state):
            raise ValueError("not a dict of fields")
        self.state = state


def _block_value(scaling: Any, shape: Any, row: Any, row_scale: Any, dtype: Any, quantizer: Any, swizzled: Any,
                 amax: Any = None) -> Any:
    import torch

    from ckptctl.formats.dcp.block_scaled import dequantize

    size = tuple(shape)
    if not isinstance(row, torch.Tensor) or not isinstance(row_scale, torch.Tensor) or swizzled is not False \
            or not (quantizer is None or isinstance(quantizer, _Inert)) or scaling.unfit(size) is not None \
            or row.dtype != torch.uint8 or tuple(row.shape) != scaling.data_shape(size) \
            or tuple(row_scale.shape) != scaling.scale_shape(size) \
            or (amax is not None and (not isinstance(amax, torch.Tensor) or amax.dtype != torch.float32)):
        raise ValueError(f"not a Transformer Engine {scaling.kind} this check reads")
    return dequantize(scaling, size, dtype, row.contiguous(), row_scale.contiguous(),
                      None if amax is None else amax.contiguous())


def _te_mxfp8(row: Any, row_scale: Any, _col: Any, _col_scale: Any, fp8: Any, dtype: Any, shape: Any,
              quantizer: Any = None, swizzled: Any = False) -> Any:
    from ckptctl.formats.dcp.block_scaled import MXFP8, BlockScaling

    scaling = BlockScaling(MXFP8, _fp8_name(fp8), (1, 32), "E8M0")
    return _block_value(scaling, shape, row, row_scale, dtype, quantizer, swizzled)


def _te_blockwise(shape: Any, row: Any, row_scale: Any, _col: Any, _col_scale: Any, fp8: Any, dtype: Any,
                  quantizer: Any, two_d: Any, data_format: Any = None) -> Any:
    from ckptctl.formats.dcp.block_scaled import BLOCKWISE, BlockScaling

    if type(two_d) is not bool or data_format is not None:
        raise ValueError("not a Float8BlockwiseQTensor this check reads")
    scaling = BlockScaling(BLOCKWISE, _fp8_name(fp8), (128, 128) if two_d else (1, 128), "float32")
    return _block_value(scaling, shape, row, row_scale, dtype, quantizer, False)


def _te_nvfp4(shape: Any, row: Any, row_scale: Any, _col: Any, _col_scale: Any, amax: Any, _col_amax: Any,
              fp4: Any, dtype: Any, quantizer: Any, swizzled: Any = False, row_scaled: Any = False,
              _four_over_six: Any = False, e4m3_max: Any = 448) -> Any:
    from ckptctl.formats.dcp.block_scaled import NVFP4, BlockScaling

    if _dtype_value(fp4) != 10 or type(row_scaled) is not bool or e4m3_max not in (448, 256) or amax is None:
        raise ValueError("not an NVFP4Tensor this check reads")
    scaling = BlockScaling(NVFP4, "e2m1", (1, 16), "E4M3", e4m3_max, row_scaled)
    return _block_value(scaling, shape, row, row_scale, dtype, quantizer, swizzled, amax)


def _te_float8_old(data: Any, fp8_dtype: Any, scale_inv: Any, dtype: Any, shape: Any) -> Any:
    """TE ≤ 2.15's `Float8Tensor._make_in_reduce_ex` (five arguments)."""
    return _te_float8(data, fp8_dtype, scale_inv, dtype, shape)


class _TeClass:
    """A TE tensor class named as a value: `getattr(cls, "_make_in_reduce_ex")` is all a pickle asks of it."""

    def __init__(self, reconstructor: Any) -> None:
        self._make_in_reduce_ex = reconstructor


def _te_getattr(obj: Any, name: Any) -> Any:
    """`getattr`, for TE ≤ 2.15's classmethod reconstructors only."""
    if type(obj) is not _TeClass or name != "_make_in_reduce_ex":
        raise ValueError("getattr of anything but a Transformer Engine tensor's _make_in_reduce_ex")
    return obj._make_in_reduce_ex


def _te_float8(data: Any, fp8_dtype: Any, scale_inv: Any, dtype: Any, shape: Any, data_transpose: Any = None) -> Any:
    import torch

    fp8 = getattr(torch, _fp8_name(fp8_dtype))
    if data_transpose is not None or not isinstance(data, torch.Tensor) or data.dtype != torch.uint8 \
            or tuple(data.shape) != tuple(shape) or not isinstance(scale_inv, torch.Tensor) \
            or scale_inv.dtype != torch.float32 or scale_inv.numel() != 1:
        raise ValueError("not a Transformer Engine Float8Tensor")
    return (data.view(fp8).float() * scale_inv.reshape(1)[0]).to(dtype)


@dataclass(frozen=True)
class Float8Parts:
    """What torch's loader builds of a TE Float8Tensor item under `float8_safe_globals`: the
    reconstructor's arguments as pickled, nothing computed (`--verify` of a reshard that keeps them)."""

    codes: Any  # uint8 tensor of the logical shape
    scale_inv: Any  # float32 tensor of one element
    fp8: int  # TE's DType value
    dtype_module: str  # the module TE's DType class was named under
    dtype: Any  # the logical torch dtype
    shape: tuple[int, ...]
    args: int  # 5, or 6 with data_transpose (None)


@dataclass(frozen=True)
class _TeCode:
    module: str
    value: int


def _te_code(module: str) -> Any:
    def te_dtype(value: Any) -> _TeCode:
        return _TeCode(module, _te_dtype(value))
    return te_dtype


def _te_float8_parts(data: Any, fp8_dtype: Any, scale_inv: Any, dtype: Any, shape: Any, *rest: Any) -> Float8Parts:
    import torch

    if rest not in ((), (None,)) or not isinstance(data, torch.Tensor) or data.dtype != torch.uint8 \
            or tuple(data.shape) != tuple(shape) or not isinstance(scale_inv, torch.Tensor) \
            or scale_inv.dtype != torch.float32 or scale_inv.numel() != 1 or type(fp8_dtype) is not _TeCode:
        raise ValueError("not a Transformer Engine Float8Tensor")
    return Float8Parts(data, scale_inv.reshape(1), fp8_dtype.value, fp8_dtype.module, dtype, tuple(shape),
                       5 + len(rest))


_FLOAT8_SAFE = [(_te_float8_parts, "transformer_engine.pytorch.tensor.float8_tensor._make_float8_tensor_in_reduce_ex"),
                *((_te_code(module), f"{module}.DType")
                  for module in ("transformer_engine.pytorch.constants", "transformer_engine_torch"))]
"""The stand-ins `load_float8_parts` allows: TE's reconstructor keeping its arguments, its DType
keeping the module it was named under."""


def load_float8_parts(raw: bytes) -> Float8Parts:
    """A TE Float8Tensor item's codes, scale and form, by `torch.load(weights_only=True)` allowed
    `_FLOAT8_SAFE`; ValueError for any other item."""
    import torch

    with _LOADING, torch.serialization.safe_globals(_FLOAT8_SAFE):
        parts = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    if type(parts) is not Float8Parts:
        raise ValueError("not a Transformer Engine Float8Tensor item")
    return parts


@dataclass(frozen=True)
class BlockParts:
    """What torch's loader builds of a TE MXFP8Tensor or Float8BlockwiseQTensor item under
    `_BLOCK_SAFE`: the reconstructor's arguments as pickled, nothing computed (`--verify` of a
    reshard that keeps them)."""

    kind: str  # "MXFP8Tensor" or "Float8BlockwiseQTensor"
    codes: Any  # rowwise uint8 codes of the logical shape
    scales: Any  # rowwise scales (uint8 E8M0 or float32), padded
    columnwise: bool  # whether it holds a columnwise copy
    fp8: int
    dtype_module: str
    dtype: Any
    shape: tuple[int, ...]
    quantizer: Any  # (class name, its fields) or None
    args: int
    two_d: bool | None  # blockwise's is_2D_scaled


def _block_parts(kind: str, row: Any, row_scale: Any, col: Any, col_scale: Any, fp8: Any, dtype: Any, shape: Any,
                 quantizer: Any, args: int, two_d: bool | None) -> BlockParts:
    import torch

    if not isinstance(row, torch.Tensor) or row.dtype != torch.uint8 or tuple(row.shape) != tuple(shape) \
            or not isinstance(row_scale, torch.Tensor) or row_scale.dim() != 2 or type(fp8) is not _TeCode \
            or not (quantizer is None or isinstance(quantizer, _Inert)):
        raise ValueError(f"not a Transformer Engine {kind}")
    held = None if quantizer is None else (type(quantizer).__name__, quantizer.state)
    return BlockParts(kind, row, row_scale, col is not None or col_scale is not None, fp8.value, fp8.module, dtype,
                      tuple(shape), held, args, two_d)


def _te_mxfp8_parts(row: Any, row_scale: Any, col: Any, col_scale: Any, fp8: Any, dtype: Any, shape: Any,
                    *rest: Any) -> BlockParts:
    if len(rest) > 2 or rest[1:] not in ((), (False,)):
        raise ValueError("not a Transformer Engine MXFP8Tensor")
    return _block_parts("MXFP8Tensor", row, row_scale, col, col_scale, fp8, dtype, shape, rest[0] if rest else None,
                        7 + len(rest), None)


def _te_blockwise_parts(shape: Any, row: Any, row_scale: Any, col: Any, col_scale: Any, fp8: Any, dtype: Any,
                        quantizer: Any, two_d: Any, *rest: Any) -> BlockParts:
    if type(two_d) is not bool or rest not in ((), (None,)):
        raise ValueError("not a Transformer Engine Float8BlockwiseQTensor")
    return _block_parts("Float8BlockwiseQTensor", row, row_scale, col, col_scale, fp8, dtype, shape, quantizer,
                        9 + len(rest), two_d)


_BLOCK_SAFE = [(_te_mxfp8_parts, f"{_TE}.mxfp8_tensor._make_mxfp8_tensor_in_reduce_ex"),
               (_te_blockwise_parts, f"{_TE}.float8_blockwise_tensor._make_float8_blockwise_tensor_in_reduce_ex"),
               (type("MXFP8Quantizer", (_Inert,), {}), f"{_TE}.mxfp8_tensor.MXFP8Quantizer"),
               (type("Float8BlockQuantizer", (_Inert,), {}), f"{_TE}.float8_blockwise_tensor.Float8BlockQuantizer"),
               *_FLOAT8_SAFE[1:]]
"""The stand-ins `load_block_parts` allows: TE's MXFP8 and blockwise reconstructors keeping their
arguments, their quantizers keeping their fields, TE's DType keeping the module it was named under."""


def load_block_parts(raw: bytes) -> BlockParts:
    """A TE MXFP8Tensor's or Float8BlockwiseQTensor's records and form, by
    `torch.load(weights_only=True)` allowed `_BLOCK_SAFE`; ValueError for any other item."""
    import torch

    with _LOADING, torch.serialization.safe_globals(_BLOCK_SAFE):
        parts = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    if type(parts) is not BlockParts:
        raise ValueError("not a Transformer Engine block-scaled item")
    return parts


_SAFE: list | None = None


def subclass_safe_globals() -> list:
    """The (stand-in, producer's name) pairs torch's loader may use for these items."""
    global _SAFE
    if _SAFE is None:
        import torch

        class WeightWithDynamicFloat8CastTensor(torch.Tensor):
            """Inert: torch builds it with `_make_wrapper_subclass` and sets its pickled state; no
            operation runs on it."""

            @classmethod
            def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
                raise TypeError(f"stand-in for torchao's wrapper runs no operation ({func})")

        class Float8TrainingWeightWrapperTensor(WeightWithDynamicFloat8CastTensor):
            """torchao's MoE training wrapper (its state `_data`, `config`), inert as the other."""

        def inert(name: str) -> type:
            return type(name, (_Inert,), {})

        def enum(name: str) -> Any:
            def make(value: Any) -> tuple:
                if type(value) is not str:
                    raise ValueError(f"not a {name}")
                return name, value
            return make

        te_classes = [(_TeClass(_te_mxfp8), f"{_TE}.mxfp8_tensor.MXFP8Tensor"),
                      (_TeClass(_te_blockwise), f"{_TE}.float8_blockwise_tensor.Float8BlockwiseQTensor"),
                      (_TeClass(_te_nvfp4), f"{_TE}.nvfp4_tensor.NVFP4Tensor"),
                      (_TeClass(_te_float8_old), f"{_TE}.float8_tensor.Float8Tensor")]
        quantizers = [(inert(n.rsplit(".", 1)[1]), n) for n in (
            f"{_TE}.mxfp8_tensor.MXFP8Quantizer", f"{_TE}.float8_blockwise_tensor.Float8BlockQuantizer",
            f"{_TE}.nvfp4_tensor.NVFP4Quantizer", f"{_TE}.float8_tensor.Float8Quantizer",
            f"{_TE}.float8_tensor.Float8CurrentScalingQuantizer")]
        configs = [(inert(n.rsplit(".", 1)[1]), n) for n in (
            "torchao.prototype.moe_training.config.Float8TrainingOpConfig", "torchao.float8.config.Float8LinearConfig",
            "torchao.float8.config.CastConfig", "torchao.float8.config.Float8GemmConfig")]
        enums = [(enum(n.rsplit(".", 1)[1]), n) for n in ("torchao.float8.config.ScalingType",
                                                          "torchao.float8.config.ScalingGranularity")]

        scaled = collections.namedtuple("ScaledMMConfig", ["emulate", "use_fast_accum", "fp8_output", "pad_inner_dim"])
        linear = collections.namedtuple("LinearMMConfig", ["output", "grad_input", "grad_weight"])
        _SAFE = [(WeightWithDynamicFloat8CastTensor, "torchao.float8.fsdp_utils.WeightWithDynamicFloat8CastTensor"),
                 (scaled, "torchao.float8.float8_training_tensor.ScaledMMConfig"),
                 (linear, "torchao.float8.float8_training_tensor.LinearMMConfig"),
                 (_te_float8, "transformer_engine.pytorch.tensor.float8_tensor._make_float8_tensor_in_reduce_ex"),
                 (_te_dtype, "transformer_engine.pytorch.constants.DType"),
                 (_PybindDType, "transformer_engine_torch.DType"),
                 (Float8TrainingWeightWrapperTensor,
                  "torchao.prototype.moe_training.tensor.Float8TrainingWeightWrapperTensor"),
                 (_te_mxfp8, f"{_TE}.mxfp8_tensor._make_mxfp8_tensor_in_reduce_ex"),
                 (_te_blockwise, f"{_TE}.float8_blockwise_tensor._make_float8_blockwise_tensor_in_reduce_ex"),
                 (_te_nvfp4, f"{_TE}.nvfp4_tensor._make_nvfp4_tensor_in_reduce_ex"),
                 (_te_getattr, "builtins.getattr"),
                 (_te_float8_old, f"{_TE}.float8_tensor.Float8Tensor._make_in_reduce_ex"),  # what getattr gives
                 *te_classes, *quantizers, *configs, *enums]
    return _SAFE


_LOADING = threading.Lock()
"""`safe_globals` is a process-wide setting that its block sets and restores: loads that use it
take turns (one thread's block ending would take the stand-ins from another's load)."""


def load_subclass_item(raw: bytes) -> Any:
    """The item's value, by `torch.load(weights_only=True)` allowed these stand-ins."""
    import torch

    with _LOADING, torch.serialization.safe_globals(subclass_safe_globals()):
        return unwrapped(torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True))


def unwrapped(value: Any) -> Any:
    """The value of what torch loaded: torchao's wrappers' `_tensor` (or `_data`), any other tensor as it is."""
    if type(value).__name__ == "Float8TrainingWeightWrapperTensor" and type(value) is subclass_safe_globals()[6][0]:
        inner = getattr(value, "_data", None)
        if not isinstance(getattr(value, "config", None), _Inert) or inner is None \
                or tuple(inner.shape) != tuple(value.shape) or inner.dtype != value.dtype:
            raise ValueError("not torchao's Float8TrainingWeightWrapperTensor")
        return inner
    if type(value).__name__ == "WeightWithDynamicFloat8CastTensor" and type(value) is subclass_safe_globals()[0][0]:
        inner = getattr(value, "_tensor", None)
        if getattr(value, "_precomputed_scale", None) is not None or inner is None \
                or tuple(inner.shape) != tuple(value.shape) or inner.dtype != value.dtype:
            raise ValueError("not torchao's WeightWithDynamicFloat8CastTensor")
        return inner
    return value
