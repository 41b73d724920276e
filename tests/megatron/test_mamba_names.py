"""megatron-core 0.19's Mamba mixer names: `mixer.conv1d_weight` / `conv1d_bias`, parameters of its own.

0.16's mixer held an `nn.Conv1d` (`mixer.conv1d.weight`); 0.19.2's registers the conv weight and
bias itself, so a module's `state_dict()` names — Megatron-FSDP's fsdp_dtensor saves — follow the
release, while its torch_dist save maps them back to `conv1d.weight` (split into x, B, C). The
run is megatron-core 0.19.2's own (`fixtures.megatron_optim`: its MambaModel on CPU, mamba_ssm's
kernels stand-ins in torch after their source, one AdamW step at TP 2) saved as torch_dist;
`fixtures.megatron_fsdp_dtensor` writes its state as Megatron-FSDP saves it, under the names the
run's modules give (`named_parameters`), the conv fused per TP rank. Every Megatron path reads
both spellings; import-hf writes the one of the release it is told (0.19 by default).
"""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from ckptctl.families.registry import fused_kind, megatron_tp_kind
from ckptctl.megatron.rows import canonical, respelled
from fixtures.make_fixtures import load_with_torch
from tests.conftest import run_cli

CONV = "decoder.layers.0.mixer.conv1d_weight"
"""0.19.2's module name of the Mamba layer's conv weight."""
VOCAB = 200


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """megatron-core 0.19.2's Nemotron-H-like run at TP 2: its torch_dist save (`tp2/fully_reshardable`),
    the same state as Megatron-FSDP saves it at TP 2 × DP 1 (`fsdp`) and at TP 1 × DP 2 (`fsdp_tp1`),
    and the HF config of the model (`ref`)."""
    from fixtures import megatron_core, megatron_fsdp_dtensor, megatron_optim

    if not megatron_optim.available("0.19"):
        pytest.skip("megatron-core 0.19 is not installed beside")
    root = tmp_path_factory.mktemp("mamba_names")
    megatron_optim.write(root / "tp2", 2, 1, kind="nemotron-h", mcore="0.19")
    src, buffers = root / "tp2" / "fully_reshardable", root / "tp2" / "buffers.json"
    megatron_fsdp_dtensor.write(src, buffers, root / "fsdp", 2, 1)
    megatron_fsdp_dtensor.write(src, buffers, root / "fsdp_tp1", 1, 2)
    (root / "ref").mkdir()
    (root / "ref" / "config.json").write_text(json.dumps(megatron_core.hf_config("nemotron-h")))
    return root


def _flat(tree, prefix: str = "") -> dict[str, torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return {prefix: tree}
    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items() for k, v in _flat(sub, f"{prefix}.{key}" if prefix else key).items()}
    return {}


def _safetensors(folder) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


def test_both_spellings_of_the_mamba_conv_have_the_rules_tp_kind():
    for name in ("decoder.layers.3.mixer.conv1d_weight", "model.module.decoder.layers.3.mixer.conv1d_bias",
                 "decoder.layers.3.mixer.conv1d.weight"):
        assert (megatron_tp_kind(name), fused_kind(name)) == ("mamba_conv1d", "mamba_conv1d"), name
    state = "optimizer.state.module.module.decoder.layers.3.mixer.conv1d_weight.exp_avg"
    assert canonical(state) == "optimizer.state.module.module.decoder.layers.3.mixer.conv1d.weight.exp_avg"
    assert canonical("decoder.layers.3.mixer.conv1d_weights") == "decoder.layers.3.mixer.conv1d_weights"
    assert respelled("decoder.layers.3.mixer.conv1d.bias", (0, 19)) == "decoder.layers.3.mixer.conv1d_bias"
    assert respelled("decoder.layers.3.mixer.conv1d.bias", (0, 16)) == "decoder.layers.3.mixer.conv1d.bias"


def test_0_19s_torch_dist_save_keeps_the_old_keys_and_its_module_the_new_names(run):
    """The fact the rest stands on, from 0.19.2's own save and module."""
    saved = load_with_torch(run / "tp2" / "fully_reshardable")
    assert sorted(k for k in saved if ".mixer.conv1d" in k and not k.startswith("optimizer.")) == sorted(
        f"decoder.layers.0.mixer.conv1d.{kind}.{part}" for kind in ("weight", "bias") for part in "xBC")
    record = json.loads((run / "tp2" / "buffers.json").read_text())
    names = {p["name"] for b in record["ranks"][0]["buffers"] for p in b["params"]}
    assert {CONV, "decoder.layers.0.mixer.conv1d_bias"} <= names and not any(".conv1d." in n for n in names)
    assert record["megatron_core"].startswith("0.19.")


def test_export_hf_of_0_19s_fsdp_dtensor_names_equals_that_of_its_torch_dist_save(run):
    for src, out in (("fsdp", "hf_fsdp"), ("tp2/fully_reshardable", "hf_torch_dist")):
        done = run_cli("export-hf", run / src, run / out, "--hf-config", run / "ref")
        assert done.returncode == 0, done.stderr
    got, want = _safetensors(run / "hf_fsdp"), _safetensors(run / "hf_torch_dist")
    assert sorted(got) == sorted(want) and "backbone.layers.0.mixer.conv1d.weight" in got
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert f"model.module.{CONV}" in _flat(load_with_torch(run / "fsdp"))


def test_a_tp_change_re_blocks_0_19s_conv_params_and_their_optimizer_states(run, tmp_path):
    """Megatron-FSDP reshard TP 2 → TP 1 × DP 2 of the 0.19 names is the run's state saved at
    TP 1 × DP 2, every tensor (the conv `[x_t; B_t; C_t]` blocks re-blocked, Adam's moments alike)."""
    done = run_cli("reshard", run / "fsdp", tmp_path / "out", "--layout", "megatron-fsdp", "--tp", 1, "--dp", 2,
                   "--source-tp", 2, "--hf-config", run / "ref")
    assert done.returncode == 0, done.stderr
    got, want = _flat(load_with_torch(tmp_path / "out")), _flat(load_with_torch(run / "fsdp_tp1"))
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert not torch.equal(_flat(load_with_torch(run / "fsdp"))[f"model.module.{CONV}"], want[f"model.module.{CONV}"])
    assert f"optimizer.state.module.module.{CONV}.exp_avg_sq" in got


def test_import_hf_writes_the_conv_names_of_the_megatron_core_release_it_is_told(run, tmp_path):
    """0.19 (the current release) by default, 0.16's `conv1d.weight` when told; the values are the
    run's, as its Megatron-FSDP save holds them (TP 2)."""
    folder = run / "hf_import_src"
    done = run_cli("export-hf", run / "tp2" / "fully_reshardable", folder, "--hf-config", run / "ref")
    assert done.returncode == 0, done.stderr
    want = _flat(load_with_torch(run / "fsdp"))
    for release, sep, note in (
            (None, "_", "note: mixer.conv1d_weight, mixer.conv1d_bias written as megatron-core 0.19 names them "
                        "(mixer.conv1d.weight, mixer.conv1d.bias before 0.19; --megatron-core RELEASE)"),
            ("0.16.1", ".", "note: mixer.conv1d.weight, mixer.conv1d.bias written as megatron-core 0.16 names them "
                            "(mixer.conv1d_weight, mixer.conv1d_bias from 0.19; --megatron-core RELEASE)")):
        out = tmp_path / str(release)
        done = run_cli("import-hf", folder, out, "--to", "megatron-fsdp", "--tp", 2, "--dp", 1,
                       *(("--megatron-core", release) if release else ()))
        assert done.returncode == 0, done.stderr
        assert note in done.stderr.splitlines()
        got = _flat(load_with_torch(out))
        conv = {f"model.module.decoder.layers.0.mixer.conv1d{sep}{kind}": kind for kind in ("weight", "bias")}
        assert sorted(k for k in got if ".conv1d" in k) == sorted(conv)
        assert all(torch.equal(got[k], want[f"model.module.decoder.layers.0.mixer.conv1d_{kind}"])
                   for k, kind in conv.items())
        mixer = [k for k in want if k.startswith("model.") and ".mixer." in k and "conv1d" not in k]
        assert mixer and all(torch.equal(got[k], want[k]) for k in mixer)
    done = run_cli("import-hf", folder, tmp_path / "no", "--to", "megatron-fsdp", "--dp", 1,
                   "--megatron-core", "latest")
    assert (done.returncode, done.stderr) == (2, "ckptctl: error: --megatron-core takes a release such as 0.19 "
                                                 "(got 'latest')\n")
    done = run_cli("import-hf", folder, tmp_path / "no", "--world-size", 1, "--megatron-core", "0.19")
    assert (done.returncode, done.stderr) == (2, "ckptctl: error: --tp, --dp, --split-fused and --megatron-core are "
                                                 "for --to megatron-fsdp\n")
    assert not (tmp_path / "no").exists()


def test_a_checkpoint_with_both_spellings_of_one_param_is_refused(run, tmp_path):
    import torch.distributed.checkpoint as dcp

    conv = torch.zeros(64, 1, 4)
    src = tmp_path / "both"
    dcp.save({"model": {"module": {"decoder.layers.0.mixer.conv1d_weight": conv,
                                   "decoder.layers.0.mixer.conv1d.weight": conv.clone()}}}, checkpoint_id=src)
    done = run_cli("export-hf", src, tmp_path / "out", "--hf-config", run / "ref")
    assert (done.returncode, done.stderr.splitlines()[-1]) == (
        2, f"ckptctl: error: {src}: holds both model.module.decoder.layers.0.mixer.conv1d_weight and "
           "model.module.decoder.layers.0.mixer.conv1d.weight, two megatron-core releases' names of one parameter: "
           "which one is the model's is not guessed")
    assert not (tmp_path / "out").exists()


def _tensors(folder) -> dict[str, torch.Tensor]:
    return {k: v for k, v in load_with_torch(folder).items() if isinstance(v, torch.Tensor)}


def test_torch_dist_conversion_of_0_19s_fsdp_dtensor_is_megatron_cores_own_torch_dist_save(run, tmp_path):
    """fsdp_dtensor → torch_dist of the hybrid model: every tensor, model and optimizer, is the one
    megatron-core 0.19.2's own torch_dist save of the run holds — the in_proj and conv (saved fused
    per TP rank, 0.19's `conv1d_weight`) in its `MambaMixer.sharded_state_dict` parts
    (`in_proj.weight.z` …, `conv1d.weight.x` …), each layer keyed on its own as the hybrid stack
    keys them, the norms under their module names. The saved run has `_extra_state` besides, which
    Megatron-FSDP does not save."""
    saved = load_with_torch(run / "tp2" / "fully_reshardable")
    want = {k: v for k, v in saved.items() if isinstance(v, torch.Tensor)}
    for files in (1, 2):
        out = tmp_path / str(files)
        done = run_cli("reshard", run / "fsdp", out, "--layout", "torch-dist", "--world-size", files, "--verify")
        assert done.returncode == 0, done.stderr
        got = _tensors(out)
        assert sorted(got) == sorted(want)
        assert all(got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]) for k in want)
    assert {k.rpartition("/")[0] for k in saved if k not in want} == {
        "common_state", *(f"{k}._extra_state" for k in ("decoder.layers.0.mixer.in_proj", "decoder.layers.0.mixer."
                          "out_proj", "decoder.layers.1.self_attention.linear_proj", "decoder.layers.1.self_attention."
                          "linear_qkv", "decoder.layers.2.mlp.linear_fc1", "decoder.layers.2.mlp.linear_fc2",
                          "output_layer"))}
    assert {f"decoder.layers.0.mixer.in_proj.weight.{p}" for p in ("z", "x", "B", "C", "dt")} | {
        f"optimizer.state.exp_avg_sq.decoder.layers.0.mixer.conv1d.bias.{p}" for p in "xBC"} <= set(got)


@pytest.mark.full
def test_megatron_core_0_19_resumes_the_converted_hybrid_checkpoint_with_the_saved_runs_loss(run, tmp_path):
    """megatron-core 0.19.2's own `dist_checkpointing.load` of the conversion into its MambaModel and
    DistributedOptimizer, at the run's TP 2 × DP 1 and at TP 1 × DP 2 (`--dist-ckpt-strictness
    log_all`: no `_extra_state`), then a step: the saved run's own next loss and the one after it."""
    from fixtures import megatron_optim

    out = tmp_path / "td"
    done = run_cli("reshard", run / "fsdp", out, "--layout", "torch-dist")
    assert done.returncode == 0, done.stderr
    want = torch.load(run / "tp2" / "loss.pt")
    for tp, dp in ((2, 1), (1, 2)):
        resumed = megatron_optim.load(out, tp, dp, tmp_path / f"loss{tp}.pt", kind="nemotron-h", mcore="0.19",
                                      strict="log_all")
        assert (resumed["sharding_type"], resumed["step"], resumed["after_step"]) == (
            "fully_reshardable", want["step2"], want["after_step2"]), (tp, dp)


def test_a_mamba_mixer_whose_sizes_disagree_is_not_converted(run, tmp_path):
    """The parts are sized from the layer's own shapes; args that say other sizes are refused in one
    line, writing nothing."""
    from tests.planners.test_torch_dist_optimizer import _with_args

    src = _with_args(run / "fsdp", tmp_path / "src", mamba_num_heads=8, mamba_head_dim=4)
    done = run_cli("reshard", src, tmp_path / "out", "--layout", "torch-dist")
    assert (done.returncode, done.stderr) == (
        2, f"ckptctl: error: {src}: model.module.decoder.layers.0.mixer.in_proj.weight: 100 rows beside a conv of "
           "64 and 4 heads are no Mamba [z, x, B, C, dt] at TP 2 (nor agree with the out_proj, norm and args)\n")
    assert not (tmp_path / "out").exists()


def test_args_whose_tp_the_chunks_contradict_are_not_trusted_to_cut_the_fused_mixer(run, tmp_path):
    """The fused in_proj and conv are TP-blocked at the saved TP: args saying TP 1 of the TP 2 save
    (its RowParallel out_proj chunks show 2 TP columns) cut the blocks as one, every part's rows
    scrambled (44 tensors, exit 0); refused in one line instead, as is TP 8."""
    from tests.planners.test_torch_dist_optimizer import _with_args

    for tp in (1, 8):
        src = _with_args(run / "fsdp", tmp_path / f"src{tp}", tensor_model_parallel_size=tp)
        done = run_cli("reshard", src, tmp_path / "out", "--layout", "torch-dist")
        assert (done.returncode, done.stderr) == (
            2, f"ckptctl: error: {src}: args say TP {tp} but RowParallel chunks show TP 2: the TP blocks of its "
               "fused tensors are unknown\n")
        assert not (tmp_path / "out").exists()


def test_a_mamba_mixer_outside_a_hybrid_stack_is_refused_by_name(run, tmp_path):
    """Without the hybrid stack's final norm the layers' keys are unknown: refused, naming the mixer."""
    import pickle
    import shutil

    from torch.distributed.checkpoint import FileSystemReader

    src = tmp_path / "no_final_norm"
    shutil.copytree(run / "fsdp", src)
    md = FileSystemReader(str(src)).read_metadata()
    dropped = [k for k in md.state_dict_metadata if "decoder.final_norm." in k]
    assert dropped
    for k in dropped:
        del md.state_dict_metadata[k]
    md.storage_data = {i: v for i, v in md.storage_data.items() if i.fqn not in dropped}
    (src / ".metadata").write_bytes(pickle.dumps(md))
    done = run_cli("reshard", src, tmp_path / "out", "--layout", "torch-dist")
    assert (done.returncode, done.stderr) == (
        2, f"ckptctl: error: {src}: model.module.decoder.layers.0.mixer.in_proj.weight: Mamba mixers outside "
           "megatron-core's hybrid stack (no decoder.final_norm.weight) are not converted to torch_dist yet\n")
    assert not (tmp_path / "out").exists()


def _decoded(folder) -> dict:
    """Every entry of a DCP checkpoint, tensors and decoded items, by flattened name."""
    return _flat_all(load_with_torch(folder))


def _flat_all(tree, prefix: str = "") -> dict:
    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items()
                for k, v in _flat_all(sub, f"{prefix}.{key}" if prefix else key).items()}
    return {prefix: tree}


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return vars(a) == vars(b) if hasattr(a, "__dict__") and hasattr(b, "__dict__") else a == b


def _as_the_runs_own(got: dict, want: dict, scheduler: bool, grid: dict | None = None) -> None:
    """`got` is the run's own Megatron-FSDP save `want`, entry for entry, but for what legitimately
    differs: each param's group `step` (written for Transformer Engine's FusedAdam beside torch
    Adam's per-param step), the RNG state (not carried over) and, where the source's common state
    holds none (`scheduler` False: megatron-core's torch_dist save of the fixture run), the
    scheduler and FLOPs counter; and at another grid, args' sizes (`grid`: the output's, where the
    fixture keeps the run's args as they were)."""
    extra = {k for k in got if k.startswith("optimizer.param_to_group_meta.") and k.endswith(".step")}
    assert len(extra) == 18 and set(got) - set(want) == extra
    absent = {k for k in want if k.startswith("rng_state")}
    if not scheduler:
        absent |= {k for k in want if k.startswith("opt_param_scheduler.")} | {"num_floating_point_operations_so_far"}
    assert absent and set(want) - set(got) == absent
    if grid:
        args = vars(want["args"])
        assert {k: args[k] for k in grid} != grid
        want = {**want, "args": argparse.Namespace(**{**args, **grid})}
    assert [k for k in want if k in got and not _same(got[k], want[k])] == []


def test_megatron_cores_torch_dist_save_of_the_hybrid_model_converts_to_the_runs_own_megatron_fsdp_save(run, tmp_path):
    """torch_dist → fsdp_dtensor of megatron-core 0.19.2's hybrid (Mamba) model: the Mamba in_proj and
    conv, saved in `MambaMixer.sharded_state_dict`'s parts (`in_proj.weight.z` …, `conv1d.weight.x`
    …), are fused and TP-blocked at the run's TP 2 (0.19's `conv1d_weight` names) by the geometry the
    torch_dist conversion cuts them with: every tensor, model and optimizer, is the run's own
    Megatron-FSDP save (`_as_the_runs_own`)."""
    out = tmp_path / "fsdp"
    done = run_cli("reshard", run / "tp2" / "fully_reshardable", out, "--layout", "megatron-fsdp", "--dp", 1)
    assert done.returncode == 0, done.stderr
    got, want = _decoded(out), _decoded(run / "fsdp")
    _as_the_runs_own(got, want, scheduler=False)
    assert got[f"model.module.{CONV}"].shape == (64, 1, 4) and f"optimizer.state.module.module.{CONV}.exp_avg" in got


@pytest.mark.full
def test_the_hybrid_models_torch_dist_converts_at_another_tp_and_round_trips(run, tmp_path):
    """At TP 1 × DP 2 the conversion is the run's own Megatron-FSDP save at TP 1 × DP 2 (the parts
    blocked for TP 1). A torch_dist checkpoint whose common state is in `common.pt` (megatron-core up
    to 0.18, or ckptctl's own conversion of fsdp_dtensor) does not say whether the conv is
    `conv1d.weight` or 0.19's `conv1d_weight`: converting it back is refused (Megatron-FSDP's
    partial load would leave a misnamed conv fresh). A dp_reshardable save's Mamba params are
    refused by name."""
    out = tmp_path / "tp1"
    done = run_cli("reshard", run / "tp2" / "fully_reshardable", out, "--layout", "megatron-fsdp", "--tp", 1,
                   "--dp", 2, "--verify")
    assert done.returncode == 0, done.stderr
    _as_the_runs_own(_decoded(out), _decoded(run / "fsdp_tp1"), scheduler=False,
                     grid={"tensor_model_parallel_size": 1, "data_parallel_size": 2, "expert_tensor_parallel_size": 1})
    td = tmp_path / "td"
    done = run_cli("reshard", run / "fsdp", td, "--layout", "torch-dist")
    assert done.returncode == 0, done.stderr
    done = run_cli("reshard", td, tmp_path / "back", "--layout", "megatron-fsdp", "--dp", 1)
    assert (done.returncode, done.stderr) == (
        2, f"ckptctl: error: {td}: decoder.layers.0.mixer: megatron-core names a Mamba mixer's conv conv1d.weight up "
           "to 0.18 and conv1d_weight from 0.19, and this torch_dist checkpoint (its common state in common.pt) does "
           "not say which release saved it: not converted to fsdp_dtensor\n")
    assert not (tmp_path / "back").exists()
    src = run / "tp2" / "dp_reshardable"
    done = run_cli("reshard", src, tmp_path / "no", "--layout", "megatron-fsdp", "--dp", 1)
    assert (done.returncode, done.stderr) == (
        2, f"ckptctl: error: {src}: decoder.layers.0.mixer.conv1d.weight.x: a Mamba mixer's in_proj or conv in "
           "dp_reshardable buckets is not converted to fsdp_dtensor yet (fully_reshardable is)\n")
    assert not (tmp_path / "no").exists()


def test_a_torch_dist_mamba_mixer_outside_a_hybrid_stack_is_refused_by_name(run, tmp_path):
    """torch_dist → fsdp_dtensor: without the hybrid stack's final norm the mixer's module names are
    unknown: refused, naming its first part."""
    import pickle
    import shutil

    from torch.distributed.checkpoint import FileSystemReader

    src = tmp_path / "no_final_norm"
    shutil.copytree(run / "tp2" / "fully_reshardable", src)
    md = FileSystemReader(str(src)).read_metadata()
    dropped = [k for k in md.state_dict_metadata if "decoder.final_norm." in k]
    assert len(dropped) == 4
    for k in dropped:
        del md.state_dict_metadata[k]
    md.storage_data = {i: v for i, v in md.storage_data.items() if i.fqn not in dropped}
    (src / ".metadata").write_bytes(pickle.dumps(md))
    done = run_cli("reshard", src, tmp_path / "out", "--layout", "megatron-fsdp", "--dp", 1)
    assert (done.returncode, done.stderr) == (
        2, f"ckptctl: error: {src}: decoder.layers.0.mixer.conv1d.weight.x: Mamba mixers outside megatron-core's "
           "hybrid stack (no decoder.final_norm.weight) are not converted to fsdp_dtensor yet\n")
    assert not (tmp_path / "out").exists()
