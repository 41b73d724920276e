"""DeepSeek-V3 Megatron-Core models: multi-head latent attention, first dense layers, MoE.

MLA tensors map one to one (Megatron-Bridge's `DeepSeekV3Bridge`): with a query LoRA,
`linear_q_down_proj` ↔ `q_a_proj`, its norm ↔ `q_a_layernorm`, `linear_q_up_proj` ↔
`q_b_proj`; without one, `linear_q_proj` ↔ `q_proj`; `linear_kv_down_proj` ↔
`kv_a_proj_with_mqa` (the latent and the shared RoPE key), its norm ↔ `kv_a_layernorm`,
`linear_kv_up_proj` ↔ `kv_b_proj`. The down projections are the same on every TP rank
(Transformer Engine's duplicated linears). The first `first_k_dense_replace` layers have a
dense SwiGLU MLP; the others a router with its load-balancing `expert_bias` ↔
`gate.e_score_correction_bias`, routed experts and `n_shared_experts` shared experts as one
MLP (HF `mlp.shared_experts`, plural, no gate). Multi-token-prediction layer i
(`mtp.layers.i.`: `enorm`, `hnorm`, `eh_proj`, `final_layernorm` ↔ `shared_head.norm`, and a
decoder layer like the others) is HF layer N + i, as DeepSeek publishes it.
"""

from __future__ import annotations

from ckptctl.families.base import HFConfig
from ckptctl.families.llama import DENSE_MLP, EMBEDDING, FINAL
from ckptctl.families.qwen3_moe import EXPERT, ROUTER
from ckptctl.families.rules import COLUMN, REPLICATED, ROW, Block, Dims, Family, Mtp, Rule, Same, swiglu


def first_k_dense(cfg: HFConfig, layer: int) -> bool:
    """DeepSeek-V3's MoE layers: all after the first `first_k_dense_replace`, as transformers builds them."""
    return layer >= cfg.int("first_k_dense_replace", 0) and cfg.int("num_experts", 0) > 0


def dense(cfg: HFConfig, layer: int) -> bool:
    return not first_k_dense(cfg, layer)


def q_lora(cfg: HFConfig, layer: int) -> bool:
    return bool(cfg.get("q_lora_rank"))


def no_q_lora(cfg: HFConfig, layer: int) -> bool:
    return not q_lora(cfg, layer)


ATTENTION: tuple[Rule, ...] = (
    Same("input_layernorm.weight", ("input_layernorm.weight",), ("hidden",), REPLICATED),
    Same("self_attn.kv_a_proj_with_mqa.weight", ("self_attention.linear_kv_down_proj.weight",),
         ("kv_a_rows", "hidden"), REPLICATED),
    Same("self_attn.kv_a_layernorm.weight", ("self_attention.linear_kv_up_proj.layer_norm_weight",
                                             "self_attention.kv_layernorm.weight"), ("kv_lora",), REPLICATED),
    Same("self_attn.kv_b_proj.weight", ("self_attention.linear_kv_up_proj.weight",), ("kv_b_rows", "kv_lora"),
         COLUMN),
    Same("self_attn.o_proj.weight", ("self_attention.linear_proj.weight",), ("hidden", "o_width"), ROW),
)
"""MLA but the query path."""
QUERY_LORA: tuple[Rule, ...] = (
    Same("self_attn.q_a_proj.weight", ("self_attention.linear_q_down_proj.weight",), ("q_lora", "hidden"),
         REPLICATED),
    Same("self_attn.q_a_layernorm.weight", ("self_attention.linear_q_up_proj.layer_norm_weight",
                                            "self_attention.q_layernorm.weight"), ("q_lora",), REPLICATED),
    Same("self_attn.q_b_proj.weight", ("self_attention.linear_q_up_proj.weight",), ("q_rows", "q_lora"), COLUMN),
)
QUERY: tuple[Rule, ...] = (
    Same("self_attn.q_proj.weight", ("self_attention.linear_q_proj.weight",), ("q_rows", "hidden"), COLUMN),
)
MOE: tuple[Rule, ...] = (
    *ROUTER,
    Same("mlp.gate.e_score_correction_bias", ("mlp.router.expert_bias",), ("experts",), REPLICATED),
    *swiglu("mlp.shared_experts.", ("mlp.shared_experts.{fc}.{kind}",), "shared_ffn"),
)
"""A MoE layer's router (with its expert bias) and shared experts; the routed experts are `EXPERT`."""


MTP: tuple[Rule, ...] = (
    Same("enorm.weight", ("enorm.weight",), ("hidden",), REPLICATED),
    Same("hnorm.weight", ("hnorm.weight",), ("hidden",), REPLICATED),
    Same("eh_proj.weight", ("eh_proj.weight",), ("hidden", "mtp_in"), COLUMN),
    Same("shared_head.norm.weight", ("final_layernorm.weight",), ("hidden",), REPLICATED),
)
"""An MTP layer's own tensors: the norms of the embedding and the hidden state, their projection,
and the norm before the shared output layer."""


def dims(cfg: HFConfig) -> Dims:
    heads = cfg.int("num_attention_heads")
    nope, rope, v = cfg.int("qk_nope_head_dim"), cfg.int("qk_rope_head_dim"), cfg.int("v_head_dim")
    kv_lora = cfg.int("kv_lora_rank")
    sizes = {"q_rows": heads * (nope + rope), "kv_a_rows": kv_lora + rope, "kv_b_rows": heads * (nope + v),
             "o_width": heads * v, "kv_lora": kv_lora, "mtp_in": 2 * cfg.int("hidden_size")}
    if cfg.get("q_lora_rank"):
        sizes["q_lora"] = cfg.int("q_lora_rank")
    if cfg.get("n_shared_experts"):
        sizes["shared_ffn"] = cfg.int("moe_intermediate_size") * cfg.int("n_shared_experts")
    return Dims(cfg, sizes)


DEEPSEEK_V3 = Family("deepseek-v3", ("deepseek_v3",), dims, EMBEDDING,
                     (Block(ATTENTION), Block(QUERY_LORA, q_lora), Block(QUERY, no_q_lora),
                      Block(DENSE_MLP, dense), Block(MOE, first_k_dense), Block(EXPERT, first_k_dense, per_expert=True)),
                     FINAL, mtp=Mtp("num_nextn_predict_layers", MTP))
