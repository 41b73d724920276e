"""Qwen3-MoE: dense attention with q/k norms, sparse MoE MLPs (router + per-expert SwiGLU).

Experts come as Megatron-Core grouped GEMM weights `mlp.experts.linear_fc1.weight<e>` /
`linear_fc2.weight<e>` (global expert index, fc1 split `_w`/`_v` or fused TP-blocked at the
expert TP) or as `mlp.experts.local_experts.<e>.linear_fc{1,2}.weight` (SequentialMLP).
They are written per expert, `mlp.experts.<e>.{gate,up,down}_proj.weight`, the layout of
published checkpoints that transformers 5 fuses into `gate_up_proj` when loading.
"""

from __future__ import annotations

from ckptctl.families.base import HFConfig
from ckptctl.families.llama import DENSE_MLP, EMBEDDING, FINAL, attention, attention_dims
from ckptctl.families.rules import REPLICATED, Block, Family, Rule, Same, swiglu


def is_sparse(cfg: HFConfig, layer: int) -> bool:
    """Which layers are MoE, exactly as transformers decides (mlp_only_layers, decoder_sparse_step)."""
    experts = cfg.int("num_experts", 0)
    step = cfg.int("decoder_sparse_step", 1)
    return layer not in (cfg.get("mlp_only_layers") or []) and experts > 0 and step > 0 and (layer + 1) % step == 0


def is_dense(cfg: HFConfig, layer: int) -> bool:
    return not is_sparse(cfg, layer)


def has_shared_expert(cfg: HFConfig, layer: int) -> bool:
    return is_sparse(cfg, layer) and cfg.int("shared_expert_intermediate_size", 0) > 0


def router(gate: str) -> tuple[Rule, ...]:
    """A MoE layer's pre-MLP norm and its router, `gate` being the HF router's name."""
    return (Same("post_attention_layernorm.weight", ("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight"),
                 ("hidden",), REPLICATED),
            Same(gate, ("mlp.router.weight",), ("experts", "hidden"), REPLICATED))


ROUTER = router("mlp.gate.weight")
EXPERT: tuple[Rule, ...] = swiglu("mlp.experts.{e}.", ("mlp.experts.{fc}.{kind}{e}",
                                                       "mlp.experts.local_experts.{e}.{fc}.{kind}"),
                                  "moe_ffn", expert=True)
"""One routed expert: grouped-GEMM names (what an import writes) or SequentialMLP's."""
SHARED_EXPERT: tuple[Rule, ...] = (
    *swiglu("mlp.shared_expert.", ("mlp.shared_experts.{fc}.{kind}",), "shared_ffn"),
    Same("mlp.shared_expert_gate.weight", ("mlp.shared_experts.gate_weight",), (1, "hidden"), REPLICATED),
)
"""The shared expert and its sigmoid gate (Qwen3-Next)."""


def moe_blocks(shared: bool) -> tuple[Block, ...]:
    """The MLP of every layer: MoE where `is_sparse`, else dense."""
    blocks = (Block(ROUTER, is_sparse), Block(EXPERT, is_sparse, per_expert=True))
    if shared:
        blocks += (Block(SHARED_EXPERT, has_shared_expert),)
    return (*blocks, Block(DENSE_MLP, is_dense))


QWEN3_MOE = Family("qwen3-moe", ("qwen3_moe",), attention_dims(None), EMBEDDING,
                   (Block(attention(qk_norm=True)), *moe_blocks(shared=False)), FINAL)
