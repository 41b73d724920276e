"""Red team: casts to a narrower dtype that overflow, and what diff --compare-as says of them.

float16's largest finite value is 65504: a float32 weight of 1e5 cast by `--dtype fp16` becomes
inf. export-hf and reshard wrote it, `--verify` agreed (it recomputes the same cast), exit 0: a
finite model written with an infinite weight; `diff --compare-as fp16` cast both sides the same
way, so two checkpoints whose values differ by 5e9 compared `equal`. A cast that rounds is what
`--dtype` asks for; one that turns a finite value into ±inf is refused, naming the tensor.
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import run_cli


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    """A tiny Llama saved by dcp.save whose final norm holds one element (1e5) past float16's range."""
    import torch.distributed.checkpoint as dcp
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("rt-fp16")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    state = LlamaForCausalLM(config).state_dict()
    state["model.norm.weight"][0] = 1e5
    dcp.save({"model": state}, checkpoint_id=root / "ckpt", no_dist=True)
    config.save_pretrained(root / "base")
    return root


@pytest.mark.parametrize("command", ["export-hf", "reshard"])
def test_a_cast_that_overflows_to_inf_is_refused(big, tmp_path, command):
    args = ("--hf-config", big / "base") if command == "export-hf" else ("--world-size", "1")
    res = run_cli(command, big / "ckpt", tmp_path / "dst", *args, "--dtype", "fp16", "--verify")
    name = "model.norm.weight" if command == "export-hf" else "model.model.norm.weight"
    assert (res.returncode, res.stderr) == (2, f"ckptctl: error: {name}: 1 finite value beyond float16's range "
                                               "(±65504) would become inf: keep the source dtype or cast to a wider one\n")
    assert not (tmp_path / "dst").exists()


def test_compare_as_fp16_does_not_call_overflowed_values_equal(tmp_path):
    from safetensors.torch import save_file

    save_file({"w": torch.tensor([1e6, 3.0, -1e7])}, tmp_path / "a.safetensors")
    save_file({"w": torch.tensor([9e6, 3.0, -5e9])}, tmp_path / "b.safetensors")
    res = run_cli("diff", tmp_path / "a.safetensors", tmp_path / "b.safetensors", "--compare-as", "fp16")
    assert (res.returncode, res.stdout) == (2, "")
    assert res.stderr == (f"ckptctl: error: {tmp_path / 'a.safetensors'}: w: 2 finite values beyond float16's range "
                          "(±65504) would become inf: keep the source dtype or cast to a wider one (--compare-as)\n")
