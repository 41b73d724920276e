"""Gemma 2 and Gemma 3 text models: GeGLU MLPs and a norm after each sublayer.

Megatron-Bridge's `Gemma2Bridge` / `Gemma3Bridge` name the extra norms after the linear they
follow: `self_attention.linear_proj.post_layernorm` ↔ `post_attention_layernorm` (not the
pre-MLP norm other families call by that HF name), `mlp.linear_fc1.layer_norm_weight` ↔
`pre_feedforward_layernorm`, `mlp.linear_fc2.post_layernorm` ↔ `post_feedforward_layernorm`.
Norms are zero-centred on both sides and copied as they are; embeddings are tied; fc1 is
gated with GELU, so Megatron-FSDP never saves it split into `_w`/`_v`. Gemma 3 adds q/k norms.
"""

from __future__ import annotations

from ckptctl.families.llama import EMBEDDING, FINAL, attention, attention_dims
from ckptctl.families.rules import REPLICATED, Block, Family, Rule, Same, swiglu

POST_ATTENTION: tuple[Rule, ...] = (
    Same("post_attention_layernorm.weight", ("self_attention.linear_proj.post_layernorm.weight",), ("hidden",),
         REPLICATED),
)
GEGLU_MLP: tuple[Rule, ...] = (
    Same("pre_feedforward_layernorm.weight", ("mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight"),
         ("hidden",), REPLICATED),
    *swiglu("mlp.", ("mlp.{fc}.{kind}",), "ffn", splits=False),
    Same("post_feedforward_layernorm.weight", ("mlp.linear_fc2.post_layernorm.weight",), ("hidden",), REPLICATED),
)


def gemma(name: str, model_types: tuple[str, ...], qk_norm: bool) -> Family:
    return Family(name, model_types, attention_dims(256, kv_heads_default=None), EMBEDDING,
                  (Block(attention(qk_norm=qk_norm) + POST_ATTENTION), Block(GEGLU_MLP)), FINAL)


GEMMA2 = gemma("gemma2", ("gemma2",), qk_norm=False)
GEMMA3 = gemma("gemma3", ("gemma3_text",), qk_norm=True)
