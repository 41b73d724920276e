"""Layout labels, coverage and cross-entry checks of `ckptctl.core.analysis`, on in-memory checkpoints."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptctl.core.analysis import (
    Coverage,
    Prefixes,
    StateName,
    analyze,
    classify_layout,
    coverage,
    find_param,
    is_layer_stacked,
    split_optimizer_fqn,
)
from ckptctl.core.geometry import Box
from ckptctl.core.checkpoint import BytesEntry, Checkpoint, Chunk, TensorEntry

Boxes = list[tuple[tuple[int, ...], tuple[int, ...]]]


def entry(fqn: str, shape: tuple[int, ...], boxes: Boxes) -> TensorEntry:
    chunks = tuple(Chunk(f"__{i}_0.distcp", 0, 0, offsets, sizes) for i, (offsets, sizes) in enumerate(boxes))
    return TensorEntry(fqn, shape, torch.float32, chunks)


def whole(fqn: str, shape: tuple[int, ...]) -> TensorEntry:
    return entry(fqn, shape, [((0,) * len(shape), shape)])


def rows(fqn: str, shape: tuple[int, ...], cuts: list[tuple[int, int]]) -> TensorEntry:
    """Whole-row chunks [start, stop) of dim 0."""
    rest = shape[1:]
    return entry(fqn, shape, [((a, *(0,) * len(rest)), (b - a, *rest)) for a, b in cuts])


def checkpoint(*entries: TensorEntry, bytes_names: tuple[str, ...] = ()) -> Checkpoint:
    return Checkpoint(
        path=Path("in-memory"),
        tensors={e.fqn: e for e in entries},
        bytes_entries={n: BytesEntry(n, "__0_0.distcp", 0, 1) for n in bytes_names},
        files={"__0_0.distcp": 1, "__1_0.distcp": 1},
    )


# --- layout labels -------------------------------------------------------------------------


def test_a_torch_dist_layer_stack_is_chunked_by_layer_or_by_whole_layers() -> None:
    """megatron-core saves a chunk per layer (and TP rank); a converter may save the stack whole or in
    runs of whole layers. A chunk cutting the rows of several layers cannot be read layer by layer."""
    name, shape = "decoder.layers.mlp.linear_fc2.weight", (4, 6, 8)
    assert is_layer_stacked(entry(name, shape, [((layer, 0, c), (1, 6, 4)) for layer in range(4) for c in (0, 4)]))
    assert is_layer_stacked(whole(name, shape))
    assert is_layer_stacked(rows(name, shape, [(0, 3), (3, 4)]))
    assert not is_layer_stacked(entry(name, shape, [((0, 0, 0), (4, 3, 8)), ((0, 3, 0), (4, 3, 8))]))
    assert not is_layer_stacked(whole("decoder.layers.0.mlp.linear_fc2.weight", shape))
    assert is_layer_stacked(rows("decoder.layers.mlp.router.expert_bias", (4,), [(0, 1), (1, 4)])) is False


def test_scalar_and_empty_tensors_get_their_own_labels() -> None:
    assert classify_layout(whole("step", ())) == ("scalar", None)
    assert classify_layout(entry("e", (0, 4), [((0, 0), (0, 4))])) == ("empty", None)


def test_one_chunk_is_single_even_beside_zero_size_chunks() -> None:
    assert classify_layout(whole("w", (4, 8))) == ("single", None)
    assert classify_layout(rows("w", (4, 8), [(0, 4), (4, 4)])) == ("single", None)


@pytest.mark.parametrize("n_rows, cuts", [
    (10, [(0, 3), (3, 6), (6, 9), (9, 10)]),           # torch.chunk(10, 4)
    (12, [(0, 6), (6, 12)]),
    (2, [(0, 1), (1, 2), (2, 2), (2, 2)]),              # trailing ranks own nothing: zero-size chunks at rows
    (5, [(0, 2), (2, 4), (4, 5)]),                     # torch.chunk(5, 4) has only 3 non-empty parts
])
def test_torch_chunk_row_cuts_are_shard0_even(n_rows: int, cuts: list[tuple[int, int]]) -> None:
    assert classify_layout(rows("w", (n_rows, 8), cuts)) == ("shard0-even", None)


def test_shard0_even_is_recognised_whatever_the_chunk_order() -> None:
    assert classify_layout(rows("w", (12, 8), [(6, 9), (0, 3), (9, 12), (3, 6)])) == ("shard0-even", None)


@pytest.mark.parametrize("n_rows, cuts", [
    (10, [(0, 3), (3, 6), (6, 10)]),                   # last part too big for torch.chunk
    (6, [(0, 4), (4, 6)]),                             # ceil(6/N) is never 4
    (8, [(0, 3), (3, 5)] + [(5, 8)]),                  # Megatron gathered offsets
    (8, [(0, 5), (3, 8)]),                             # whole rows but overlapping
])
def test_whole_row_cuts_not_from_torch_chunk_are_rows_uneven(n_rows: int, cuts: list[tuple[int, int]]) -> None:
    assert classify_layout(rows("w", (n_rows, 8), cuts)) == ("rows-uneven", None)


def test_one_dimensional_uneven_split_is_rows_uneven() -> None:
    assert classify_layout(rows("b", (8,), [(0, 3), (3, 8)])) == ("rows-uneven", None)


def test_splits_on_dim_one_are_a_grid_or_shard1_with_their_column_blocks() -> None:
    grid = entry("proj", (8, 8), [((0, 0), (7, 4)), ((0, 4), (7, 4)), ((7, 0), (1, 4)), ((7, 4), (1, 4))])
    assert classify_layout(grid) == ("grid", 2)
    four_way = entry("proj", (4, 8), [((0, c), (4, 2)) for c in (0, 2, 4, 6)])
    assert classify_layout(four_way) == ("shard1", 4)


def test_boxes_fitting_no_scheme_are_irregular() -> None:
    ragged_columns = entry("w", (4, 8), [((0, 0), (2, 4)), ((2, 0), (2, 3)), ((0, 4), (2, 4)), ((2, 3), (2, 5))])
    assert classify_layout(ragged_columns) == ("irregular", None)
    split_dim2 = entry("w", (2, 2, 4), [((0, 0, 0), (2, 2, 2)), ((0, 0, 2), (2, 2, 2))])
    assert classify_layout(split_dim2) == ("irregular", None)


def test_flat_state_needs_an_n_d_param_of_the_same_numel() -> None:
    state = rows("optim.state.w.exp_avg", (12,), [(0, 5), (5, 12)])
    assert classify_layout(state, whole("model.w", (4, 3))) == ("flat", None)
    assert classify_layout(state, whole("model.w", (12,))) == ("rows-uneven", None)
    assert classify_layout(state, whole("model.w", (4, 4))) == ("rows-uneven", None)


# --- coverage ------------------------------------------------------------------------------


def test_full_coverage_is_complete() -> None:
    assert coverage(rows("w", (10, 8), [(0, 3), (3, 6), (6, 9), (9, 10), (10, 10)])) == Coverage("complete", 80, 0, 0)


def test_missing_rows_are_counted_as_gaps() -> None:
    assert coverage(rows("w", (4, 8), [(0, 1), (3, 4)])) == Coverage("gaps", 16, 16, 0)


def test_doubly_saved_elements_are_counted_as_overlaps() -> None:
    assert coverage(rows("w", (4, 8), [(0, 3), (2, 4)])) == Coverage("overlaps", 32, 0, 8)


def test_gaps_and_overlaps_together() -> None:
    grid = entry("w", (4, 4), [((0, 0), (2, 3)), ((1, 1), (2, 2))])   # 6 + 4 elements, 2 shared
    assert coverage(grid) == Coverage("gaps+overlaps", 8, 8, 2)


def test_scalar_and_empty_coverage() -> None:
    assert coverage(whole("step", ())) == Coverage("complete", 1, 0, 0)
    assert coverage(entry("step", (), [])) == Coverage("gaps", 0, 1, 0)
    assert coverage(entry("e", (0, 4), [((0, 0), (0, 4))])) == Coverage("complete", 0, 0, 0)


def _boxes_in(shape: tuple[int, ...]) -> st.SearchStrategy:
    def box(draw_dims: list[tuple[int, int]]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return tuple(a for a, _ in draw_dims), tuple(b for _, b in draw_dims)

    dims = [st.integers(0, d).flatmap(lambda o, d=d: st.tuples(st.just(o), st.integers(0, d - o))) for d in shape]
    return st.lists(st.tuples(*dims).map(box), max_size=6)


@st.composite
def _shape_and_boxes(draw: st.DrawFn) -> tuple[tuple[int, ...], Boxes]:
    shape = tuple(draw(st.lists(st.integers(1, 5), min_size=1, max_size=3)))
    return shape, draw(_boxes_in(shape))


@settings(max_examples=200, deadline=None)
@given(_shape_and_boxes())
def test_coverage_matches_a_brute_force_mask(case: tuple[tuple[int, ...], Boxes]) -> None:
    shape, boxes = case
    mask = torch.zeros(shape, dtype=torch.int64)
    for offsets, sizes in boxes:
        mask[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))] += 1
    covered = int((mask > 0).sum())
    got = coverage(entry("w", shape, boxes))
    assert (got.covered, got.gaps, got.overlaps) == (covered, math.prod(shape) - covered, int(mask.sum()) - covered)
    assert got.complete == (covered == math.prod(shape) and int(mask.sum()) == covered)


# --- names ---------------------------------------------------------------------------------


@pytest.mark.parametrize("fqn, expected", [
    ("optim.state.layers.0.weight.exp_avg", StateName("optim.state.", "layers.0.weight", "exp_avg")),
    ("optimizer.state.module.decoder.x.weight.exp_avg_sq",
     StateName("optimizer.state.module.", "decoder.x.weight", "exp_avg_sq")),
    ("optimizer.state.module.module.w.step", StateName("optimizer.state.module.module.", "w", "step")),
    ("optim.state.w.momentum_buffer", StateName("optim.state.", "w", "momentum_buffer")),
    ("optim.param_groups.0.lr", None),
    ("model.layers.0.weight", None),
    ("optim.state.exp_avg", None),
])
def test_split_optimizer_fqn(fqn: str, expected: StateName | None) -> None:
    assert split_optimizer_fqn(fqn) == expected


@pytest.mark.parametrize("model_key, optim_key", [
    ("model.w", "optim.state.w.exp_avg"),
    ("model.module.decoder.w", "optimizer.state.module.decoder.w.exp_avg"),
    ("model.module.module.decoder.w", "optimizer.state.module.decoder.w.exp_avg"),
    ("model.module.decoder.w", "optimizer.state.decoder.w.exp_avg"),
    ("decoder.w", "optimizer.state.module.decoder.w.exp_avg_sq"),
    ("model.w", "optim.state.w.step"),
])
def test_find_param_across_prefixes(model_key: str, optim_key: str) -> None:
    assert find_param({model_key, "model.other"}, optim_key) == model_key


def test_find_param_prefers_the_key_spelled_as_in_the_state() -> None:
    names = {"model.module.w", "model.w"}
    assert find_param(names, "optim.state.module.w.exp_avg") == "model.module.w"
    assert find_param(names, "optim.state.w.exp_avg") == "model.module.w"   # most specific model prefix first


def test_find_param_without_a_param_or_for_non_state_keys() -> None:
    ckpt = checkpoint(whole("model.w", (4,)))
    assert find_param(ckpt, "optim.state.v.exp_avg") is None
    assert find_param(ckpt, "optim.param_groups.0.lr") is None
    assert find_param(ckpt, "optim.state.w.exp_avg") == "model.w"


# --- analyze -------------------------------------------------------------------------------


PLAIN_BUG = ("optim.state.w.exp_avg: saved [2, 8] (16 elements) but param model.w is [4, 8] (32 elements): "
             "optimizer state was saved as a plain per-rank tensor and DCP kept one rank's copy (data loss)")


def test_plain_per_rank_optimizer_state_is_reported_as_data_loss() -> None:
    ckpt = checkpoint(
        rows("model.w", (4, 8), [(0, 2), (2, 4)]),
        whole("optim.state.w.exp_avg", (2, 8)),
        whole("optim.state.w.step", ()),
    )
    analysis = analyze(ckpt)
    problems = [(p.fqn, p.kind, p.message) for p in analysis.problems]
    assert problems == [("optim.state.w.exp_avg", "data-loss", PLAIN_BUG)]
    assert analysis.report("optim.state.w.exp_avg").param == "model.w"
    assert analysis.report("optim.state.w.step").layout == "scalar"


def test_step_is_one_number_whatever_its_shape() -> None:
    ckpt = checkpoint(whole("model.w", (4, 8)), whole("optim.state.w.step", (1,)), whole("optim.state.w.exp_avg", (1,)))
    assert [(p.fqn, p.kind) for p in analyze(ckpt).problems] == [("optim.state.w.exp_avg", "data-loss")]


def test_healthy_flat_state_has_no_problem() -> None:
    ckpt = checkpoint(
        rows("model.module.w", (4, 3), [(0, 1), (1, 4)]),
        rows("optimizer.state.module.w.exp_avg", (12,), [(0, 5), (5, 7), (7, 12)]),
    )
    analysis = analyze(ckpt)
    assert analysis.problems == []
    report = analysis.report("optimizer.state.module.w.exp_avg")
    assert (report.layout, report.param, report.group) == ("flat", "model.module.w", "optimizer")


def test_state_with_the_params_numel_in_another_n_d_shape_is_a_shape_mismatch() -> None:
    analysis = analyze(checkpoint(whole("model.w", (4, 8)), whole("optim.state.w.exp_avg", (8, 4))))
    assert [(p.kind, p.message) for p in analysis.problems] == [
        ("shape-mismatch", "optim.state.w.exp_avg: saved [8, 4] but param model.w is [4, 8]")]


def test_coverage_problems_carry_exact_counts() -> None:
    analysis = analyze(checkpoint(rows("model.a", (4, 8), [(0, 1), (3, 4)]), rows("model.b", (4, 8), [(0, 3), (2, 4)])))
    assert [(p.fqn, p.kind, p.message) for p in analysis.problems] == [
        ("model.a", "gaps", "model.a: chunks cover 16 of 32 elements (16 missing)"),
        ("model.b", "overlaps", "model.b: chunks overlap on 8 elements"),
    ]


def test_megatron_prefixes_groups_and_counts() -> None:
    ckpt = checkpoint(
        rows("model.module.decoder.w", (4, 8), [(0, 1), (1, 4)]),
        rows("model.module.decoder.b", (4,), [(0, 1), (1, 4)]),
        rows("optimizer.state.module.decoder.w.exp_avg", (32,), [(0, 9), (9, 32)]),
        whole("optimizer.state.module.decoder.w.step", ()),
        whole("rng_tracker", (4,)),
        bytes_names=("args", "iteration", "optimizer.param_to_group_meta.module.decoder.w.lr"),
    )
    analysis = analyze(ckpt)
    assert analysis.prefixes == Prefixes(("model.module.",), ("optimizer.state.module.",))
    assert analysis.groups == {"model": 2, "optimizer": 3, "other": 3}
    assert analysis.layouts == {"flat": 1, "rows-uneven": 2, "scalar": 1, "single": 1}
    assert analysis.dtypes == {"float32": 5}
    assert analysis.world_size == 2
    assert analysis.report("rng_tracker").group == "other"


def test_model_prefix_is_the_most_common_one() -> None:
    ckpt = checkpoint(whole("model.a", (2,)), whole("model.b", (2,)), whole("model.module.stray", (2,)))
    analysis = analyze(ckpt)
    assert analysis.prefixes == Prefixes(("model.", "model.module."), ())
    assert analysis.groups == {"model": 3, "optimizer": 0, "other": 0}


def test_unprefixed_model_keys() -> None:
    ckpt = checkpoint(whole("w", (2, 2)), whole("optim.state.w.exp_avg", (2, 2)))
    analysis = analyze(ckpt)
    assert analysis.prefixes == Prefixes(("",), ("optim.state.",))
    assert [r.group for r in analysis.reports] == ["model", "optimizer"]


def test_params_outside_the_model_prefix_still_count_as_model_when_the_optimizer_names_them() -> None:
    ckpt = checkpoint(whole("model.layers.0.w", (2, 2)), whole("model.layers.1.w", (2, 2)),
                      whole("lm_head.weight", (2, 2)), whole("extra", (1,)),
                      whole("optim.state.lm_head.weight.exp_avg", (2, 2)))
    groups = {r.fqn: r.group for r in analyze(ckpt).reports}
    assert groups == {"model.layers.0.w": "model", "model.layers.1.w": "model", "lm_head.weight": "model",
                      "extra": "other", "optim.state.lm_head.weight.exp_avg": "optimizer"}


@pytest.mark.parametrize("shape", ["1d", "2d"])
def test_300k_overlapping_one_element_wide_chunks_are_analysed_in_bounded_time(shape: str) -> None:
    """Chunk i starts at element i and runs to the end (on one dim, one element wide on the
    other): every slab of a sweep meets all earlier chunks, which cost minutes when each
    slab re-scanned them; the interval merge and the segment-tree sweep are n log n. The bound is
    on this process's CPU time, which other work on the machine does not stretch."""
    import time

    n = 300_000
    if shape == "1d":
        e = entry("t", (n,), [((i,), (n - i,)) for i in range(n)])
        want = Coverage("overlaps", n, 0, n * (n + 1) // 2 - n)
    else:
        e = entry("t", (n, n), [((i, i), (n - i, 1)) for i in range(n)] + [((0, 0), (n, n))])
        want = Coverage("overlaps", n * n, 0, n * (n + 1) // 2)
    start = time.process_time()
    assert coverage(e) == want
    assert time.process_time() - start <= 10.0


@pytest.mark.parametrize("name", ["broken_plain_optim", "megatron_tp2_dp2", "megatron_torch_dist"])
@pytest.mark.parametrize("workers", [2, 3])
def test_an_analysis_shared_out_among_workers_is_the_whole_analysis(fixture_ckpt, name, workers) -> None:
    """torchrun workers each analyse every K-th tensor (`engine.dist.shared_analysis`): put back
    together, reports and problems are those of one process, in the same order."""
    from ckptctl.formats.dcp.metadata import open_checkpoint
    from ckptctl.core.analysis import analyze, analyze_shares, shared_findings

    ckpt = open_checkpoint(fixture_ckpt(name))
    whole = analyze(ckpt)
    shares = [shared_findings(ckpt, rank, workers) for rank in range(workers)]
    assert sum(map(len, shares)) == len(ckpt.tensors) and all(shares)  # every tensor once, every worker some
    assert analyze_shares(ckpt, shares) == whole
    if name == "broken_plain_optim":
        assert [p.kind for p in whole.problems] == ["data-loss", "data-loss"]


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 12).flatmap(lambda n: st.tuples(st.just(n), st.lists(
    st.tuples(st.integers(0, n), st.integers(0, n)).map(sorted).map(tuple), min_size=1, max_size=6))))
def test_whole_row_coverage_counts_what_the_box_union_counts(case) -> None:
    """Whole-row chunks are covered and labelled from their row ranges; the counts are those of the
    exact union of their boxes, gaps and overlaps included."""
    from ckptctl.core.geometry import union_volume
    from ckptctl.core.analysis import whole_row_spans

    n_rows, cuts = case
    tensor = rows("w", (n_rows, 3), cuts)
    assert whole_row_spans(tensor) == sorted((a, b) for a, b in cuts if b > a)
    boxes = [Box(o, s) for o, s in tensor.boxes() if 0 not in s]
    covered = union_volume(boxes)
    assert coverage(tensor) == Coverage(coverage(tensor).status, covered, n_rows * 3 - covered,
                                        sum(b.numel for b in boxes) - covered)


def test_chunks_split_on_another_dim_have_no_row_spans() -> None:
    from ckptctl.core.analysis import whole_row_spans

    assert whole_row_spans(entry("w", (4, 3), [((0, 0), (4, 2)), ((0, 2), (4, 1))])) is None
    assert whole_row_spans(entry("w", (4, 3), [((0, 0), (4, 3))])) == [(0, 4)]
    assert whole_row_spans(entry("s", (), [((), ())])) is None
