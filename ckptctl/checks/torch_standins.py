"""Stand-ins for the FP8 training subclasses, for torch's own `weights_only` loader.

`--verify` decodes source items with `torch.load(weights_only=True)`, not with ckptctl's item
reader. An item holding torchao's `WeightWithDynamicFloat8CastTensor` or Transformer Engine's
`Float8Tensor` names globals torch does not allow; these stand-ins are allowed under exactly
those names (`torch.serialization.safe_globals` with (object, name) pairs), so torch's
unpickler, with its own checks, builds the item: torchao's wrapper as an inert wrapper subclass
whose `_tensor` is the value, TE's reconstructor as the value TE's dequantize gives (float32
code × scale_inv, rounded to the logical dtype). A second set (`load_float8_parts`) builds TE's
items as their reconstructor's arguments — codes, scale_inv, FP8 format, DType module, logical
dtype, shape — for the check of a reshard that keeps them. No producer's code is imported or
run. The pickled forms are described in `ckptctl.formats.pickle.subclass`.
"""

from __future__ import annotations

import collections
import io
import threading
from dataclasses import dataclass
from typing import Any

MARKERS = (b"torch._tensor\n_rebuild_from_type_v2", b"transformer_engine")
_TE_FP8 = {7: "float8_e4m3fn", 8: "float8_e5m2"}


def names_subclass(pickled: bytes) -> bool:
    return any(marker in pickled for marker in MARKERS)


def _te_dtype(value: Any) -> int:
    if type(value) is not int or value not in _TE_FP8:
        raise ValueError("not a Transformer Engine FP8 DType")
    return value


def _te_float8(data: Any, fp8_dtype: Any, scale_inv: Any, dtype: Any, shape: Any, data_transpose: Any = None) -> Any:
    import torch

    if data_transpose is not None or not isinstance(data, torch.Tensor) or data.dtype != torch.uint8 \
            or tuple(data.shape) != tuple(shape) or not isinstance(scale_inv, torch.Tensor) \
            or scale_inv.dtype != torch.float32 or scale_inv.numel() != 1 or type(fp8_dtype) is not int:
        raise ValueError("not a Transformer Engine Float8Tensor")
    fp8 = getattr(torch, _TE_FP8[fp8_dtype])
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

        scaled = collections.namedtuple("ScaledMMConfig", ["emulate", "use_fast_accum", "fp8_output", "pad_inner_dim"])
        linear = collections.namedtuple("LinearMMConfig", ["output", "grad_input", "grad_weight"])
        _SAFE = [(WeightWithDynamicFloat8CastTensor, "torchao.float8.fsdp_utils.WeightWithDynamicFloat8CastTensor"),
                 (scaled, "torchao.float8.float8_training_tensor.ScaledMMConfig"),
                 (linear, "torchao.float8.float8_training_tensor.LinearMMConfig"),
                 (_te_float8, "transformer_engine.pytorch.tensor.float8_tensor._make_float8_tensor_in_reduce_ex"),
                 (_te_dtype, "transformer_engine.pytorch.constants.DType"),
                 (_te_dtype, "transformer_engine_torch.DType")]
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
    """The value of what torch loaded: torchao's wrapper's `_tensor`, any other tensor as it is."""
    if type(value).__name__ == "WeightWithDynamicFloat8CastTensor" and type(value) is subclass_safe_globals()[0][0]:
        inner = getattr(value, "_tensor", None)
        if getattr(value, "_precomputed_scale", None) is not None or inner is None \
                or tuple(inner.shape) != tuple(value.shape) or inner.dtype != value.dtype:
            raise ValueError("not torchao's WeightWithDynamicFloat8CastTensor")
        return inner
    return value
