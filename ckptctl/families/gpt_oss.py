"""GPT-OSS: attention with biases and learned sinks, and experts packed per layer, gate and up interleaved.

HF keeps each MoE layer's experts as four stacks (transformers' `GptOssExperts`, which
multiplies `x @ gate_up_proj[e]`): `mlp.experts.gate_up_proj` [E, H, 2F] whose last dim
interleaves gate and up (column 2j is gate row j, 2j + 1 up row j), `gate_up_proj_bias`
[E, 2F] likewise, `down_proj` [E, F, H] and `down_proj_bias` [E, H]. Megatron holds expert e
as fc1 `[gate; up]` [2F, H] (fused per expert TP rank, or `_w`/`_v`), fc2 [H, F] and their
biases (Megatron-Bridge's `GPTOSSMLPGateUpProjMapping` / `GPTOSSMLPDownProjMapping`). Each
block of an expert's rows is one transposed piece of the stack, seen as [E, H, F, 2] (a
logical shape of the same elements), so the stacks are never held whole. Sinks are
`self_attn.sinks` ↔ `self_attention.core_attention.softmax_offset`, split over TP by head;
the router has a bias.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from ckptctl.core.dtypes import DType
from ckptctl.families.base import ExportContext, HFConfig, HFTensor, MegatronSpec, RowView, Shapes
from ckptctl.families.llama import EMBEDDING, FINAL, attention
from ckptctl.families.qwen3_moe import router
from ckptctl.families.rules import (COLUMN, REPLICATED, ROW, SWIGLU, Attention, Block, Dims, Family, Rule, Same, Scope,
                              fused_shapes, put)
from ckptctl.megatron.rows import SWIGLU_PARTS
from ckptctl.core.plan import Piece, TargetTensor

FC = "mlp.experts.{fc}.{kind}{e}", "mlp.experts.local_experts.{e}.{fc}.{kind}"
"""An expert's Megatron names: grouped-GEMM (what an import writes) or SequentialMLP's."""


@dataclass(frozen=True)
class ExpertStack:
    """An HF tensor stacking every expert [E, …], made of transposed pieces of each expert's
    Megatron tensors; with `logical_shape` its pieces are in that shape of the same elements
    ([E, H, F, 2] for an interleaved [E, H, 2F])."""

    name: str
    shape: tuple[int, ...]
    parts: tuple[Piece, ...]
    logical_shape: tuple[int, ...] | None = None
    add: float = 0.0

    @property
    def sources(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(p.src for p in self.parts))

    def pieces(self) -> tuple[Piece, ...]:
        return self.parts

    def target(self, dtype: DType) -> TargetTensor:
        return TargetTensor(self.name, self.shape, dtype, self.parts, logical_shape=self.logical_shape)


def _rows_along(view: RowView, expert: int, dst: tuple[int, ...], rows_dim: int,
                trailing: tuple[tuple[int, int], ...], axes: tuple[int | None, ...]) -> list[Piece]:
    """Pieces placing each block of `view`'s rows at `dst` of slab `expert`, its rows along dim
    `rows_dim` and its columns (`trailing`: (dim, size) pairs) along theirs."""
    out = []
    for b in view.blocks:
        start = list(dst)
        start[0], start[rows_dim] = expert, dst[rows_dim] + b.dst_row
        sizes = [1] * len(dst)
        sizes[rows_dim] = b.rows
        for d, n in trailing:
            sizes[d] = n
        out.append(Piece(view.fqn, (b.src_row, *(0 for _ in view.trailing)), tuple(start), tuple(sizes), axes))
    return out


@dataclass(frozen=True)
class PackedExperts:
    """Every expert's fc1 and fc2 (weight and bias) of one MoE layer ↔ HF's four interleaved stacks."""

    def names(self, at: Scope, e: int, fc: str, kind: str) -> list[str]:
        return [at.name("mg", n.format(fc=fc, kind=kind, e=e)) for n in FC]

    def to_hf(self, ctx: ExportContext, dims: Dims, at: Scope, out: dict[str, HFTensor]) -> None:
        m = ctx.model
        experts, ffn, hidden = dims.size("experts"), dims.size("ffn"), dims.size("hidden")
        pieces: dict[str, list[Piece]] = {"gate_up_proj": [], "gate_up_proj_bias": [], "down_proj": [],
                                          "down_proj_bias": []}
        for e in range(experts):
            for kind in ("weight", "bias"):
                names = self.names(at, e, "linear_fc1", kind)
                base = next((n for n in names if m.has(n) or m.has(n + SWIGLU_PARTS[0])), None)
                if base is None:
                    raise m.missing(*names)
                halves = m.components(base, SWIGLU_PARTS, (ffn, ffn), ctx.expert_tp)
                for c, half in enumerate(halves):  # gate → column 2j, up → 2j + 1 of [E, H, F, 2]
                    if kind == "weight":
                        pieces["gate_up_proj"] += _rows_along(half, e, (0, 0, 0, c), 2, ((1, hidden),),
                                                              (None, 1, 0, None))
                    else:
                        pieces["gate_up_proj_bias"] += _rows_along(half, e, (0, 0, c), 1, (), (None, 0, None))
                fc2 = m.view(*self.names(at, e, "linear_fc2", kind))
                if kind == "weight":
                    pieces["down_proj"] += _rows_along(fc2, e, (0, 0, 0), 2, ((1, ffn),), (None, 1, 0))
                else:
                    pieces["down_proj_bias"] += _rows_along(fc2, e, (0, 0), 1, (), (None, 0))
        layer = at.name("hf", "mlp.experts.")
        for name, shape, logical in (("gate_up_proj", (experts, hidden, 2 * ffn), (experts, hidden, ffn, 2)),
                                     ("gate_up_proj_bias", (experts, 2 * ffn), (experts, ffn, 2)),
                                     ("down_proj", (experts, ffn, hidden), None),
                                     ("down_proj_bias", (experts, hidden), None)):
            put(out, ExpertStack(layer + name, shape, tuple(pieces[name]), logical), shape, dims.config)

    def megatron_shapes(self, dims: Dims, spec: MegatronSpec, at: Scope, shapes: Shapes) -> None:
        ffn, hidden = dims.size("ffn"), dims.size("hidden")
        for e in range(dims.size("experts")):
            for kind, trailing in (("weight", (hidden,)), ("bias", ())):
                fused_shapes(spec, shapes, self.names(at, e, "linear_fc1", kind)[0], SWIGLU_PARTS, (ffn, ffn), trailing)
            shapes[self.names(at, e, "linear_fc2", "weight")[0]] = (hidden, ffn)
            shapes[self.names(at, e, "linear_fc2", "bias")[0]] = (hidden,)

    def megatron_tensors(self) -> Iterable[tuple[str, str]]:
        for name in FC:
            yield from ((name.format(fc="linear_fc1", kind=k, e="{e}"), SWIGLU) for k in ("weight", "bias"))
            yield name.format(fc="linear_fc2", kind="weight", e="{e}"), ROW
            yield name.format(fc="linear_fc2", kind="bias", e="{e}"), REPLICATED


LAYER: tuple[Rule, ...] = (
    *attention(qkv_bias="attention_bias"),
    Same("self_attn.sinks", ("self_attention.core_attention.softmax_offset",), ("heads",), COLUMN),
    *router("mlp.router.weight"),
    Same("mlp.router.bias", ("mlp.router.bias",), ("experts",), REPLICATED),
    PackedExperts(),
)
"""A GPT-OSS layer: every one is attention (with biases and sinks) and a MoE."""


def dims(cfg: HFConfig) -> Dims:
    att = Attention.from_config(cfg, 64)
    return Dims(cfg, {**att.sizes(), "heads": att.heads}, {"attention": att})


GPT_OSS = Family("gpt-oss", ("gpt_oss",), dims, EMBEDDING, (Block(LAYER),), FINAL)
