"""import-hf `--to megatron-fsdp` against NVIDIA Megatron-Bridge's own mapping code, and export-hf back.

A tiny HF model (`fixtures.hf_models.reference`) is mapped to Megatron by Megatron-Bridge
0.6.2's `param_mapping.py` and the family's bridge class, unmodified, on 2 gloo ranks at TP 2
(GPT-OSS: 1 rank at TP 1) into megatron-core's GPTModel or MambaModel (`fixtures.megatron_bridge`):
each rank holds what the Bridge scattered to it. import-hf of the same folder at that TP must
hold the same values, rank block by rank block: grouped QKV, SwiGLU fc1 fused per TP rank
(every expert's too), the padded vocab, q/k norms, the router, DeepSeek-V3's latent attention,
expert bias, shared experts and multi-token prediction layer, Qwen3-Next's and Qwen3.5's Gated
DeltaNet (`in_proj` and `conv1d` per TP rank, from grouped and flat HF projections), gated
attention and gated shared experts, Gemma's GeGLU fc1 (never split) and its norms after each
sublayer, Nemotron-H's Mamba `in_proj` and `conv1d` per TP rank, relu² MLP and MoE layers,
GPT-OSS's sinks, biases and packed experts (de-interleaved, transposed), RowParallel and
duplicated tensors alike; and export-hf of it gives the HF folder back bit for bit, as does
export-hf of megatron-core's own torch_dist save of the model the Bridge filled. Skipped
without megatron-core and megatron-bridge (`make install` puts them in).
"""

from __future__ import annotations

import re

import pytest
import torch

from fixtures import hf_models
from fixtures import megatron_bridge as mb
from tests.conftest import run_cli

pytestmark = pytest.mark.skipif(not mb.available(), reason="megatron-core or megatron-bridge is not installed")
pytest.importorskip("transformers")
TP = 2
FAMILY_TP = {"gpt-oss": 1}
"""GPT-OSS at TP 1: the Bridge maps its experts at expert TP 1 only (its recipes' setting), and
import-hf writes experts at the expert TP = TP."""
LOCAL_SPEC_NAMES = (("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight"),
                    ("input_layernorm.weight", "self_attention.in_proj.layer_norm_weight"),
                    ("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight"),
                    ("self_attention.q_layernorm.weight", "self_attention.linear_q_up_proj.layer_norm_weight"),
                    ("self_attention.kv_layernorm.weight", "self_attention.linear_kv_up_proj.layer_norm_weight"),
                    (".norm.weight", ".mixer.in_proj.layer_norm_weight"))
"""megatron-core's local spec keeps its norms apart; Megatron-FSDP saves the TE spec's names,
fused into the next linear, where it has them (not a MoE layer's `pre_mlp_layernorm`, a
Qwen3 q/k norm, or MLA's input norm; a GDN layer's input norm is fused into `in_proj`, a Mamba
layer's `norm` into its mixer's)."""
SEQUENTIAL_EXPERT = re.compile(r"mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.(weight|bias)$")
"""SequentialMLP's expert names; import-hf writes grouped-GEMM names, `linear_fc1.weight<e>`."""
OVERRIDES = {"qwen3-moe": {"mlp_only_layers": []}, "qwen3-next": {"mlp_only_layers": []}}
"""Megatron-Bridge 0.6.2's Qwen3MoEBridge maps no dense MLP among the MoE layers (`mlp_only_layers`)."""


FULL_ONLY = ("llama", "qwen3", "qwen3-moe", "qwen3-next", "qwen3.5", "qwen3.5-moe", "gemma2", "gemma3", "nemotron-h",
             "gpt-oss")
"""Run by `make test-full` only: deepseek-v3 holds the SwiGLU, expert, router, norm, vocab and
MTP mappings too (the others also have the test-side mapping of `test_import_hf`), and each
family costs a Megatron-Bridge run under torchrun."""


@pytest.fixture(scope="module", params=[pytest.param(f, marks=[pytest.mark.full] if f in FULL_ONLY else [])
                                        for f in sorted(mb.FAMILIES)])
def mapped(request, tmp_path_factory):
    """(the Bridge's tensors per rank, import-hf's global tensors) for one family."""
    from fixtures.make_fixtures import load_with_torch

    root = tmp_path_factory.mktemp(f"bridge-{request.param}")
    ref = hf_models.reference(request.param, root / "hf", mtp=request.param == "deepseek-v3",
                              **OVERRIDES.get(request.param, {}))
    tp = FAMILY_TP.get(request.param, TP)
    mb.write(ref.folder, root / "bridge", tp, request.param)
    run = run_cli("import-hf", ref.folder, root / "ckpt", "--to", "megatron-fsdp", "--tp", tp, "--dp", 1, "--verify")
    assert run.returncode == 0, run.stderr
    ranks = [torch.load(root / "bridge" / f"rank{t}.pt") for t in range(tp)]
    nested = load_with_torch(root / "ckpt")  # {"model": {"module.…": …}}, as Megatron-FSDP's saves nest
    return ranks, {"model." + name: value for name, value in nested["model"].items()}, ref, root / "ckpt"


def saved_name(name: str, ours: dict) -> str:
    name = SEQUENTIAL_EXPERT.sub(r"mlp.experts.\2.\3\1", name)
    name = name.replace(".transformer_layer.", ".mtp_model_layer.")  # megatron-core 0.16's MTP decoder layer
    name = re.sub(r"\.mixer\.conv1d\.(weight|bias)$", r".mixer.conv1d_\1", name)  # and its Mamba conv module
    for local, saved in LOCAL_SPEC_NAMES:
        if name.endswith(local) and "model.module." + name[: -len(local)] + saved in ours:
            return "model.module." + name[: -len(local)] + saved
    return "model.module." + name


def test_every_tensor_equals_what_megatron_bridge_scatters_to_each_tp_rank(mapped):
    ranks, ours, _, _ = mapped
    seen = set()
    for name in ranks[0]:
        parts, tensor = [r[name] for r in ranks], ours[saved_name(name, ours)]
        seen.add(saved_name(name, ours))
        if parts[0].shape == tensor.shape:  # duplicated on every TP rank
            assert all(torch.equal(p, tensor) for p in parts), name
            continue
        if len(ranks) == 1:  # at TP 1 the Bridge hands the vocab rows unpadded (its scatter pads at TP > 1)
            rows = parts[0].shape[0]
            assert torch.equal(parts[0], tensor[:rows]) and not tensor[rows:].any(), name
            continue
        dim = next(i for i, (a, b) in enumerate(zip(parts[0].shape, tensor.shape)) if a != b)
        blocks = torch.chunk(tensor, len(ranks), dim=dim)
        for t in range(len(ranks)):
            assert torch.equal(parts[t], blocks[t]), (name, t)
    assert sorted(n for n, v in ours.items() if isinstance(v, torch.Tensor)) == sorted(seen)


def _assert_the_reference(folder, ref) -> None:
    """`folder` holds the reference HF model's tensors, bit for bit."""
    from safetensors.torch import load_file

    got = {}
    for path in sorted(folder.glob("*.safetensors")):
        got.update(load_file(path))
    assert sorted(got) == sorted(ref.state)
    for name, tensor in ref.state.items():
        assert torch.equal(got[name], tensor), name


def test_export_hf_gives_the_folder_back_bit_for_bit(mapped, tmp_path):
    _, _, ref, ckpt = mapped
    tp = FAMILY_TP.get(ref.family, TP)
    run = run_cli("export-hf", ckpt, tmp_path / "hf", "--hf-config", ref.folder, "--tp", tp, "--verify")
    assert run.returncode == 0, run.stderr
    _assert_the_reference(tmp_path / "hf", ref)


def test_export_hf_of_megatron_cores_torch_dist_save_gives_the_folder_back_bit_for_bit(mapped, tmp_path):
    """The model the Bridge mapped, saved by megatron-core's own `dist_checkpointing.save`
    (`fixtures.megatron_bridge`: torch_dist's layer stacks, or per-layer keys where layers differ;
    experts stacked per layer, biases too; SwiGLU fc1 as `[W_all; V_all]`; GDN's and Mamba's
    `in_proj` and `conv1d` split into components; the padded vocab), exports to the HF folder it
    came from."""
    _, _, ref, ckpt = mapped
    run = run_cli("export-hf", ckpt.parent / "bridge" / "torch_dist", tmp_path / "hf", "--hf-config", ref.folder,
                  "--verify")
    assert run.returncode == 0, run.stderr
    _assert_the_reference(tmp_path / "hf", ref)
