"""A config that contradicts the weights is an error (exit 2, one line, no DST), never exit 0.

export-hf and import-hf write what the config describes: a config that ties the embeddings
to a trained output head that differs from them, or whose sizes (vocab_size, hidden_size,
intermediate_size …) are not the tensors', would give a folder transformers refuses to load,
or one that loads with another model than the one trained. Real parts: checkpoints written
by torch's own `dcp.save` (HF names as FSDP2 saves a transformers model, torchtitan's names,
Megatron's padded vocab), folders by `save_pretrained`, and transformers loading the exports.
"""

from __future__ import annotations

import importlib
import json
import shutil
from pathlib import Path

import pytest
import torch

from fixtures import hf_models
from tests.conftest import run_cli
from tests.commands.test_export_hf import load_hf, logits, read_safetensors
from tests.families.test_export_hf_names import save, torchtitan_llama3_state, write_config

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

DROP_HINT = "(pass --drop-tied-head to drop the trained head on purpose)"
VOCAB = hf_models.CONFIGS["llama"]["vocab_size"]


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> hf_models.Reference:
    """A tiny untied Llama (lm_head trained apart from the embeddings), saved by save_pretrained."""
    return hf_models.reference("llama", tmp_path_factory.mktemp("llama") / "ref")


@pytest.fixture(scope="module")
def trained_head(llama, tmp_path_factory) -> Path:
    """Its state dict under `model.`, as `dcp.save` of a fully_shard'ed transformers model writes it."""
    return save({"model": dict(llama.model.state_dict())}, tmp_path_factory.mktemp("ckpt") / "trained-head")


def config_folder(llama: hf_models.Reference, folder: Path, **changes) -> Path:
    """The reference's config.json with `changes`, alone in `folder`."""
    return write_config(folder, **{**json.loads((llama.folder / "config.json").read_text()), **changes})


def test_a_tying_config_and_a_trained_head_that_differs_is_refused_naming_both_and_the_key(llama, trained_head,
                                                                                         tmp_path):
    ref = config_folder(llama, tmp_path / "tied", tie_word_embeddings=True)
    line = (f"ckptctl: error: {trained_head}: model.lm_head.weight differs from model.model.embed_tokens.weight, "
            f"but {ref / 'config.json'} has tie_word_embeddings=true {DROP_HINT}\n")
    for extra in ((), ("--dry-run",)):
        res = run_cli("export-hf", trained_head, tmp_path / "dst", "--hf-config", ref, *extra)
        assert (res.returncode, res.stdout, res.stderr) == (2, "", line)
        assert not (tmp_path / "dst").exists()


def test_drop_tied_head_exports_the_embeddings_as_the_head_and_transformers_loads_it_tied(llama, trained_head,
                                                                                         tmp_path):
    ref = config_folder(llama, tmp_path / "tied", tie_word_embeddings=True)
    res = run_cli("export-hf", trained_head, tmp_path / "dst", "--hf-config", ref, "--drop-tied-head", "--verify",
                  "--json")
    assert res.returncode == 0, res.stderr
    summary = json.loads(res.stdout)
    assert summary["verified"] and summary["notes"] == [
        "model.lm_head.weight not exported (--drop-tied-head): the config ties it to model.model.embed_tokens.weight"]
    assert sorted(read_safetensors(tmp_path / "dst")) == sorted(set(llama.state) - {"lm_head.weight"})
    model = load_hf(tmp_path / "dst")
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    want = {n: t for n, t in llama.model.state_dict().items() if n != "lm_head.weight"}
    for name, tensor in want.items():
        assert torch.equal(model.state_dict()[name], tensor), name
    oracle = type(llama.model)(llama.config).eval()  # transformers' model, its head the embeddings
    oracle.load_state_dict({**want, "lm_head.weight": want["model.embed_tokens.weight"]})
    assert torch.equal(logits(model, VOCAB), logits(oracle, VOCAB))


def test_a_head_that_differs_in_its_last_element_only_is_refused_reading_block_by_block(llama, tmp_path,
                                                                                       monkeypatch):
    """The head is compared a few rows at a time (16-byte blocks here): the last block counts."""
    from ckptctl.util.errors import CheckpointError
    from ckptctl.formats.dcp.metadata import open_checkpoint
    from ckptctl.families.base import load_hf_config

    state = dict(llama.model.state_dict())
    head = state["model.embed_tokens.weight"].clone()
    state["lm_head.weight"] = head
    ckpt = save({"model": state}, tmp_path / "equal")
    head = head.clone()
    head[-1, -1] = torch.nextafter(head[-1, -1], torch.tensor(1.0))
    differs = save({"model": {**state, "lm_head.weight": head}}, tmp_path / "differs")
    cfg = load_hf_config(config_folder(llama, tmp_path / "tied", tie_word_embeddings=True))
    export_hf = importlib.import_module("ckptctl.commands.export_hf")
    monkeypatch.setattr(export_hf, "COMPARED_BYTES", 16)
    plan = export_hf.plan_export(open_checkpoint(ckpt), cfg, export_hf.ExportOptions())
    assert "lm_head.weight" not in plan.targets
    assert plan.notes == ["model.lm_head.weight not exported: the config ties it to model.model.embed_tokens.weight, "
                          "which it equals"]
    with pytest.raises(CheckpointError, match="model.lm_head.weight differs from model.model.embed_tokens.weight"):
        export_hf.plan_export(open_checkpoint(differs), cfg, export_hf.ExportOptions())


def test_torchtitans_trained_lm_head_under_a_tying_config_is_refused(tmp_path):
    from tests.families.test_export_hf_names import TITAN

    ckpt = save(torchtitan_llama3_state(), tmp_path / "titan")
    ref = write_config(tmp_path / "ref", model_type="llama", vocab_size=TITAN["vocab"], hidden_size=TITAN["dim"],
                       intermediate_size=TITAN["ffn"], num_hidden_layers=TITAN["layers"],
                       num_attention_heads=TITAN["heads"], num_key_value_heads=TITAN["kv_heads"],
                       tie_word_embeddings=True, max_position_embeddings=64)
    res = run_cli("export-hf", ckpt, tmp_path / "dst", "--hf-config", ref)
    assert (res.returncode, res.stdout) == (2, "")
    assert res.stderr == (f"ckptctl: error: {ckpt}: lm_head.weight differs from tok_embeddings.weight, but "
                          f"{ref / 'config.json'} has tie_word_embeddings=true {DROP_HINT}\n")
    assert not (tmp_path / "dst").exists()


def megatron_state(llama: hf_models.Reference, head: torch.Tensor) -> dict[str, torch.Tensor]:
    """The Llama as Megatron-FSDP names it (`model.module.`, fc1 split: no TP needed), vocab padded
    to 104 rows, with `head` as its output layer."""
    state = {f"model.module.{name}": t for name, (t, _) in hf_models.to_megatron(llama, 1, "split").items()}
    state["model.module.output_layer.weight"] = head
    return state


def test_a_megatron_output_layer_under_a_tying_config_must_equal_the_embedding_in_its_vocab_rows(llama, tmp_path):
    """Megatron's padded rows past vocab_size are not the model's: only the vocab rows are compared."""
    ref = config_folder(llama, tmp_path / "tied", tie_word_embeddings=True)
    embedding = hf_models.to_megatron(llama, 1, "split")["embedding.word_embeddings.weight"][0]
    assert embedding.shape[0] > VOCAB
    same = torch.cat([embedding[:VOCAB], torch.full_like(embedding[VOCAB:], 3.0)])
    ckpt = save(megatron_state(llama, same), tmp_path / "same")
    res = run_cli("export-hf", ckpt, tmp_path / "dst", "--hf-config", ref, "--json")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["notes"] == [
        "model.module.output_layer.weight not exported: the config ties it to "
        "model.module.embedding.word_embeddings.weight, which it equals"]
    model = load_hf(tmp_path / "dst")
    assert torch.equal(model.lm_head.weight, llama.state["model.embed_tokens.weight"])
    other = save(megatron_state(llama, _padded_head(llama, embedding)), tmp_path / "other")
    res = run_cli("export-hf", other, tmp_path / "dst2", "--hf-config", ref)
    assert (res.returncode, res.stdout) == (2, "")
    assert res.stderr == (f"ckptctl: error: {other}: model.module.output_layer.weight differs from "
                          f"model.module.embedding.word_embeddings.weight, but {ref / 'config.json'} has "
                          f"tie_word_embeddings=true {DROP_HINT}\n")
    assert not (tmp_path / "dst2").exists()


def _padded_head(llama: hf_models.Reference, embedding: torch.Tensor) -> torch.Tensor:
    """The trained lm_head, padded as the embedding is."""
    return torch.cat([llama.state["lm_head.weight"], embedding[VOCAB:]])


@pytest.mark.parametrize("rows", [VOCAB + 2, VOCAB - 2], ids=["more-rows", "fewer-rows"])
def test_an_fsdp2_checkpoint_whose_vocab_rows_are_not_vocab_size_is_refused(llama, tmp_path, rows):
    g = torch.Generator().manual_seed(rows)
    state = dict(llama.model.state_dict())
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        state[name] = torch.randn(rows, 32, generator=g)
    ckpt = save({"model": state}, tmp_path / "ckpt")
    res = run_cli("export-hf", ckpt, tmp_path / "dst", "--hf-config", llama.folder)
    assert (res.returncode, res.stdout) == (2, "")
    assert res.stderr == (f"ckptctl: error: {ckpt}: model.model.embed_tokens.weight is [{rows}, 32], but "
                          f"{llama.folder / 'config.json'} has vocab_size={VOCAB}: a LlamaForCausalLM wants "
                          f"[{VOCAB}, 32] (+1 more tensor; wrong --hf-config?)\n")
    assert not (tmp_path / "dst").exists()


def test_a_hidden_size_the_weights_do_not_have_is_refused_naming_the_key(llama, trained_head, tmp_path):
    """Every tensor of hidden width is misshapen (21): the first in the model's order is named."""
    ref = config_folder(llama, tmp_path / "ref", hidden_size=64)
    res = run_cli("export-hf", trained_head, tmp_path / "dst", "--hf-config", ref)
    assert (res.returncode, res.stdout) == (2, "")
    assert res.stderr == (f"ckptctl: error: {trained_head}: model.model.embed_tokens.weight is [{VOCAB}, 32], but "
                          f"{ref / 'config.json'} has hidden_size=64: a LlamaForCausalLM wants [{VOCAB}, 64] "
                          f"(+20 more tensors; wrong --hf-config?)\n")
    assert not (tmp_path / "dst").exists()


@pytest.mark.parametrize("rows", [VOCAB + 2, VOCAB - 2], ids=["more-rows", "fewer-rows"])
@pytest.mark.parametrize("to", ["fsdp2", "torchtitan"])
def test_an_hf_folder_whose_embeddings_are_not_vocab_size_rows_is_refused_by_import(llama, tmp_path, rows, to):
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "hf"
    shutil.copytree(llama.folder, folder)
    state = load_file(folder / "model.safetensors")
    state["model.embed_tokens.weight"] = torch.randn(rows, 32, generator=torch.Generator().manual_seed(rows))
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    res = run_cli("import-hf", folder, tmp_path / "dst", "-n", "2", "--to", to)
    assert (res.returncode, res.stdout) == (2, "")
    assert res.stderr == (f"ckptctl: error: {folder}: model.embed_tokens.weight is [{rows}, 32], but "
                          f"{folder / 'config.json'} has vocab_size={VOCAB}: a LlamaForCausalLM wants [{VOCAB}, 32] "
                          f"(is config.json this model's?)\n")
    assert not (tmp_path / "dst").exists()


@pytest.mark.parametrize("to", ["fsdp2", "torchtitan"])
def test_an_hf_folder_holding_a_head_that_differs_from_the_embeddings_it_is_tied_to_is_refused_by_import(
        llama, tmp_path, to):
    """An untied save under a tying config: the model keeps one tensor for both, and a load would
    take either silently."""
    folder = tmp_path / "hf"
    shutil.copytree(llama.folder, folder)
    config_folder(llama, folder, tie_word_embeddings=True)
    res = run_cli("import-hf", folder, tmp_path / "dst", "-n", "2", "--to", to)
    assert (res.returncode, res.stdout) == (2, "")
    assert res.stderr == (f"ckptctl: error: {folder}: lm_head.weight differs from model.embed_tokens.weight, but "
                          f"{folder / 'config.json'} has tie_word_embeddings=true: the model holds one tensor for "
                          "both (is config.json this model's?)\n")
    assert not (tmp_path / "dst").exists()


def test_an_hf_folder_holding_a_tied_head_equal_to_the_embeddings_is_imported(llama, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "hf"
    shutil.copytree(llama.folder, folder)
    config_folder(llama, folder, tie_word_embeddings=True)
    state = load_file(folder / "model.safetensors")
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    res = run_cli("import-hf", folder, tmp_path / "dst", "-n", "2")
    assert res.returncode == 0, res.stderr
