"""Qwen3.5 text models, dense and MoE: Qwen3-Next's layers with GDN's input projection flat.

HF `linear_attn.in_proj_qkv` is `[q; k; v]`, each of all heads in order, with `in_proj_z`,
`in_proj_b` (beta) and `in_proj_a` (alpha) apart (transformers' `Qwen3_5GatedDeltaNet`,
Megatron-Bridge's `GDNLinearMappingSeparate`), where Qwen3-Next groups them per key head.
The Megatron side is Qwen3-Next's: `in_proj` `[q, k, v, z, beta, alpha]` per TP rank,
`conv1d`, the gated attention with q/k norms, zero-centred norms but GDN's `out_norm`. A
MoE model (`qwen3_5_moe_text`) has routed experts and a gated shared expert in every
layer; a dense one (`qwen3_5_text`) a SwiGLU MLP. The vision-language configs (`qwen3_5`,
`qwen3_5_moe`, weights under `model.language_model.`) are not this family.
"""

from __future__ import annotations

from dataclasses import dataclass

from ckptctl.families.base import ExportContext, HFTensor
from ckptctl.families.llama import EMBEDDING, FINAL, attention
from ckptctl.families.qwen3_moe import moe_blocks
from ckptctl.families.qwen3_next import GDN, GatedDeltaNet, GdnInProj, dims, is_full, is_linear
from ckptctl.families.rules import Block, Dims, Family, Rule, Scope, put
from ckptctl.megatron.rows import GDN_IN_PROJ_PARTS


@dataclass(frozen=True)
class GdnInProjFlat(GdnInProj):
    """Megatron `in_proj` `[q, k, v, z, beta, alpha]` per TP rank ↔ HF `in_proj_qkv` `[q; k; v]`,
    `in_proj_z`, `in_proj_b` and `in_proj_a`, every component whole."""

    def to_hf(self, ctx: ExportContext, dims: Dims, at: Scope, out: dict[str, HFTensor]) -> None:
        g: GatedDeltaNet = dims.heads["gdn"]
        q, k, v, z, beta, alpha = ctx.model.components(at.name("mg", self.mg), GDN_IN_PROJ_PARTS, g.in_proj_rows,
                                                       ctx.tp)
        qk, vd = g.in_proj_rows[0], g.in_proj_rows[2]
        for name, parts, rows in (("in_proj_qkv", (q, k, v), 2 * qk + vd), ("in_proj_z", (z,), vd),
                                  ("in_proj_b", (beta,), g.value_heads), ("in_proj_a", (alpha,), g.value_heads)):
            put(out, HFTensor(at.name("hf", f"linear_attn.{name}.weight"), parts), (rows, g.hidden), dims.config)


FLAT_GDN: tuple[Rule, ...] = tuple(GdnInProjFlat() if type(rule) is GdnInProj else rule for rule in GDN)
"""Qwen3-Next's GDN layer with the flat input projection."""

QWEN3_5 = Family("qwen3.5", ("qwen3_5_text", "qwen3_5_moe_text"), dims, EMBEDDING,
                 (Block(FLAT_GDN, is_linear), Block(attention(qk_norm=True), is_full), *moe_blocks(shared=True)),
                 FINAL)
