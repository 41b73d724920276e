"""Pure planning: copy runs, FSDP2 placement and DCP file layout, checked without disk."""

from __future__ import annotations

import itertools
import math
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptctl.core.dtypes import float32
from ckptctl.util.errors import CheckpointError
from ckptctl.core.geometry import Box, FlatRange, chunk_rows, copy_runs, region_bounds, rows_box, union_volume
from ckptctl.core.checkpoint import Chunk, TensorEntry
from ckptctl.families.placement import Placed, fsdp2
from ckptctl.core.plan import Piece, SourceTensor, TargetTensor, identity_target, layer_stacked_view, plan_box, source_view


@st.composite
def box_in(draw, shape):
    offsets = tuple(draw(st.integers(0, d - 1)) for d in shape)
    sizes = tuple(draw(st.integers(1, d - o)) for d, o in zip(shape, offsets))
    return Box(offsets, sizes)


@st.composite
def copy_case(draw):
    shape = tuple(draw(st.lists(st.integers(1, 5), min_size=1, max_size=3)))
    n = math.prod(shape)
    if draw(st.booleans()):
        start = draw(st.integers(0, n - 1))
        src = FlatRange(start, draw(st.integers(1, n - start)))
    else:
        src = draw(box_in(shape))
    return shape, src, draw(box_in(shape))


def values_of(region, grid: torch.Tensor) -> torch.Tensor:
    if isinstance(region, FlatRange):
        return grid.reshape(-1)[region.start: region.end]
    return grid[tuple(slice(o, o + s) for o, s in zip(region.offsets, region.sizes))].reshape(-1)


@settings(max_examples=300, deadline=None)
@given(copy_case())
def test_copy_runs_move_exactly_the_shared_elements(case):
    shape, src, dst = case
    grid = torch.arange(math.prod(shape)).reshape(shape)
    out = torch.full((dst.numel,), -1)
    part = region_bounds(src, shape).intersect(dst)
    if part is not None:
        data = values_of(src, grid)
        for run in copy_runs(part, src, shape, dst, (0,) * len(shape)):
            out[run.dst: run.dst + run.length] = data[run.src: run.src + run.length]
    expected = torch.full(shape, -1)
    if isinstance(src, FlatRange):
        expected.view(-1)[src.start: src.end] = grid.view(-1)[src.start: src.end]
    else:
        sl = tuple(slice(o, o + s) for o, s in zip(src.offsets, src.sizes))
        expected[sl] = grid[sl]
    assert torch.equal(out, values_of(dst, expected))


def test_full_rows_copy_as_one_run():
    runs = copy_runs(Box((2, 0), (3, 6)), Box((0, 0), (6, 6)), (8, 6), Box((2, 0), (4, 6)), (0, 0))
    assert [(r.src, r.dst, r.length) for r in runs] == [(12, 0, 18)]


def test_column_split_source_copies_row_by_row():
    # a RowParallel (dim-1) TP chunk: columns 3..5 of a [4, 6] tensor into full rows 1..2
    runs = copy_runs(Box((1, 3), (2, 3)), Box((0, 3), (4, 3)), (4, 6), Box((1, 0), (2, 6)), (0, 0))
    assert [(r.src, r.dst, r.length) for r in runs] == [(3, 3, 3), (6, 9, 3)]


def test_flat_range_mid_row_into_rows():
    runs = copy_runs(Box((1, 0), (2, 6)), FlatRange(7, 13), (5, 6), Box((0, 0), (5, 6)), (0, 0))
    assert [(r.src, r.dst, r.length) for r in runs] == [(0, 7, 11)]  # flat 7..18: where rows 1-2 meet the range


def test_torch_chunk_rows_and_fsdp2_placement():
    assert chunk_rows(10, 4) == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert chunk_rows(2, 4) == [(0, 1), (1, 2), (2, 2), (2, 2)]
    assert fsdp2((2, 8), 4) == [Placed(0, Box((0, 0), (1, 8))), Placed(1, Box((1, 0), (1, 8)))]
    assert fsdp2((), 3) == [Placed(0, Box((), ()))]
    assert fsdp2((0, 4), 3) == [Placed(0, Box((0, 0), (0, 4)))]


def entry(fqn, shape, chunks, dtype=torch.float32):
    return TensorEntry(fqn, shape, dtype, tuple(
        Chunk(f"__{i}_0.distcp", 0, 10**6, o, s) for i, (o, s) in enumerate(chunks)))


def test_plan_box_reads_only_intersecting_chunks():
    src = source_view(entry("w", (6, 4), [((0, 0), (2, 4)), ((2, 0), (3, 4)), ((5, 0), (1, 4))]))
    reads = plan_box(identity_target(src), Box((1, 0), (3, 4)), {"w": src})
    assert [(r.chunk.file, [(x.src, x.dst, x.length) for x in r.runs]) for r in reads] == [
        ("__0_0.distcp", [(4, 0, 4)]), ("__1_0.distcp", [(0, 4, 8)])]


def test_plan_box_reads_chunks_in_saved_order():
    src = source_view(entry("w", (6, 4), [((3, 0), (3, 4)), ((0, 0), (3, 4))]))
    reads = plan_box(identity_target(src), Box((1, 0), (4, 4)), {"w": src})
    assert [(r.chunk.file, [(x.src, x.dst, x.length) for x in r.runs]) for r in reads] == [
        ("__0_0.distcp", [(0, 8, 8)]), ("__1_0.distcp", [(4, 0, 8)])]


def test_plan_box_translates_pieces():
    # component rows 2..3 of a fused [6, 2] source become rows 0..1 of a [2, 2] target
    src = source_view(entry("fused", (6, 2), [((0, 0), (6, 2))]))
    target = TargetTensor("w", (2, 2), torch.float32, (Piece("fused", (2, 0), (0, 0), (2, 2)),))
    reads = plan_box(target, Box((0, 0), (2, 2)), {"fused": src})
    assert [(x.src, x.dst, x.length) for x in reads[0].runs] == [(4, 0, 4)]


def test_flat_source_takes_param_shape():
    src = source_view(entry("s", (30,), [((0,), (7,)), ((7,), (13,)), ((20,), (10,))]), (5, 6))
    assert src.shape == (5, 6)
    assert [region for _, region in src.chunks] == [FlatRange(0, 7), FlatRange(7, 13), FlatRange(20, 10)]
    reads = plan_box(identity_target(src), Box((1, 0), (2, 6)), {"s": src})
    assert [[(x.src, x.dst, x.length) for x in r.runs] for r in reads] == [[(6, 0, 1)], [(0, 1, 11)]]


@st.composite
def row_plan_case(draw):
    """A source saved in whole-row chunks (any order, gaps, overlaps, empty ones), a target made of
    row blocks of it (or one N-D block), and an output box of whole rows or any N-D box."""
    trailing = tuple(draw(st.lists(st.integers(0, 3), max_size=2)))
    rows = draw(st.integers(1, 12))
    cuts = draw(st.lists(st.tuples(st.integers(0, rows), st.integers(0, rows)), max_size=6))
    zeros = (0,) * len(trailing)
    src = source_view(entry("s", (rows, *trailing), [((min(a, b), *zeros), (abs(a - b), *trailing)) for a, b in cuts]))
    width = draw(st.integers(1, rows))
    target_rows = draw(st.integers(width, 2 * rows))
    shape = (target_rows, *trailing)
    src_row, dst_row = draw(st.integers(0, rows - width)), draw(st.integers(0, target_rows - width))
    pieces = [Piece("s", (src_row, *zeros), (dst_row, *zeros), (width, *trailing))]
    if trailing and all(trailing) and draw(st.booleans()):
        block = draw(box_in(shape))
        pieces.append(Piece("s", block.offsets, block.offsets, block.sizes))
    target = TargetTensor("t", shape, torch.float32, tuple(pieces))
    if 0 not in shape and draw(st.booleans()):
        box = draw(box_in(shape))
    else:
        lo = draw(st.integers(0, target_rows))
        box = rows_box(shape, lo, draw(st.integers(lo, target_rows)))
    return target, box, src


@settings(max_examples=500, deadline=None)
@given(row_plan_case())
def test_whole_row_fast_path_plans_the_general_paths_runs(case):
    target, box, src = case
    assert src.whole_rows is not None
    fast = plan_box(target, box, {"s": src})
    with mock.patch.object(SourceTensor, "whole_rows", property(lambda self: None)):  # the general path only
        general = plan_box(target, box, {"s": src})
    assert fast == general


def test_sources_with_any_partial_row_chunk_take_the_general_path():
    assert source_view(entry("w", (6, 4), [((0, 0), (6, 2)), ((0, 2), (6, 2))])).whole_rows is None
    assert source_view(entry("s", (24,), [((0,), (7,)), ((7,), (17,))]), (6, 4)).whole_rows is None
    assert source_view(entry("w", (6, 4), [((0, 0), (2, 4)), ((2, 0), (4, 4))])).whole_rows == ((4,), 4)


@st.composite
def boxes_in(draw, shape: tuple[int, ...]) -> Box:
    offsets = tuple(draw(st.integers(0, d)) for d in shape)
    return Box(offsets, tuple(draw(st.integers(0, d - o)) for d, o in zip(shape, offsets)))


@settings(max_examples=300, deadline=None)
@given(st.lists(boxes_in((7, 5, 3)), max_size=7))
def test_union_volume_counts_every_covered_element_once(boxes):
    covered = set()
    for b in boxes:
        covered.update(itertools.product(*(range(o, o + n) for o, n in zip(b.offsets, b.sizes))))
    assert union_volume(boxes) == len(covered)


@st.composite
def stack_grids(draw):
    """A stack [L, R, T] (depth 1) or [L, E, R, T] (depth 2) cut into a grid of chunks on any of
    its stacked dims (each cut in up to three parts), its trailing dim whole."""
    depth = draw(st.sampled_from((1, 2)))
    lead = tuple(draw(st.integers(1, 4)) for _ in range(depth + 1))
    shape = (*lead, draw(st.integers(1, 3)))
    cuts = []
    for n in lead:
        inner = sorted(draw(st.sets(st.integers(1, n - 1), max_size=2))) if n > 1 else []
        edges = [0, *inner, n]
        cuts.append([(a, b - a) for a, b in zip(edges, edges[1:])])
    boxes = [Box((*(o for o, _ in pick), 0), (*(n for _, n in pick), shape[-1])) for pick in itertools.product(*cuts)]
    return depth, shape, boxes


@settings(max_examples=200, deadline=None)
@given(stack_grids())
def test_a_stack_read_slab_by_slab_pairs_each_chunk_with_the_rows_it_holds(grid):
    """Every (chunk, region) of the view is the chunk's elements: a box of the [L·R, T] rows, or
    (a chunk cut inside several slabs) a flat range read from element `skip` of the chunk; the
    regions tile the view exactly once."""
    depth, shape, boxes = grid
    full = torch.arange(math.prod(shape)).reshape(shape)
    chunks = tuple(Chunk("__0_0.distcp", 0, 1, b.offsets, b.sizes) for b in boxes)
    view = layer_stacked_view(TensorEntry("stack", shape, float32, chunks), depth)
    flat = full.reshape(view.shape).reshape(-1)
    seen = torch.zeros(flat.numel(), dtype=torch.int64)
    for chunk, region in view.chunks:
        held = full[tuple(slice(o, o + n) for o, n in zip(chunk.offsets, chunk.sizes))].reshape(-1)
        if isinstance(region, FlatRange):
            assert torch.equal(held[region.skip:region.skip + region.length], flat[region.start:region.end])
            seen[region.start:region.end] += 1
        else:
            part = full.reshape(view.shape)[tuple(slice(o, o + n) for o, n in zip(region.offsets, region.sizes))]
            assert torch.equal(held, part.reshape(-1))
            seen.view(view.shape)[tuple(slice(o, o + n) for o, n in zip(region.offsets, region.sizes))] += 1
    assert bool((seen == 1).all())


def test_a_stack_chunk_cut_inside_several_slabs_plans_each_slabs_rows_from_its_place():
    """torchtitan experts [E, F, D] under EP with FSDP `Shard(1)`: a chunk two experts deep and
    half of F wide holds rows 0..8 of each expert; expert 1's rows come from its element 32."""
    chunks = tuple(Chunk(f"__{r}_0.distcp", 0, 1, (0, 8 * r, 0), (2, 8, 4)) for r in range(2))
    entry = TensorEntry("layers.0.moe.routed_experts.inner_experts.w1_EFD", (2, 16, 4), float32, chunks)
    view = layer_stacked_view(entry)
    assert [(c.offsets, region) for c, region in view.chunks] == [
        ((0, 0, 0), FlatRange(0, 32, 0)), ((0, 0, 0), FlatRange(64, 32, 32)),
        ((0, 8, 0), FlatRange(32, 32, 0)), ((0, 8, 0), FlatRange(96, 32, 32))]
    expert1 = TargetTensor("e1", (16, 4), float32, (Piece(entry.fqn, (16, 0), (0, 0), (16, 4)),))
    reads = plan_box(expert1, Box((0, 0), (16, 4)), {entry.fqn: view})
    assert [(r.chunk.offsets, [(run.src, run.dst, run.length) for run in r.runs]) for r in reads] == [
        ((0, 0, 0), [(32, 0, 32)]), ((0, 8, 0), [(32, 32, 32)])]
    whole_slabs = TensorEntry(entry.fqn, (2, 16, 4), float32,
                              tuple(Chunk(f"__{r}_0.distcp", 0, 1, (r, 0, 0), (1, 16, 4)) for r in range(2)))
    assert [region for _, region in layer_stacked_view(whole_slabs).chunks] == [
        Box((0, 0), (16, 4)), Box((16, 0), (16, 4))]


def test_a_stack_chunk_cut_inside_several_slabs_and_its_rows_is_refused_by_name():
    chunks = tuple(Chunk(f"__{r}_0.distcp", 0, 1, (0, 8 * (r // 2), 2 * (r % 2)), (2, 8, 2)) for r in range(4))
    entry = TensorEntry("w1_EFD", (2, 16, 4), float32, chunks)
    with pytest.raises(CheckpointError) as caught:
        layer_stacked_view(entry)
    assert str(caught.value) == ("w1_EFD: a chunk at [0, 0, 0] of [2, 8, 2] cuts dim 1 inside 2 slabs of the "
                                 "stack and its rows too, which ckptctl cannot read slab by slab yet")
