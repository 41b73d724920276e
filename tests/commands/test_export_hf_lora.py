"""`export-hf` of an FSDP2 checkpoint of an HF `peft` LoRA model: merged, or as a PEFT folder.

A tiny LlamaForCausalLM wrapped by peft (r 5, α 7: a scale that is no power of two; every
linear of the decoder adapted; lora_B random, so every adapter changes its weight) is
`fully_shard`ed on 2 gloo ranks and saved by `dcp.save` of `get_model_state_dict`, as a
fine-tuning run saves it (`make test-full`; `make test` proves the same on its state dict saved
whole by one process, the same names and shapes, in a tenth of the time). The oracles are
peft's own: `merge_and_unload()` in float32 (bit for bit), `PeftModel.from_pretrained` of the
adapter folder (logits equal to the trained model's, no "missing adapter keys" warning),
transformers' `from_pretrained` of the merged folder.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

from fixtures.gloo import run_ranks
from tests.conftest import run_cli

pytest.importorskip("peft")

WORLD = 2
RANK, ALPHA = 5, 7
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TOKENS = torch.tensor([[1, 5, 9, 2, 33, 17, 4, 60, 3]])


def llama_config(**sizes):
    from transformers import LlamaConfig

    return LlamaConfig(**{"vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
                          "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": False, **sizes})


WIDE = {"hidden_size": 128, "intermediate_size": 768}
"""Sizes whose MLP weights (128 × 768 float32: 384 KiB) are larger than the engine's block."""


def lora_config(**overrides):
    from peft import LoraConfig

    return LoraConfig(**{"r": RANK, "lora_alpha": ALPHA, "target_modules": TARGETS, **overrides})


def peft_model(sizes=None, **overrides):
    """The trained model: a seeded base with adapters whose B is random (peft starts it at zero)."""
    from peft import get_peft_model
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = get_peft_model(LlamaForCausalLM(llama_config(**(sizes or {}))), lora_config(**overrides))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5)
    return model.eval()


def _save(rank: int, world_size: int, out: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = peft_model()
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model.base_model.model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=out)


def saved(root: Path) -> Path:
    """`root` with the base model's HF config folder and the run's adapter_config.json beside `ckpt`."""
    llama_config().save_pretrained(root / "base")
    peft_model().save_pretrained(root / "adapter")
    return root


@pytest.fixture(scope="session")
def fsdp2(tmp_path_factory):
    """The trained model saved by FSDP2 on 2 gloo ranks (every tensor row-sharded)."""
    root = tmp_path_factory.mktemp("lora-fsdp2")
    run_ranks(_save, WORLD, str(root / "ckpt"), timeout=240)
    return saved(root)


@pytest.fixture(scope="session")
def lora(tmp_path_factory):
    """The trained model's state dict saved whole by `dcp.save` in this process: the names and
    shapes of the FSDP2 save, in a tenth of the time."""
    import torch.distributed.checkpoint as dcp

    root = tmp_path_factory.mktemp("lora")
    dcp.save({"model": peft_model().state_dict()}, checkpoint_id=root / "ckpt", no_dist=True)
    return saved(root)


SAVES = ["lora", pytest.param("fsdp2", marks=pytest.mark.full)]
"""The checkpoints the exports are proven on (the FSDP2 one by `make test-full`)."""


def export(lora: Path, dst: Path, *args: str):
    return run_cli("export-hf", lora / "ckpt", dst, "--hf-config", lora / "base", *args)


def base_state(sizes=None) -> dict[str, torch.Tensor]:
    """The trained model's base weights under HF names (what the adapters are merged into)."""
    state = peft_model(sizes).get_base_model().state_dict()
    return {k.replace(".base_layer", ""): v for k, v in state.items() if "lora_" not in k}


def merged_state() -> dict[str, torch.Tensor]:
    return peft_model().merge_and_unload().state_dict()


def read_folder(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


@pytest.mark.parametrize("save", SAVES)
def test_merged_fp32_weights_are_peft_merge_bit_for_bit_and_give_its_logits(request, save, tmp_path):
    lora = request.getfixturevalue(save)
    from transformers import AutoModelForCausalLM

    dst = tmp_path / "merged"
    res = export(lora, dst, "--merge-adapters", "--adapter-config", lora / "adapter" / "adapter_config.json",
                 "--verify", "--json")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["verified"] is True
    want = merged_state()
    got = read_folder(dst)
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name
    base = base_state()
    assert sum(not torch.equal(base[n], want[n]) for n in want) == 7 * 2  # every adapted weight changed
    model = AutoModelForCausalLM.from_pretrained(dst).eval()
    with torch.no_grad():
        assert torch.equal(model(TOKENS).logits, peft_model().merge_and_unload()(TOKENS).logits)


@pytest.mark.parametrize("save", SAVES)
def test_bf16_merge_is_the_fp32_merge_rounded_once(request, save, tmp_path):
    lora = request.getfixturevalue(save)
    dst = tmp_path / "bf16"
    res = export(lora, dst, "--merge-adapters", "--lora-alpha", str(ALPHA), "--dtype", "bf16")
    assert res.returncode == 0, res.stderr
    got = read_folder(dst)
    want = peft_model().float().merge_and_unload().to(torch.bfloat16).state_dict()
    for name, tensor in want.items():
        assert got[name].dtype == torch.bfloat16 and torch.equal(got[name], tensor), name


@pytest.mark.parametrize("save", SAVES)
def test_adapter_folder_loads_in_peft_with_the_trained_logits(request, save, tmp_path):
    lora = request.getfixturevalue(save)
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    dst = tmp_path / "adapter"
    res = export(lora, dst, "--adapter-only", "--lora-alpha", str(ALPHA), "--verify")
    assert res.returncode == 0, res.stderr
    assert sorted(p.name for p in dst.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    trained = peft_model()
    saved = read_folder(lora / "adapter")
    got = read_folder(dst)
    assert sorted(got) == sorted(saved)
    assert all(torch.equal(got[n], saved[n]) for n in saved)
    config = json.loads((dst / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"], config["use_rslora"], config["target_modules"]) \
        == ("LORA", RANK, ALPHA, False, sorted(TARGETS))
    assert config["base_model_name_or_path"] == str(lora / "base")
    base = LlamaForCausalLM(llama_config())
    base.load_state_dict(base_state())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = PeftModel.from_pretrained(base, dst).eval()
    assert not [w for w in caught if "adapter keys" in str(w.message)]
    with torch.no_grad():
        assert torch.equal(loaded(TOKENS).logits, trained(TOKENS).logits)


def test_adapters_without_an_export_mode_are_refused_naming_both(lora, tmp_path):
    res = export(lora, tmp_path / "dst")
    assert res.returncode == 2
    assert res.stderr == (f"ckptctl: error: {lora / 'ckpt'}: holds 14 peft LoRA adapters (rank 5 on down_proj, "
                          "gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj): pass --merge-adapters to export the "
                          "model with them merged, or --adapter-only to export them as a PEFT adapter folder\n")
    assert not (tmp_path / "dst").exists()


@pytest.mark.parametrize("args, line", [
    ((), "{ckpt}: LoRA α is not in the checkpoint: pass --lora-alpha (and --rslora for an rsLoRA run) or "
         "--adapter-config (the run's adapter_config.json)"),
    (("--lora-alpha", "8", "--adapter-config", "{cfg}"), "--lora-alpha 8 disagrees with {cfg}, whose lora_alpha is 7"),
    (("--rslora", "--adapter-config", "{cfg}"), "--rslora disagrees with {cfg}, whose use_rslora is false"),
    (("--adapter-only", "--lora-alpha", "7"), "--merge-adapters and --adapter-only exclude each other: pass one"),
])
def test_scale_refusals_are_one_exact_line(lora, tmp_path, args, line):
    cfg = lora / "adapter" / "adapter_config.json"
    args = [a.format(cfg=cfg) for a in args]
    res = export(lora, tmp_path / "dst", "--merge-adapters", *args)
    assert res.returncode == 2
    assert res.stderr == "ckptctl: error: " + line.format(ckpt=lora / "ckpt", cfg=cfg) + "\n"


def test_a_config_rank_other_than_the_tensors_is_refused(lora, tmp_path):
    cfg = tmp_path / "adapter_config.json"
    cfg.write_text(json.dumps({"peft_type": "LORA", "r": 8, "lora_alpha": ALPHA}))
    res = export(lora, tmp_path / "dst", "--merge-adapters", "--adapter-config", cfg)
    assert res.returncode == 2
    assert res.stderr == (f"ckptctl: error: {lora / 'ckpt'}: model.base_model.model.model.layers.0.mlp.down_proj."
                          f"lora_A.default.weight has rank 5 (its rows), but {cfg} says r 8 (+13 more adapters)\n")


def test_dora_merges_bit_for_bit_and_its_folder_loads_with_the_trained_logits(tmp_path):
    """DoRA (magnitudes random, so each row's scale differs from 1): merged, each row scaled by
    m / ‖W + (B @ A) · s‖ as peft merges it, bit for bit in float32; as a folder, the magnitudes
    under PEFT's name (`lora_magnitude_vector`, no `.weight`) and `use_dora` true."""
    import torch.distributed.checkpoint as dcp
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    from ckptctl.commands.export_hf import ExportOptions, export_hf

    def trained():
        model = peft_model(use_dora=True, target_modules=["q_proj", "down_proj"])
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_magnitude_vector" in name:
                    param.mul_(torch.rand(param.shape, generator=torch.Generator().manual_seed(3)) + 0.5)
        return model

    dcp.save({"model": trained().state_dict()}, checkpoint_id=tmp_path / "ckpt", no_dist=True)
    llama_config().save_pretrained(tmp_path / "base")
    trained().save_pretrained(tmp_path / "peft")
    options = dict(adapter_config=tmp_path / "peft" / "adapter_config.json")
    export_hf(tmp_path / "ckpt", tmp_path / "merged", tmp_path / "base", ExportOptions(merge_adapters=True, **options))
    want = trained().merge_and_unload().state_dict()
    got = read_folder(tmp_path / "merged")
    assert sorted(got) == sorted(want) and all(torch.equal(got[n], want[n]) for n in want)
    export_hf(tmp_path / "ckpt", tmp_path / "adapter", tmp_path / "base", ExportOptions(adapter_only=True, **options))
    saved = read_folder(tmp_path / "peft")
    written = read_folder(tmp_path / "adapter")
    assert sorted(written) == sorted(saved) and all(torch.equal(written[n], saved[n]) for n in saved)
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["use_dora"] is True
    base = LlamaForCausalLM(llama_config())
    base.load_state_dict(base_state())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    assert not [w for w in caught if "adapter keys" in str(w.message)]
    with torch.no_grad():
        assert torch.equal(loaded(TOKENS).logits, trained()(TOKENS).logits)


def test_an_adapter_on_a_module_the_model_lacks_is_refused(tmp_path):
    import torch.distributed.checkpoint as dcp

    state = peft_model(target_modules=["q_proj"]).state_dict()
    renamed = {k.replace("layers.1.self_attn.q_proj", "layers.1.self_attn.x_proj"): v for k, v in state.items()}
    dcp.save({"model": renamed}, checkpoint_id=tmp_path / "ckpt", no_dist=True)
    llama_config().save_pretrained(tmp_path / "base")
    res = export(tmp_path, tmp_path / "dst", "--merge-adapters", "--lora-alpha", "7")
    assert res.returncode == 2
    assert res.stderr == (f"ckptctl: error: {tmp_path / 'ckpt'}: a LoRA adapter on model.layers.1.self_attn.x_proj, "
                          "which a LlamaForCausalLM has no weight for (wrong --hf-config?)\n")
    state = peft_model(target_modules=["q_proj", "k_proj"]).state_dict()
    renamed = {k.replace("self_attn.q_proj", "self_attn.x_proj").replace("self_attn.k_proj", "self_attn.y_proj"): v
               for k, v in state.items()}
    dcp.save({"model": renamed}, checkpoint_id=tmp_path / "ckpt", no_dist=True)
    res = export(tmp_path, tmp_path / "dst", "--merge-adapters", "--lora-alpha", "7")
    assert (res.returncode, res.stderr) == (2, f"ckptctl: error: {tmp_path / 'ckpt'}: a LoRA adapter on model.layers.0."
                                               "self_attn.x_proj (+3 more), which a LlamaForCausalLM has no weight for "
                                               "(wrong --hf-config?)\n")  # "(+3 mores)" was written


@pytest.mark.parametrize("save", SAVES)
def test_reshard_keeps_the_adapters_bit_for_bit(request, save, tmp_path):
    lora = request.getfixturevalue(save)
    import torch.distributed.checkpoint as dcp

    dst = tmp_path / "resharded"
    res = run_cli("reshard", lora / "ckpt", dst, "--world-size", "3")
    assert res.returncode == 0, res.stderr
    want = peft_model().state_dict()
    state = {k: torch.empty_like(v) for k, v in want.items()}
    dcp.load({"model": state}, checkpoint_id=dst, no_dist=True)
    assert all(torch.equal(state[k], want[k]) for k in want)


RSLORA_SOME = {"use_rslora": True, "target_modules": ["q_proj", "down_proj"], "layers_to_transform": [1]}
"""rsLoRA (s = α / √r) on layer 1's q_proj and down_proj only."""


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """A model of WIDE sizes with RSLORA_SOME adapters, saved whole by one process, and its base config."""
    import torch.distributed.checkpoint as dcp

    root = tmp_path_factory.mktemp("wide")
    dcp.save({"model": peft_model(WIDE, **RSLORA_SOME).state_dict()}, checkpoint_id=root / "ckpt", no_dist=True)
    llama_config(**WIDE).save_pretrained(root / "base")
    return root


def test_rslora_adapters_on_some_layers_merge_and_load_exactly(wide, tmp_path):
    """rsLoRA on some modules of a model whose MLP weights are larger than a block: the merge is
    peft's bit for bit (and passes --verify), and the adapter folder's `target_modules` names
    exactly those modules (a leaf-name list would put fresh adapters on layer 0 too)."""
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    from ckptctl.commands.export_hf import ExportOptions, export_hf

    trained = RSLORA_SOME
    scale = dict(lora_alpha=ALPHA, rslora=True)
    report = export_hf(wide / "ckpt", tmp_path / "merged", wide / "base", ExportOptions(merge_adapters=True, **scale),
                       verify=True)
    assert report.verified
    want = peft_model(WIDE, **trained).merge_and_unload().state_dict()
    got = read_folder(tmp_path / "merged")
    assert all(torch.equal(got[n], want[n]) for n in want)
    export_hf(wide / "ckpt", tmp_path / "adapter", wide / "base", ExportOptions(adapter_only=True, **scale))
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (config["use_rslora"], config["target_modules"]) == (
        True, r"model\.layers\.1\.mlp\.down_proj|model\.layers\.1\.self_attn\.q_proj")
    base = LlamaForCausalLM(llama_config(**WIDE))
    base.load_state_dict(base_state(WIDE))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    assert not [w for w in caught if "adapter keys" in str(w.message)]
    assert sorted(n for n, _ in loaded.named_parameters() if "lora_A" in n) == [
        "base_model.model.model.layers.1.mlp.down_proj.lora_A.default.weight",
        "base_model.model.model.layers.1.self_attn.q_proj.lora_A.default.weight"]
    with torch.no_grad():
        assert torch.equal(loaded(TOKENS).logits, peft_model(WIDE, **trained)(TOKENS).logits)


def test_the_output_check_recomputes_merged_weights(wide, tmp_path, monkeypatch):
    """A merged weight written with its first element wrong (one bit) is caught by the check
    every export passes, which recomputes it from the source: nothing takes DST's name."""
    from ckptctl.commands.export_hf import ExportOptions, export_hf
    from ckptctl.engine import cpu
    from ckptctl.util.errors import CheckpointError

    def flipped(item, sources, files, progress):
        data = cpu.merged_bytes(item, sources)
        data[0] ^= 1
        files.write(item.file, data, item.offset)
        progress(item.nbytes)
        return 0

    monkeypatch.setattr(cpu, "_stream_merged", flipped)
    with pytest.raises(CheckpointError, match=r": model\.layers\.1\.mlp\.down_proj\.weight: element \[0, 0\] of "
                                              r"\[128, 768\] differs from the source's$"):
        export_hf(wide / "ckpt", tmp_path / "dst", wide / "base", ExportOptions(merge_adapters=True, lora_alpha=ALPHA,
                                                                                  rslora=True))
    assert not (tmp_path / "dst").exists()


def test_inspect_names_the_adapters(lora):
    res = run_cli("inspect", lora / "ckpt", "--json")
    assert res.returncode == 0, res.stderr
    targets = {leaf: 2 for leaf in sorted(TARGETS)}
    assert json.loads(res.stdout)["adapters"] == {"kind": "peft-lora", "adapters": ["default"], "modules": 14,
                                                  "ranks": [RANK], "targets": targets,
                                                  "modules_to_save": []}
    shown = " ".join(run_cli("inspect", lora / "ckpt").stdout.split())
    assert ("Adapters peft LoRA 'default': 14 modules, rank 5 (down_proj ×2, gate_proj ×2, k_proj ×2, o_proj ×2, "
            "q_proj ×2, up_proj ×2, v_proj ×2); α is not in the checkpoint (export-hf --merge-adapters or "
            "--adapter-only take --lora-alpha or --adapter-config)") in shown


def test_dry_run_shows_each_merged_weight_with_its_adapter(lora, tmp_path):
    res = export(lora, tmp_path / "dst", "--merge-adapters", "--lora-alpha", str(ALPHA), "--dry-run")
    assert res.returncode == 0, res.stderr
    at = "model.base_model.model.model.layers.0.self_attn.q_proj"
    assert (f"model.layers.0.self_attn.q_proj.weight ← {at}.base_layer.weight + ({at}.lora_B.default.weight @ "
            f"{at}.lora_A.default.weight) · 1.4") in res.stdout.splitlines()
    assert "model.layers.0.self_attn.k_proj.weight ← model.base_model.model.model.layers.0.self_attn.k_proj." \
           "base_layer.weight + (" in res.stdout
    plan = json.loads(export(lora, tmp_path / "dst", "--merge-adapters", "--lora-alpha", "7", "--dry-run",
                             "--json").stdout)
    assert len(plan["merged"]) == 14 and plan["merged"]["model.layers.1.mlp.down_proj.weight"]["scale"] == 1.4
    assert not (tmp_path / "dst").exists()


def test_a_qwen3_with_tied_embeddings_merges_bit_for_bit(tmp_path):
    """Qwen3 (q/k norms, tied embeddings: peft's state dict holds lm_head, equal to the embeddings
    and left out) with adapters on attention and MLP, saved whole by one process."""
    import torch.distributed.checkpoint as dcp
    from peft import get_peft_model
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from ckptctl.commands.export_hf import ExportOptions, export_hf

    def model():
        torch.manual_seed(0)
        config = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True)
        peft = get_peft_model(Qwen3ForCausalLM(config), lora_config())
        with torch.no_grad():
            for name, param in peft.named_parameters():
                if "lora_B" in name:
                    param.normal_(0, 0.5)
        return peft, config

    peft, config = model()
    dcp.save({"model": peft.state_dict()}, checkpoint_id=tmp_path / "ckpt", no_dist=True)
    config.save_pretrained(tmp_path / "base")
    report = export_hf(tmp_path / "ckpt", tmp_path / "merged", tmp_path / "base",
                       ExportOptions(merge_adapters=True, lora_alpha=ALPHA))
    assert report.notes[0] == ("model.base_model.model.lm_head.weight not exported: the config ties it to "
                               "model.base_model.model.model.embed_tokens.weight, which it equals")
    want = model()[0].merge_and_unload().state_dict()
    got = read_folder(tmp_path / "merged")
    assert sorted(got) == sorted(n for n in want if n != "lm_head.weight")
    assert all(torch.equal(got[n], want[n]) for n in got)


def test_an_adapter_on_a_tied_head_is_refused(tmp_path):
    """The head equals the embeddings, so a tying config leaves it out: its adapter would be lost."""
    import torch.distributed.checkpoint as dcp

    from ckptctl.commands.export_hf import ExportOptions, export_hf
    from ckptctl.util.errors import CheckpointError

    state = peft_model(target_modules=["q_proj", "lm_head"]).state_dict()
    state["base_model.model.lm_head.base_layer.weight"] = state["base_model.model.model.embed_tokens.weight"]
    dcp.save({"model": state}, checkpoint_id=tmp_path / "ckpt", no_dist=True)
    llama_config(tie_word_embeddings=True).save_pretrained(tmp_path / "base")
    with pytest.raises(CheckpointError) as err:
        export_hf(tmp_path / "ckpt", tmp_path / "dst", tmp_path / "base", ExportOptions(merge_adapters=True,
                                                                                      lora_alpha=ALPHA))
    assert str(err.value) == (f"{tmp_path / 'ckpt'}: model.base_model.model.lm_head.lora_A.default.weight: a LoRA "
                              "adapter on lm_head, whose weight the export leaves out (the config ties it to another "
                              "tensor): merged, the two would differ")


def test_modules_to_save_are_exported_as_trained(tmp_path):
    """peft trains lm_head whole (`modules_to_save`): merged, the HF head is its trained copy, not
    the original peft keeps beside it; in the folder, under the module's own name, with
    `modules_to_save` in the config, as peft's `save_pretrained` writes it."""
    import torch.distributed.checkpoint as dcp
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    from ckptctl.commands.export_hf import ExportOptions, export_hf

    def trained():
        model = peft_model(target_modules=["q_proj"], modules_to_save=["lm_head"])
        with torch.no_grad():
            model.base_model.model.lm_head.modules_to_save.default.weight.normal_()
        return model

    dcp.save({"model": trained().state_dict()}, checkpoint_id=tmp_path / "ckpt", no_dist=True)
    llama_config().save_pretrained(tmp_path / "base")
    trained().save_pretrained(tmp_path / "peft")
    export_hf(tmp_path / "ckpt", tmp_path / "merged", tmp_path / "base",
              ExportOptions(merge_adapters=True, lora_alpha=ALPHA))
    want = trained().merge_and_unload().state_dict()
    got = read_folder(tmp_path / "merged")
    assert sorted(got) == sorted(want) and all(torch.equal(got[n], want[n]) for n in want)
    assert not torch.equal(got["lm_head.weight"], base_state()["lm_head.weight"])
    export_hf(tmp_path / "ckpt", tmp_path / "adapter", tmp_path / "base", ExportOptions(adapter_only=True,
                                                                                      lora_alpha=ALPHA))
    saved, written = read_folder(tmp_path / "peft"), read_folder(tmp_path / "adapter")
    assert sorted(written) == sorted(saved) and all(torch.equal(written[n], saved[n]) for n in saved)
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["modules_to_save"] == ["lm_head"]
    base = LlamaForCausalLM(llama_config())
    base.load_state_dict(base_state())
    loaded = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    with torch.no_grad():
        assert torch.equal(loaded(TOKENS).logits, trained()(TOKENS).logits)


def test_an_embedding_adapter_merges_transposed_and_loads(tmp_path):
    """LoRA on embed_tokens (A [r, vocab], B [hidden, r]): merged as W + ((B @ A) · s)ᵀ, bit for bit
    peft's merge; in the folder as `lora_embedding_A`/`_B` (peft's own names without the base
    embedding, which `save_embedding_layers=False` leaves out too)."""
    import torch.distributed.checkpoint as dcp
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    from ckptctl.commands.export_hf import ExportOptions, export_hf

    def trained():
        model = peft_model(target_modules=["embed_tokens", "q_proj"])
        with torch.no_grad():
            model.base_model.model.model.embed_tokens.lora_embedding_A.default.normal_()
        return model

    dcp.save({"model": trained().state_dict()}, checkpoint_id=tmp_path / "ckpt", no_dist=True)
    llama_config().save_pretrained(tmp_path / "base")
    trained().save_pretrained(tmp_path / "peft", save_embedding_layers=False)
    options = dict(adapter_config=tmp_path / "peft" / "adapter_config.json")
    export_hf(tmp_path / "ckpt", tmp_path / "merged", tmp_path / "base", ExportOptions(merge_adapters=True, **options))
    want = trained().merge_and_unload().state_dict()
    got = read_folder(tmp_path / "merged")
    assert sorted(got) == sorted(want) and all(torch.equal(got[n], want[n]) for n in want)
    assert not torch.equal(got["model.embed_tokens.weight"], base_state()["model.embed_tokens.weight"])
    export_hf(tmp_path / "ckpt", tmp_path / "adapter", tmp_path / "base", ExportOptions(adapter_only=True, **options))
    saved, written = read_folder(tmp_path / "peft"), read_folder(tmp_path / "adapter")
    assert sorted(written) == sorted(saved) and all(torch.equal(written[n], saved[n]) for n in saved)
    base = LlamaForCausalLM(llama_config())
    base.load_state_dict(base_state())
    loaded = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    with torch.no_grad():
        assert torch.equal(loaded(TOKENS).logits, trained()(TOKENS).logits)


def two_adapters():
    """The trained model with a second adapter, 'other' (r 3 on v_proj, B random), beside 'default'."""
    model = peft_model()
    model.add_adapter("other", lora_config(r=3, target_modules=["v_proj"]))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B.other" in name:
                param.normal_(0, 0.5)
    return model.eval()


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    import torch.distributed.checkpoint as dcp

    root = tmp_path_factory.mktemp("two")
    dcp.save({"model": two_adapters().state_dict()}, checkpoint_id=root / "ckpt", no_dist=True)
    llama_config().save_pretrained(root / "base")
    return root


def test_of_several_adapters_none_is_chosen_silently(two, tmp_path):
    res = export(two, tmp_path / "dst", "--merge-adapters", "--lora-alpha", str(ALPHA))
    assert res.returncode == 2
    assert res.stderr == (f"ckptctl: error: {two / 'ckpt'}: 2 peft adapters (default, other): pass --adapter-name to "
                          "export one\n")
    res = export(two, tmp_path / "dst", "--merge-adapters", "--lora-alpha", str(ALPHA), "--adapter-name", "mine")
    assert res.returncode == 2
    assert res.stderr == (f"ckptctl: error: {two / 'ckpt'}: has no peft adapter 'mine' (--adapter-name): its adapters "
                          "are 'default', 'other'\n")
    assert not (tmp_path / "dst").exists()


def test_a_chosen_adapter_merges_as_peft_merges_it_alone_and_its_folder_loads(two, tmp_path):
    """`--adapter-name other`: merged, peft's `merge_and_unload(adapter_names=["other"])` bit for bit
    (the 'default' adapter left out, said in a note); as a folder, `PeftModel.from_pretrained` gives
    the logits of the trained model with 'other' active."""
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    res = export(two, tmp_path / "merged", "--merge-adapters", "--lora-alpha", str(ALPHA), "--adapter-name", "other",
                 "--json")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["notes"][-1].endswith("; adapter 'default' left out")
    want = two_adapters().merge_and_unload(adapter_names=["other"]).state_dict()
    got = read_folder(tmp_path / "merged")
    assert sorted(got) == sorted(want) and all(torch.equal(got[n], want[n]) for n in want)
    base = base_state()
    assert [n for n in want if not torch.equal(want[n], base[n])] == [
        "model.layers.0.self_attn.v_proj.weight", "model.layers.1.self_attn.v_proj.weight"]
    res = export(two, tmp_path / "adapter", "--adapter-only", "--lora-alpha", str(ALPHA), "--adapter-name", "other")
    assert res.returncode == 0, res.stderr
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["target_modules"]) == (3, ["v_proj"])
    model = LlamaForCausalLM(llama_config())
    model.load_state_dict(base)
    loaded = PeftModel.from_pretrained(model, tmp_path / "adapter").eval()
    trained = two_adapters()
    trained.set_adapter("other")
    with torch.no_grad():
        assert torch.equal(loaded(TOKENS).logits, trained(TOKENS).logits)
