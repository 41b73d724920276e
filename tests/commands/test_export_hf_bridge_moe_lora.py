"""`export-hf --merge-adapters` / `--adapter-only` of Megatron-Bridge LoRA on MoE experts (qwen3-moe).

The checkpoints: megatron-core's qwen3-moe GPTModel with Megatron-Bridge's own adapter modules
(`ParallelLinearAdapter`, `GroupedExpertLinearAdapter`, `AdapterWrapper`) on attention's linears
and on every expert's fc1 and fc2, saved by megatron-core's `dist_checkpointing.save`
(fixtures/bridge_lora.py): SequentialMLP's own adapter per expert, TEGroupedMLP's one shared
adapter (Bridge's default) and one per expert — all three saved under the same keys
(`decoder.layers.mlp.experts.experts.linear_fc1.adapter.linear_in.weight` [L, E, dim, H] …).
The oracle of the merge: Megatron-Bridge's own `LoRAMerge.merge` (from its file) on each expert's
whole fc1 / fc2 and each layer's attention weights, saved as a plain checkpoint and exported by
the base rules; of the PEFT folder: peft's `PeftModel.from_pretrained` on the plain export, whose
logits must be the merged export's.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

from fixtures import bridge_lora
from fixtures import megatron_bridge as mb
from fixtures import megatron_core as mc
from tests.commands.test_export_hf_bridge_lora import _load_all, _loads_as_the_merged_export, bridge_merge
from tests.conftest import run_cli
from tests.families.test_bridge_adapters import run_config_yaml

pytestmark = pytest.mark.skipif(not mb.available(), reason="megatron-core or megatron-bridge is not installed")
ALPHA, DIM = 8, 4
EXPERTS, LAYERS = mc.MOE["num_moe_experts"], mc.DIMS["layers"]


def _reference(run: Path, out: Path) -> Path:
    """Bridge's `LoRAMerge.merge` of every adapter of `run/ckpt` into its base weight (an expert's
    own slab of the stack, each layer's), saved beside the base's common.pt and metadata.json."""
    merge = bridge_merge()
    state = _load_all(run / "ckpt")
    merged = {k: v for k, v in state.items() if ".adapter." not in k}
    for name in [n for n in state if n.endswith(".adapter.linear_in.weight")]:
        module = name.removesuffix(".adapter.linear_in.weight")
        a, b, w = state[name], state[f"{module}.adapter.linear_out.weight"], merged[f"{module}.weight"]
        out_w = w.clone()
        for index in torch.cartesian_prod(*(torch.arange(n) for n in w.shape[:-2])).view(-1, w.dim() - 2).tolist():
            i = tuple(index)
            out_w[i] = merge(w[i], b[i], a[i], ALPHA, DIM, tp_group=None)
        merged[f"{module}.weight"] = out_w
    dcp.save(merged, checkpoint_id=out)
    for name in ("common.pt", "metadata.json"):
        shutil.copy(run / "base" / name, out / name)
    return out


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> Path:
    """`sequential/` (the run: ckpt, only, base), `cfg/`, `plain/` (the base exported), `ref/` (Bridge's merge exported)."""
    root = tmp_path_factory.mktemp("bridge_moe_lora")
    bridge_lora.write(root / "sequential", "sequential", DIM, ALPHA)
    (root / "sequential" / "only" / "run_config.yaml").write_text(run_config_yaml(alpha=ALPHA, dim=DIM))
    (root / "cfg").mkdir()
    (root / "cfg" / "config.json").write_text(json.dumps(mc.hf_config("qwen3-moe")))
    _reference(root / "sequential", root / "merged")
    for src, out in ((root / "sequential" / "base", root / "plain"), (root / "merged", root / "ref")):
        run = run_cli("export-hf", src, out, "--hf-config", root / "cfg")
        assert run.returncode == 0, run.stderr
    return root


def _exported(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(folder / "model.safetensors")


def _expert_names() -> list[str]:
    return sorted([f"model.layers.{i}.mlp.experts.{e}.{m}.weight" for i in range(LAYERS) for e in range(EXPERTS)
                   for m in ("gate_proj", "up_proj", "down_proj")] +
                  [f"model.layers.{i}.self_attn.{m}.weight" for i in range(LAYERS) for m in ("q_proj", "k_proj",
                                                                                             "v_proj", "o_proj")])


@pytest.mark.full
def test_expert_adapters_merged_are_bridge_merge_of_each_expert(moe, tmp_path):
    run = run_cli("export-hf", moe / "sequential" / "ckpt", tmp_path / "hf", "--hf-config", moe / "cfg",
                  "--merge-adapters", "--lora-alpha", ALPHA, "--verify")
    assert run.returncode == 0, run.stderr
    assert ("note: 32 weights merged with 20 Megatron-Bridge LoRA adapters (s = α / dim, α 8 from --lora-alpha): "
            "W + (B @ A) · s in float32 over each whole Megatron weight") in run.stderr
    got, want, plain = _exported(tmp_path / "hf"), _exported(moe / "ref"), _exported(moe / "plain")
    assert sorted(got) == sorted(want)
    for name in want:
        assert torch.equal(got[name], want[name]), name
    assert sorted(n for n in want if not torch.equal(want[n], plain[n])) == _expert_names()


@pytest.mark.full
def test_expert_adapters_as_peft_target_parameters_load_as_the_merged_model(moe, tmp_path):
    """The experts' LoRA as PEFT's ParamWrapper on transformers 5's fused `gate_up_proj` / `down_proj`:
    expert e's A rows e·r…, its B columns e, E + e, … (peft's own reshape), gate then up; gate_up_proj's
    wrapper inside down_proj's, as peft nests them in the order the module registers them."""
    run = run_cli("export-hf", moe / "sequential" / "ckpt", tmp_path / "ad", "--hf-config", moe / "cfg",
                  "--adapter-only", "--lora-alpha", ALPHA)
    assert run.returncode == 0, run.stderr
    assert ("note: 20 Megatron-Bridge LoRA adapters written as 8 PEFT LoRA modules and 4 expert parameters (each with "
            "the shared linear_in as lora_A and its rows of linear_out as lora_B; the experts' as PEFT's "
            "target_parameters experts.down_proj, experts.gate_up_proj of transformers 5's fused experts; α 8 from "
            "--lora-alpha)") in run.stderr
    config = json.loads((tmp_path / "ad" / "adapter_config.json").read_text())
    assert (config["target_modules"], config["target_parameters"], config["r"]) == (
        ["k_proj", "o_proj", "q_proj", "v_proj"], ["experts.down_proj", "experts.gate_up_proj"], DIM)
    tensors = load_file(tmp_path / "ad" / "adapter_model.safetensors")
    adapters = _load_all(moe / "sequential" / "only")
    fc1 = "decoder.layers.mlp.experts.experts.linear_fc1.adapter"
    gate_up_b = tensors["base_model.model.model.layers.1.mlp.experts.base_layer.lora_B.weight"]
    assert torch.equal(gate_up_b.view(48, DIM, EXPERTS)[:, :, 2], adapters[f"{fc1}.linear_out.weight"][1, 2])
    gate_up_a = tensors["base_model.model.model.layers.1.mlp.experts.base_layer.lora_A.weight"]
    assert torch.equal(gate_up_a.view(EXPERTS, DIM, 32)[2], adapters[f"{fc1}.linear_in.weight"][1, 2])
    merged = run_cli("export-hf", moe / "sequential" / "ckpt", tmp_path / "merged", "--hf-config", moe / "cfg",
                     "--merge-adapters", "--lora-alpha", ALPHA)
    assert merged.returncode == 0, merged.stderr

    _loads_as_the_merged_export(moe / "plain", tmp_path / "ad", tmp_path / "merged")


@pytest.mark.full
@pytest.mark.parametrize("experts", ["shared", "per-expert", "sequential"])
def test_expert_adapters_saved_alone_at_ep_2_merge_with_base(moe, tmp_path, experts):
    """Saved at EP 2 (two ranks, two experts each): TEGroupedMLP's adapters — Bridge's default one
    shared by an EP rank's experts (written to its global expert slots), or `GroupedExpertLinearAdapter`'s
    one per expert — and SequentialMLP's, saved alone with the run's run_config.yaml, joined to the
    pretrained checkpoint by `--base`: Bridge's merge of each expert, bit for bit; and the PEFT folder
    loads as that merged model."""
    run_dir = tmp_path / experts
    bridge_lora.write(run_dir, experts, DIM, ALPHA, ep=2)
    only = run_dir / "only"
    (only / "run_config.yaml").write_text(run_config_yaml(alpha=ALPHA, dim=DIM))
    fc1 = _load_all(only)["decoder.layers.mlp.experts.experts.linear_fc1.adapter.linear_out.weight"]
    assert torch.equal(fc1[0, 0], fc1[0, 3]) == (experts == "shared")  # rank 0's expert 0, rank 1's expert 3
    run = run_cli("reshard", run_dir / "ckpt", tmp_path / "again", "--verify")  # kept at its layout, bit for bit
    assert run.returncode == 0, run.stderr
    saved, again = _load_all(run_dir / "ckpt"), _load_all(tmp_path / "again")
    assert sorted(saved) == sorted(again) and all(torch.equal(saved[n], again[n]) for n in saved)
    ref = tmp_path / "ref"
    run = run_cli("export-hf", _reference(run_dir, tmp_path / "merged-ref"), ref, "--hf-config", moe / "cfg")
    assert run.returncode == 0, run.stderr
    run = run_cli("export-hf", only, tmp_path / "hf", "--hf-config", moe / "cfg", "--base", run_dir / "base",
                  "--merge-adapters", "--verify")
    assert run.returncode == 0, run.stderr
    got, want = _exported(tmp_path / "hf"), _exported(ref)
    assert sorted(got) == sorted(want) and all(torch.equal(got[n], want[n]) for n in want)
    run = run_cli("export-hf", only, tmp_path / "ad", "--hf-config", moe / "cfg", "--adapter-only")
    assert run.returncode == 0, run.stderr
    plain = tmp_path / "plain"
    assert run_cli("export-hf", run_dir / "base", plain, "--hf-config", moe / "cfg").returncode == 0
    _loads_as_the_merged_export(plain, tmp_path / "ad", tmp_path / "hf")


@pytest.mark.full
def test_an_hf_folder_as_base_of_expert_adapters_merges_as_bridge(moe, tmp_path):
    """The HF folder of the pretrained MoE model (its per-expert gate/up/down read back as each expert's
    fc1 [gate; up] and fc2) as `--base` of the adapters-alone save: Bridge's merge, bit for bit."""
    run = run_cli("export-hf", moe / "sequential" / "only", tmp_path / "hf", "--hf-config", moe / "cfg", "--base",
                  moe / "plain", "--merge-adapters", "--verify")
    assert run.returncode == 0, run.stderr
    got, want = _exported(tmp_path / "hf"), _exported(moe / "ref")
    assert sorted(got) == sorted(want) and all(torch.equal(got[n], want[n]) for n in want)


def _with_args(run: Path, dst: Path, grouped: bool) -> Path:
    """A copy of the run's save whose common.pt holds Megatron-LM's args (local spec, SwiGLU, TP 1, 4
    experts; `grouped`: args.moe_grouped_gemm, TEGroupedMLP), which the conversion to Megatron-FSDP needs."""
    import argparse

    shutil.copytree(run / "ckpt", dst)
    common = torch.load(dst / "common.pt", weights_only=False)
    common["args"] = argparse.Namespace(transformer_impl="local", swiglu=True, tensor_model_parallel_size=1,
                                        pipeline_model_parallel_size=1, num_experts=EXPERTS,
                                        moe_grouped_gemm=grouped, expert_model_parallel_size=1)
    torch.save(common, dst / "common.pt")
    return dst


@pytest.mark.full
def test_grouped_expert_adapters_are_not_written_per_expert_in_megatron_fsdp(moe, tmp_path):
    """Under args.moe_grouped_gemm Bridge's model holds an expert adapter once per EP rank (or packed),
    never as `linear_fc1.adapter.linear_in.weight<e>`: the conversion is refused, not written so."""
    src = _with_args(moe / "sequential", tmp_path / "grouped", grouped=True)
    run = run_cli("reshard", src, tmp_path / "fsdp", "--layout", "megatron-fsdp", "--tp", "1", "--dp", "1")
    assert (run.returncode, run.stderr.strip()) == (
        2, f"ckptctl: error: {src}: decoder.layers.mlp.experts.experts.linear_fc1.adapter.linear_in.weight: a "
           "Megatron-Bridge adapter on grouped experts (args.moe_grouped_gemm: TEGroupedMLP), which Bridge's model "
           "holds as one adapter shared by an EP rank's experts or packed [E, …], never per expert: not converted to "
           "Megatron-FSDP yet")
    assert not (tmp_path / "fsdp").exists()


@pytest.mark.full
def test_sequential_expert_adapters_in_megatron_fsdp_merge_as_bridge(moe, tmp_path):
    """SequentialMLP's adapters converted to Megatron-FSDP (`…local_experts.<e>.linear_fc1.adapter.…`, one
    tensor per expert and layer): merged to Bridge's merge, bit for bit."""
    src = _with_args(moe / "sequential", tmp_path / "seq", grouped=False)
    fsdp = tmp_path / "fsdp"
    run = run_cli("reshard", src, fsdp, "--layout", "megatron-fsdp", "--tp", "1", "--dp", "1", "--verify")
    assert run.returncode == 0, run.stderr
    run = run_cli("export-hf", fsdp, tmp_path / "hf", "--hf-config", moe / "cfg", "--merge-adapters", "--lora-alpha",
                  ALPHA, "--verify")
    assert run.returncode == 0, run.stderr
    got, want = _exported(tmp_path / "hf"), _exported(moe / "ref")
    assert sorted(got) == sorted(want) and all(torch.equal(got[n], want[n]) for n in want)
