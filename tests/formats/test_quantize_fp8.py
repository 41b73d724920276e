"""`quantize_fp8`'s choices, without a checkpoint: which weights `fp8-block` quantizes (DeepSeek-V3's
published set), the config transformers' FP8 integration reads, and the scheme refusal."""

from __future__ import annotations

import pytest
import torch

from ckptctl.core.plan import TargetTensor
from ckptctl.formats.safetensors.quantize_fp8 import FP8_BLOCK, parse_quantize, quantization_config, quantize_fp8
from ckptctl.util.errors import UsageError

DEEPSEEK_V3 = {  # name: (shape, quantized in deepseek-ai/DeepSeek-V3's safetensors)
    "model.embed_tokens.weight": ((1024, 256), False),
    "model.layers.3.input_layernorm.weight": ((256,), False),
    "model.layers.3.self_attn.q_a_proj.weight": ((384, 256), True),
    "model.layers.3.self_attn.q_a_layernorm.weight": ((384,), False),
    "model.layers.3.self_attn.q_b_proj.weight": ((512, 384), True),
    "model.layers.3.self_attn.kv_a_proj_with_mqa.weight": ((576, 256), True),
    "model.layers.3.self_attn.kv_a_layernorm.weight": ((512,), False),
    "model.layers.3.self_attn.kv_b_proj.weight": ((512, 512), True),
    "model.layers.3.self_attn.o_proj.weight": ((256, 512), True),
    "model.layers.3.mlp.gate.weight": ((8, 256), False),
    "model.layers.3.mlp.gate.e_score_correction_bias": ((8,), False),
    "model.layers.3.mlp.experts.7.down_proj.weight": ((256, 128), True),
    "model.layers.3.mlp.shared_experts.gate_proj.weight": ((128, 256), True),
    "model.norm.weight": ((256,), False),
    "lm_head.weight": ((1024, 256), False),
}


def test_fp8_block_quantizes_what_deepseek_v3_publishes_quantized():
    layout = parse_quantize(FP8_BLOCK)
    assert {n: layout.wants(n, shape) for n, (shape, _) in DEEPSEEK_V3.items()} == \
        {n: quantized for n, (_, quantized) in DEEPSEEK_V3.items()}


def _target(name: str, shape: tuple[int, ...]) -> TargetTensor:
    return TargetTensor(name, shape, "bfloat16", ())


def test_modules_to_not_convert_only_where_a_kept_2d_weight_is_not_lm_head_or_embeddings():
    """transformers 5.24 swaps every nn.Linear not listed (lm_head by default) for an FP8Linear:
    a kept 2-D weight such as DeepSeek's router or Qwen3-Next's shared_expert_gate must be listed,
    and lm_head with it (a given list replaces the default)."""
    layout = parse_quantize(FP8_BLOCK)
    base = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    plain = {n: _target(n, s) for n, s in (("model.embed_tokens.weight", (8, 4)), ("lm_head.weight", (8, 4)),
                                           ("model.norm.weight", (4,)))}
    assert quantization_config(layout, plain) == base
    gated = {**plain, "model.layers.0.mlp.shared_expert_gate.weight": _target("g", (1, 4))}
    assert quantization_config(layout, gated) == {
        **base, "modules_to_not_convert": ["lm_head", "model.layers.0.mlp.shared_expert_gate"]}


def test_an_unknown_scheme_is_refused():
    with pytest.raises(UsageError) as caught:
        parse_quantize("fp8")
    assert str(caught.value) == ("--quantize 'fp8': not a scheme ckptctl writes (fp8-block or like:REF (the layout "
                                 "of a quantized model folder REF))")


def test_all_zero_blocks_scale_1_and_edge_blocks_use_only_their_own_elements():
    values = torch.zeros(130, 129)
    values[128:, 128:] = torch.tensor([[-896.0], [3.0]])  # the 2×1 corner block: amax 896, scale 2
    codes, scale = quantize_fp8(values, (128, 128), False)
    assert scale.tolist() == [[1.0, 1.0], [1.0, 2.0]]
    assert codes.float()[128:, 128].tolist() == [-448.0, 1.5] and not codes.float()[:128].any()
