"""A config that contradicts the weights is an error (exit 2, one line, no DST), never exit 0.

export-hf and import-hf write what the config describes: a config whose sizes (vocab_size,
hidden_size, intermediate_size …) are not the tensors' would give a folder transformers
refuses to load. Real parts: checkpoints written by torch's own `dcp.save` (HF names as FSDP2
saves a transformers model), folders by `save_pretrained`.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from fixtures import hf_models
from tests.conftest import run_cli
from tests.test_export_hf_names import save, write_config

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

VOCAB = hf_models.CONFIGS["llama"]["vocab_size"]


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> hf_models.Reference:
    """A tiny Llama, saved by save_pretrained."""
    return hf_models.reference("llama", tmp_path_factory.mktemp("llama") / "ref")


@pytest.fixture(scope="module")
def trained_head(llama, tmp_path_factory) -> Path:
    """Its state dict under `model.`, as `dcp.save` of a fully_shard'ed transformers model writes it."""
    return save({"model": dict(llama.model.state_dict())}, tmp_path_factory.mktemp("ckpt") / "trained-head")


def config_folder(llama: hf_models.Reference, folder: Path, **changes) -> Path:
    """The reference's config.json with `changes`, alone in `folder`."""
    return write_config(folder, **{**json.loads((llama.folder / "config.json").read_text()), **changes})


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
