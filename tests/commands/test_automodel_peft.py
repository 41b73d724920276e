"""A NeMo Automodel LoRA run's checkpoint, written by Automodel's own code (`fixtures.automodel_lora`:
`apply_lora_to_linear_modules` on a tiny Llama, FSDP2 on 2 gloo ranks, its `Checkpointer` with
`is_peft=True`), as a user points ckptctl at it.

Automodel saves the model as a PEFT folder in `<step>/model/` (not DCP), so: `inspect` names
the adapters (LoRA, modules, rank, α, s, targets) and the optimizer part; `export-hf <step>
--merge-adapters` with the base model's folder (`--hf-config`, or `--base`) is Automodel's own
merge (`LinearLoRA.materialize_effective_weight`) bit for bit, `--adapter-only` gives back
Automodel's adapter tensors exactly; `import-hf BASE TMP --adapter <step>` takes the step
folder. Oracles: Automodel's merge, peft's `PeftModel.from_pretrained` / `merge_and_unload` of
the folder Automodel wrote, transformers' `from_pretrained` of the merged folder.
All behind `full` (Automodel's import and the two-rank save take ~25 s) but one: LoRA on MoE
experts merged straight into the base folder's per-expert weights (one rank, ~10 s).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fixtures import automodel_lora
from fixtures.gloo import run_ranks
from tests.conftest import run_cli


@pytest.fixture(scope="module", autouse=True)
def oracles():
    """Automodel and peft, imported when a test runs (not at collection: `make test` skips these)."""
    pytest.importorskip("peft")
    if not automodel_lora.available():
        pytest.skip("nemo_automodel is not installed")

TOKENS = torch.tensor([[1, 5, 9, 2, 33, 17, 4, 60, 3]])


@pytest.fixture(scope="session")
def run(tmp_path_factory) -> Path:
    """`root/base` (the pretrained HF model) and `root/run/epoch_0_step_1` (Automodel's save)."""
    root = tmp_path_factory.mktemp("automodel-lora")
    automodel_lora.save_base(str(root / "base"))
    run_ranks(automodel_lora.save, 2, str(root / "run"), timeout=300)
    return root


def step(root: Path) -> Path:
    return root / "run" / automodel_lora.STEP


def read_folder(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


@pytest.mark.full
def test_automodel_saves_a_peft_folder_peft_loads_with_the_trained_logits(run):
    """The fact the rest builds on: `model/` is PEFT's own format, names without an adapter name."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    folder = step(run) / "model"
    assert sorted(p.name for p in folder.iterdir()) == ["adapter_config.json", "adapter_model.safetensors",
                                                         "automodel_peft_config.json"]
    names = sorted(read_folder(folder))
    assert len(names) == 28 and names[0] == "base_model.model.model.layers.0.mlp.down_proj.lora_A.weight"
    config = json.loads((folder / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["use_dora"]) == (5, 7, False)
    assert config["target_modules"][0] == "model.layers.0.mlp.down_proj"  # full names, not leaf names
    trained, _ = automodel_lora.trained_model()
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(run / "base"), folder).eval()
    with torch.no_grad():
        torch.testing.assert_close(peft(TOKENS).logits, trained(TOKENS).logits, rtol=0, atol=1e-5)


@pytest.mark.full
def test_inspect_names_the_adapters_the_optimizer_and_the_merge(run):
    s = step(run)
    result = run_cli("inspect", s)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        f"{s}: NeMo Automodel PEFT checkpoint",
        f"  adapters: {s}/model, a PEFT folder (PeftModel.from_pretrained loads it as is): LoRA, 14 modules, rank 5, "
        "α 7 (s = α / r = 1.4) (down_proj ×2, gate_proj ×2, k_proj ×2, o_proj ×2, q_proj ×2, up_proj ×2, v_proj ×2)",
        "  automodel: use_triton false, dropout 0.0, lora_dtype null",
        f"  optimizer: {s}/optim, a DCP checkpoint (ckptctl inspect {s}/optim)",
        f"  merged model: ckptctl export-hf {s} DST --hf-config BASE --merge-adapters",
    ]
    doc = json.loads(run_cli("inspect", s / "model", "--json").stdout)
    assert doc["format"] == "nemo-automodel peft" and doc["optimizer"] is None
    assert doc["adapters"]["kind"] == "lora" and (doc["adapters"]["rank"], doc["adapters"]["alpha"]) == (5, 7)
    assert doc["automodel"]["target_modules"][0] == "*.q_proj"
    assert run_cli("inspect", s / "optim").returncode == 0  # the optimizer part is a DCP checkpoint


@pytest.mark.full
def test_export_hf_of_the_step_is_automodels_merge_bit_for_bit(run, tmp_path):
    from transformers import AutoModelForCausalLM

    result = run_cli("export-hf", step(run), tmp_path / "hf", "--hf-config", run / "base", "--merge-adapters",
                     "--verify")
    assert result.returncode == 0, result.stderr
    assert (f"14 weights merged with 'default' LoRA adapters (s = α / r, α 7 from {step(run)}/model/"
            "adapter_config.json)") in result.stderr
    got, want = read_folder(tmp_path / "hf"), automodel_lora.merged_state()
    assert sorted(got) == sorted(want)
    assert [k for k in want if not torch.equal(got[k], want[k])] == []
    trained, _ = automodel_lora.trained_model()
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(TOKENS).logits, trained(TOKENS).logits, rtol=0, atol=1e-5)


@pytest.mark.full
def test_export_hf_adapter_only_of_the_step_gives_back_automodels_adapter(run, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    result = run_cli("export-hf", step(run), tmp_path / "ad", "--hf-config", run / "base", "--adapter-only")
    assert result.returncode == 0, result.stderr
    got, want = read_folder(tmp_path / "ad"), read_folder(step(run) / "model")
    assert sorted(got) == sorted(want)
    assert [k for k in want if not torch.equal(got[k], want[k])] == []
    trained, _ = automodel_lora.trained_model()
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(run / "base"), tmp_path / "ad").eval()
    with torch.no_grad():
        torch.testing.assert_close(peft(TOKENS).logits, trained(TOKENS).logits, rtol=0, atol=1e-5)


@pytest.mark.full
def test_the_base_weights_come_from_base_when_hf_config_holds_none(run, tmp_path):
    config_only = tmp_path / "config-only"
    config_only.mkdir()
    (config_only / "config.json").write_bytes((run / "base" / "config.json").read_bytes())
    s = step(run)
    result = run_cli("export-hf", s, tmp_path / "out", "--hf-config", config_only, "--merge-adapters")
    assert result.returncode == 2 and result.stderr == (
        f"ckptctl: error: {s}: a NeMo Automodel PEFT checkpoint holds the adapters alone: pass --base (the "
        "pretrained model's Hugging Face folder) or an --hf-config folder holding its safetensors weights\n")
    result = run_cli("export-hf", s, tmp_path / "bf16", "--hf-config", config_only, "--base", run / "base",
                     "--merge-adapters", "--dtype", "bf16")
    assert result.returncode == 0, result.stderr
    got, want = read_folder(tmp_path / "bf16"), automodel_lora.merged_state()
    assert [k for k in want if not torch.equal(got[k], want[k].to(torch.bfloat16))] == []  # rounded once
    result = run_cli("export-hf", s, run / "base" / "out", "--hf-config", run / "base", "--merge-adapters")
    assert result.returncode == 2 and result.stderr == (
        f"ckptctl: error: {run / 'base' / 'out'}: destination overlaps the base {run / 'base'}; the source is never "
        "modified\n")
    result = run_cli("export-hf", s, tmp_path / "a8", "--hf-config", run / "base", "--merge-adapters",
                     "--lora-alpha", "8")
    assert result.returncode == 2 and result.stderr == (
        f"ckptctl: error: --lora-alpha 8 disagrees with {s}/model/adapter_config.json, whose lora_alpha is 7\n")


@pytest.fixture(scope="module")
def imported(run, tmp_path_factory) -> Path:
    """`import-hf base TMP --adapter <step>` at 2 ranks: the peft model's FSDP2 DCP."""
    out = tmp_path_factory.mktemp("automodel-import") / "ckpt"
    result = run_cli("import-hf", run / "base", out, "--adapter", step(run), "--world-size", "2")
    assert result.returncode == 0, result.stderr
    assert f"14 LoRA adapters (rank 5) of {step(run)}/model written under peft's names" in result.stderr
    return out


@pytest.mark.full
def test_the_step_imported_with_its_base_merges_as_automodel_merges(run, imported, tmp_path):
    """`import-hf --adapter <step>`: the peft model's FSDP2 DCP, whose own merged export is Automodel's merge."""
    result = run_cli("export-hf", imported, tmp_path / "hf", "--hf-config", run / "base", "--merge-adapters",
                     "--adapter-config", step(run) / "model" / "adapter_config.json")
    assert result.returncode == 0, result.stderr
    got, want = read_folder(tmp_path / "hf"), automodel_lora.merged_state()
    assert sorted(got) == sorted(want)
    assert [k for k in want if not torch.equal(got[k], want[k])] == []


@pytest.fixture(scope="module")
def dora(tmp_path_factory) -> Path:
    """A DoRA run (`use_dora=True`) saved as `run` is."""
    root = tmp_path_factory.mktemp("automodel-dora")
    automodel_lora.save_base(str(root / "base"))
    run_ranks(automodel_lora.save_dora, 2, str(root / "run"), timeout=300)
    return root


@pytest.mark.full
def test_a_dora_run_merges_as_peft_merges_automodels_folder(dora, tmp_path):
    """Automodel has no DoRA merge of its own (`materialize_effective_weight` refuses DoRA): the
    oracle is peft's `merge_and_unload()` of the folder Automodel wrote, bit for bit, and the
    merged model gives the DoRA model's logits."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    s = step(dora)
    assert ": DoRA, 14 modules, rank 5," in run_cli("inspect", s).stdout
    assert any(k.endswith(".lora_magnitude_vector") for k in read_folder(s / "model"))
    result = run_cli("export-hf", s, tmp_path / "hf", "--hf-config", dora / "base", "--merge-adapters")
    assert result.returncode == 0, result.stderr
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(dora / "base"), s / "model")
    want = peft.merge_and_unload().state_dict()
    got = read_folder(tmp_path / "hf")
    assert sorted(got) == sorted(want)
    assert [k for k in want if not torch.equal(got[k], want[k])] == []
    trained, _ = automodel_lora.trained_model(use_dora=True)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(TOKENS).logits, trained(TOKENS).logits, rtol=0, atol=1e-5)


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> Path:
    """Automodel's own Qwen3-MoE with LoRA on q_proj and on its grouped experts, saved (PEFT) by its Checkpointer."""
    from fixtures import automodel, hf_models

    if not automodel.available():
        pytest.skip("Automodel's Qwen3-MoE is not importable here")
    root = tmp_path_factory.mktemp("automodel-moe-lora")
    ref = hf_models.reference("qwen3-moe", root / "base", **automodel.AUTOMODEL_OVERRIDES)
    run_ranks(automodel_lora.save_moe, 1, str(root / "run"), str(ref.folder), timeout=300)
    return root


def per_expert(stacked: dict[str, torch.Tensor], names: list[str]) -> dict[str, torch.Tensor]:
    """Each of `names` (the base folder's) out of a transformers 5 state dict: an expert's
    `gate_proj` / `up_proj` the first / last half of its rows of `mlp.experts.gate_up_proj`
    [E, 2F, H] (transformers' MergeModulelist then Concatenate), `down_proj` its `down_proj`."""
    out = {}
    for name in names:
        layer, sep, rest = name.partition(".mlp.experts.")
        if not sep:
            out[name] = stacked[name]
            continue
        e, part = int(rest.split(".")[0]), rest.split(".")[1]
        whole = stacked[f"{layer}.mlp.experts.{'down_proj' if part == 'down_proj' else 'gate_up_proj'}"][e]
        half = whole.shape[0] // 2
        out[name] = {"gate_proj": whole[:half], "up_proj": whole[half:], "down_proj": whole}[part]
    return out


def test_lora_on_moe_experts_merges_into_the_base_folders_experts_as_peft_merges_automodels_folder(moe, tmp_path):
    """Automodel writes its grouped experts' LoRA as peft's ParamWrapper (`lora_gate_and_up_A`
    [E, H, dim] → `experts.base_layer.lora_A.weight` [E·dim, H] …, down_proj outermost), while the
    base folder holds the experts one by one: `export-hf STEP --merge-adapters` merges each
    expert's weight as its block of peft's merge of the stack, named as the base folder names
    it, bit for bit peft's `merge_and_unload()` of Automodel's folder (expert by expert), and the
    merged folder loads with the merged model's logits."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    s = step(moe)
    config = json.loads((s / "model" / "adapter_config.json").read_text())
    assert config["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    adapter = read_folder(s / "model")
    assert "base_model.model.model.layers.0.mlp.experts.base_layer.lora_A.weight" in adapter
    assert all(v.abs().max() > 0 for k, v in adapter.items() if "lora_B" in k)  # every adapter changes its weight
    lines = run_cli("inspect", s).stdout.splitlines()
    assert lines[1].endswith("LoRA, 2 modules, rank 4, α 8 (s = α / r = 2) (q_proj ×2); and LoRA on 2 MoE expert "
                             "parameters (mlp.experts.gate_up_proj, mlp.experts.down_proj: 8 tensors as peft's "
                             "ParamWrapper), which export-hf merges into the base folder's per-expert weights; "
                             f"base model {moe / 'base'}")
    assert lines[-1] == f"  merged model: ckptctl export-hf {s} DST --hf-config BASE --merge-adapters"
    result = run_cli("export-hf", s, tmp_path / "merged", "--hf-config", moe / "base", "--merge-adapters")
    assert result.returncode == 0, result.stderr
    assert "38 weights merged with 'default' LoRA adapters" in result.stderr
    base, got = read_folder(moe / "base"), read_folder(tmp_path / "merged")
    assert sorted(got) == sorted(base) and any(".mlp.experts.5.up_proj.weight" in k for k in got)
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(moe / "base"), s / "model")
    merged_model = peft.merge_and_unload().eval()
    want = per_expert(merged_model.state_dict(), sorted(base))
    assert [k for k in want if not torch.equal(got[k], want[k])] == []
    assert len([k for k in base if not torch.equal(got[k], base[k])]) == 38  # 2 q_proj, 2 layers × 6 experts × 3
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    with torch.no_grad():
        assert torch.equal(loaded(TOKENS).logits, merged_model(TOKENS).logits)


@pytest.mark.full
def test_lora_on_moe_experts_exports_as_automodels_own_adapter_folder(moe, tmp_path):
    """`--adapter-only` over the base folder of per-expert weights: Automodel's tensors exactly,
    under its names, and a config peft loads them with to the same logits as Automodel's folder."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    s = step(moe)
    result = run_cli("export-hf", s, tmp_path / "ad", "--hf-config", moe / "base", "--adapter-only")
    assert result.returncode == 0, result.stderr
    got, want = read_folder(tmp_path / "ad"), read_folder(s / "model")
    assert sorted(got) == sorted(want) and [k for k in want if not torch.equal(got[k], want[k])] == []
    config = json.loads((tmp_path / "ad" / "adapter_config.json").read_text())
    assert config["target_parameters"] == ["experts.down_proj", "experts.gate_up_proj"]
    ours = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(moe / "base"), tmp_path / "ad").eval()
    theirs = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(moe / "base"), s / "model").eval()
    with torch.no_grad():
        assert torch.equal(ours(TOKENS).logits, theirs(TOKENS).logits)


@pytest.mark.full
def test_lora_on_moe_experts_is_imported_and_then_merged_as_peft_merges_automodels_folder(moe, tmp_path):
    """The other way: `import-hf --adapter` takes the step folder beside the base folder (the
    experts stacked as transformers holds them), and export-hf merges that import as peft's
    `merge_and_unload()` of Automodel's folder, bit for bit."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    s = step(moe)
    result = run_cli("import-hf", moe / "base", tmp_path / "imp", "--adapter", s, "--world-size", "2")
    assert result.returncode == 0, result.stderr
    result = run_cli("export-hf", tmp_path / "imp", tmp_path / "merged", "--hf-config", moe / "base",
                     "--merge-adapters", "--adapter-config", s / "model" / "adapter_config.json")
    assert result.returncode == 0, result.stderr
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(moe / "base"), s / "model")
    want = peft.merge_and_unload().state_dict()
    got = read_folder(tmp_path / "merged")
    assert sorted(got) == sorted(want)
    assert [k for k in want if not torch.equal(got[k], want[k])] == []
