"""Megatron-aware `ckptctl reshard`, run as a user would, on checkpoints built from known components.

The components (gate/up of every SwiGLU fc1, q/k/v/z/beta/alpha of GDN in_proj, q/k/v of
conv1d, and their exp_avg / exp_avg_sq) are generated first; the source is what a TP-2 ×
DP-2 Megatron-FSDP job saves from them with real gloo ranks (uneven DP cuts, flat 1-D
optimizer states cut mid-row). Every expectation comes from the components and torch's
own loaders (`dcp_to_torch_save`, `dcp.load` at the new world size), never from ckptctl.
One session builds the sources and runs the CLI commands (concurrently) once; the tests
read the results.
"""

from __future__ import annotations

import json
import math
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

from fixtures import megatron_components as mc
from fixtures.make_fixtures import load_with_torch, megatron_tp2_dp2_reference
from fixtures.megatron_layout import fuse_swiglu_tp_blocked
from tests.conftest import FIXTURES, run_cli

FC1 = "decoder.layers.0.mlp.linear_fc1.weight"
IN_PROJ = "decoder.layers.0.self_attention.in_proj.weight"


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for key, value in tree.items():
            out.update(flatten(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: tree}


def torch_load(path: Path) -> dict[str, Any]:
    """Every entry as torch's own offline loader (dcp_to_torch_save + torch.load) returns it."""
    return flatten(load_with_torch(path))


def key(which: str, name: str) -> str:
    return f"model.module.{name}" if which == "model" else f"optimizer.state.module.{name}.{which}"


def assert_values(loaded: dict[str, Any], ref: dict[str, dict[str, torch.Tensor]]) -> None:
    """Each reference tensor equals the loaded one bit for bit (a flat 1-D state seen in the param's shape)."""
    for which, tensors in ref.items():
        for name, want in tensors.items():
            got = loaded[key(which, name)]
            if got.shape != want.shape:
                assert got.dim() == 1 and got.numel() == want.numel(), key(which, name)
                got = got.reshape(want.shape)
            assert got.dtype == want.dtype and torch.equal(got, want), key(which, name)


def model_names(loaded: dict[str, Any]) -> set[str]:
    return {k[len("model.module."):] for k in loaded if k.startswith("model.module.")}


def ok(result) -> None:
    assert result.returncode == 0, result.stderr


def chunks_by_file(path: Path) -> tuple[dict[str, Any], dict[str, dict[str, set]]]:
    """torch's metadata, and for each tensor {file: {(offsets, sizes)}} of its chunks."""
    md = FileSystemReader(str(path)).read_metadata()
    out: dict[str, dict[str, set]] = {}
    for fqn, meta in md.state_dict_metadata.items():
        if isinstance(meta, TensorStorageMetadata):
            for c in meta.chunks:
                file = md.storage_data[MetadataIndex(fqn, c.offsets)].relative_path
                out.setdefault(fqn, {}).setdefault(file, set()).add((tuple(c.offsets), tuple(c.sizes)))
    return md.state_dict_metadata, out


def param_of(fqn: str) -> str:
    """The param name of a model key or of an optimizer state key."""
    if fqn.startswith("model."):
        return fqn[len("model.module."):]
    return fqn[len("optimizer.state.module."):].rsplit(".", 1)[0]


def item_ranges(box: tuple, shape: tuple[int, ...]) -> list[tuple[int, int]]:
    """The (start, length) item ranges of a box, adjacent ones merged (torch index arithmetic)."""
    view = torch.arange(math.prod(shape)).reshape(shape)
    for d, (o, s) in enumerate(zip(*box)):
        view = view.narrow(d, o, s)
    items = view.reshape(-1).tolist()
    ranges: list[list[int]] = []
    for i in items:
        if ranges and ranges[-1][0] + ranges[-1][1] == i:
            ranges[-1][1] += 1
        else:
            ranges.append([i, 1])
    return [tuple(r) for r in ranges]


# --------------------------------------------------------------------------------------
# One session: sources, then every CLI run (independent ones concurrently)
# --------------------------------------------------------------------------------------

RUNS: dict[str, tuple[str, ...]] = {
    "split": ("tp2", "--split-fused", "--world-size", "3", "--verify"),
    "reblock": ("tp2", "--source-tp", "2", "--tp", "4", "--world-size", "4", "--verify"),
    "mfsdp": ("tp2", "--layout", "megatron-fsdp", "--tp", "4", "--dp", "2", "--verify"),
    "flat": ("tp2", "--layout", "megatron-fsdp", "--tp", "2", "--dp", "2", "--world-size", "4",
             "--flat-optimizer", "--verify"),
    "fixture_split": ("fixture", "--split-fused", "--world-size", "2"),
    "fixture_fuse": ("fixture", "--fuse", "--tp", "2", "--world-size", "2", "--verify"),
    "refuse_plain": ("broken_plain", "--split-fused", "--world-size", "2"),
    "refuse_fused": ("broken_fused", "--split-fused", "--world-size", "2", "--allow-incomplete"),
    "no_dims": ("noargs", "--split-fused", "--world-size", "2"),
    "no_tp": ("noargs", "--split-fused", "--world-size", "2", "--hf-config", "hf/config.json"),
    "hf_config": ("noargs", "--split-fused", "--world-size", "2", "--hf-config", "hf", "--source-tp", "2"),
    "bad_world": ("tp2", "--layout", "megatron-fsdp", "--tp", "2", "--dp", "2", "--world-size", "8"),
}
SECOND_WAVE: dict[str, tuple[str, ...]] = {
    "fuse": ("split", "--fuse", "--tp", "2", "--world-size", "2", "--verify"),
    "split_after_reblock": ("reblock", "--split-fused", "--world-size", "2"),
}


@pytest.fixture(scope="session")
def megatron(tmp_path_factory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("megatron_reshard")
    paths: dict[str, Path] = {
        "tp2": root / "tp2", "tp4": root / "tp4", "noargs": root / "noargs", "broken_fused": root / "broken_fused",
        "fixture": FIXTURES / "megatron_tp2_dp2", "broken_plain": FIXTURES / "broken_plain_optim",
    }
    mc.save_megatron(paths["tp2"], tp=2, dp=2, flat_states=True)
    mc.save_full(paths["tp4"], tp=4)
    mc.save_full(paths["noargs"], tp=2, with_args=False)
    mc.save_broken_fused(paths["broken_fused"])
    (root / "hf").mkdir()
    (root / "hf" / "config.json").write_text(json.dumps(mc.hf_config()))

    def run(name: str, spec: tuple[str, ...]):
        src, *args = spec
        args = [str(root / a) if a.startswith("hf") else a for a in args]
        paths[name] = root / name
        return name, run_cli("reshard", paths[src], paths[name], *args)

    results: dict[str, Any] = {}
    with ThreadPoolExecutor(max_workers=3) as pool:
        results.update(pool.map(lambda item: run(*item), RUNS.items()))
        results.update(pool.map(lambda item: run(*item), SECOND_WAVE.items()))
    return {"paths": paths, "results": results}


def output(megatron: dict[str, Any], name: str) -> Path:
    ok(megatron["results"][name])
    return megatron["paths"][name]


# --------------------------------------------------------------------------------------
# --split-fused
# --------------------------------------------------------------------------------------


def test_split_fused_components_equal_the_originals_bit_exactly(megatron):
    loaded = torch_load(output(megatron, "split"))
    ref = mc.split_reference()
    assert_values(loaded, ref)
    assert model_names(loaded) == set(ref["model"])  # every fused tensor split, nothing else renamed
    for name in ref["model"]:
        assert loaded[key("step", name)] == mc.ITERATION  # per-param `step` copied under every name


def test_split_fused_optimizer_keys_follow_the_new_param_names(megatron):
    md, _ = chunks_by_file(output(megatron, "split"))
    planner = FileSystemReader(str(output(megatron, "split"))).read_metadata().planner_data
    for fqn in (f"optimizer.state.module.{FC1}_w.exp_avg", f"optimizer.state.module.{IN_PROJ}.query.exp_avg_sq",
                "optimizer.state.module.decoder.layers.1.mlp.experts.linear_fc1.weight1_v.step",
                "optimizer.state.module.decoder.layers.0.self_attention.conv1d.bias.value.exp_avg",
                "model.module.decoder.layers.1.mlp.shared_experts.linear_fc1.weight_v"):
        assert fqn in md
    assert not any(k.endswith((f"{FC1}.exp_avg", f"{IN_PROJ}.exp_avg")) for k in md)
    assert planner[f"optimizer.state.module.{FC1}_w.exp_avg"] == ("optimizer", "state", f"module.{FC1}_w", "exp_avg")
    assert planner[f"model.module.{IN_PROJ}.alpha"] == ("model", f"module.{IN_PROJ}.alpha")


def test_split_fused_on_the_committed_fixture_matches_its_reference(megatron):
    loaded = torch_load(output(megatron, "fixture_split"))
    ref = megatron_tp2_dp2_reference()
    name = "decoder.layers.1.mlp.linear_fc1.weight"
    for which, (w, v) in ref["swiglu"][name].items():
        assert torch.equal(loaded[key(which, name + "_w")], w) and torch.equal(loaded[key(which, name + "_v")], v)
    assert f"model.module.{name}" not in loaded


# --------------------------------------------------------------------------------------
# --source-tp S --tp T
# --------------------------------------------------------------------------------------


def test_reblock_tp2_to_tp4_equals_a_checkpoint_built_at_tp4(megatron):
    got, want = torch_load(output(megatron, "reblock")), torch_load(megatron["paths"]["tp4"])
    tensors = {k for k, v in want.items() if isinstance(v, torch.Tensor)}
    assert tensors == {k for k, v in got.items() if isinstance(v, torch.Tensor)}
    for k in tensors:
        assert torch.equal(got[k].reshape(want[k].shape), want[k]), k
    assert_values(got, mc.reference(4))
    assert got["args"].tensor_model_parallel_size == 4 and got["args"].expert_tensor_parallel_size == 4


def test_a_later_split_of_the_reblocked_output_reads_the_new_tp_from_args(megatron):
    assert_values(torch_load(output(megatron, "split_after_reblock")), mc.split_reference())


def test_source_tp_from_args_into_megatron_fsdp_layout_equals_tp4(megatron):
    assert_values(torch_load(output(megatron, "mfsdp")), mc.reference(4))


# --------------------------------------------------------------------------------------
# --layout megatron-fsdp
# --------------------------------------------------------------------------------------


def test_megatron_fsdp_chunks_are_tp_outer_dp_inner_one_file_per_rank(megatron):
    path = output(megatron, "mfsdp")
    md, chunks = chunks_by_file(path)
    assert sorted(p.name for p in path.glob("*.distcp")) == [f"__{r}_0.distcp" for r in range(8)]
    shapes = {param_of(f): tuple(m.size) for f, m in md.items() if f.startswith("model.")}
    checked = 0
    for fqn, files in chunks.items():
        if not fqn.startswith(("model.", "optimizer.state.")):
            continue
        size = tuple(md[fqn].size)
        expected = mc.expected_boxes(param_of(fqn), size and shapes[param_of(fqn)], tp=4, dp=2)
        assert files == {f"__{r}_0.distcp": set(b) for r, b in expected.items()}, fqn
        checked += 1
    assert checked == 4 * len(shapes)


def test_flat_optimizer_states_are_item_ranges_of_each_ranks_box(megatron):
    md, chunks = chunks_by_file(output(megatron, "flat"))
    shapes = {param_of(f): tuple(m.size) for f, m in md.items() if f.startswith("model.")}
    mid_row = 0
    for fqn, files in chunks.items():
        if not fqn.endswith((".exp_avg", ".exp_avg_sq")):
            continue
        shape = shapes[param_of(fqn)]
        if len(shape) < 2:
            continue
        assert tuple(md[fqn].size) == (math.prod(shape),), fqn
        expected = {f"__{r}_0.distcp": {((s,), (n,)) for box in boxes for s, n in item_ranges(box, shape)}
                    for r, boxes in mc.expected_boxes(param_of(fqn), shape, tp=2, dp=2).items()}
        assert files == expected, fqn
        mid_row += sum(off[0] % shape[-1] != 0 for chunk_set in files.values() for off, _ in chunk_set)
    assert mid_row > 0  # RowParallel slices start mid-row


def test_megatron_fsdp_output_loads_with_dcp_load_at_the_new_world_size(megatron):
    ref = mc.reference(2)
    per_rank = mc.load_megatron(output(megatron, "flat"), tp=2, dp=2)
    seen = 0
    for pieces in per_rank:
        for fqn, boxes in pieces.items():
            name, which = param_of(fqn), "model" if fqn.startswith("model.") else fqn.rsplit(".", 1)[1]
            if which == "step":
                assert boxes[0][1] == mc.ITERATION
                continue
            full = ref[which][name].reshape(-1) if boxes and boxes[0][1].dim() == 1 and \
                ref[which][name].dim() > 1 else ref[which][name]
            for offsets, values in boxes:
                want = full
                for d, (o, s) in enumerate(zip(offsets, values.shape)):
                    want = want.narrow(d, o, s)
                assert torch.equal(values, want), fqn
                seen += 1
    assert seen > 100


def test_megatron_fsdp_world_size_must_equal_tp_times_dp(megatron):
    result = megatron["results"]["bad_world"]
    assert result.returncode == 2
    assert result.stderr == ("ckptctl: error: --world-size 8 must equal TP × DP = 2 × 2 = 4 for --layout "
                             "megatron-fsdp (or be omitted)\n")


# --------------------------------------------------------------------------------------
# --fuse
# --------------------------------------------------------------------------------------


def test_split_then_fuse_is_the_identity(megatron):
    got, want = torch_load(output(megatron, "fuse")), torch_load(megatron["paths"]["tp2"])
    assert set(got) == set(want)
    for k, v in want.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(got[k].reshape(v.shape), v), k
        elif k == "args":
            assert vars(got[k]) == vars(v)
        else:
            assert got[k] == v, k


def test_fuse_on_the_committed_fixture_blocks_for_tp_and_moves_group_meta(megatron):
    path = output(megatron, "fixture_fuse")
    loaded = torch_load(path)
    ref = megatron_tp2_dp2_reference()
    name = "decoder.layers.0.mlp.linear_fc1.weight"
    for which in ("model", "exp_avg", "exp_avg_sq"):
        want = fuse_swiglu_tp_blocked(ref[which][name + "_w"], ref[which][name + "_v"], 2)
        assert torch.equal(loaded[key(which, name)], want), which
        layer1 = "decoder.layers.1.mlp.linear_fc1.weight"
        assert torch.equal(loaded[key(which, layer1)], ref[which][layer1])
    assert loaded[f"optimizer.state.module.{name}.step"] == 7
    meta = "optimizer.param_to_group_meta.module." + name
    assert loaded[meta + ".lr"] == 3e-4
    assert not any(k.startswith((meta + "_w.", meta + "_v.")) for k in loaded)


# --------------------------------------------------------------------------------------
# Refusals
# --------------------------------------------------------------------------------------


def test_fusedadam_plain_optimizer_state_is_refused_with_the_diagnosis(megatron):
    result = megatron["results"]["refuse_plain"]
    assert result.returncode == 2
    assert result.stderr == (
        f"ckptctl: error: {FIXTURES / 'broken_plain_optim'}: refusing incomplete checkpoint: optim.state.w.exp_avg: "
        "saved [2, 8] (16 elements) but param model.w is [4, 8] (32 elements): optimizer state was saved as a "
        "plain per-rank tensor and DCP kept one rank's copy (data loss) (+1 more; see `ckptctl inspect --check`); "
        "pass --allow-incomplete to go on\n")
    assert not megatron["paths"]["refuse_plain"].exists()


def test_a_fused_param_with_a_plain_state_is_never_split_even_with_allow_incomplete(megatron):
    result = megatron["results"]["refuse_fused"]
    assert result.returncode == 2
    state = f"optimizer.state.module.{FC1}.exp_avg"
    assert result.stderr == (
        f"ckptctl: error: {state}: saved [8, 8] but its param model.module.{FC1} is [16, 8]: not in the param's "
        "shape (a plain per-rank tensor DCP kept one rank's copy of?); refusing to split or re-block it "
        "(see `ckptctl inspect --check`)\n")
    assert not megatron["paths"]["refuse_fused"].exists()


def test_split_without_model_dims_is_refused(megatron):
    result = megatron["results"]["no_dims"]
    assert result.returncode == 2
    assert result.stderr == (
        f"ckptctl: error: model.module.{IN_PROJ}: splitting or re-blocking GDN in_proj needs the GDN head counts "
        "and dims (linear_num_key_heads, linear_key_head_dim, linear_num_value_heads, linear_value_head_dim), but "
        "no --hf-config was given and the checkpoint has no readable args entry; pass --hf-config REF\n")


def test_split_without_a_known_source_tp_is_refused(megatron):
    result = megatron["results"]["no_tp"]
    assert result.returncode == 2
    assert result.stderr == (
        f"ckptctl: error: {megatron['paths']['noargs']}: cannot tell the training TP size (no args entry, no "
        "RowParallel chunks split on dim 1); pass --source-tp\n")


def test_hf_config_folder_gives_the_model_dims(megatron):
    assert_values(torch_load(output(megatron, "hf_config")), mc.split_reference())


def test_a_tp_change_refuses_tensors_no_rule_knows(megatron, tmp_path):
    """A tensor no rule knows (here GDN's `in_proj` renamed `mixer.x_proj`) may be fused per TP
    rank like GDN's and Mamba's: re-slicing its rows for another TP would scramble it, so the TP
    change is refused, naming the first tensor no rule knows and counting the others.
    (The same checkpoint with the tensor under GDN's name re-blocks: the `reblock` run.)"""
    import pickle
    import shutil

    src = tmp_path / "mamba"
    shutil.copytree(megatron["paths"]["tp2"], src)

    def rename(name: str) -> str:
        return name.replace("self_attention.in_proj", "mixer.x_proj")

    md = pickle.loads((src / ".metadata").read_bytes())
    md.state_dict_metadata = {rename(k): v for k, v in md.state_dict_metadata.items()}
    for index in md.storage_data:
        object.__setattr__(index, "fqn", rename(index.fqn))
    md.storage_data = dict(md.storage_data.items())
    md.planner_data = {rename(k): tuple(rename(p) if isinstance(p, str) else p for p in v)
                       for k, v in md.planner_data.items()}
    (src / ".metadata").write_bytes(pickle.dumps(md))
    unknown = [k for k in md.state_dict_metadata if ".mixer." in k and not k.startswith("optimizer.")]
    assert [n.rsplit(".", 2)[1:] for n in unknown] == [["x_proj", "weight"], ["x_proj", "layer_norm_weight"]]
    result = run_cli("reshard", src, tmp_path / "out", "--source-tp", "2", "--tp", "4", "--world-size", "4")
    assert (result.returncode, result.stderr) == (2, (
        f"ckptctl: error: {unknown[0]} (and 1 more): no rule knows how Megatron splits it over TP (it may be fused "
        "per TP rank, as GDN's and Mamba's in_proj are), so changing TP 2 to 4 could scramble it; reshard at "
        "--tp 2\n"))
    assert not (tmp_path / "out").exists()
    ok(run_cli("reshard", src, tmp_path / "same_tp", "--source-tp", "2", "--tp", "2", "--world-size", "4"))


def test_a_fused_fc1_whose_args_tp_the_chunks_contradict_is_not_converted_to_torch_dist(tmp_path):
    """A SwiGLU fc1 saved fused at TP 2 ([W_0; V_0; W_1; V_1]) is torch_dist's [W_all; V_all] only at
    TP 1: args saying TP 1 where the RowParallel chunks show 2 let it through as that, half of fc1's
    rows (weights and moments) scrambled, exit 0. Refused in one line instead, as at TP 2."""
    from tests.planners.test_torch_dist_optimizer import _with_args

    fused = tmp_path / "fused"
    ok(run_cli("reshard", FIXTURES / "megatron_tp2_dp2", fused, "--layout", "megatron-fsdp", "--fuse", "--tp", "2",
               "--dp", "2"))
    for tp, line in ((2, "model.module.decoder.layers.0.mlp.linear_fc1.weight: a SwiGLU fc1 saved fused at TP 2 is "
                         "TP-blocked; split it first (ckptctl reshard --layout megatron-fsdp --split-fused), then "
                         "convert"),
                     (1, "args say TP 1 but RowParallel chunks show TP 2: the TP blocks of its fused tensors are "
                         "unknown")):
        src = _with_args(fused, tmp_path / f"tp{tp}", transformer_impl="local", tensor_model_parallel_size=tp)
        res = run_cli("reshard", src, tmp_path / "out", "--layout", "torch-dist")
        assert (res.returncode, res.stderr) == (2, f"ckptctl: error: {src}: {line}\n")
        assert not (tmp_path / "out").exists()
