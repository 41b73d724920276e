"""Llama, Qwen2 and Qwen3 dense models as tables of rules (`families.rules`).

Also the rule groups the other families reuse: embeddings and output layer (vocab padding
sliced off, a tied `lm_head` left out), grouped-query attention, and a dense SwiGLU MLP.
"""

from __future__ import annotations

from typing import Callable

from ckptctl.families.base import HFConfig
from ckptctl.families.rules import (REPLICATED, ROW, Attention, Block, Dims, Family, GroupedQKV, Rule, Same,
                              VocabRows, swiglu)

EMBED = "embedding.word_embeddings.weight"
OUTPUT = "output_layer.weight"
FINAL_NORM = "decoder.final_layernorm.weight"

EMBEDDING: tuple[Rule, ...] = (VocabRows("model.embed_tokens.weight", EMBED),)
FINAL: tuple[Rule, ...] = (
    Same("model.norm.weight", (FINAL_NORM,), ("hidden",), REPLICATED),
    VocabRows("lm_head.weight", OUTPUT, tied_by="tie_word_embeddings"),
)
"""The final norm, and `lm_head` (vocab padding sliced off; none when the config ties it)."""


def attention(qkv_bias: bool | str = "attention_bias", qk_norm: bool = False) -> tuple[Rule, ...]:
    """Self-attention with Megatron's fused-norm `linear_qkv` (layer norm inside), `linear_proj`,
    optional biases and q/k norms."""
    rules: tuple[Rule, ...] = (
        Same("input_layernorm.weight", ("self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight"),
             ("hidden",), REPLICATED),
        GroupedQKV("weight"),
        GroupedQKV("bias", required=qkv_bias),
        Same("self_attn.o_proj.weight", ("self_attention.linear_proj.weight",), ("hidden", "q_width"), ROW),
        Same("self_attn.o_proj.bias", ("self_attention.linear_proj.bias",), ("hidden",), REPLICATED, optional=True),
    )
    if qk_norm:
        rules += (Same("self_attn.q_norm.weight", ("self_attention.q_layernorm.weight",), ("head_dim",), REPLICATED),
                  Same("self_attn.k_norm.weight", ("self_attention.k_layernorm.weight",), ("head_dim",), REPLICATED))
    return rules


DENSE_MLP: tuple[Rule, ...] = (
    Same("post_attention_layernorm.weight", ("mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight"),
         ("hidden",), REPLICATED),
    *swiglu("mlp.", ("mlp.{fc}.{kind}",), "ffn"),
)
"""A dense SwiGLU MLP with Megatron's fused-norm fc1."""


def attention_dims(head_dim_default: int | None, kv_heads_default: int | None = None,
                   gated: bool = False) -> Callable[[HFConfig], Dims]:
    """The sizes of a model with one kind of self-attention (its head layout from the config)."""
    def dims(cfg: HFConfig) -> Dims:
        att = Attention.from_config(cfg, head_dim_default, gated, kv_heads_default)
        return Dims(cfg, att.sizes(), {"attention": att})
    return dims


def dense(name: str, model_types: tuple[str, ...], qkv_bias: bool | str, qk_norm: bool,
          head_dim_default: int | None, kv_heads_default: int | None = None) -> Family:
    """A Llama-style dense decoder; the variants differ in defaults, q/k norms and qkv biases."""
    return Family(name, model_types, attention_dims(head_dim_default, kv_heads_default), EMBEDDING,
                  (Block(attention(qkv_bias, qk_norm)), Block(DENSE_MLP)), FINAL)


LLAMA = dense("llama", ("llama",), qkv_bias="attention_bias", qk_norm=False, head_dim_default=None)
QWEN2 = dense("qwen2", ("qwen2",), qkv_bias=True, qk_norm=False, head_dim_default=None, kv_heads_default=32)
QWEN3 = dense("qwen3", ("qwen3",), qkv_bias="attention_bias", qk_norm=True, head_dim_default=128,
              kv_heads_default=32)
