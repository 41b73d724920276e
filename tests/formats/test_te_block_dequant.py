"""TE's block-scaled tensors dequantized (`formats.dcp.block_scaled.dequantize`) bit for bit as TE's
own dequantize computes them.

Oracle: `fixtures.te_blocks_dcp`'s references, TE's math followed element by element in numpy
float32 (`dequantize_mxfp8.cuh` with `ptx::exp2f`, `dequantize_nvfp4.cuh`) or TE's Python
(`_FromFloat8BlockwiseFunc`) transcribed. The records hold every finite code of their format
(subnormals, ±0, the maxima), scales down to subnormal products and up to overflow, and NaN in
their padding (which TE never reads); the logical dtypes are TE's three. Values TE's dequantize
does not define, or its releases disagree on, are refused with one line.
"""

from __future__ import annotations

import math

import pytest
import torch

from ckptctl.formats.dcp import block_scaled
from ckptctl.formats.dcp.block_scaled import BLOCKWISE, MXFP8, NVFP4, BlockScaleError, BlockScaling, dequantize
from fixtures import te_blocks_dcp as te

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@pytest.fixture(params=[block_scaled.BAND_ROWS, 128], ids=["one-band", "bands-of-128"])
def band(request, monkeypatch):
    """Rows dequantized at a time: the tensors here in one band, or in several."""
    monkeypatch.setattr(block_scaled, "BAND_ROWS", request.param)


def _same(got: torch.Tensor, expected: torch.Tensor) -> bool:
    bits = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}[expected.dtype]
    return got.dtype == expected.dtype and torch.equal(got.view(bits), expected.view(bits))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_mxfp8_is_te_dequantize(fp8, dtype, band):
    codes, scales, _, _ = te.mxfp8_records(torch.Generator().manual_seed(1), (260, 256), fp8)
    assert {0x00, 0x80, 0x01, 0x7E if fp8 == torch.float8_e4m3fn else 0x7B} <= set(codes.flatten().tolist())
    assert scales.shape == (384, 8) and int(scales[0, 0]) == 0 and int(scales[259, 7]) == 254
    got = dequantize(BlockScaling(MXFP8, str(fp8).split(".")[1], (1, 32), "E8M0"), (260, 256), dtype, codes, scales)
    expected = te.reference_mxfp8(codes, scales, fp8, dtype)
    assert _same(got, expected)
    assert torch.isinf(expected.float()).any() and (expected.float().abs() < torch.finfo(dtype).tiny).any()
    assert torch.equal(torch.signbit(got[0, :32]), torch.arange(32) % 2 == 1)  # ±0 under E8M0 code 0


def test_mxfp8_folds_leading_dims_into_rows():
    codes, scales, _, _ = te.mxfp8_records(torch.Generator().manual_seed(2), (128, 64), torch.float8_e4m3fn)
    got = dequantize(BlockScaling(MXFP8, "float8_e4m3fn", (1, 32), "E8M0"), (2, 64, 64), torch.bfloat16, codes, scales)
    assert _same(got, te.reference_mxfp8(codes, scales, torch.float8_e4m3fn, torch.bfloat16).reshape(2, 64, 64))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("two_d, shape", [(True, (200, 300)), (False, (200, 300)), (True, (128, 128)),
                                          (False, (6, 130))])
def test_blockwise_is_te_dequantize(two_d, shape, dtype, band):
    codes, scales = te.blockwise_records(torch.Generator().manual_seed(3), shape, torch.float8_e4m3fn, two_d)
    m, n = shape
    assert scales.shape == ((-(-m // 128), -(-(-(-n // 128)) // 4) * 4) if two_d else (-(-n // 128), -(-m // 4) * 4))
    scaling = BlockScaling(BLOCKWISE, "float8_e4m3fn", (128, 128) if two_d else (1, 128), "float32")
    got = dequantize(scaling, shape, dtype, codes, scales)
    expected = te.reference_blockwise(codes, scales, torch.float8_e4m3fn, two_d, dtype)
    assert _same(got, expected)
    if dtype != torch.float16:  # subnormal products (flushed to ±0 in float16's range)
        tiny = expected.float().abs()
        assert ((tiny > 0) & (tiny < torch.finfo(dtype).tiny)).any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("row_amax, e4m3_max", [(False, 448), (True, 256)])
def test_nvfp4_is_te_dequantize(row_amax, e4m3_max, dtype, band):
    packed, scales, amax = te.nvfp4_records(torch.Generator().manual_seed(4), (130, 64), row_amax)
    assert set((packed & 0xF).flatten().tolist()) == set(range(16)) and scales.shape == (256, 4)
    assert {0x00, 0x01, 0x7E} <= set(scales[:130, :4].flatten().tolist())  # 0, the least subnormal, 448
    scaling = BlockScaling(NVFP4, "e2m1", (1, 16), "E4M3", e4m3_max, row_amax)
    got = dequantize(scaling, (130, 64), dtype, packed, scales, amax)
    assert _same(got, te.reference_nvfp4(packed, scales, amax, row_amax, e4m3_max, dtype))


MXFP8_SCALING = BlockScaling(MXFP8, "float8_e4m3fn", (1, 32), "E8M0")


def _mxfp8(edit) -> tuple:
    codes, scales, _, _ = te.mxfp8_records(torch.Generator().manual_seed(5), (32, 64), torch.float8_e4m3fn)
    edit(codes, scales)
    return codes, scales


@pytest.mark.parametrize("edit, line", [
    (lambda c, s: s.__setitem__((3, 1), 255), "MXFP8Tensor with a NaN E8M0 scale (code 255)"),
    (lambda c, s: c.__setitem__((0, 5), 0x01), "MXFP8Tensor with E8M0 scale code 0 over nonzero codes (2^-127 in "
                                               "TE's main, 0 in its releases)"),
])
def test_mxfp8_scales_te_does_not_define_are_refused(edit, line):
    codes, scales = _mxfp8(edit)
    with pytest.raises(BlockScaleError) as refused:
        dequantize(MXFP8_SCALING, (32, 64), torch.bfloat16, codes, scales)
    assert str(refused.value) == line


def test_nan_in_padding_is_never_read():
    codes, scales = _mxfp8(lambda c, s: s[:, 2:].fill_(255))
    assert (scales[32:] == 255).all() and (scales[:, 2:] == 255).all()
    assert not torch.isnan(dequantize(MXFP8_SCALING, (32, 64), torch.float32, codes, scales)).any()


@pytest.mark.parametrize("which, line", [
    ("blockwise", "block-scaled tensor with a NaN or infinite float32 scale"),
    ("e4m3", "block-scaled tensor with a NaN or infinite E4M3 scale"),
    ("amax", "block-scaled tensor with a NaN or infinite amax"),
])
def test_nan_scales_are_refused(which, line):
    g = torch.Generator().manual_seed(6)
    if which == "blockwise":
        codes, scales = te.blockwise_records(g, (4, 128), torch.float8_e4m3fn, False)
        scales[0, 3] = math.inf
        args = (BlockScaling(BLOCKWISE, "float8_e4m3fn", (1, 128), "float32"), (4, 128), torch.bfloat16, codes, scales)
    else:
        packed, scales, amax = te.nvfp4_records(g, (4, 32), False)
        if which == "e4m3":
            scales[2, 1] = 0xFF
        else:
            amax[0] = math.nan
        args = (BlockScaling(NVFP4, "e2m1", (1, 16), "E4M3"), (4, 32), torch.bfloat16, packed, scales, amax)
    with pytest.raises(BlockScaleError) as refused:
        dequantize(*args)
    assert str(refused.value) == line


def test_records_of_another_shape_are_refused():
    """Whatever decoded the records, a row-scaled NVFP4 amax of one element is not spread over its rows."""
    packed, scales, amax = te.nvfp4_records(torch.Generator().manual_seed(7), (4, 32), True)
    with pytest.raises(BlockScaleError) as refused:
        dequantize(BlockScaling(NVFP4, "e2m1", (1, 16), "E4M3", 448, True), (4, 32), torch.bfloat16, packed, scales,
                   amax[:1])
    assert str(refused.value) == "NVFP4Tensor records do not hold a tensor of [4, 32]"
