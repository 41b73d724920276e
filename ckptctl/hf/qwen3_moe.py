"""Qwen3-MoE: dense attention with q/k norms, sparse MoE MLPs (router + per-expert SwiGLU).

Experts come as Megatron-Core grouped GEMM weights `mlp.experts.linear_fc1.weight<e>` /
`linear_fc2.weight<e>` (global expert index, fc1 split `_w`/`_v` or fused TP-blocked at the
expert TP) or as `mlp.experts.local_experts.<e>.linear_fc{1,2}.weight` (SequentialMLP).
They are written per expert, `mlp.experts.<e>.{gate,up,down}_proj.weight`, the layout of
published checkpoints that transformers 5 fuses into `gate_up_proj` when loading.
"""

from __future__ import annotations

from dataclasses import dataclass

from ckptctl.errors import CheckpointError
from ckptctl.hf.base import ExportContext, HFConfig, HFTensor, MegatronSpec, Shapes
from ckptctl.hf.llama import (HF_LAYER, LAYER, Attention, attention, attention_shapes, dense_mlp, dense_mlp_shapes,
                              embeddings, embeddings_shapes, output_layer, output_shapes, post_attention_norm, put,
                              swiglu, swiglu_shapes)

ROUTER = "mlp.router.weight"
SHARED_GATE = "mlp.shared_experts.gate_weight"


def is_sparse(cfg: HFConfig, layer: int) -> bool:
    """Which layers are MoE, exactly as transformers decides (mlp_only_layers, decoder_sparse_step)."""
    experts = cfg.int("num_experts", 0)
    step = cfg.int("decoder_sparse_step", 1)
    return layer not in (cfg.get("mlp_only_layers") or []) and experts > 0 and step > 0 and (layer + 1) % step == 0


def moe_mlp(ctx: ExportContext, out: dict[str, HFTensor], layer: int, shared: bool) -> None:
    """Router, experts (and with `shared`, the shared expert and its sigmoid gate) of one MoE layer."""
    cfg, m = ctx.config, ctx.model
    mg, hf = LAYER.format(layer), HF_LAYER.format(layer)
    hidden, experts, ffn = cfg.int("hidden_size"), cfg.int("num_experts"), cfg.int("moe_intermediate_size")
    post_attention_norm(ctx, out, layer)
    put(out, HFTensor(hf + "mlp.gate.weight", (m.view(mg + ROUTER),)), (experts, hidden), cfg)
    grouped = m.first(mg + "mlp.experts.linear_fc2.weight0") is not None
    for e in range(experts):
        if grouped:
            swiglu(ctx, out, mg + "mlp.experts.", f"{hf}mlp.experts.{e}.", ffn, expert=True, index=str(e))
        else:
            swiglu(ctx, out, f"{mg}mlp.experts.local_experts.{e}.", f"{hf}mlp.experts.{e}.", ffn, expert=True)
    if not shared:
        return
    swiglu(ctx, out, mg + "mlp.shared_experts.", hf + "mlp.shared_expert.", cfg.int("shared_expert_intermediate_size"))
    if not m.has(mg + SHARED_GATE):
        raise CheckpointError(m.ckpt.path, f"no {m.prefix}{mg}{SHARED_GATE}: the HF model gates its shared expert")
    put(out, HFTensor(hf + "mlp.shared_expert_gate.weight", (m.view(mg + SHARED_GATE),)), (1, hidden), cfg)


def moe_mlp_shapes(cfg: HFConfig, spec: MegatronSpec, shapes: Shapes, layer: int, shared: bool) -> None:
    """Megatron's MoE layer as an import writes it: `pre_mlp_layernorm`, router, grouped-GEMM experts
    (`linear_fc1.weight<e>`, fused at the expert TP = TP, or `_w`/`_v`), the shared expert and its gate."""
    mg, hf = LAYER.format(layer), HF_LAYER.format(layer)
    hidden, experts = cfg.int("hidden_size"), cfg.int("num_experts")
    shapes[mg + "pre_mlp_layernorm.weight"] = (hidden,)
    shapes[mg + ROUTER] = (experts, hidden)
    for e in range(experts):
        swiglu_shapes(cfg, spec, shapes, mg + "mlp.experts.", f"{hf}mlp.experts.{e}.", cfg.int("moe_intermediate_size"),
                      index=str(e))
    if shared:
        swiglu_shapes(cfg, spec, shapes, mg + "mlp.shared_experts.", hf + "mlp.shared_expert.",
                      cfg.int("shared_expert_intermediate_size"))
        shapes[mg + SHARED_GATE] = (1, hidden)


@dataclass(frozen=True)
class Qwen3MoeFamily:
    name: str = "qwen3-moe"
    model_types: tuple[str, ...] = ("qwen3_moe",)

    def to_hf(self, ctx: ExportContext) -> dict[str, HFTensor]:
        cfg = ctx.config
        att = Attention.from_config(cfg, None)
        out: dict[str, HFTensor] = {}
        embeddings(ctx, out)
        for layer in range(cfg.int("num_hidden_layers")):
            attention(ctx, out, layer, att, qk_norm=True, bias=None)
            if is_sparse(cfg, layer):
                moe_mlp(ctx, out, layer, shared=False)
            else:
                dense_mlp(ctx, out, layer, cfg.int("intermediate_size"))
        output_layer(ctx, out)
        return out

    def megatron_shapes(self, cfg: HFConfig, spec: MegatronSpec) -> Shapes:
        att = Attention.from_config(cfg, None)
        shapes: Shapes = {}
        embeddings_shapes(cfg, spec, shapes)
        for layer in range(cfg.int("num_hidden_layers")):
            attention_shapes(cfg, spec, shapes, layer, att, qk_norm=True)
            if is_sparse(cfg, layer):
                moe_mlp_shapes(cfg, spec, shapes, layer, shared=False)
            else:
                dense_mlp_shapes(cfg, spec, shapes, layer, cfg.int("intermediate_size"))
        output_shapes(cfg, spec, shapes)
        return shapes


QWEN3_MOE = Qwen3MoeFamily()
