"""Pure planning: copy runs, FSDP2 placement and DCP file layout, checked without disk."""

from __future__ import annotations

import itertools
import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptctl.geometry import Box, FlatRange, chunk_rows, copy_runs, region_bounds, union_volume
from ckptctl.model import Chunk, TensorEntry
from ckptctl.placement import Placed, fsdp2
from ckptctl.plan import Piece, TargetTensor, identity_target, plan_box, source_view


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
