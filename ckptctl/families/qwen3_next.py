"""Qwen3-Next: Gated DeltaNet (linear attention) and gated full attention, MoE with a shared expert.

Which layers are linear or full attention comes from `config.layer_types` (else
`full_attention_interval`, as transformers derives it); which are MoE from
`mlp_only_layers` / `decoder_sparse_step`.

GDN (`decoder.layers.L.self_attention.` → `model.layers.L.linear_attn.`), per TP rank
Megatron's `in_proj` is `[q, k, v, z, beta, alpha]` (sizes `[qk, qk, vd, vd, nv, nv] / TP`,
qk = nk·dk, vd = nv·dv), saved fused TP-blocked or split into `in_proj.weight.<component>`.
HF `in_proj_qkvz` is grouped per key head g: `[q_g (dk), k_g (dk), v_g (r·dv), z_g (r·dv)]`
and `in_proj_ba` `[beta_g (r), alpha_g (r)]` with r = nv / nk — the inverse of
`Qwen3NextGatedDeltaNet.fix_query_key_value_ordering`. `conv1d` = `[q; k; v]` of all heads.
HF `norm.weight` = Megatron `out_norm.weight` + 1 (Megatron keeps a zero-centred gamma;
every other Qwen3-Next norm is zero-centred on both sides and copied as is).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from ckptctl.util.errors import UsageError
from ckptctl.families.base import ExportContext, HFConfig, HFTensor, MegatronSpec, Shapes
from ckptctl.families.llama import EMBEDDING, FINAL, attention
from ckptctl.families.qwen3_moe import moe_blocks
from ckptctl.families.rules import (COLUMN, REPLICATED, GDN_CONV1D, GDN_IN_PROJ, ROW, Attention, Block, Dims, Family, Rule,
                              Same, Scope, fused_shapes, put)
from ckptctl.megatron.rows import GDN_CONV1D_PARTS, GDN_IN_PROJ_PARTS


def layer_types(cfg: HFConfig) -> list[str]:
    layers = cfg.int("num_hidden_layers")
    types = cfg.get("layer_types")
    if types is None:
        interval = cfg.int("full_attention_interval", 4)
        types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(layers)]
    if len(types) != layers or any(t not in ("linear_attention", "full_attention") for t in types):
        raise UsageError(f"{cfg.path}: layer_types must list linear_attention/full_attention for each of "
                         f"{layers} layers")
    return list(types)


def is_linear(cfg: HFConfig, layer: int) -> bool:
    return layer_types(cfg)[layer] == "linear_attention"


def is_full(cfg: HFConfig, layer: int) -> bool:
    return not is_linear(cfg, layer)


@dataclass(frozen=True)
class GatedDeltaNet:
    """GDN head layout: from the HF config for an export or import; Megatron-aware reshard
    knows the head counts and dims only (`kernel` and `hidden` 0), which is all its splits need."""

    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    kernel: int = 0
    hidden: int = 0

    @classmethod
    def from_config(cls, cfg: HFConfig) -> "GatedDeltaNet":
        gdn = cls(cfg.int("linear_num_key_heads"), cfg.int("linear_num_value_heads"), cfg.int("linear_key_head_dim"),
                  cfg.int("linear_value_head_dim"), cfg.int("linear_conv_kernel_dim"), cfg.int("hidden_size"))
        cfg.divides("linear_num_value_heads", "linear_num_key_heads")
        return gdn

    @property
    def ratio(self) -> int:
        return self.value_heads // self.key_heads

    @property
    def in_proj_rows(self) -> tuple[int, ...]:
        """`in_proj`'s components `[q, k, v, z, beta, alpha]` (per TP rank, each its share)."""
        qk, vd = self.key_heads * self.key_dim, self.value_heads * self.value_dim
        return (qk, qk, vd, vd, self.value_heads, self.value_heads)

    @property
    def conv_rows(self) -> tuple[int, ...]:
        """`conv1d`'s components `[q, k, v]`."""
        return self.in_proj_rows[:3]

    def sizes(self) -> dict[str, int]:
        return {"v_heads": self.value_heads, "v_dim": self.value_dim, "v_width": self.value_heads * self.value_dim}


@dataclass(frozen=True)
class GdnInProj:
    """Megatron `in_proj` `[q, k, v, z, beta, alpha]` per TP rank (fused TP-blocked, or split into
    `in_proj.weight.<component>`) ↔ HF `in_proj_qkvz` and `in_proj_ba`, grouped per key head."""

    mg: str = "self_attention.in_proj.weight"

    def to_hf(self, ctx: ExportContext, dims: Dims, at: Scope, out: dict[str, HFTensor]) -> None:
        g: GatedDeltaNet = dims.heads["gdn"]
        q, k, v, z, beta, alpha = ctx.model.components(at.name("mg", self.mg), GDN_IN_PROJ_PARTS, g.in_proj_rows,
                                                       ctx.tp)
        r, dk, dv = g.ratio, g.key_dim, g.value_dim
        qkvz, ba = [], []
        for h in range(g.key_heads):
            qkvz += [q.take(h * dk, dk), k.take(h * dk, dk), v.take(h * r * dv, r * dv), z.take(h * r * dv, r * dv)]
            ba += [beta.take(h * r, r), alpha.take(h * r, r)]
        put(out, HFTensor(at.name("hf", "linear_attn.in_proj_qkvz.weight"), tuple(qkvz)),
            (sum(g.in_proj_rows[:4]), g.hidden), dims.config)
        put(out, HFTensor(at.name("hf", "linear_attn.in_proj_ba.weight"), tuple(ba)), (2 * g.value_heads, g.hidden),
            dims.config)

    def megatron_shapes(self, dims: Dims, spec: MegatronSpec, at: Scope, shapes: Shapes) -> None:
        g: GatedDeltaNet = dims.heads["gdn"]
        if g.key_heads % spec.tp:
            raise UsageError(f"linear_num_key_heads={g.key_heads} does not divide by TP {spec.tp} (Megatron gives "
                             "each TP rank whole key heads)")
        fused_shapes(spec, shapes, at.name("mg", self.mg), GDN_IN_PROJ_PARTS, g.in_proj_rows, (g.hidden,))

    def megatron_tensors(self) -> Iterable[tuple[str, str]]:
        return ((self.mg, GDN_IN_PROJ), (self.mg.replace("weight", "bias"), GDN_IN_PROJ))


@dataclass(frozen=True)
class GdnConv1d:
    """Megatron `conv1d` `[q, k, v]` per TP rank ↔ HF `conv1d`, the same components whole."""

    mg: str = "self_attention.conv1d.weight"

    def to_hf(self, ctx: ExportContext, dims: Dims, at: Scope, out: dict[str, HFTensor]) -> None:
        g: GatedDeltaNet = dims.heads["gdn"]
        conv = ctx.model.components(at.name("mg", self.mg), GDN_CONV1D_PARTS, g.conv_rows, ctx.tp)
        put(out, HFTensor(at.name("hf", "linear_attn.conv1d.weight"), tuple(conv)),
            (sum(g.conv_rows), 1, g.kernel), dims.config)

    def megatron_shapes(self, dims: Dims, spec: MegatronSpec, at: Scope, shapes: Shapes) -> None:
        g: GatedDeltaNet = dims.heads["gdn"]
        fused_shapes(spec, shapes, at.name("mg", self.mg), GDN_CONV1D_PARTS, g.conv_rows, (1, g.kernel))

    def megatron_tensors(self) -> Iterable[tuple[str, str]]:
        return ((self.mg, GDN_CONV1D), (self.mg.replace("weight", "bias"), GDN_CONV1D))


GDN: tuple[Rule, ...] = (
    Same("input_layernorm.weight", ("self_attention.in_proj.layer_norm_weight", "input_layernorm.weight"),
         ("hidden",), REPLICATED),
    GdnInProj(),
    GdnConv1d(),
    Same("linear_attn.A_log", ("self_attention.A_log",), ("v_heads",), COLUMN),
    Same("linear_attn.dt_bias", ("self_attention.dt_bias",), ("v_heads",), COLUMN),
    Same("linear_attn.norm.weight", ("self_attention.out_norm.weight",), ("v_dim",), REPLICATED, add=1.0),
    Same("linear_attn.out_proj.weight", ("self_attention.out_proj.weight",), ("hidden", "v_width"), ROW),
)
"""A Gated DeltaNet layer (`decoder.layers.L.self_attention.` ↔ `model.layers.L.linear_attn.`)."""


def dims(cfg: HFConfig) -> Dims:
    att = Attention.from_config(cfg, 256, gated=True)
    gdn = GatedDeltaNet.from_config(cfg)
    return Dims(cfg, {**att.sizes(), **gdn.sizes()}, {"attention": att, "gdn": gdn})


QWEN3_NEXT = Family("qwen3-next", ("qwen3_next",), dims, EMBEDDING,
                    (Block(GDN, is_linear), Block(attention(qk_norm=True), is_full), *moe_blocks(shared=True)),
                    FINAL)
