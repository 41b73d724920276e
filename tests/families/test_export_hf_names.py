"""export-hf is closed-world: an output name the HF model has no place for, or a weight it
expects that the output lacks, is refused (exit 2, one line, nothing written).

Real checkpoints, written by `dcp.save`: torchtitan llama3 names and shapes (torchtitan
0.3's `Llama3StateDictAdapter` names: `tok_embeddings`, `attention.qkv_linear.wq`, …,
`output`), the committed Megatron fixture, transformers tiny models' own state dicts (one
key short; NeMo Automodel's native grouped experts). The expectation is transformers'
own model class built for the config on the meta device; "transformers not installed" is
a real interpreter in which `import transformers` fails.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fixtures import hf_models
from tests.conftest import ROOT, run_cli
from tests.commands.test_export_hf import load_hf, logits, read_safetensors

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

NO_TRANSFORMERS = ("import sys; sys.modules['transformers'] = None; from ckptctl.cli import main; "
                   "main(sys.argv[1:])")
"""A ckptctl whose `import transformers` fails, as where it is not installed."""

TITAN = dict(dim=32, layers=2, heads=8, kv_heads=4, ffn=48, vocab=100)


def save(state: dict, path: Path) -> Path:
    import torch.distributed.checkpoint as dcp

    dcp.save(state, checkpoint_id=path, no_dist=True)
    return path


def write_config(folder: Path, **config) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def torchtitan_llama3_state() -> dict[str, torch.Tensor]:
    """Model tensors as torchtitan 0.3's llama3 names and shapes them (wqkv saved split)."""
    d, h, kv, f, v = TITAN["dim"], TITAN["heads"], TITAN["kv_heads"], TITAN["ffn"], TITAN["vocab"]
    hd = d // h
    g = torch.Generator().manual_seed(0)
    shapes = {"tok_embeddings.weight": (v, d), "norm.weight": (d,), "lm_head.weight": (v, d)}
    for i in range(TITAN["layers"]):
        p = f"layers.{i}."
        shapes.update({p + "attention.qkv_linear.wq.weight": (h * hd, d),
                       p + "attention.qkv_linear.wk.weight": (kv * hd, d),
                       p + "attention.qkv_linear.wv.weight": (kv * hd, d), p + "attention.wo.weight": (d, h * hd),
                       p + "feed_forward.w1.weight": (f, d), p + "feed_forward.w2.weight": (d, f),
                       p + "feed_forward.w3.weight": (f, d), p + "attention_norm.weight": (d,),
                       p + "ffn_norm.weight": (d,)})
    return {name: torch.randn(shape, generator=g) for name, shape in shapes.items()}


@pytest.fixture(scope="module")
def titan(tmp_path_factory) -> tuple[Path, Path]:
    """A torchtitan-named checkpoint with its optimizer, scheduler, train state and dataloader
    entries as its CheckpointManager lays them out; and the matching HF Llama config."""
    root = tmp_path_factory.mktemp("titan")
    model = torchtitan_llama3_state()
    state: dict = dict(model)
    state["optimizer"] = {"state": {"tok_embeddings.weight": {"exp_avg": torch.zeros(TITAN["vocab"], TITAN["dim"]),
                                                              "step": torch.tensor(3.0)}}}
    state["lr_scheduler"] = {"last_epoch": 3, "base_lrs": [0.1]}
    state["train_state"] = {"step": 3, "ntokens_seen": 1536}
    state["dataloader"] = {"dp_rank_0": b"\x00" * 16}
    ckpt = save(state, root / "step-3")
    ref = write_config(root / "ref", model_type="llama", vocab_size=TITAN["vocab"], hidden_size=TITAN["dim"],
                       intermediate_size=TITAN["ffn"], num_hidden_layers=TITAN["layers"],
                       num_attention_heads=TITAN["heads"], num_key_value_heads=TITAN["kv_heads"],
                       tie_word_embeddings=False, max_position_embeddings=64)
    return ckpt, ref


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory) -> hf_models.Reference:
    """A tiny tied-embedding Qwen3 saved by save_pretrained (its folder is the REF)."""
    return hf_models.reference("qwen3", tmp_path_factory.mktemp("qwen3") / "ref")


def hf_state(ref: hf_models.Reference) -> dict[str, torch.Tensor]:
    """The model's own state dict (tied lm_head included), as FSDP2 on a transformers model saves it."""
    return {name: t.detach().clone() for name, t in ref.model.state_dict().items()}


TITAN_LINE = ("a torchtitan checkpoint (15 tensors named as torchtitan names them: "
              "layers.0.attention.qkv_linear.wk.weight, layers.0.attention.qkv_linear.wq.weight, "
              "layers.0.attention.qkv_linear.wv.weight (+12 more)); its names and llama's RoPE row order differ "
              "from Hugging Face's: export it with --arch auto (torchtitan's llama3 and qwen3 are converted)")


def test_a_torchtitan_checkpoint_is_refused_by_name_as_raw_and_converted_by_auto(titan, tmp_path):
    ckpt, ref = titan
    res = run_cli("export-hf", ckpt, tmp_path / "dst", "--hf-config", ref, "--arch", "raw")
    assert (res.returncode, res.stdout, res.stderr) == (2, "", f"ckptctl: error: {ckpt}: {TITAN_LINE}\n")
    res = run_cli("export-hf", ckpt, tmp_path / "dst", "--hf-config", ref, "--arch", "raw", "--dry-run")
    assert (res.returncode, res.stderr) == (2, f"ckptctl: error: {ckpt}: {TITAN_LINE}\n")
    assert not (tmp_path / "dst").exists()
    res = run_cli("export-hf", ckpt, tmp_path / "dst", "--hf-config", ref)
    assert res.returncode == 0, res.stderr
    assert "(torchtitan-llama3, 21 tensors in 1 safetensors file" in res.stderr


def test_inspect_counts_torchtitan_bookkeeping_as_other(titan):
    doc = json.loads(run_cli("inspect", titan[0], "--json").stdout)
    # 21 model tensors; exp_avg and step; lr_scheduler (2), train_state (2), dataloader (1) bytes entries
    assert doc["groups"] == {"model": 21, "optimizer": 2, "other": 5}


def test_raw_export_of_megatron_names_with_a_llama_config_is_refused(fixture_ckpt, tmp_path):
    ckpt = fixture_ckpt("megatron_tp2_dp2")
    ref = write_config(tmp_path / "ref", **hf_models.CONFIGS["llama"])
    res = run_cli("export-hf", ckpt, tmp_path / "dst", "--hf-config", ref, "--arch", "raw", "--dry-run")
    assert (res.returncode, res.stdout) == (2, "")
    assert res.stderr == (
        f"ckptctl: error: {ckpt}: 16 tensors have no place in a LlamaForCausalLM: "
        f"module.decoder.final_layernorm.weight, module.decoder.layers.0.mlp.linear_fc1.layer_norm_weight, "
        f"module.decoder.layers.0.mlp.linear_fc1.weight_v (+13 more) (Megatron names: export with --arch auto "
        f"or the model's family)\n")
    assert not (tmp_path / "dst").exists()


def test_a_checkpoint_missing_one_weight_is_refused_and_no_name_check_writes_it(qwen3, tmp_path):
    state = hf_state(qwen3)
    del state["model.layers.1.mlp.up_proj.weight"]
    ckpt = save({"model": state}, tmp_path / "ckpt")
    dst = tmp_path / "dst"
    res = run_cli("export-hf", ckpt, dst, "--hf-config", qwen3.folder)
    assert (res.returncode, res.stdout) == (2, "")
    assert res.stderr == (f"ckptctl: error: {ckpt}: 1 weight a Qwen3ForCausalLM expects is missing: "
                          f"model.layers.1.mlp.up_proj.weight (an incomplete checkpoint, or the wrong --hf-config?)\n")
    assert not dst.exists()
    res = run_cli("export-hf", ckpt, dst, "--hf-config", qwen3.folder, "--no-name-check", "--json")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["notes"] == [
        "model.lm_head.weight not exported: the config ties it to model.model.embed_tokens.weight, which it equals",
        "tensor names not checked (--no-name-check): the output may not load"]
    assert sorted(read_safetensors(dst)) == sorted(set(qwen3.state) - {"model.layers.1.mlp.up_proj.weight"})


def test_a_whole_hf_named_checkpoint_exports_verifies_and_loads_with_equal_logits(qwen3, tmp_path):
    ckpt = save({"model": hf_state(qwen3)}, tmp_path / "ckpt")
    res = run_cli("export-hf", ckpt, tmp_path / "dst", "--hf-config", qwen3.folder, "--verify", "--json")
    assert res.returncode == 0, res.stderr
    summary = json.loads(res.stdout)
    assert summary["verified"] and summary["arch"] == "raw"
    assert summary["notes"] == ["model.lm_head.weight not exported: the config ties it to "
                                "model.model.embed_tokens.weight, which it equals"]
    assert sorted(read_safetensors(tmp_path / "dst")) == sorted(qwen3.state)
    model = load_hf(tmp_path / "dst")
    assert torch.equal(logits(model, 90), logits(qwen3.model, 90))


def test_verify_checks_written_names_against_the_written_config(qwen3, tmp_path):
    """An output whose config.json no longer ties lm_head lacks a weight its model expects."""
    from ckptctl.util.errors import CheckpointError
    from ckptctl.commands.export_hf import ExportOptions, check_written_names, plan_export
    from ckptctl.formats.dcp.metadata import open_checkpoint
    from ckptctl.families.base import load_hf_config

    ckpt = save({"model": hf_state(qwen3)}, tmp_path / "ckpt")
    dst = tmp_path / "dst"
    assert run_cli("export-hf", ckpt, dst, "--hf-config", qwen3.folder).returncode == 0
    plan = plan_export(open_checkpoint(ckpt), load_hf_config(qwen3.folder), ExportOptions())
    check_written_names(plan, dst)
    config = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}))
    with pytest.raises(CheckpointError) as err:
        check_written_names(plan, dst)
    assert str(err.value) == f"{dst}: verification failed: a Qwen3ForCausalLM expects lm_head.weight, not written"


def test_native_automodel_experts_are_refused_by_name_under_arch_raw(tmp_path):
    ref = hf_models.reference("qwen3-moe", tmp_path / "ref")
    state = {n: t for n, t in hf_state(ref).items() if ".mlp.experts." not in n}
    e, h, i = 4, 32, 16
    state["model.layers.1.mlp.experts.gate_and_up_projs"] = torch.zeros(e, h, 2 * i)
    state["model.layers.1.mlp.experts.down_projs"] = torch.zeros(e, i, h)
    ckpt = save({"model": state}, tmp_path / "ckpt")
    res = run_cli("export-hf", ckpt, tmp_path / "dst", "--hf-config", ref.folder, "--arch", "raw",
                  "--no-name-check")
    assert (res.returncode, res.stdout) == (2, "")
    assert res.stderr == (f"ckptctl: error: {ckpt}: 2 tensors in NeMo Automodel's native expert layout, not "
                          f"Hugging Face's: model.layers.1.mlp.experts.down_projs, "
                          f"model.layers.1.mlp.experts.gate_and_up_projs (grouped, transposed experts): export "
                          f"with --arch auto, which converts them\n")


def run_without_transformers(*args: object) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", NO_TRANSFORMERS, *map(str, args)], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)


def test_without_transformers_raw_is_refused_and_no_name_check_exports(qwen3, tmp_path):
    ckpt = save({"model": hf_state(qwen3)}, tmp_path / "ckpt")
    dst = tmp_path / "dst"
    res = run_without_transformers("export-hf", ckpt, dst, "--hf-config", qwen3.folder, "--arch", "raw")
    assert (res.returncode, res.stdout) == (2, "")
    assert res.stderr == ("ckptctl: error: --arch raw checks the tensor names against transformers' model for the "
                          "config, and transformers is not installed (pip install transformers; or --no-name-check "
                          "to write them unchecked)\n")
    assert not dst.exists()
    res = run_without_transformers("export-hf", ckpt, dst, "--hf-config", qwen3.folder, "--arch", "raw",
                                   "--no-name-check", "--verify")
    assert res.returncode == 0, res.stderr
    assert sorted(read_safetensors(dst)) == sorted(qwen3.state)


def test_without_transformers_a_megatron_family_exports_with_a_note(tmp_path):
    import torch.distributed.checkpoint as dcp

    ref = hf_models.reference("llama", tmp_path / "ref")
    state = hf_models.to_megatron(ref, 2, "fused")
    dcp.save({"model.module." + n: t for n, (t, _) in state.items()}, checkpoint_id=tmp_path / "ckpt", no_dist=True)
    res = run_without_transformers("export-hf", tmp_path / "ckpt", tmp_path / "dst", "--hf-config", ref.folder,
                                   "--tp", "2", "--json")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["notes"] == [
        "tensor names not checked against transformers' model (transformers is not installed)"]
    got = read_safetensors(tmp_path / "dst")
    assert sorted(got) == sorted(ref.state)
    assert all(torch.equal(got[n], t) for n, t in ref.state.items())
