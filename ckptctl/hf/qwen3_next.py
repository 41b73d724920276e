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

from ckptctl.errors import UsageError
from ckptctl.hf.base import ExportContext, HFConfig, HFTensor, MegatronSpec, Shapes
from ckptctl.hf.llama import (HF_LAYER, LAYER, Attention, attention, attention_shapes, dense_mlp, dense_mlp_shapes,
                              embeddings, embeddings_shapes, output_layer, output_shapes, put)
from ckptctl.hf.qwen3_moe import is_sparse, moe_mlp, moe_mlp_shapes
from ckptctl.megatron import GDN_CONV1D_PARTS, GDN_IN_PROJ_PARTS

GDN_INPUT_NORM = ("self_attention.in_proj.layer_norm_weight", "input_layernorm.weight")


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


@dataclass(frozen=True)
class GatedDeltaNet:
    """GDN head layout from the HF config."""

    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    kernel: int
    hidden: int

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
        qk, vd = self.key_heads * self.key_dim, self.value_heads * self.value_dim
        return (qk, qk, vd, vd, self.value_heads, self.value_heads)


def gdn(ctx: ExportContext, out: dict[str, HFTensor], layer: int, g: GatedDeltaNet) -> None:
    """`linear_attn.*` and `input_layernorm` of one linear-attention layer."""
    cfg, m = ctx.config, ctx.model
    mg, hf = LAYER.format(layer) + "self_attention.", HF_LAYER.format(layer) + "linear_attn."
    put(out, HFTensor(HF_LAYER.format(layer) + "input_layernorm.weight",
                      (m.view(*(LAYER.format(layer) + n for n in GDN_INPUT_NORM)),)), (g.hidden,), cfg)
    q, k, v, z, beta, alpha = m.components(mg + "in_proj.weight", GDN_IN_PROJ_PARTS, g.in_proj_rows, ctx.tp)
    r, dk, dv = g.ratio, g.key_dim, g.value_dim
    qkvz, ba = [], []
    for h in range(g.key_heads):
        qkvz += [q.take(h * dk, dk), k.take(h * dk, dk), v.take(h * r * dv, r * dv), z.take(h * r * dv, r * dv)]
        ba += [beta.take(h * r, r), alpha.take(h * r, r)]
    put(out, HFTensor(hf + "in_proj_qkvz.weight", tuple(qkvz)), (sum(g.in_proj_rows[:4]), g.hidden), cfg)
    put(out, HFTensor(hf + "in_proj_ba.weight", tuple(ba)), (2 * g.value_heads, g.hidden), cfg)
    conv = m.components(mg + "conv1d.weight", GDN_CONV1D_PARTS, g.in_proj_rows[:3], ctx.tp)
    put(out, HFTensor(hf + "conv1d.weight", tuple(conv)), (sum(g.in_proj_rows[:3]), 1, g.kernel), cfg)
    put(out, HFTensor(hf + "A_log", (m.view(mg + "A_log"),)), (g.value_heads,), cfg)
    put(out, HFTensor(hf + "dt_bias", (m.view(mg + "dt_bias"),)), (g.value_heads,), cfg)
    put(out, HFTensor(hf + "norm.weight", (m.view(mg + "out_norm.weight"),), add=1.0), (g.value_dim,), cfg)
    put(out, HFTensor(hf + "out_proj.weight", (m.view(mg + "out_proj.weight"),)),
        (g.hidden, g.value_heads * g.value_dim), cfg)


def gdn_shapes(spec: MegatronSpec, shapes: Shapes, layer: int, g: GatedDeltaNet) -> None:
    """Megatron's GDN tensors: in_proj and conv1d fused (TP-blocked) or split into components."""
    mg = LAYER.format(layer) + "self_attention."
    if g.key_heads % spec.tp:
        raise UsageError(f"linear_num_key_heads={g.key_heads} does not divide by TP {spec.tp} (Megatron gives each "
                         "TP rank whole key heads)")
    shapes[LAYER.format(layer) + GDN_INPUT_NORM[0]] = (g.hidden,)
    for base, rows, parts, trailing in (("in_proj.weight", g.in_proj_rows, GDN_IN_PROJ_PARTS, (g.hidden,)),
                                        ("conv1d.weight", g.in_proj_rows[:3], GDN_CONV1D_PARTS, (1, g.kernel))):
        if spec.split:
            for part, n in zip(parts, rows):
                shapes[mg + base + part] = (n, *trailing)
        else:
            shapes[mg + base] = (sum(rows), *trailing)
    shapes[mg + "A_log"] = (g.value_heads,)
    shapes[mg + "dt_bias"] = (g.value_heads,)
    shapes[mg + "out_norm.weight"] = (g.value_dim,)
    shapes[mg + "out_proj.weight"] = (g.hidden, g.value_heads * g.value_dim)


@dataclass(frozen=True)
class Qwen3NextFamily:
    name: str = "qwen3-next"
    model_types: tuple[str, ...] = ("qwen3_next",)

    def to_hf(self, ctx: ExportContext) -> dict[str, HFTensor]:
        cfg = ctx.config
        att = Attention.from_config(cfg, 256, gated=True)
        linear = GatedDeltaNet.from_config(cfg)
        out: dict[str, HFTensor] = {}
        embeddings(ctx, out)
        for layer, kind in enumerate(layer_types(cfg)):
            if kind == "linear_attention":
                gdn(ctx, out, layer, linear)
            else:
                attention(ctx, out, layer, att, qk_norm=True, bias=None)
            if is_sparse(cfg, layer):
                moe_mlp(ctx, out, layer, shared=cfg.int("shared_expert_intermediate_size", 0) > 0)
            else:
                dense_mlp(ctx, out, layer, cfg.int("intermediate_size"))
        output_layer(ctx, out)
        return out

    def megatron_shapes(self, cfg: HFConfig, spec: MegatronSpec) -> Shapes:
        att = Attention.from_config(cfg, 256, gated=True)
        linear = GatedDeltaNet.from_config(cfg)
        shapes: Shapes = {}
        embeddings_shapes(cfg, spec, shapes)
        for layer, kind in enumerate(layer_types(cfg)):
            if kind == "linear_attention":
                gdn_shapes(spec, shapes, layer, linear)
            else:
                attention_shapes(cfg, spec, shapes, layer, att, qk_norm=True)
            if is_sparse(cfg, layer):
                moe_mlp_shapes(cfg, spec, shapes, layer, shared=cfg.int("shared_expert_intermediate_size", 0) > 0)
            else:
                dense_mlp_shapes(cfg, spec, shapes, layer, cfg.int("intermediate_size"))
        output_shapes(cfg, spec, shapes)
        return shapes


QWEN3_NEXT = Qwen3NextFamily()
