"""Output placement: FSDP2 rows, Megatron-FSDP TP×DP boxes and flat item-coordinate chunks, without disk."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptctl.util.errors import UsageError
from ckptctl.core.geometry import Box, box_flat_ranges, flat_boxes
from ckptctl.families.placement import Placed, flat, fsdp2, megatron_fsdp
from fixtures.megatron_layout import megatron_boxes

COLUMN = "decoder.layers.0.self_attention.linear_qkv.weight"
ROW = "decoder.layers.0.self_attention.linear_proj.weight"
DUP = "decoder.layers.0.mlp.linear_fc1.layer_norm_weight"


def as_dict(placed: list[Placed]) -> dict[int, list[tuple]]:
    out: dict[int, list[tuple]] = {}
    for p in placed:
        out.setdefault(p.rank, []).append((p.box.offsets, p.box.sizes))
    return out


def even(rows: int, parts: int) -> list[int]:
    base, extra = divmod(rows, parts)
    return [base + (i < extra) for i in range(parts)]


def test_fsdp2_placement_is_unchanged_torch_chunk_rows():
    assert fsdp2((5, 3), 2) == [Placed(0, Box((0, 0), (3, 3))), Placed(1, Box((3, 0), (2, 3)))]
    assert [p.rank for p in fsdp2((2, 4), 4)] == [0, 1]
    assert fsdp2((), 8) == [Placed(0, Box((), ()))]


def test_fsdp2_placements_are_built_once_per_shape_but_each_caller_gets_its_own_list():
    first = fsdp2((5, 3), 2)
    first.clear()
    assert fsdp2([5, 3], 2) == [Placed(0, Box((0, 0), (3, 3))), Placed(1, Box((3, 0), (2, 3)))]


@pytest.mark.parametrize("name,kind", [(COLUMN, "column"), (ROW, "row"), (DUP, "dup")])
@pytest.mark.parametrize("tp,dp", [(1, 1), (2, 1), (1, 3), (2, 2), (4, 2), (2, 5)])
def test_megatron_fsdp_boxes_follow_tp_outer_dp_inner_with_even_whole_row_cuts(name, kind, tp, dp):
    shape = (8,) if kind == "dup" else (16, 8)
    local = shape[0] // tp if kind == "column" else shape[0]
    expected = megatron_boxes(kind, shape, tp, even(local, dp))
    if kind == "dup":  # TP-duplicated: written once per DP rank, by its tp_rank 0 rank
        expected = {r: b for r, b in expected.items() if r % tp == 0}
    expected = {r: b for r, b in expected.items() if b}
    assert as_dict(megatron_fsdp(shape, name, tp, dp)) == expected


def test_megatron_fsdp_rank_is_dp_rank_times_tp_plus_tp_rank():
    placed = as_dict(megatron_fsdp((12, 8), "decoder.layers.1.mlp.linear_fc1.weight_w", 2, 2))
    # TP block t holds rows [6t, 6t+6); DP cuts each into 3 + 3 rows
    assert placed == {0: [((0, 0), (3, 8))], 1: [((6, 0), (3, 8))], 2: [((3, 0), (3, 8))], 3: [((9, 0), (3, 8))]}
    placed = as_dict(megatron_fsdp((8, 12), "decoder.layers.1.mlp.linear_fc2.weight", 2, 3))
    assert placed[5] == [((6, 6), (2, 6))]  # dp 2, tp 1: rows 6..8, columns 6..12


def test_megatron_fsdp_leaves_empty_dp_shards_out_and_puts_scalars_on_rank_0():
    placed = megatron_fsdp((4, 2), COLUMN, 2, 3)  # 2 rows per TP block over 3 DP ranks
    assert sorted(p.rank for p in placed) == [0, 1, 2, 3]
    assert megatron_fsdp((), "optimizer.state.x.step", 4, 2) == [Placed(0, Box((), ()))]


def test_megatron_fsdp_refuses_a_tp_size_that_does_not_divide_the_sharded_dim():
    with pytest.raises(UsageError, match="does not divide by TP 4"):
        megatron_fsdp((6, 8), COLUMN, 4, 1)
    with pytest.raises(UsageError, match="dim 1 of \\[8, 6\\]"):
        megatron_fsdp((8, 6), ROW, 4, 1)


def test_flat_placement_turns_boxes_into_item_ranges_that_may_start_mid_row():
    column = flat(megatron_fsdp((8, 6), COLUMN, 2, 1), (8, 6))
    assert [(p.rank, p.box.offsets, p.box.sizes) for p in column] == [(0, (0,), (24,)), (1, (24,), (24,))]
    row = flat(megatron_fsdp((2, 6), ROW, 2, 1), (2, 6))
    assert [(p.rank, p.box.offsets[0], p.box.sizes[0]) for p in row] == [(0, 0, 3), (0, 6, 3), (1, 3, 3), (1, 9, 3)]


@st.composite
def box_case(draw):
    shape = tuple(draw(st.lists(st.integers(1, 5), min_size=1, max_size=3)))
    offsets = tuple(draw(st.integers(0, d - 1)) for d in shape)
    sizes = tuple(draw(st.integers(1, d - o)) for d, o in zip(shape, offsets))
    return shape, Box(offsets, sizes)


@settings(max_examples=200, deadline=None)
@given(box_case())
def test_box_flat_ranges_are_exactly_the_items_of_the_box_in_order(case):
    shape, box = case
    grid = torch.arange(math.prod(shape)).reshape(shape)
    items = grid[tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes))].reshape(-1)
    ranges = box_flat_ranges(box, shape)
    got = torch.cat([torch.arange(r.start, r.end) for r in ranges])
    assert torch.equal(got, items)
    assert all(a.end < b.start for a, b in zip(ranges, ranges[1:]))  # maximal: never adjacent


@st.composite
def range_case(draw):
    shape = tuple(draw(st.lists(st.integers(1, 5), min_size=1, max_size=3)))
    n = math.prod(shape)
    start = draw(st.integers(0, n))
    return shape, start, draw(st.integers(start, n))


@settings(max_examples=200, deadline=None)
@given(range_case())
def test_flat_boxes_tile_a_flat_range_with_boxes_contiguous_in_item_order(case):
    shape, start, stop = case
    at = start
    for first, box in flat_boxes(shape, start, stop):
        assert first == at
        assert [(r.start, r.length) for r in box_flat_ranges(box, shape)] == [(first, box.numel)]
        at += box.numel
    assert at == stop
