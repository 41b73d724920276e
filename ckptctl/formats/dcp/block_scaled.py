"""Transformer Engine's block-scaled tensors: their records' geometry and their dequantized value.

FSDP2 saves a TE parameter's local tensor as TE pickles it (`pickle.te_blocks` decodes that);
its value is computed here from the records, as TE's own `dequantize()` computes it (facts from
TE's source, release 2.16 to its current main):

* `MXFP8Tensor`: `rowwise_data` uint8 FP8 codes (e4m3 or e5m2) of the logical shape, N = the
  last dim a multiple of 32, M = the others' product; `rowwise_scale_inv` uint8 E8M0 exponents,
  one per 1×32 block, padded to [round_up(M, 128), round_up(N/32, 4)] (`MXFP8Quantizer.
  get_scale_shape`). Value = OType(exp2f(e) × float(code)) (`dequantize_mxfp8.cuh`, `ptx::exp2f`).
  E8M0 255 is NaN (TE's main; releases read it as +inf) and 0 is 2^-127 in TE's main but 0 in
  every release (`ptx::exp2f` before #3262): a block whose scale is 0 is only read when all its
  codes are ±0 (where both agree), and 255 is refused.
* `Float8BlockwiseQTensor`: codes as above; float32 `rowwise_scale_inv`. 1-D (1×128 blocks):
  [⌈N/128⌉, round_up(M, 4)], scale of (m, n) at [n/128, m]; 2-D (128×128 blocks):
  [⌈M/128⌉, round_up(⌈N/128⌉, 4)], at [m/128, n/128] (`Float8BlockQuantizer.get_scale_shape`).
  Value = (float32(code) × scale).to(dtype) (TE's Python `_FromFloat8BlockwiseFunc`).
* `NVFP4Tensor`: `rowwise_data` uint8 holding two E2M1 codes a byte, low nibble first, [..., N/2]
  with N a multiple of 16; `rowwise_scale_inv` uint8 E4M3 per 1×16 block, padded to
  [round_up(M, 128), round_up(N/16, 4)]; `amax_rowwise` float32 [1] ([M] when row-scaled).
  Value = OType(e2m1 × ((float(scale) × amax) × (1 / (6 × e4m3_max)))), e4m3_max 448 or 256
  (`dequantize_nvfp4.cuh`).

Each product is one float32 multiply rounded to nearest even, then one rounding to the logical
dtype — on a GPU without flush-to-zero (TE's cast kernels are not built with fast math) as here,
so the values are bit-equal, subnormals included. A NaN or infinite scale or amax in the read
region is refused (TE would spread it over its block); padding is never read (TE allocates it
uninitialized).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

MXFP8 = "MXFP8Tensor"
BLOCKWISE = "Float8BlockwiseQTensor"
NVFP4 = "NVFP4Tensor"
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
"""E2M1's eight magnitudes by code (bit 3 is the sign)."""


class BlockScaleError(ValueError):
    """A block-scaled tensor whose value TE's dequantize does not define (or its releases disagree on)."""


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@dataclass(frozen=True)
class BlockScaling:
    """One of TE's block-scaled formats: `codes` the element format, `block` (rows, columns) one
    scale covers, `scales` the scale encoding; NVFP4's second level: `e4m3_max`, `row_amax`."""

    kind: str
    codes: str  # "float8_e4m3fn", "float8_e5m2" or "e2m1"
    block: tuple[int, int]
    scales: str  # "E8M0", "float32" or "E4M3"
    e4m3_max: int = 448
    row_amax: bool = False

    @staticmethod
    def flat(shape: tuple[int, ...]) -> tuple[int, int]:
        """(M, N): the logical shape as TE flattens it, every dim but the last folded into rows."""
        return math.prod(shape[:-1]), (shape[-1] if shape else 1)

    def unfit(self, shape: tuple[int, ...]) -> str | None:
        """Why TE cannot hold a tensor of `shape` in this format (None when it can)."""
        if len(shape) < 2:
            return f"{self.kind} of {len(shape)} dimensions"
        n = shape[-1]
        if self.kind == MXFP8 and n % 32:
            return f"MXFP8Tensor whose last dimension {n} is not a multiple of 32"
        if self.kind == NVFP4 and n % 16:
            return f"NVFP4Tensor whose last dimension {n} is not a multiple of 16"
        return None

    def data_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return (*shape[:-1], shape[-1] // 2) if self.codes == "e2m1" else tuple(shape)

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, int]:
        """The rowwise scale tensor's shape, padding included, as TE's quantizer allocates it."""
        m, n = self.flat(shape)
        if self.kind == BLOCKWISE and self.block == (1, 128):
            return -(-n // 128), _round_up(m, 4)
        if self.kind == BLOCKWISE:
            return -(-m // 128), _round_up(-(-n // 128), 4)
        return _round_up(m, 128), _round_up(-(-n // self.block[1]), 4)

    def amax_numel(self, shape: tuple[int, ...]) -> int | None:
        """Elements of NVFP4's amax (None: the format has none)."""
        if self.kind != NVFP4:
            return None
        return self.flat(shape)[0] if self.row_amax else 1

    def describe(self, dtype: str, scale_shape: tuple[int, ...]) -> str:
        shown = "×".join(map(str, self.block))
        codes = "e2m1 data (two a byte)" if self.codes == "e2m1" else f"{self.codes} data"
        second = (f" × float32 amax{' per row' if self.row_amax else ''} / (6 × {self.e4m3_max})"
                  if self.kind == NVFP4 else "")
        return f"{codes}, {self.scales} scales {list(scale_shape)} per {shown} block{second}, logical {dtype}"


BAND_ROWS = 1024
"""Rows dequantized at a time (a multiple of 128, the tallest block): the float32 intermediates
of a band, not of the whole tensor, are what memory holds beside the result."""


def dequantize(scaling: BlockScaling, shape: tuple[int, ...], dtype: Any, data: Any, scales: Any,
               amax: Any = None) -> Any:
    """The tensor TE's dequantize gives: `data` the rowwise codes (uint8, any shape of the right
    size), `scales` the padded rowwise scales (uint8, or float32 for blockwise) of
    `scaling.scale_shape(shape)`, `amax` NVFP4's float32 amax; `dtype` a torch dtype."""
    import torch

    m, n = BlockScaling.flat(shape)
    width, scale_shape = (n // 2 if scaling.codes == "e2m1" else n), scaling.scale_shape(shape)
    amax_numel = None if amax is None else amax.numel()
    if data.numel() != m * width or scales.numel() != math.prod(scale_shape) or amax_numel != scaling.amax_numel(shape):
        raise BlockScaleError(f"{scaling.kind} records do not hold a tensor of {list(shape)}")
    scales = scales.reshape(scale_shape)
    data = data.reshape(m, width)
    out = torch.empty((m, n), dtype=dtype)
    for start in range(0, m, BAND_ROWS):
        stop = min(m, start + BAND_ROWS)
        out[start:stop] = _band(scaling, start, stop, n, data[start:stop], scales, amax).to(dtype)
    return out.reshape(shape)


def _band(scaling: BlockScaling, start: int, stop: int, n: int, data: Any, scales: Any, amax: Any) -> Any:
    """Rows [start, stop) in float32, before the rounding to the logical dtype."""
    import torch

    if scaling.kind == NVFP4:
        return _nvfp4(scaling, start, stop, n, data, scales, amax)
    codes = data.view(getattr(torch, scaling.codes)).float()
    if scaling.kind == MXFP8:
        used = scales[start:stop, :n // 32]
        if bool((used == 255).any()):
            raise BlockScaleError("MXFP8Tensor with a NaN E8M0 scale (code 255)")
        spread = used.repeat_interleave(32, dim=1)
        if bool(((spread == 0) & (codes != 0)).any()):
            raise BlockScaleError("MXFP8Tensor with E8M0 scale code 0 over nonzero codes (2^-127 in TE's "
                                  "main, 0 in its releases)")
        factor = (spread.to(torch.int32) << 23).view(torch.float32)
    elif scaling.block == (1, 128):
        factor = _finite(scales[:, start:stop].t(), "float32 scale").repeat_interleave(128, dim=1)[:, :n]
    else:
        used = _finite(scales[start // 128:-(-stop // 128), :-(-n // 128)], "float32 scale")
        factor = used.repeat_interleave(128, dim=0)[:stop - start].repeat_interleave(128, dim=1)[:, :n]
    return codes * factor


def _finite(values: Any, what: str) -> Any:
    import torch

    if not bool(torch.isfinite(values).all()):
        raise BlockScaleError(f"block-scaled tensor with a NaN or infinite {what}")
    return values


def _nvfp4(scaling: BlockScaling, start: int, stop: int, n: int, packed: Any, scales: Any, amax: Any) -> Any:
    import torch

    nibbles = torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(stop - start, n).long()
    table = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32)
    block = _finite(scales[start:stop, :n // 16].view(torch.float8_e4m3fn).float(), "E4M3 scale")
    amax = amax.reshape(-1).to(torch.float32)
    amax = _finite(amax[start:stop].reshape(-1, 1) if scaling.row_amax else amax.reshape(1, 1), "amax")
    factor_inv = torch.tensor(1.0 / (6.0 * scaling.e4m3_max), dtype=torch.float32)
    final = (block * amax) * factor_inv
    return table[nibbles] * final.repeat_interleave(16, dim=1)


__all__ = ["BAND_ROWS", "BLOCKWISE", "BlockScaleError", "BlockScaling", "MXFP8", "NVFP4", "dequantize"]
