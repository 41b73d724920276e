"""Megatron-aware reshard planning checked in memory: row maps on real tensors, flat targets, names, options."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptctl.util.errors import UsageError
from ckptctl.formats.dcp.metadata import open_checkpoint
from ckptctl.core.geometry import Box, FlatRange
from ckptctl.formats.megatron_args import checkpoint_args
from ckptctl.families.registry import fused_component, fused_kind, megatron_tp_kind
from ckptctl.megatron.tp import resolve_tp
from ckptctl.planners.megatron_fsdp import (
    MegatronRequest,
    fuse_regroup,
    group_meta_renames,
    model_dims,
    reblock_regroup,
    renamed_path,
    resolve_layout,
    split_regroup,
)
from ckptctl.core.checkpoint import Chunk
from ckptctl.core.plan import Piece, SourceTensor, TargetTensor, plan_box
from ckptctl.commands.reshard import ReshardOptions, plan_reshard, reshard
from fixtures import megatron_components as mc
from tests.conftest import FIXTURES


def apply(group, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Execute a regroup's row maps on in-memory tensors (rows no block writes stay NaN)."""
    out = {}
    for j, target in enumerate(group.targets):
        first = tensors[group.sources[0]]
        built = torch.full((group.rows[j], *first.shape[1:]), float("nan"))
        for i, b in group.blocks[j]:
            built[b.dst_row: b.dst_row + b.rows] = tensors[group.sources[i]][b.src_row: b.src_row + b.rows]
        out[target] = built
    return out


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(1, 3), min_size=1, max_size=6), st.sampled_from([1, 2, 4]), st.sampled_from([1, 2, 4]))
def test_split_fuse_and_reblock_row_maps_match_megatron_tp_blocking(units, source_tp, target_tp):
    rows = [u * 4 for u in units]
    comps = [torch.randn(r, 3) for r in rows]
    parts = tuple(f".c{i}" for i in range(len(rows)))
    fused = mc.fuse_tp_blocked(comps, source_tp)
    split = apply(split_regroup("f", parts, rows, source_tp), {"f": fused})
    assert all(torch.equal(split["f" + p], c) for p, c in zip(parts, comps))
    refused = apply(fuse_regroup("f", parts, rows, target_tp), {"f" + p: c for p, c in zip(parts, comps)})
    assert torch.equal(refused["f"], mc.fuse_tp_blocked(comps, target_tp))
    reblocked = apply(reblock_regroup("f", rows, source_tp, target_tp), {"f": fused})
    assert torch.equal(reblocked["f"], mc.fuse_tp_blocked(comps, target_tp))


def test_split_of_a_component_that_does_not_divide_by_tp_is_refused():
    with pytest.raises(UsageError, match="6 rows cannot be split over TP 4"):
        split_regroup("f", ("_w", "_v"), (6, 6), 4)


@st.composite
def flat_case(draw):
    shape = tuple(draw(st.lists(st.integers(1, 5), min_size=2, max_size=3)))
    n = math.prod(shape)
    cuts = sorted(set(draw(st.lists(st.integers(0, n if draw(st.booleans()) else shape[0]), max_size=4))))
    flat_source = draw(st.booleans())
    end = n if flat_source else shape[0]
    points = [0, *[c for c in cuts if 0 < c < end], end]
    start = draw(st.integers(0, n - 1))
    return shape, flat_source, list(zip(points, points[1:])), start, draw(st.integers(start + 1, n))


@settings(max_examples=200, deadline=None)
@given(flat_case())
def test_a_flat_target_is_planned_from_row_boxes_and_flat_ranges_alike(case):
    shape, flat_source, cuts, start, stop = case
    grid = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
    row = math.prod(shape[1:])
    chunks, data = [], {}
    for i, (a, b) in enumerate(cuts):
        region = FlatRange(a, b - a) if flat_source else Box((a, *(0 for _ in shape[1:])), (b - a, *shape[1:]))
        chunk = Chunk(f"c{i}", 0, 0, (a,) if flat_source else region.offsets, (b - a,) if flat_source else region.sizes)
        chunks.append((chunk, region))
        data[chunk.file] = grid.reshape(-1)[a: b] if flat_source else grid.reshape(-1)[a * row: b * row]
    source = SourceTensor("s", shape, torch.float32, tuple(chunks))
    zero = tuple(0 for _ in shape)
    target = TargetTensor("t", (math.prod(shape),), torch.float32, (Piece("s", zero, zero, shape),),
                          logical_shape=shape)
    out = torch.full((stop - start,), float("nan"))
    for read in plan_box(target, Box((start,), (stop - start,)), {"s": source}):
        for r in read.runs:
            out[r.dst: r.dst + r.length] = data[read.chunk.file][r.src: r.src + r.length]
    assert torch.equal(out, grid.reshape(-1)[start:stop])


def test_fused_tensor_names_and_their_saved_components():
    assert fused_kind("model.module.decoder.layers.3.mlp.linear_fc1.weight") == "swiglu"
    assert fused_kind("decoder.layers.3.mlp.experts.linear_fc1.weight12") == "swiglu"
    assert fused_kind("decoder.layers.3.mlp.experts.local_experts.1.linear_fc1.bias") == "swiglu"
    assert fused_kind("decoder.layers.0.self_attention.conv1d.bias") == "gdn_conv1d"
    assert fused_kind("decoder.layers.0.mixer.in_proj.weight") == "mamba_in_proj"
    assert fused_kind("decoder.layers.0.mixer.conv1d.bias") == "mamba_conv1d"
    assert fused_kind("decoder.layers.0.mixer.in_proj.x_proj") is None
    assert fused_kind("decoder.layers.0.mlp.linear_fc1.layer_norm_weight") is None
    assert fused_component("decoder.layers.3.mlp.experts.linear_fc1.weight3_v") == (
        "decoder.layers.3.mlp.experts.linear_fc1.weight3", "swiglu", 1)
    assert fused_component("module.decoder.layers.0.self_attention.in_proj.weight.beta") == (
        "module.decoder.layers.0.self_attention.in_proj.weight", "gdn_in_proj", 4)
    assert fused_component("decoder.layers.0.mixer.in_proj.weight.dt") == (
        "decoder.layers.0.mixer.in_proj.weight", "mamba_in_proj", 4)
    assert fused_component("decoder.layers.0.mlp.linear_fc1.weight") is None
    assert fused_component("x.mlp.linear_fc1.weight_w") is None  # not a Megatron layer name


@pytest.mark.parametrize("name, kind", [
    ("model.module.decoder.layers.7.self_attention.linear_qkv.weight", "column"),
    ("decoder.layers.0.self_attention.linear_proj.weight", "row"),
    ("decoder.layers.0.mlp.experts.linear_fc2.weight15", "row"),
    ("decoder.layers.0.mlp.experts.local_experts.3.linear_fc2.weight", "row"),
    ("decoder.layers.2.mlp.router.weight", "replicated"),
    ("decoder.layers.2.self_attention.out_norm.weight", "replicated"),
    ("decoder.layers.2.self_attention.A_log", "column"),
    ("embedding.word_embeddings.weight", "column"),
    ("output_layer.weight", "column"),
    ("decoder.layers.0.mlp.linear_fc1.weight_v", "column"),
    ("decoder.layers.0.self_attention.linear_qkv.layer_norm_bias", "replicated"),
    ("decoder.layers.1.self_attention.linear_q_up_proj.layer_norm_bias", "replicated"),
    ("decoder.layers.1.self_attention.linear_kv_up_proj.layer_norm_bias", "replicated"),
    ("decoder.layers.0.mixer.in_proj.weight", "mamba_in_proj"),
    ("decoder.layers.0.mixer.D", "column"),
    ("decoder.layers.0.mixer.x_proj.weight", None),
    ("decoder.layers.0.self_attention.linear_qkv.weight.extra", None),
    ("mtp.layers.0.transformer_layer.mlp.linear_fc1.weight", "swiglu"),
    ("mtp.layers.0.eh_proj.weight", "column"),
])
def test_megatron_tp_kinds_come_from_the_family_rules_and_unknown_names_have_none(name, kind):
    assert megatron_tp_kind(name) == kind


def test_planner_paths_are_renamed_at_the_param_element():
    old = "optimizer.state.module.decoder.fc1.weight.exp_avg"
    path = ("optimizer", "state", "module.decoder.fc1.weight", "exp_avg")
    assert renamed_path(path, old, "optimizer.state.module.decoder.fc1.weight_w.exp_avg", 8) == \
        ("optimizer", "state", "module.decoder.fc1.weight_w", "exp_avg")
    assert renamed_path(path, old, "optimizer.state.module.decoder.fc1.weight.query.exp_avg", 8) == \
        ("optimizer", "state", "module.decoder.fc1.weight.query", "exp_avg")
    assert renamed_path(("model", "module.x.weight_v"), "model.module.x.weight_v", "model.module.x.weight", 0) == \
        ("model", "module.x.weight")
    assert renamed_path(("odd",), "model.x", "model.x_w", 0) == ("model", "x_w")


def test_fuse_moves_group_meta_of_the_first_component_to_the_fused_name():
    group = fuse_regroup("model.module.d.mlp.linear_fc1.weight", ("_w", "_v"), (4, 4), 2)
    root = "optimizer.param_to_group_meta.module.d.mlp.linear_fc1.weight"
    names = [root + "_w.lr", root + "_v.lr", root + "_w.weight_decay", "optimizer.param_to_group_meta.module.x.lr"]
    assert group_meta_renames(names, [group]) == {root + "_w.lr": root + ".lr", root + "_v.lr": None,
                                                  root + "_w.weight_decay": root + ".weight_decay"}


@pytest.fixture(scope="module")
def noargs(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("units") / "noargs"
    mc.save_full(path, tp=2, with_args=False)
    return path


def test_model_dims_come_from_an_hf_config_folder_file_or_text_config(tmp_path, noargs):
    ckpt = open_checkpoint(noargs)
    assert model_dims(ckpt, None).swiglu is None and model_dims(ckpt, None).gdn is None
    (tmp_path / "config.json").write_text(json.dumps(mc.hf_config()))
    for ref in (tmp_path, tmp_path / "config.json"):
        dims = model_dims(ckpt, ref)
        assert dims.swiglu is True and dims.gdn.in_proj_rows == (4, 4, 8, 8, 4, 4) and dims.gdn.conv_rows == (4, 4, 8)
    nested = tmp_path / "vl.json"
    nested.write_text(json.dumps({"model_type": "qwen3_5", "text_config": {**mc.hf_config(), "hidden_act": "gelu"}}))
    dims = model_dims(ckpt, nested)
    assert dims.swiglu is False and dims.gdn.key_heads == mc.NK


def test_model_dims_come_from_the_checkpoint_args():
    dims = model_dims(open_checkpoint(FIXTURES / "megatron_tp2_dp2"), None)
    assert dims.swiglu is True and dims.gdn is None
    assert dims.not_found() == "they are not in the checkpoint's args"


def test_unsplit_rowparallel_chunks_never_contradict_args_and_are_not_trusted_strictly(tmp_path, noargs):
    mc.save_full(tmp_path / "args2", tp=2)
    with_args = open_checkpoint(tmp_path / "args2")
    assert resolve_tp(with_args, checkpoint_args(with_args), None) == 2
    ckpt = open_checkpoint(noargs)
    assert checkpoint_args(ckpt) is None
    assert resolve_tp(ckpt, None, None) == 1
    with pytest.raises(UsageError, match="pass --source-tp"):
        resolve_tp(ckpt, None, None, "--source-tp", strict=True)


def opts(**kw) -> ReshardOptions:
    return ReshardOptions(**{"world_size": None, **kw})


@pytest.mark.parametrize("kw,message", [
    ({"split_fused": True, "fuse": True, "tp": 2, "world_size": 2}, "--split-fused and --fuse are opposites"),
    ({"fuse": True, "world_size": 2}, "--fuse needs --tp"),
    ({"tp": 2}, "--world-size is required with --layout fsdp2"),
    ({"source_tp": 2, "world_size": 2}, "pass --tp (the target TP) or --split-fused"),
    ({"dp": 2, "world_size": 2}, "--dp applies to --layout megatron-fsdp only"),
    ({"layout": "megatron"}, "--layout must be one of fsdp2, megatron-fsdp, torch-dist"),
    ({"layout": "megatron-fsdp", "tp": 2}, "needs --dp"),
    ({"layout": "megatron-fsdp", "tp": 4, "world_size": 6}, "--world-size 6 is not a multiple of TP 4"),
    ({"layout": "megatron-fsdp", "tp": 0, "dp": 1}, "--tp must be at least 1"),
])
def test_option_combinations_that_cannot_work_are_refused(kw, message):
    ckpt = open_checkpoint(FIXTURES / "megatron_tp2_dp2")
    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(")", r"\)")):
        resolve_layout(ckpt, MegatronRequest.from_options(ckpt, opts(**kw)))


def test_megatron_fsdp_layout_defaults_to_the_source_tp_and_world_size_over_tp():
    ckpt = open_checkpoint(FIXTURES / "megatron_tp2_dp2")
    layout = resolve_layout(ckpt, MegatronRequest.from_options(ckpt, opts(layout="megatron-fsdp", world_size=8)))
    assert (layout.tp, layout.dp, layout.world_size) == (2, 4, 8)
    assert not opts(world_size=2).megatron and opts(world_size=2, flat_optimizer=True).megatron


def test_fuse_refuses_a_missing_component(tmp_path):
    reshard(FIXTURES / "megatron_tp2_dp2", tmp_path / "no_v",
            ReshardOptions(world_size=1, exclude=["*weight_v*"], device="cpu"))
    with pytest.raises(UsageError, match="component model.module.decoder.layers.0.mlp.linear_fc1.weight_v is missing"):
        plan_reshard(open_checkpoint(tmp_path / "no_v"), opts(fuse=True, tp=2, world_size=2))


def test_experts_blocked_for_another_expert_tp_are_refused(tmp_path):
    mc.save_full(tmp_path / "etp1", tp=2, expert_tensor_parallel_size=1)
    with pytest.raises(UsageError, match="experts are blocked for expert TP 1, not TP 2"):
        plan_reshard(open_checkpoint(tmp_path / "etp1"), opts(split_fused=True, world_size=2))


def test_gdn_dims_that_do_not_match_the_saved_rows_are_refused(tmp_path, noargs):
    (tmp_path / "config.json").write_text(json.dumps({**mc.hf_config(), "linear_num_value_heads": 2}))
    with pytest.raises(UsageError, match=r"in_proj.weight: has 32 rows but the GDN dims from --hf-config .* give "
                                         r"4 \+ 4 \+ 4 \+ 4 \+ 2 \+ 2 = 20"):
        plan_reshard(open_checkpoint(noargs), opts(split_fused=True, source_tp=2, world_size=1, hf_config=tmp_path))


def test_converting_to_torch_dist_refuses_what_it_cannot_name(tmp_path):
    """`--layout torch-dist` (fsdp_dtensor → torch_dist) names the model's norms by its spec, and
    converts only what it knows: each refusal is one line, and nothing is written."""
    from tests.conftest import ROOT, run_cli

    def refused(src, *options) -> str:
        run = run_cli("reshard", src, tmp_path / "o", "--layout", "torch-dist", *options)
        assert run.returncode == 2 and not (tmp_path / "o").exists(), run.stderr
        return run.stderr

    fsdp = ROOT / "fixtures" / "data" / "megatron_tp2_dp2"
    assert refused(fsdp) == (f"ckptctl: error: {fsdp}: args.transformer_impl is None: the torch_dist names of the "
                             "model's norms are known for 'local' and 'transformer_engine' only\n")
    gdn = tmp_path / "gdn"
    mc.save_full(gdn, tp=1, transformer_impl="local")
    assert refused(gdn) == (f"ckptctl: error: {gdn}: optimizer.param_to_group_meta has no settings for "
                            "decoder.final_layernorm.weight (26 params lack them)\n")
    assert refused(gdn, "--tp", "2") == ("ckptctl: error: --layout torch-dist writes the whole checkpoint as "
                                         "megatron-core's torch_dist, which megatron-core loads at any TP and DP: "
                                         "pass at most --world-size (the number of files)\n")
    plain = ROOT / "fixtures" / "data" / "fsdp2_4ranks"
    assert refused(plain) == (f"ckptctl: error: {plain}: no Megatron args item: not a Megatron-FSDP fsdp_dtensor "
                              "checkpoint (the model spec and dtype are unknown)\n")


def test_a_split_params_tp_block_is_each_parts_block_in_turn():
    """GDN's `in_proj` at TP 2, saved as six parts: TP rank 1's block is 52 rows ([q_1; k_1; v_1;
    z_1; β_1; α_1] of 8, 8, 16, 16, 2, 2 rows), each part's rows going to rows 1 of its own key."""
    from ckptctl.util.errors import CheckpointError
    from ckptctl.megatron.buckets import GDN_IN_PROJ, LocalParam, Window, keyed_places, local_shape
    from ckptctl.core.checkpoint import Checkpoint, TensorEntry

    key = "decoder.layers.0.self_attention.in_proj.weight"
    rows = dict(query=16, key=16, value=32, z=32, beta=4, alpha=4)
    ckpt = Checkpoint(Path("c"), {f"{key}.{p}": TensorEntry(f"{key}.{p}", (n, 32), "float32", ())
                                  for p, n in rows.items()}, {}, {})
    param = LocalParam(key, (), GDN_IN_PROJ, 0)
    assert local_shape(ckpt, param, 2) == (52, 32)
    window = Window(param, 1, 2, (52, 32), 0, 52 * 32, {})
    assert keyed_places(ckpt, window) == [
        (f"{key}.query", (0, 0), (8, 0), (8, 32)), (f"{key}.key", (8, 0), (8, 0), (8, 32)),
        (f"{key}.value", (16, 0), (16, 0), (16, 32)), (f"{key}.z", (32, 0), (16, 0), (16, 32)),
        (f"{key}.beta", (48, 0), (2, 0), (2, 32)), (f"{key}.alpha", (50, 0), (2, 0), (2, 32))]
    with pytest.raises(CheckpointError, match=rf"^{key}.beta: dim 0 of \[4, 32\] does not divide by TP 8$"):
        local_shape(ckpt, param, 8)
    ckpt.tensors[f"{key}.z"] = TensorEntry(f"{key}.z", (32, 16), "float32", ())
    with pytest.raises(CheckpointError, match=r"in_proj.weight: parts \('query', .*\) of shapes \[\[16, 32\], "
                                              r"\[16, 32\], \[32, 32\], \[32, 16\], \[4, 32\], \[4, 32\]\] "
                                              r"do not stack as rows$"):
        local_shape(ckpt, param, 2)


def test_a_single_grouped_weights_slabs_are_the_next_expert_of_one_key_and_layer():
    """Transformer Engine ≥ 2.14's single grouped weight: a bucket holds expert e + 1's block of a
    key right after expert e's, in one layer; nothing else continues a param unpadded."""
    from ckptctl.megatron.buckets import COLUMN, ROW, LocalParam, grouped_next

    fc1 = "decoder.layers.mlp.experts.experts.linear_fc1.weight"
    fc2 = "decoder.layers.mlp.experts.experts.linear_fc2.weight"
    assert grouped_next(LocalParam(fc1, (1, 2), COLUMN, 1), LocalParam(fc1, (1, 3), COLUMN, 1))
    assert not grouped_next(LocalParam(fc1, (1, 3), COLUMN, 1), LocalParam(fc1, (1, 2), COLUMN, 1))  # per-GEMM order
    assert not grouped_next(LocalParam(fc1, (1, 2), COLUMN, 1), LocalParam(fc1, (2, 3), COLUMN, 2))  # another layer
    assert not grouped_next(LocalParam(fc1, (1, 2), COLUMN, 1), LocalParam(fc2, (1, 3), ROW, 1))  # another key
    dense = "decoder.layers.mlp.linear_fc1.weight"
    assert not grouped_next(LocalParam(dense, (1,), COLUMN, 1), LocalParam(dense, (2,), COLUMN, 2))  # not experts
