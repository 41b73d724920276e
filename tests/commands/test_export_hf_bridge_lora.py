"""`export-hf --merge-adapters` of Megatron-Bridge LoRA adapters in a Megatron torch_dist checkpoint.

The checkpoint: megatron-core's own torch_dist save of fixtures/data/megatron_torch_dist (a tiny
Llama, TP 2 at save) with Megatron-Bridge adapters on every linear added under Bridge's names and
shapes (tests/families/test_bridge_adapters.py), all saved again by torch's `dcp.save` beside the
fixture's common.pt and metadata.json. The oracle: Megatron-Bridge's own `LoRAMerge.merge`, loaded
from its file (the package's `__init__` imports transformers names that transformers 5 no longer
has; lora_merge.py needs torch and megatron-core only), applied to each whole layer weight; those
merged weights saved as a plain checkpoint and exported by the base rule must be the merged
export, bit for bit, and transformers must give the same logits from both.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

from fixtures import megatron_core as mc
from tests.conftest import ROOT, run_cli
from tests.families.test_bridge_adapters import DIM, LAYERS, lora_state, run_config_yaml

SRC = ROOT / "fixtures" / "data" / "megatron_torch_dist"
ALPHA = 8


def bridge_merge():
    """Megatron-Bridge's `LoRAMerge.merge`, from its own source file."""
    spec = importlib.util.find_spec("megatron.bridge")
    path = Path(spec.submodule_search_locations[0]) / "peft" / "lora_merge.py"
    module_spec = importlib.util.spec_from_file_location("bridge_lora_merge", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module.LoRAMerge().merge


def save_torch_dist(state: dict[str, torch.Tensor], out: Path) -> Path:
    dcp.save(state, checkpoint_id=out)
    for name in ("common.pt", "metadata.json"):
        shutil.copy(SRC / name, out / name)
    return out


@pytest.fixture(scope="module")
def bridge(tmp_path_factory) -> Path:
    """`ckpt` (base + adapters), `merged` (Bridge's merge of them, no adapters), `cfg` (the HF config)."""
    root = tmp_path_factory.mktemp("bridge_lora")
    meta = dcp.FileSystemReader(str(SRC)).read_metadata()
    base = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in meta.state_dict_metadata.items()
            if hasattr(v, "size")}
    dcp.load(base, checkpoint_id=SRC)
    adapters = lora_state()
    save_torch_dist({**base, **adapters}, root / "ckpt")
    merge = bridge_merge()
    merged = dict(base)
    for name in adapters:
        if name.endswith("adapter.linear_in.weight"):
            module = name.removesuffix(".adapter.linear_in.weight")
            a, b = adapters[name], adapters[f"{module}.adapter.linear_out.weight"]
            merged[f"{module}.weight"] = torch.stack([merge(base[f"{module}.weight"][i], b[i], a[i], ALPHA, DIM,
                                                            tp_group=None) for i in range(LAYERS)])
    save_torch_dist(merged, root / "merged")
    (root / "cfg").mkdir()
    (root / "cfg" / "config.json").write_text(json.dumps(mc.hf_config("llama")))
    # what a Bridge LoRA run saves: the adapters alone, and its run_config.yaml in the same folder
    save_torch_dist(adapters, root / "only")
    (root / "only" / "run_config.yaml").write_text(run_config_yaml(alpha=ALPHA, dim=DIM))
    save_torch_dist({**base, **lora_state(canonical=True)}, root / "canonical")
    save_torch_dist(lora_state(canonical=True), root / "canonical-only")
    (root / "canonical-only" / "run_config.yaml").write_text(run_config_yaml("canonical-lora", alpha=ALPHA, dim=DIM))
    plain = run_cli("export-hf", SRC, root / "plain", "--hf-config", root / "cfg")
    assert plain.returncode == 0, plain.stderr
    return root


def test_merged_export_is_bridge_merge_split_by_the_base_rule(bridge, tmp_path):
    run = run_cli("export-hf", bridge / "ckpt", tmp_path / "hf", "--hf-config", bridge / "cfg", "--merge-adapters",
                  "--lora-alpha", ALPHA, "--verify")
    assert run.returncode == 0, run.stderr
    assert ("note: 14 weights merged with 8 Megatron-Bridge LoRA adapters (s = α / dim, α 8 from --lora-alpha): "
            "W + (B @ A) · s in float32 over each whole Megatron weight, as Megatron-Bridge's LoRAMerge, then split "
            "as the base and cast once") in run.stderr
    ref = run_cli("export-hf", bridge / "merged", tmp_path / "ref", "--hf-config", bridge / "cfg")
    assert ref.returncode == 0, ref.stderr
    plain = run_cli("export-hf", SRC, tmp_path / "plain", "--hf-config", bridge / "cfg")
    assert plain.returncode == 0, plain.stderr
    got, want, unmerged = (load_file(tmp_path / d / "model.safetensors") for d in ("hf", "ref", "plain"))
    assert sorted(got) == sorted(want)
    for name in want:
        assert torch.equal(got[name], want[name]), name
    changed = sorted(n for n in want if not torch.equal(got[n], unmerged[n]))
    assert changed == sorted(f"model.layers.{i}.{m}.weight" for i in range(LAYERS) for m in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
        "mlp.up_proj", "mlp.down_proj"))

    from transformers import AutoModelForCausalLM
    tokens = torch.arange(12).view(2, 6) % 200
    logits = []
    for folder in ("hf", "ref"):
        model = AutoModelForCausalLM.from_pretrained(tmp_path / folder, torch_dtype=torch.float32).eval()
        with torch.no_grad():
            logits.append(model(tokens).logits)
    assert torch.equal(logits[0], logits[1])


def test_bf16_export_is_bridge_fp32_merge_cast_once(bridge, tmp_path):
    run = run_cli("export-hf", bridge / "ckpt", tmp_path / "hf", "--hf-config", bridge / "cfg", "--merge-adapters",
                  "--lora-alpha", ALPHA, "--dtype", "bf16")
    assert run.returncode == 0, run.stderr
    ref = run_cli("export-hf", bridge / "merged", tmp_path / "ref", "--hf-config", bridge / "cfg", "--dtype", "bf16")
    assert ref.returncode == 0, ref.stderr
    got, want = (load_file(tmp_path / d / "model.safetensors") for d in ("hf", "ref"))
    assert all(torch.equal(got[n], want[n]) for n in want) and got["model.layers.0.self_attn.q_proj.weight"].dtype \
        == torch.bfloat16


@pytest.mark.parametrize(("flags", "line"), [
    ((), "ckptctl: error: {ckpt}: holds 8 Megatron-Bridge LoRA adapters (dim 4): pass --merge-adapters to export the "
         "model with them merged, or --adapter-only to export them as a PEFT adapter folder"),
    (("--merge-adapters",), "ckptctl: error: {ckpt}: has no run_config.yaml, where Megatron-Bridge keeps the run's "
                            "LoRA α (peft.alpha): pass --lora-alpha"),
    (("--adapter-only",), "ckptctl: error: {ckpt}: has no run_config.yaml, where Megatron-Bridge keeps the run's LoRA "
                          "α (peft.alpha): pass --lora-alpha"),
    (("--adapter-only", "--lora-alpha", "8", "--include", "*q_proj*"), "ckptctl: error: --include/--exclude do not "
                                                                       "apply to --adapter-only (a PEFT folder holds "
                                                                       "every adapter)"),
    (("--merge-adapters", "--lora-alpha", "8", "--rslora"), "ckptctl: error: --rslora applies to peft adapters, not "
                                                            "to Megatron-Bridge's"),
])
def test_refusals(bridge, tmp_path, flags, line):
    run = run_cli("export-hf", bridge / "ckpt", tmp_path / "hf", "--hf-config", bridge / "cfg", *flags)
    assert (run.returncode, run.stderr.strip()) == (2, line.format(ckpt=bridge / "ckpt"))
    assert not (tmp_path / "hf").exists()


def test_flags_without_adapters_are_refused(bridge, tmp_path):
    run = run_cli("export-hf", SRC, tmp_path / "hf", "--hf-config", bridge / "cfg", "--merge-adapters")
    assert (run.returncode, run.stderr.strip()) == (2, f"ckptctl: error: {SRC}: --merge-adapters, but the checkpoint "
                                                       "holds no LoRA adapter")


def test_an_adapter_on_a_module_the_family_does_not_know_is_refused(bridge, tmp_path):
    meta = dcp.FileSystemReader(str(SRC)).read_metadata()
    state = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in meta.state_dict_metadata.items()
             if hasattr(v, "size")}
    dcp.load(state, checkpoint_id=SRC)
    state.update({"decoder.layers.self_attention.linear_foo.weight": torch.ones(LAYERS, 8, 32),
                  "decoder.layers.self_attention.linear_foo.adapter.linear_in.weight": torch.ones(LAYERS, DIM, 32),
                  "decoder.layers.self_attention.linear_foo.adapter.linear_out.weight": torch.ones(LAYERS, 8, DIM)})
    ckpt = save_torch_dist(state, tmp_path / "ckpt")
    run = run_cli("export-hf", ckpt, tmp_path / "hf", "--hf-config", bridge / "cfg", "--merge-adapters",
                  "--lora-alpha", "8")
    assert (run.returncode, run.stderr.strip()) == (
        2, f"ckptctl: error: {ckpt}: decoder.layers.0.self_attention.linear_foo.adapter.linear_in.weight: a "
           "Megatron-Bridge LoRA adapter on decoder.layers.0.self_attention.linear_foo, which a llama model has no "
           "place for (+1 more adapter)")


def test_adapters_without_base_are_refused(bridge, tmp_path):
    only = bridge / "only"
    run = run_cli("export-hf", only, tmp_path / "hf", "--hf-config", bridge / "cfg", "--merge-adapters")
    assert (run.returncode, run.stderr.strip()) == (
        2, f"ckptctl: error: {only}: decoder.layers.0.mlp.linear_fc1.adapter.linear_in.weight: an adapter on "
           "decoder.layers.0.mlp.linear_fc1, which has no decoder.layers.0.mlp.linear_fc1.weight (a Megatron-Bridge "
           "LoRA save holds the adapters alone: pass --base, the pretrained checkpoint the run started from)")


def test_adapter_only_is_a_peft_folder_peft_loads_on_the_base(bridge, tmp_path):
    run = run_cli("export-hf", bridge / "ckpt", tmp_path / "ad", "--hf-config", bridge / "cfg", "--adapter-only",
                  "--lora-alpha", ALPHA)
    assert run.returncode == 0, run.stderr
    assert ("note: 8 Megatron-Bridge LoRA adapters written as 14 PEFT LoRA modules (each with the shared linear_in as "
            "lora_A and its rows of linear_out as lora_B; α 8 from --lora-alpha): load it with "
            "PeftModel.from_pretrained(base model, folder)") in run.stderr
    config = json.loads((tmp_path / "ad" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["use_rslora"], sorted(config["target_modules"])) == (
        DIM, ALPHA, False, ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"])
    tensors = load_file(tmp_path / "ad" / "adapter_model.safetensors")
    adapters = lora_state()
    for i in range(LAYERS):  # down_proj is linear_fc2 as it is; every module has its linear's A
        hf, meg = f"base_model.model.model.layers.{i}.mlp", "decoder.layers.mlp"
        fc1, fc2 = f"{meg}.linear_fc1.adapter", f"{meg}.linear_fc2.adapter"
        assert torch.equal(tensors[f"{hf}.down_proj.lora_B.weight"], adapters[f"{fc2}.linear_out.weight"][i])
        for proj in ("gate_proj", "up_proj"):
            assert torch.equal(tensors[f"{hf}.{proj}.lora_A.weight"], adapters[f"{fc1}.linear_in.weight"][i])
        gate_up = torch.cat([tensors[f"{hf}.gate_proj.lora_B.weight"], tensors[f"{hf}.up_proj.lora_B.weight"]])
        assert torch.equal(gate_up, adapters[f"{fc1}.linear_out.weight"][i])  # torch_dist's fc1 is [W; V]
    for folder, flags in (("plain", ()), ("merged", ("--merge-adapters", "--lora-alpha", ALPHA))):
        run = run_cli("export-hf", SRC if folder == "plain" else bridge / "ckpt", tmp_path / folder, "--hf-config",
                      bridge / "cfg", *flags)
        assert run.returncode == 0, run.stderr

    _loads_as_the_merged_export(tmp_path / "plain", tmp_path / "ad", tmp_path / "merged")


def _loads_as_the_merged_export(plain: Path, adapter: Path, merged: Path) -> None:
    """The PEFT folder `adapter` on the plain export gives the merged export's logits, and peft's
    own merge of it the merged export's weights."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    tokens = torch.arange(12).view(2, 6) % 200
    base = AutoModelForCausalLM.from_pretrained(plain, torch_dtype=torch.float32)
    lora = PeftModel.from_pretrained(base, adapter).eval()
    model = AutoModelForCausalLM.from_pretrained(merged, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(lora(tokens).logits, model(tokens).logits, rtol=1e-5, atol=1e-5)
        peft_weights = lora.merge_and_unload().state_dict()
        for name, value in model.state_dict().items():
            torch.testing.assert_close(peft_weights[name], value, rtol=1e-6, atol=1e-6)


def _exported(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(folder / "model.safetensors")


def test_base_joins_an_adapter_save_to_its_pretrained_checkpoint(bridge, tmp_path):
    """A Bridge LoRA save (adapters alone, run_config.yaml beside them) with `--base` (megatron-core's
    own TP 2 save) merges to Bridge's merge, α from run_config.yaml; and so does its --dry-run."""
    run = run_cli("export-hf", bridge / "only", tmp_path / "hf", "--hf-config", bridge / "cfg", "--base", SRC,
                  "--merge-adapters", "--verify")
    assert run.returncode == 0, run.stderr
    assert f"note: base weights from {SRC} (--base)" in run.stderr
    assert (f"note: 14 weights merged with 8 Megatron-Bridge LoRA adapters (s = α / dim, α 8 from "
            f"{bridge / 'only' / 'run_config.yaml'}): W + (B @ A) · s") in run.stderr
    ref = run_cli("export-hf", bridge / "merged", tmp_path / "ref", "--hf-config", bridge / "cfg")
    assert ref.returncode == 0, ref.stderr
    got, want = _exported(tmp_path / "hf"), _exported(tmp_path / "ref")
    assert sorted(got) == sorted(want) and all(torch.equal(got[n], want[n]) for n in want)
    dry = run_cli("export-hf", bridge / "only", tmp_path / "dry", "--hf-config", bridge / "cfg", "--base", SRC,
                  "--merge-adapters", "--dry-run", "--json")
    assert dry.returncode == 0, dry.stderr
    plan = json.loads(dry.stdout)
    assert plan["merged"]["model.layers.0.self_attn.q_proj.weight"] == {
        "lora_A": "decoder.layers.self_attention.linear_qkv.adapter.linear_in.weight",
        "lora_B": "decoder.layers.self_attention.linear_qkv.adapter.linear_out.weight", "scale": ALPHA / DIM,
        "magnitude": None}
    assert plan["mapping"]["model.layers.0.self_attn.q_proj.weight"] == ["decoder.layers.self_attention.linear_qkv.weight"]
    assert not (tmp_path / "dry").exists()


def test_base_adapter_only_is_the_folder_of_the_full_checkpoint(bridge, tmp_path):
    run = run_cli("export-hf", bridge / "only", tmp_path / "ad", "--hf-config", bridge / "cfg", "--base", SRC,
                  "--adapter-only")
    assert run.returncode == 0, run.stderr
    assert (f"α 8 from {bridge / 'only' / 'run_config.yaml'}): load it with PeftModel.from_pretrained(base model, "
            "folder)") in run.stderr
    full = run_cli("export-hf", bridge / "ckpt", tmp_path / "full", "--hf-config", bridge / "cfg", "--adapter-only",
                   "--lora-alpha", ALPHA)
    assert full.returncode == 0, full.stderr
    # without --base: laid out by the shapes the family's rules give the config's model, no base read
    run = run_cli("export-hf", bridge / "only", tmp_path / "shaped", "--hf-config", bridge / "cfg", "--adapter-only",
                  "--verify")
    assert run.returncode == 0, run.stderr
    assert (f"note: the adapters alone in {bridge / 'only'}: laid out by the base model's shapes for "
            f"{bridge / 'cfg' / 'config.json'} (transformers' llama model), no base weight read") in run.stderr
    for folder in ("ad", "shaped"):
        got, want = (load_file(tmp_path / d / "adapter_model.safetensors") for d in (folder, "full"))
        assert sorted(got) == sorted(want) and all(torch.equal(got[n], want[n]) for n in want)
        assert json.loads((tmp_path / folder / "adapter_config.json").read_text()) == \
            json.loads((tmp_path / "full" / "adapter_config.json").read_text())
    run = run_cli("export-hf", bridge / "only", tmp_path / "unchecked", "--hf-config", bridge / "cfg",
                  "--adapter-only", "--no-name-check")
    assert (run.returncode, run.stderr.strip()) == (
        2, f"ckptctl: error: {bridge / 'only'}: holds Megatron-Bridge LoRA adapters alone: --adapter-only lays them out "
           "by the base model's shapes, known from transformers' model for the config; pass --base (the pretrained "
           "checkpoint) where transformers or the name check is off")


def test_base_refusals(bridge, tmp_path):
    cfg = ("--hf-config", bridge / "cfg")
    only, ckpt = bridge / "only", bridge / "ckpt"
    meta = dcp.FileSystemReader(str(SRC)).read_metadata()
    state = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in meta.state_dict_metadata.items()
             if hasattr(v, "size") and k != "decoder.layers.mlp.linear_fc1.weight"}
    dcp.load(state, checkpoint_id=SRC)
    other = save_torch_dist(state, tmp_path / "no-fc1")
    cases = [
        ((only, "--base", other, "--merge-adapters"),
         f"{only}: decoder.layers.0.mlp.linear_fc1.adapter.linear_in.weight: an adapter on "
         f"decoder.layers.0.mlp.linear_fc1, whose weight decoder.layers.0.mlp.linear_fc1.weight is not in {other} "
         "either (is it the run's pretrained checkpoint?)"),
        ((ckpt, "--base", SRC, "--merge-adapters", "--lora-alpha", "8"),
         f"{ckpt}: decoder.final_layernorm.weight (+8 more) is in {SRC} too: which one is the model's is not guessed "
         "(--base is for a Megatron-Bridge LoRA save, which holds the adapters alone)"),
        ((SRC, "--base", SRC, "--merge-adapters"),
         f"{SRC}: decoder.final_layernorm.weight (+8 more) is in {SRC} too: which one is the model's is not guessed "
         "(--base is for a Megatron-Bridge LoRA save, which holds the adapters alone)"),
        ((only, "--base", SRC, "--merge-adapters", "--lora-alpha", "16"),
         f"--lora-alpha 16 disagrees with {only / 'run_config.yaml'}, whose peft.alpha is 8"),
    ]
    for args, line in cases:
        run = run_cli("export-hf", args[0], tmp_path / "hf", *cfg, *args[1:])
        assert (run.returncode, run.stderr.strip()) == (2, f"ckptctl: error: {line}"), args
        assert not (tmp_path / "hf").exists()
    plain = tmp_path / "plain-dcp"
    dcp.save(lora_state(), checkpoint_id=plain)  # torch's own save: no metadata.json
    run = run_cli("export-hf", only, tmp_path / "hf", *cfg, "--base", plain, "--merge-adapters")
    assert (run.returncode, run.stderr.strip()) == (
        2, f"ckptctl: error: --base {plain}: not a Megatron torch_dist checkpoint (--base joins a Megatron-Bridge LoRA "
           "save to its pretrained torch_dist checkpoint)")
    run = run_cli("export-hf", only, only / "out", *cfg, "--base", SRC, "--merge-adapters")
    assert run.returncode == 2 and "destination overlaps the source" in run.stderr
    base = tmp_path / "base"
    shutil.copytree(SRC, base)
    run = run_cli("export-hf", only, base / "out", *cfg, "--base", base, "--merge-adapters")
    assert (run.returncode, run.stderr.strip()) == (2, f"ckptctl: error: {base / 'out'}: destination overlaps the base "
                                                       f"{base}; the source is never modified")
    assert sorted(p.name for p in base.iterdir()) == sorted(p.name for p in SRC.iterdir())


def test_run_config_that_does_not_describe_the_adapters_is_refused(bridge, tmp_path):
    """A dim other than the adapters', canonical adapters beside a LoRA run's config, a hostile
    file: one line naming run_config.yaml (tests/formats/test_bridge_run_config.py has the rest)."""
    ckpt = tmp_path / "only"
    shutil.copytree(bridge / "only", ckpt)
    canonical = tmp_path / "canonical-only"
    shutil.copytree(bridge / "canonical-only", canonical)
    for folder, text, line in (
        (ckpt, run_config_yaml(alpha=8, dim=8), "peft.dim is 8, but decoder.layers.0.mlp.linear_fc1.adapter.linear_in."
                                                "weight has dim 4 (is this the run's run_config.yaml?)"),
        (ckpt, "peft: !!python/object/apply:os.system ['true']\n", "not a readable run config (could not determine a "
                                                                   "constructor for the tag 'tag:yaml.org,2002:python/"
                                                                   "object/apply:os.system' at line 1)"),
        (canonical, run_config_yaml(alpha=8, dim=4), "peft._target_ is LoRA, but decoder.layers.0.mlp.linear_fc1."
                                                     "adapter.adapter_gate.linear_in.weight is canonical LoRA's (is this "
                                                     "the run's run_config.yaml?)"),
    ):
        (folder / "run_config.yaml").write_text(text)
        run = run_cli("export-hf", folder, tmp_path / "hf", "--hf-config", bridge / "cfg", "--base", SRC,
                      "--merge-adapters")
        assert (run.returncode, run.stderr.strip()) == (2, f"ckptctl: error: {folder / 'run_config.yaml'}: {line}")
        assert not (tmp_path / "hf").exists()


def _canonical_reference(bridge) -> dict[str, torch.Tensor]:
    """Megatron-Bridge's merge of canonical LoRA, as `_merge_canonical_adapter_from_weights` does it:
    each HF tensor of the base (the plain export) merged with its adapter by `LoRAMerge.merge` in
    float32 — q_proj with adapter_q …, o_proj and down_proj with linear_proj's and linear_fc2's."""
    merge = bridge_merge()
    adapters = lora_state(canonical=True)
    out = dict(_exported(bridge / "plain"))
    hf = {"adapter_q": "self_attn.q_proj", "adapter_k": "self_attn.k_proj", "adapter_v": "self_attn.v_proj",
          "adapter_gate": "mlp.gate_proj", "adapter_up": "mlp.up_proj"}
    for i in range(LAYERS):
        for name in adapters:
            if not name.endswith(".linear_in.weight"):
                continue
            prefix = name.removesuffix(".linear_in.weight")
            leaf = prefix.rsplit(".", 1)[-1]
            module = hf.get(leaf) or {"linear_proj": "self_attn.o_proj", "linear_fc2": "mlp.down_proj"}[
                prefix.removesuffix(".adapter").rsplit(".", 1)[-1]]
            key = f"model.layers.{i}.{module}.weight"
            out[key] = merge(out[key].float(), adapters[f"{prefix}.linear_out.weight"][i], adapters[name][i], ALPHA,
                             DIM, tp_group=None)
    return out


def test_canonical_lora_merged_is_bridge_merge_of_each_projection(bridge, tmp_path):
    want = _canonical_reference(bridge)
    for src, extra in ((bridge / "canonical", ("--lora-alpha", ALPHA)), (bridge / "canonical-only", ("--base", SRC))):
        out = tmp_path / src.name
        run = run_cli("export-hf", src, out, "--hf-config", bridge / "cfg", "--merge-adapters", "--verify", *extra)
        assert run.returncode == 0, run.stderr
        assert ("note: 14 weights merged with 14 Megatron-Bridge LoRA adapters (s = α / dim, α 8 from "
                f"{'--lora-alpha' if src.name == 'canonical' else src / 'run_config.yaml'}): W + (B @ A) · s in float32 "
                "over each whole Megatron weight, as Megatron-Bridge's LoRAMerge, then split as the base and cast once; "
                "canonical LoRA's over the HF tensor it names (q_proj …), as Bridge merges those") in run.stderr
        got = _exported(out)
        assert sorted(got) == sorted(want)
        for name in want:
            assert torch.equal(got[name], want[name]), name


def test_canonical_lora_adapter_only_is_a_peft_folder_of_its_own_factors(bridge, tmp_path):
    run = run_cli("export-hf", bridge / "canonical-only", tmp_path / "ad", "--hf-config", bridge / "cfg",
                  "--adapter-only")  # no --base: laid out by the config's shapes
    assert run.returncode == 0, run.stderr
    assert "note: 14 Megatron-Bridge LoRA adapters written as 14 PEFT LoRA modules" in run.stderr
    tensors = load_file(tmp_path / "ad" / "adapter_model.safetensors")
    adapters = lora_state(canonical=True)
    hf = {"adapter_q": "self_attn.q_proj", "adapter_k": "self_attn.k_proj", "adapter_v": "self_attn.v_proj",
          "adapter_gate": "mlp.gate_proj", "adapter_up": "mlp.up_proj"}
    for i in range(LAYERS):
        for split, module in hf.items():
            meg = f"decoder.layers.{'self_attention.linear_qkv' if 'attn' in module else 'mlp.linear_fc1'}.adapter.{split}"
            peft_name = f"base_model.model.model.layers.{i}.{module}"
            assert torch.equal(tensors[f"{peft_name}.lora_A.weight"], adapters[f"{meg}.linear_in.weight"][i])
            assert torch.equal(tensors[f"{peft_name}.lora_B.weight"], adapters[f"{meg}.linear_out.weight"][i])
    merged = run_cli("export-hf", bridge / "canonical-only", tmp_path / "merged", "--hf-config", bridge / "cfg",
                     "--base", SRC, "--merge-adapters")
    assert merged.returncode == 0, merged.stderr

    _loads_as_the_merged_export(bridge / "plain", tmp_path / "ad", tmp_path / "merged")


def _load_all(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP checkpoint, by torch's own `dcp.load`."""
    meta = dcp.FileSystemReader(str(path)).read_metadata()
    state = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in meta.state_dict_metadata.items()
             if hasattr(v, "size")}
    dcp.load(state, checkpoint_id=path)
    return state


def _with_args(src: Path, dst: Path) -> Path:
    """A copy of `src` whose common.pt holds Megatron-LM's args (the fixture's model: local spec,
    SwiGLU, TP 2), which the conversion to Megatron-FSDP needs."""
    import argparse

    shutil.copytree(src, dst)
    common = torch.load(dst / "common.pt", weights_only=False)
    common["args"] = argparse.Namespace(transformer_impl="local", swiglu=True, tensor_model_parallel_size=2,
                                        pipeline_model_parallel_size=1)
    torch.save(common, dst / "common.pt")
    return dst


@pytest.mark.full
def test_reshard_keeps_bridge_adapters_at_their_layout_and_in_megatron_fsdp(bridge, tmp_path):
    """A torch_dist save with Bridge adapters: rewritten at its own layout, every tensor comes back
    equal (`dcp.load`); converted to Megatron-FSDP's fsdp_dtensor at TP 2 × DP 2, each layer's adapter
    is its slab, fc1's linear_out TP-blocked [W_0; V_0; W_1; V_1] as Megatron-LM saves an fc1 adapter
    it does not split (`handle_swiglu_in_state_dict` splits fc1's own weight only), and export-hf
    merges it (fc1 saved as weight_w / weight_v) to Bridge's merge bit for bit, and writes the same
    PEFT folder; the way back to torch_dist unblocks fc1's adapter to the first save's tensors. Canonical
    LoRA's adapters (their own rows, never blocked) convert and merge too."""
    own = tmp_path / "own"
    run = run_cli("reshard", bridge / "ckpt", own, "--verify")
    assert run.returncode == 0, run.stderr
    want = _load_all(bridge / "ckpt")
    got = _load_all(own)
    assert sorted(got) == sorted(want) and all(torch.equal(got[n], want[n]) for n in want)

    src = _with_args(bridge / "ckpt", tmp_path / "args")
    fsdp = tmp_path / "fsdp"
    run = run_cli("reshard", src, fsdp, "--layout", "megatron-fsdp", "--tp", "2", "--dp", "2", "--verify")
    assert run.returncode == 0, run.stderr
    got = _load_all(fsdp)
    for name, stack in lora_state().items():
        for i in range(LAYERS):
            saved = got[f"model.module.{name.replace('decoder.layers.', f'decoder.layers.{i}.')}"]
            if name.endswith("linear_fc1.adapter.linear_out.weight"):
                w, v = stack[i].chunk(2)
                assert torch.equal(saved, torch.cat([w[:24], v[:24], w[24:], v[24:]])), name
            else:
                assert torch.equal(saved, stack[i]), name
    inspect = run_cli("inspect", fsdp, "--json")
    assert json.loads(inspect.stdout)["adapters"]["targets"] == {"linear_fc1": 2, "linear_fc2": 2, "linear_proj": 2,
                                                                 "linear_qkv": 2}

    run = run_cli("export-hf", fsdp, tmp_path / "hf", "--hf-config", bridge / "cfg", "--merge-adapters", "--lora-alpha",
                  ALPHA, "--verify")
    assert run.returncode == 0, run.stderr
    ref = run_cli("export-hf", bridge / "merged", tmp_path / "ref", "--hf-config", bridge / "cfg")
    assert ref.returncode == 0, ref.stderr
    merged, want = _exported(tmp_path / "hf"), _exported(tmp_path / "ref")
    assert sorted(merged) == sorted(want) and all(torch.equal(merged[n], want[n]) for n in want)
    for folder, ckpt in (("ad-fsdp", fsdp), ("ad-dist", bridge / "ckpt")):
        run = run_cli("export-hf", ckpt, tmp_path / folder, "--hf-config", bridge / "cfg", "--adapter-only",
                      "--lora-alpha", ALPHA)
        assert run.returncode == 0, run.stderr
    a, b = (load_file(tmp_path / d / "adapter_model.safetensors") for d in ("ad-fsdp", "ad-dist"))
    assert sorted(a) == sorted(b) and all(torch.equal(a[n], b[n]) for n in b)

    run = run_cli("export-hf", fsdp, tmp_path / "hf-tp1", "--hf-config", bridge / "cfg", "--merge-adapters",
                  "--lora-alpha", ALPHA, "--tp", "1")
    assert (run.returncode, run.stderr.strip()) == (2, f"ckptctl: error: {fsdp}: --tp 1 but the checkpoint's args say "
                                                       "TP 2")
    run = run_cli("reshard", fsdp, tmp_path / "back", "--layout", "torch-dist", "--verify")
    assert run.returncode == 0, run.stderr
    back = _load_all(tmp_path / "back")  # fc1's adapter unblocked to torch_dist's [W_all; V_all], as saved at first
    assert all(torch.equal(back[name], stack) for name, stack in lora_state().items())

    # canonical LoRA: each projection's adapter is its own, never TP-blocked; merged as Bridge merges it
    src = _with_args(bridge / "canonical", tmp_path / "canonical-args")
    fsdp = tmp_path / "canonical-fsdp"
    run = run_cli("reshard", src, fsdp, "--layout", "megatron-fsdp", "--tp", "2", "--dp", "2", "--verify")
    assert run.returncode == 0, run.stderr
    run = run_cli("export-hf", fsdp, tmp_path / "canonical-hf", "--hf-config", bridge / "cfg", "--merge-adapters",
                  "--lora-alpha", ALPHA)
    assert run.returncode == 0, run.stderr
    merged, want = _exported(tmp_path / "canonical-hf"), _canonical_reference(bridge)
    assert sorted(merged) == sorted(want) and all(torch.equal(merged[n], want[n]) for n in want)


def test_an_hf_folder_as_base_merges_as_the_torch_dist_base(bridge, tmp_path):
    """The pretrained model as users hold it, the HF folder (here the plain export of the fixture's
    model): each Megatron weight is read back from its HF tensors' rows through the family's rules
    (linear_qkv's query groups, fc1's [gate; up]); the merge is Bridge's, bit for bit, and so is the
    PEFT folder."""
    hf_base = bridge / "plain"
    run = run_cli("export-hf", bridge / "only", tmp_path / "hf", "--hf-config", bridge / "cfg", "--base", hf_base,
                  "--merge-adapters", "--verify")
    assert run.returncode == 0, run.stderr
    assert f"note: base weights from {hf_base} (--base, a Hugging Face folder read through the llama rules)" \
        in run.stderr
    ref = run_cli("export-hf", bridge / "merged", tmp_path / "ref", "--hf-config", bridge / "cfg")
    assert ref.returncode == 0, ref.stderr
    got, want = _exported(tmp_path / "hf"), _exported(tmp_path / "ref")
    assert sorted(got) == sorted(want) and all(torch.equal(got[n], want[n]) for n in want)
    for folder, base in (("ad", hf_base), ("ad-dist", SRC)):
        run = run_cli("export-hf", bridge / "only", tmp_path / folder, "--hf-config", bridge / "cfg", "--base", base,
                      "--adapter-only")
        assert run.returncode == 0, run.stderr
    a, b = (load_file(tmp_path / d / "adapter_model.safetensors") for d in ("ad", "ad-dist"))
    assert sorted(a) == sorted(b) and all(torch.equal(a[n], b[n]) for n in b)


def test_an_hf_base_the_config_does_not_describe_is_refused(bridge, tmp_path):
    from safetensors.torch import save_file

    plain = _exported(bridge / "plain")
    cases = [("stray", {**plain, "model.extra.weight": torch.zeros(2)},
              "model.extra.weight: a tensor a llama model of {cfg} has no place for (is --hf-config the base's "
              "config?)"),
             ("short", {k: v for k, v in plain.items() if k != "model.norm.weight"},
              "has no model.norm.weight, which a llama model of {cfg} has (is --base the run's pretrained model?)"),
             ("wide", {**plain, "model.norm.weight": torch.zeros(33)},
              "model.norm.weight: shape [33], a llama model of {cfg} has [32] (is --hf-config the base's config?)")]
    for name, tensors, line in cases:
        folder = tmp_path / name
        folder.mkdir()
        save_file(tensors, folder / "model.safetensors")
        shutil.copy(bridge / "plain" / "config.json", folder / "config.json")
        run = run_cli("export-hf", bridge / "only", tmp_path / "hf", "--hf-config", bridge / "cfg", "--base", folder,
                      "--merge-adapters")
        want = f"ckptctl: error: {folder}: {line.format(cfg=bridge / 'cfg' / 'config.json')}"
        assert (run.returncode, run.stderr.strip()) == (2, want), name
        assert not (tmp_path / "hf").exists()
    run = run_cli("export-hf", bridge / "ckpt", tmp_path / "hf", "--hf-config", bridge / "cfg", "--base",
                  bridge / "plain", "--merge-adapters", "--lora-alpha", "8")
    assert (run.returncode, run.stderr.strip()) == (
        2, f"ckptctl: error: {bridge / 'ckpt'}: holds model weights beside its Megatron-Bridge LoRA adapters: an HF "
           "--base is for a Bridge LoRA save, which holds the adapters alone")
    plain_dcp = tmp_path / "plain-dcp"
    dcp.save(lora_state(), checkpoint_id=plain_dcp)  # torch's own save: no metadata.json, not torch_dist
    run = run_cli("export-hf", plain_dcp, tmp_path / "hf", "--hf-config", bridge / "cfg", "--base", bridge / "plain",
                  "--merge-adapters", "--lora-alpha", "8")
    assert (run.returncode, run.stderr.strip()) == (
        2, f"ckptctl: error: {plain_dcp}: not a Megatron torch_dist checkpoint: an HF --base is joined to a torch_dist "
           "Megatron-Bridge LoRA save (a Megatron-FSDP one's fused adapters are TP-blocked at its run's TP), not yet "
           "to others")


def test_a_bridge_dora_save_is_refused_by_its_magnitude(bridge, tmp_path):
    """`DoRALinear`'s `adapter.weight_magnitude` beside the factors: refused by name, whatever the base."""
    state = {**lora_state(), "decoder.layers.self_attention.linear_qkv.adapter.weight_magnitude": torch.ones(LAYERS, 64)}
    ckpt = save_torch_dist(state, tmp_path / "dora")
    (ckpt / "run_config.yaml").write_text(run_config_yaml("dora", alpha=ALPHA, dim=DIM))
    for base in (SRC, bridge / "plain"):
        run = run_cli("export-hf", ckpt, tmp_path / "hf", "--hf-config", bridge / "cfg", "--base", base,
                      "--merge-adapters")
        assert (run.returncode, run.stderr.strip()) == (
            2, f"ckptctl: error: {ckpt}: decoder.layers.0.self_attention.linear_qkv.adapter.weight_magnitude: a "
               "Megatron-Bridge DoRA magnitude, which export-hf does not merge (Megatron-Bridge has no DoRA merge of "
               "its own to be equal to)"), base
