"""Nemotron-H (Mamba-2 hybrid) through Megatron-aware reshard: a TP change re-blocks Mamba's fused tensors.

Megatron keeps a Mamba layer's `in_proj` fused per TP rank `[z_t; x_t; B_t; C_t; dt_t]` and
its `conv1d` weight and bias `[x_t; B_t; C_t]`, so the global tensor differs at every TP.
Two checkpoints of one tiny HF model (`fixtures.hf_models`, test-side mapping) are saved by
real gloo ranks, at TP 2 × DP 2 (uneven DP cuts) and at TP 4, each with AdamW's exp_avg and
exp_avg_sq for every parameter; `reshard --source-tp 2 --tp 4` of the first must equal the
second, parameters and optimizer state alike. The model-side sizes come from `--hf-config`
or the checkpoint's args, else the reshard is refused naming them.
"""

from __future__ import annotations

import pytest
import torch

from fixtures import hf_models
from fixtures.gloo import run_ranks
from fixtures.make_fixtures import load_with_torch
from tests.conftest import run_cli

pytest.importorskip("transformers")
VOCAB = hf_models.CONFIGS["nemotron-h"]["vocab_size"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("nemotron_h")
    ref = hf_models.reference("nemotron-h", root / "ref", seed=7)
    jobs = [hf_models.MegatronJob(str(root / f"tp{tp}"), hf_models.to_megatron(ref, tp), tp=tp, dp=dp, seed=tp,
                                  adam=True)
            for tp, dp in ((2, 2), (4, 1))]
    run_ranks(hf_models.save_jobs, 2, hf_models.write_jobs(jobs, root / "jobs.pt"), timeout=600)
    return root, ref


def test_a_tp_change_re_blocks_mamba_in_proj_and_conv1d_with_their_optimizer_state(saved):
    root, ref = saved
    run = run_cli("reshard", root / "tp2", root / "out", "--layout", "megatron-fsdp", "--tp", 4, "--dp", 1,
                  "--source-tp", 2, "--hf-config", ref.folder)
    assert run.returncode == 0, run.stderr
    got, want = load_with_torch(root / "out"), load_with_torch(root / "tp4")
    in_proj = "module.decoder.layers.0.mixer.in_proj.weight"
    assert not torch.equal(load_with_torch(root / "tp2")["model"][in_proj], want["model"][in_proj])
    for part in ("model", "optimizer"):
        flat_got, flat_want = _tensors(got[part]), _tensors(want[part])
        assert sorted(flat_got) == sorted(flat_want)
        for name, tensor in flat_want.items():
            rows = VOCAB if "word_embeddings" in name or "output_layer" in name else None  # padding is per TP
            assert torch.equal(flat_got[name][:rows], tensor[:rows]), name
    assert any(".mixer.conv1d_bias" in n and "exp_avg_sq" in n for n in _tensors(got["optimizer"]))


def test_without_the_mamba_sizes_the_tp_change_is_refused_naming_them(saved):
    root, _ = saved
    run = run_cli("reshard", root / "tp2", root / "refused", "--layout", "megatron-fsdp", "--tp", 4, "--dp", 1,
                  "--source-tp", 2)
    assert run.returncode == 2
    assert run.stderr.splitlines()[-1].endswith(
        "needs the Mamba sizes (mamba_num_heads, mamba_head_dim, n_groups, ssm_state_size), but they are not in "
        "the checkpoint's args; pass --hf-config REF")
    assert not (root / "refused").exists()


def _tensors(tree, prefix: str = "") -> dict[str, torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return {prefix: tree}
    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items()
                for k, v in _tensors(sub, f"{prefix}.{key}" if prefix else key).items()}
    return {}
