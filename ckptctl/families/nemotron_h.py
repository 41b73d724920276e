"""Nemotron-H: a hybrid stack of Mamba-2, attention and relu² MLP layers, one mixer each.

HF layer L is `backbone.layers.L.` with one `norm` and a `mixer` of the kind
`layers_block_type` (or the older `hybrid_override_pattern`, `M*-E`) gives it; Megatron's
hybrid stack numbers its layers the same way and fuses each layer's norm into its first
linear (Megatron-Bridge's `NemotronHBridge`). Mamba (`decoder.layers.L.mixer.`): `in_proj`
per TP rank `[z_t; x_t; B_t; C_t; dt_t]` ↔ HF `[z; x; B; C; dt]` (`MambaInProjMapping`),
`conv1d` weight and bias `[x_t; B_t; C_t]` ↔ `[x; B; C]` (`MambaConv1dMapping`); megatron-core's
torch_dist saves them split (`in_proj.weight.z` …), which is read too. `A_log`, `D`,
`dt_bias` and the gated `norm` are split over TP on dim 0. MLP layers are not gated:
fc1 ↔ `up_proj`. A MoE layer (`E`) has a separate pre-MLP norm, a sigmoid router with its
expert bias (`mixer.gate.weight`, `gate.e_score_correction_bias`), relu² experts written
per expert (`mixer.experts.{e}.up_proj` / `down_proj`, which transformers stacks on load)
and shared experts. Latent MoE projections (`moe_latent_size`) are refused.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Iterable

from ckptctl.util.errors import UsageError
from ckptctl.families.base import ExportContext, HFConfig, HFTensor, MegatronSpec, Shapes
from ckptctl.families.llama import attention_dims
from ckptctl.families.rules import (COLUMN, REPLICATED, MAMBA_CONV1D, MAMBA_IN_PROJ, ROW, SWIGLU, Block, Dims, Family,
                              GroupedQKV, Rule, Same, Scope, VocabRows, fused_shapes, put)
from ckptctl.megatron.rows import MAMBA_CONV1D_PARTS, MAMBA_IN_PROJ_PARTS

PATTERN = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
"""`hybrid_override_pattern` characters → `layers_block_type` values (transformers' own)."""


def layer_kinds(cfg: HFConfig) -> list[str]:
    """Each layer's kind; the count is theirs (transformers derives `num_hidden_layers` from them)."""
    kinds = cfg.get("layers_block_type")
    if kinds is None and isinstance(cfg.get("hybrid_override_pattern"), str):
        kinds = [PATTERN.get(c, c) for c in cfg.get("hybrid_override_pattern")]
    layers = cfg.get("num_hidden_layers", len(kinds) if isinstance(kinds, list) else None)
    if not isinstance(kinds, list) or len(kinds) != layers or any(k not in PATTERN.values() for k in kinds):
        raise UsageError(f"{cfg.path}: layers_block_type (or hybrid_override_pattern) must name one of "
                         f"{', '.join(PATTERN.values())} for each layer (num_hidden_layers={layers})")
    if "moe" in kinds and cfg.get("moe_latent_size"):
        raise UsageError(f"{cfg.path}: Nemotron-H latent MoE (moe_latent_size) is not supported yet")
    return kinds


def is_mamba(cfg: HFConfig, layer: int) -> bool:
    return layer_kinds(cfg)[layer] == "linear_attention"


def is_attention(cfg: HFConfig, layer: int) -> bool:
    return layer_kinds(cfg)[layer] == "full_attention"


def is_mlp(cfg: HFConfig, layer: int) -> bool:
    return layer_kinds(cfg)[layer] == "mlp"


def is_moe(cfg: HFConfig, layer: int) -> bool:
    return layer_kinds(cfg)[layer] == "moe"


@dataclass(frozen=True)
class Mamba:
    """Mamba-2 mixer sizes: heads of `head_dim` channels (d_inner = heads · head_dim), and
    `groups` groups of B and C of `state` channels each. Megatron-aware reshard knows these four
    only (`kernel` and `hidden` 0), which is all re-blocking needs."""

    heads: int
    head_dim: int
    groups: int
    state: int
    kernel: int = 0
    hidden: int = 0

    @classmethod
    def from_config(cls, cfg: HFConfig) -> "Mamba":
        return cls(cfg.int("mamba_num_heads"), cfg.int("mamba_head_dim"), cfg.int("n_groups"),
                   cfg.int("ssm_state_size"), cfg.int("conv_kernel"), cfg.int("hidden_size"))

    @property
    def inner(self) -> int:
        return self.heads * self.head_dim

    @property
    def in_proj_rows(self) -> tuple[int, ...]:
        """`in_proj`'s components `[z, x, B, C, dt]`."""
        gn = self.groups * self.state
        return (self.inner, self.inner, gn, gn, self.heads)

    @property
    def conv_rows(self) -> tuple[int, ...]:
        """`conv1d`'s components `[x, B, C]`."""
        return self.in_proj_rows[1:4]

    def check_tp(self, tp: int) -> None:
        if self.heads % tp or self.groups % tp:
            raise UsageError(f"mamba_num_heads={self.heads} and n_groups={self.groups} must both divide by TP {tp} "
                             "(Megatron gives each TP rank whole heads and groups)")


@dataclass(frozen=True)
class MambaFused:
    """A Mamba tensor Megatron fuses per TP rank (`in_proj`, or `conv1d` weight or bias) ↔ the
    HF tensor of the same components whole, in the same order. Written fused (`megatron.rows.WRITTEN_SPLIT`)."""

    mg: str
    hf: str
    kind: str

    def rows(self, m: Mamba) -> tuple[int, ...]:
        return m.in_proj_rows if self.kind == MAMBA_IN_PROJ else m.conv_rows

    def parts(self) -> tuple[str, ...]:
        return MAMBA_IN_PROJ_PARTS if self.kind == MAMBA_IN_PROJ else MAMBA_CONV1D_PARTS

    def trailing(self, m: Mamba) -> tuple[int, ...]:
        if self.kind == MAMBA_IN_PROJ:
            return (m.hidden,)
        return (1, m.kernel) if self.mg.endswith("weight") else ()

    def to_hf(self, ctx: ExportContext, dims: Dims, at: Scope, out: dict[str, HFTensor]) -> None:
        m: Mamba = dims.heads["mamba"]
        views = ctx.model.components(at.name("mg", self.mg), self.parts(), self.rows(m), ctx.tp)
        put(out, HFTensor(at.name("hf", self.hf), tuple(views)), (sum(self.rows(m)), *self.trailing(m)), dims.config)

    def megatron_shapes(self, dims: Dims, spec: MegatronSpec, at: Scope, shapes: Shapes) -> None:
        m: Mamba = dims.heads["mamba"]
        m.check_tp(spec.tp)
        fused_shapes(replace(spec, split=False), shapes, at.name("mg", self.mg), self.parts(), self.rows(m),
                     self.trailing(m))

    def megatron_tensors(self) -> Iterable[tuple[str, str]]:
        return ((self.mg, self.kind),)


MAMBA: tuple[Rule, ...] = (
    Same("norm.weight", ("mixer.in_proj.layer_norm_weight", "norm.weight"), ("hidden",), REPLICATED),
    MambaFused("mixer.in_proj.weight", "mixer.in_proj.weight", MAMBA_IN_PROJ),
    MambaFused("mixer.conv1d.weight", "mixer.conv1d.weight", MAMBA_CONV1D),
    MambaFused("mixer.conv1d.bias", "mixer.conv1d.bias", MAMBA_CONV1D),
    Same("mixer.A_log", ("mixer.A_log",), ("mamba_heads",), COLUMN),
    Same("mixer.D", ("mixer.D",), ("mamba_heads",), COLUMN),
    Same("mixer.dt_bias", ("mixer.dt_bias",), ("mamba_heads",), COLUMN),
    Same("mixer.norm.weight", ("mixer.norm.weight",), ("mamba_inner",), COLUMN),
    Same("mixer.out_proj.weight", ("mixer.out_proj.weight",), ("hidden", "mamba_inner"), ROW),
)
"""A Mamba-2 layer (`decoder.layers.L.mixer.` ↔ `backbone.layers.L.mixer.`)."""
ATTENTION: tuple[Rule, ...] = (
    Same("norm.weight", ("self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight"), ("hidden",),
         REPLICATED),
    GroupedQKV("weight", module="mixer"),
    Same("mixer.o_proj.weight", ("self_attention.linear_proj.weight",), ("hidden", "q_width"), ROW),
)
MLP: tuple[Rule, ...] = (
    Same("norm.weight", ("mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight"), ("hidden",), REPLICATED),
    Same("mixer.up_proj.weight", ("mlp.linear_fc1.weight",), ("ffn", "hidden"), SWIGLU),
    Same("mixer.down_proj.weight", ("mlp.linear_fc2.weight",), ("hidden", "ffn"), ROW),
)
"""A relu² MLP layer: fc1 is declared with the other families' fc1 kind, which Megatron-aware
reshard re-blocks only for a gated family (`Family.gated_mlp`)."""
MOE: tuple[Rule, ...] = (
    Same("norm.weight", ("pre_mlp_layernorm.weight",), ("hidden",), REPLICATED),
    Same("mixer.gate.weight", ("mlp.router.weight",), ("experts", "hidden"), REPLICATED),
    Same("mixer.gate.e_score_correction_bias", ("mlp.router.expert_bias",), ("experts",), REPLICATED),
    Same("mixer.shared_experts.up_proj.weight", ("mlp.shared_experts.linear_fc1.weight",), ("shared_ffn", "hidden"),
         SWIGLU),
    Same("mixer.shared_experts.down_proj.weight", ("mlp.shared_experts.linear_fc2.weight",), ("hidden", "shared_ffn"),
         ROW),
)
"""A MoE layer but its routed experts (`EXPERT`)."""
EXPERT: tuple[Rule, ...] = (
    Same("mixer.experts.{e}.up_proj.weight", ("mlp.experts.linear_fc1.weight{e}",
                                              "mlp.experts.local_experts.{e}.linear_fc1.weight"), ("moe_ffn", "hidden"),
         SWIGLU),
    Same("mixer.experts.{e}.down_proj.weight", ("mlp.experts.linear_fc2.weight{e}",
                                                "mlp.experts.local_experts.{e}.linear_fc2.weight"), ("hidden", "moe_ffn"),
         ROW),
)
"""One relu² routed expert: grouped-GEMM names (what an import writes) or SequentialMLP's."""


def dims(cfg: HFConfig) -> Dims:
    base = attention_dims(None)(cfg)
    mamba = Mamba.from_config(cfg)
    return Dims(cfg, {**base.derived, "mamba_heads": mamba.heads, "mamba_inner": mamba.inner,
                      "layers": len(layer_kinds(cfg)),
                      **({"shared_ffn": cfg.int("moe_shared_expert_intermediate_size")}
                         if "moe" in layer_kinds(cfg) else {})},
                {**base.heads, "mamba": mamba})


NEMOTRON_H = Family("nemotron-h", ("nemotron_h",), dims,
                    (VocabRows("backbone.embeddings.weight", "embedding.word_embeddings.weight"),),
                    (Block(MAMBA, is_mamba), Block(ATTENTION, is_attention), Block(MLP, is_mlp), Block(MOE, is_moe),
                     Block(EXPERT, is_moe, per_expert=True)),
                    (Same("backbone.norm_f.weight", ("decoder.final_norm.weight",), ("hidden",), REPLICATED),
                     VocabRows("lm_head.weight", "output_layer.weight", tied_by="tie_word_embeddings",
                               tied_to="backbone.embeddings.weight")),
                    hf_layer="backbone.layers.{L}.")
