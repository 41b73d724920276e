"""The scales a kept TE block-scaled chunk holds (`formats.dcp.te_block_items.TeBlockTarget.scales_of`),
against the same layout built with torch indexing from TE's `get_scale_shape`: shapes whose
scale tensors have more than one block column (the DCP fixture's have one), saved shards of rows
that are not multiples of 4 or 128, chunks across them, and the 2-D refusal."""

from __future__ import annotations

import pytest
import torch

from ckptctl.core.dtypes import DTYPES
from ckptctl.core.geometry import Box
from ckptctl.formats.dcp.block_scaled import BLOCKWISE, MXFP8, BlockScaling
from ckptctl.formats.dcp.te_block_items import BlockRows, TeBlockTarget
from ckptctl.util.errors import CheckpointError

COLUMNS = 384  # MXFP8: 12 scales a row (padded width 12); blockwise: 3 blocks a row
SHARDS = (0, 5, 136, 300)  # saved shards [0, 5), [5, 136), [136, 300)


def _target(scaling: BlockScaling) -> tuple[TeBlockTarget, list[torch.Tensor]]:
    """A target over saved shards whose scales are distinct values (padding NaN-like 0xFF bytes)."""
    rows, saved = [], []
    for i, (start, end) in enumerate(zip(SHARDS, SHARDS[1:])):
        shape = scaling.scale_shape((end - start, COLUMNS))
        dtype = torch.float32 if scaling.scales == "float32" else torch.uint8
        scales = torch.arange(shape[0] * shape[1], dtype=torch.int64).reshape(shape).add(1000 * i)
        scales = scales.float() if dtype == torch.float32 else scales.remainder(250).to(torch.uint8)
        saved.append(scales)
        rows.append(BlockRows(start, end, scales.numpy().tobytes()))
    return TeBlockTarget("w", scaling, DTYPES["bfloat16"], "m", 9, None, COLUMNS, tuple(rows)), saved


def _as_tensor(data: bytes, target: TeBlockTarget, rows: int) -> torch.Tensor:
    dtype = torch.float32 if target.scaling.scales == "float32" else torch.uint8
    shape = target.scale_shape(rows)
    return torch.frombuffer(bytearray(data), dtype=dtype).reshape(shape) if data else torch.zeros(shape, dtype=dtype)


@pytest.mark.parametrize("scaling", [BlockScaling(MXFP8, "float8_e4m3fn", (1, 32), "E8M0"),
                                     BlockScaling(BLOCKWISE, "float8_e4m3fn", (1, 128), "float32")],
                         ids=["mxfp8", "blockwise-1d"])
@pytest.mark.parametrize("lo, hi", [(0, 300), (3, 140), (5, 136), (130, 131), (7, 7)])
def test_row_scales_follow_their_rows(scaling, lo, hi):
    target, saved = _target(scaling)
    got = _as_tensor(target.scales_of(Box((lo, 0), (hi - lo, COLUMNS))), target, hi - lo)
    expected = torch.zeros(target.scale_shape(hi - lo), dtype=got.dtype)
    for (start, end), scales in zip(zip(SHARDS, SHARDS[1:]), saved):
        a, b = max(lo, start), min(hi, end)
        if a < b and scaling.kind == MXFP8:
            expected[a - lo:b - lo] = scales[a - start:b - start]
        elif a < b:
            expected[:, a - lo:b - lo] = scales[:, a - start:b - start]
    assert torch.equal(got, expected)


def test_2d_blocks_keep_a_saved_block_or_are_refused():
    scaling = BlockScaling(BLOCKWISE, "float8_e4m3fn", (128, 128), "float32")
    target, saved = _target(scaling)
    got = _as_tensor(target.scales_of(Box((5 + 128, 0), (3, COLUMNS))), target, 3)  # in shard 1's block 1
    assert torch.equal(got, saved[1][1:2])
    got = _as_tensor(target.scales_of(Box((5, 0), (131, COLUMNS))), target, 131)  # shard 1 whole
    assert torch.equal(got, saved[1])
    with pytest.raises(CheckpointError, match=r"the target chunk of rows \[100, 140\): its 128-row block \[100, 140\) "
                                              r"spans more than one saved 128×128 block"):
        target.scales_of(Box((100, 0), (40, COLUMNS)))
    with pytest.raises(CheckpointError, match=r"its 128-row block \[6, 134\) spans"):
        target.scales_of(Box((6, 0), (130, COLUMNS)))  # within shard 1, across its blocks 0 and 1
