"""Red team: `export-hf --merge-adapters` / `--adapter-only` on hostile LoRA checkpoints and options.

Each case once exited 0 over a wrong output or with a traceback: `--lora-alpha nan` (or inf)
wrote every merged weight NaN (inf) and exited 0, the output check agreeing with itself; a rank-0
adapter (lora_A [0, in], lora_B [out, 0]) ended in a ZeroDivisionError traceback (s = α / 0).
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import run_cli

pytest.importorskip("peft")


def _peft_state(**overrides) -> dict[str, torch.Tensor]:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    model = get_peft_model(LlamaForCausalLM(config), LoraConfig(r=5, lora_alpha=7, target_modules=["q_proj"]))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5)
    return model.state_dict(), config


def _saved(root, change=None):
    import torch.distributed.checkpoint as dcp

    state, config = _peft_state()
    if change:
        state = change(state)
    dcp.save({"model": state}, checkpoint_id=root / "ckpt", no_dist=True)
    config.save_pretrained(root / "base")
    return root


@pytest.fixture(scope="module")
def lora(tmp_path_factory):
    return _saved(tmp_path_factory.mktemp("rt-lora"))


@pytest.mark.parametrize("alpha", ["nan", "inf", "-inf"])
@pytest.mark.parametrize("mode", ["--merge-adapters", "--adapter-only"])
def test_a_non_finite_lora_alpha_is_refused(lora, tmp_path, alpha, mode):
    """Was: exit 0, every merged weight NaN (or ±inf); the folder's config `"lora_alpha": NaN`."""
    res = run_cli("export-hf", lora / "ckpt", tmp_path / "dst", "--hf-config", lora / "base", mode,
                  "--lora-alpha", alpha)
    assert (res.returncode, res.stderr) == (2, f"ckptctl: error: --lora-alpha {float(alpha):g} is not a finite "
                                               "number\n")
    assert not (tmp_path / "dst").exists()


def _rank_zero(state):
    return {k: v[:0] if "lora_A" in k else v[:, :0] if "lora_B" in k else v for k, v in state.items()}


@pytest.mark.parametrize("extra", [(), ("--dry-run",), ("--rslora",)])
def test_a_rank_zero_adapter_is_one_line_not_a_traceback(tmp_path, extra):
    """Was: `ZeroDivisionError: float division by zero` from LoraScale.scale, exit 1."""
    root = _saved(tmp_path, _rank_zero)
    res = run_cli("export-hf", root / "ckpt", tmp_path / "dst", "--hf-config", root / "base", "--merge-adapters",
                  "--lora-alpha", "7", *extra)
    assert (res.returncode, res.stderr) == (
        2, f"ckptctl: error: {root / 'ckpt'}: model.base_model.model.model.layers.0.self_attn.q_proj.lora_A.default."
           "weight: rank 0 (lora_A [0, 32]): s = α / r has no value\n")
    assert not (tmp_path / "dst").exists()


def test_an_integer_adapter_is_refused(tmp_path):
    root = _saved(tmp_path, lambda s: {k: v.to(torch.int32) if "lora_A" in k else v for k, v in s.items()})
    res = run_cli("export-hf", root / "ckpt", tmp_path / "dst", "--hf-config", root / "base", "--merge-adapters",
                  "--lora-alpha", "7")
    name = "model.base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight"
    assert (res.returncode, res.stderr) == (2, f"ckptctl: error: {root / 'ckpt'}: {name}: int32 is no LoRA factor's "
                                               "dtype (peft's factors are floating point)\n")
    assert not (tmp_path / "dst").exists()


@pytest.mark.parametrize("key, value", [("use_rslora", '"true"'), ("use_rslora", "1"), ("use_dora", '"false"')])
def test_an_adapter_config_flag_that_is_not_a_boolean_is_refused(lora, tmp_path, key, value):
    """Was: `"use_rslora": "true"` read as false, merged with s = α / r and exit 0, where peft (which
    reads any truthy value as true) scales by α / √r."""
    cfg = tmp_path / "adapter_config.json"
    cfg.write_text(f'{{"peft_type": "LORA", "r": 5, "lora_alpha": 7, "{key}": {value}}}')
    res = run_cli("export-hf", lora / "ckpt", tmp_path / "dst", "--hf-config", lora / "base", "--merge-adapters",
                  "--adapter-config", cfg)
    assert (res.returncode, res.stderr) == (2, f"ckptctl: error: {cfg}: {key} is {value}, not true or false\n")
    assert not (tmp_path / "dst").exists()


def test_a_folder_exported_with_hf_config_as_a_file_loads_by_auto_peft(tmp_path):
    """`--hf-config base/config.json` was written as `base_model_name_or_path`, a file path
    `AutoPeftModelForCausalLM.from_pretrained(DST)` cannot load the base model from (OSError
    'Repo id must be in the form …'); the folder is what it loads."""
    import torch.distributed.checkpoint as dcp
    from peft import AutoPeftModelForCausalLM, LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    state, config = _peft_state()
    dcp.save({"model": state}, checkpoint_id=tmp_path / "ckpt", no_dist=True)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "base")  # the base the adapters were trained on
    res = run_cli("export-hf", tmp_path / "ckpt", tmp_path / "adapter", "--hf-config",
                  tmp_path / "base" / "config.json", "--adapter-only", "--lora-alpha", "7")
    assert res.returncode == 0, res.stderr
    loaded = AutoPeftModelForCausalLM.from_pretrained(tmp_path / "adapter").eval()
    torch.manual_seed(0)
    trained = get_peft_model(LlamaForCausalLM(config), LoraConfig(r=5, lora_alpha=7, target_modules=["q_proj"]))
    trained.load_state_dict(state)
    tokens = torch.tensor([[1, 5, 9, 2, 33]])
    with torch.no_grad():
        assert torch.equal(loaded(tokens).logits, trained.eval()(tokens).logits)


@pytest.mark.parametrize("mode", ["--adapter-only", "--merge-adapters"])
def test_peft_trainable_tokens_are_refused_not_dropped(tmp_path, mode):
    """LoRA with `trainable_token_indices` (peft's trained rows of the embeddings,
    `embed_tokens.token_adapter.trainable_tokens_delta.default` [3, 32]). Was: --adapter-only exit 0
    with a folder holding neither the deltas nor `trainable_token_indices`, which peft loads with the
    base embeddings for those tokens (not the trained model); --merge-adapters refused them as names
    a LlamaForCausalLM has no place for."""
    import torch.distributed.checkpoint as dcp
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    _, config = _peft_state()
    torch.manual_seed(0)
    model = get_peft_model(LlamaForCausalLM(config), LoraConfig(r=5, lora_alpha=7, target_modules=["q_proj"],
                                                                trainable_token_indices=[1, 2, 3]))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name or "trainable_tokens_delta" in name:
                param.normal_()
    dcp.save({"model": model.state_dict()}, checkpoint_id=tmp_path / "ckpt", no_dist=True)
    config.save_pretrained(tmp_path / "base")
    res = run_cli("export-hf", tmp_path / "ckpt", tmp_path / "dst", "--hf-config", tmp_path / "base", mode,
                  "--lora-alpha", "7")
    assert (res.returncode, res.stderr) == (
        2, f"ckptctl: error: {tmp_path / 'ckpt'}: model.base_model.model.model.embed_tokens.token_adapter."
           "trainable_tokens_delta.default: peft trainable tokens (trainable_token_indices), which export-hf does not "
           "merge or export yet: without them the export would not be the trained model\n")
    assert not (tmp_path / "dst").exists()


def test_a_dcp_of_peft_adapter_weights_alone_is_named_for_what_it_is(tmp_path):
    """`dcp.save` of `get_peft_model_state_dict(model)` (PEFT's names, no adapter name: `….lora_A.weight`)
    was refused as 'a LoRA bias (lora_bias)'."""
    import torch.distributed.checkpoint as dcp
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from transformers import LlamaForCausalLM

    _, config = _peft_state()
    model = get_peft_model(LlamaForCausalLM(config), LoraConfig(r=5, lora_alpha=7, target_modules=["q_proj"]))
    dcp.save({"model": get_peft_model_state_dict(model)}, checkpoint_id=tmp_path / "ckpt", no_dist=True)
    config.save_pretrained(tmp_path / "base")
    res = run_cli("export-hf", tmp_path / "ckpt", tmp_path / "dst", "--hf-config", tmp_path / "base",
                  "--adapter-only", "--lora-alpha", "7")
    assert (res.returncode, res.stderr) == (
        2, f"ckptctl: error: {tmp_path / 'ckpt'}: model.base_model.model.model.layers.0.self_attn.q_proj.lora_A."
           "weight: a LoRA tensor without an adapter name, as a PEFT folder or get_peft_model_state_dict names it; export-hf "
           "reads a peft model's own state dict (<m>.lora_A.<adapter>.weight beside <m>.base_layer.weight)\n")


def test_a_finite_lora_alpha_whose_merge_overflows_is_refused(lora, tmp_path):
    """`--lora-alpha 1e40` (s = α / 5 is a finite float) made every merged q_proj weight ±inf in float32, exit
    0, as peft's own merge does: an unusable model. Refused, naming the weight, as a cast past a
    dtype's range is."""
    res = run_cli("export-hf", lora / "ckpt", tmp_path / "dst", "--hf-config", lora / "base", "--merge-adapters",
                  "--lora-alpha", "1e40")
    assert (res.returncode, res.stderr) == (
        2, "ckptctl: error: model.layers.0.self_attn.q_proj.weight: 1024 finite values become inf or NaN when its "
           "LoRA adapter is merged (W + (B @ A) · 2e+39 in float32): check the LoRA α\n")
    assert not (tmp_path / "dst").exists()


@pytest.mark.parametrize("key, value, what", [
    ("alora_invocation_tokens", [1, 2], "aLoRA: the adapter acts only after its invocation tokens"),
    ("arrow_config", {}, "Arrow: a per-token router over LoRA experts"),
    ("kasa_config", {}, "KaSA: the base weight truncated by SVD, a learned diagonal between B and A"),
])
@pytest.mark.parametrize("mode", ["--merge-adapters", "--adapter-only"])
def test_an_adapter_config_of_a_lora_variant_no_merge_gives_is_refused(lora, tmp_path, key, value, what, mode):
    """The run's `--adapter-config` of a LoRA variant with the tensors of a plain LoRA: merged as
    plain LoRA (peft refuses to merge aLoRA and Arrow, and truncates KaSA's base first), or written
    as a plain LoRA folder that loads another model, exit 0. Refused by name."""
    import json

    config = tmp_path / "adapter_config.json"
    config.write_text(json.dumps({"peft_type": "LORA", "r": 5, "lora_alpha": 7, "target_modules": ["q_proj"],
                                  key: value}))
    res = run_cli("export-hf", lora / "ckpt", tmp_path / "dst", "--hf-config", lora / "base", mode,
                  "--adapter-config", config)
    assert (res.returncode, res.stderr) == (2, f"ckptctl: error: {config}: {key} is set ({what}), which export-hf "
                                               "does not merge yet\n")
    assert not (tmp_path / "dst").exists()
