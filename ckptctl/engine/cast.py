"""Casts and adds that give every engine the same bytes: a NaN they produce takes one bit pattern.

torch's kernels give a cast or computed NaN whatever bits the code path at hand yields: on
x86 CPUs a bfloat16 NaN is 0xFFFF in vector lanes and 0x7FC0 in a loop's scalar tail (whose
position depends on run lengths and on the intra-op thread count), float16 keeps part of
the payload, and CUDA writes 0x7FFF. ckptctl writes the quiet NaN with the source's sign
instead, so outputs are byte-identical across engines, thread counts, worker counts and
machines. Copies without a cast keep every bit, NaN payloads included.
"""

from __future__ import annotations

import torch

from ckptctl.util.errors import CastOverflowError

_QUIET: dict[torch.dtype, tuple[torch.dtype, int]] = {
    torch.bfloat16: (torch.int16, 0x7FC0),
    torch.float16: (torch.int16, 0x7E00),
    torch.float32: (torch.int32, 0x7FC00000),
    torch.float64: (torch.int64, 0x7FF8000000000000),
}


def canonical_nan_bits(dtype: torch.dtype, negative: bool) -> int:
    """The bits ckptctl writes for a NaN of `dtype` (as a signed integer of the same width)."""
    ints, quiet = _QUIET[dtype]
    width = ints.itemsize * 8
    value = quiet | (1 << (width - 1)) if negative else quiet
    return value - (1 << width) if value >= 1 << (width - 1) else value


def _put_canonical(out: torch.Tensor, nan: torch.Tensor, negative: torch.Tensor) -> None:
    """Overwrite `out`'s NaNs with the canonical bits (scalar operands: no host↔device traffic)."""
    ints, _ = _QUIET[out.dtype]
    view = out.view(ints)
    fixed = torch.where(nan, canonical_nan_bits(out.dtype, False), view)
    view.copy_(torch.where(nan & negative, canonical_nan_bits(out.dtype, True), fixed))


def _may_hold_nan(t: torch.Tensor) -> bool:
    """False only when `t` holds no NaN: a sum is NaN whenever an element is (one fast reduction)."""
    return bool(torch.isnan(t.sum()))


_WIDER: dict[torch.dtype, tuple[torch.dtype, ...]] = {
    torch.float16: (torch.bfloat16, torch.float32, torch.float64),
    torch.bfloat16: (torch.float32, torch.float64),
    torch.float32: (torch.float64,),
}
"""The floating dtypes each target dtype cannot hold every finite value of."""


def _refuse_overflow(out: torch.Tensor, src: torch.Tensor, low: torch.Tensor, high: torch.Tensor, nan: bool) -> None:
    """Raise `CastOverflowError` when the cast of `src` into `out` made a finite value infinite:
    compared element by element only when the source's extremes (`low`, `high`, NaN when it holds
    one) reach the target's largest finite value."""
    largest = torch.finfo(out.dtype).max
    if not (nan or bool(low <= -largest) or bool(high >= largest)):
        return
    count = int((torch.isinf(out) & torch.isfinite(src)).sum())
    if count:
        raise CastOverflowError(count, str(out.dtype).removeprefix("torch."), largest)


def cast_into(out: torch.Tensor, src: torch.Tensor) -> None:
    """`out.copy_(src)`; when that casts between floating dtypes, NaNs become canonical, and a
    finite value the target cannot hold is refused (`CastOverflowError`), never written as inf.

    One reduction of the source (`aminmax`, NaN when it holds one) answers both questions. On the
    CPU the NaN fix-up runs only if the source holds a NaN; on a GPU it always runs, and only a
    narrowing cast (whose range must be checked) waits for the reduction.
    """
    out.copy_(src)
    if src.dtype == out.dtype or out.dtype not in _QUIET or not src.dtype.is_floating_point or not src.numel():
        return
    if src.dtype.itemsize == 1:  # float8: no reduction or signbit kernels; float32 holds every value exactly
        src = src.float()
    narrowing = src.dtype in _WIDER.get(out.dtype, ())
    on_cpu = out.device.type == "cpu"
    if narrowing or on_cpu:
        low, high = torch.aminmax(src)
        nan = bool(torch.isnan(high))
        if narrowing:
            _refuse_overflow(out, src, low, high, nan)
        if on_cpu and not nan:
            return
    _put_canonical(out, torch.isnan(src), torch.signbit(src))


def add_into(out: torch.Tensor, value: float) -> None:
    """`out.add_(value)`; NaNs of `out` come out canonical, with their sign."""
    if out.dtype not in _QUIET:
        out.add_(value)
        return
    if out.device.type == "cpu" and not _may_hold_nan(out):
        out.add_(value)
        return
    nan = torch.isnan(out)
    negative = torch.signbit(out)
    out.add_(value)
    _put_canonical(out, nan, negative)
