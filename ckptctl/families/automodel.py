"""NeMo Automodel's native layout: Hugging Face names, but grouped, transposed MoE experts.

With its state-dict adapter off (and always in its `optim/` folder) Automodel saves each MoE
layer's experts as two stacks (`nemo_automodel/components/moe/experts.py`, converted by
`moe/state_dict_mixin.py`): `<layer>.mlp.experts.gate_and_up_projs` [E, H, 2I] and
`<layer>.mlp.experts.down_projs` [E, I, H]. Hugging Face holds one tensor per expert, each the
transpose of a block of a slab: `gate_proj[e] = gate_and_up_projs[e, :, :I]ᵀ`,
`up_proj[e] = gate_and_up_projs[e, :, I:]ᵀ`, `down_proj[e] = down_projs[e]ᵀ`; a non-gated
(ReLU²) MoE has `gate_and_up_projs` [E, H, I] and only `up_proj`. Every other tensor already
has its HF name and is exported as `--arch raw` exports it. Each expert tensor is one
transposed `Piece`, gathered tile by tile, never a whole stack in memory.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from ckptctl.core.dtypes import DType
from ckptctl.util.errors import CheckpointError
from ckptctl.families.base import ExportContext, MegatronModel
from ckptctl.families.raw import RawFamily, RawTensor
from ckptctl.core.plan import Piece, TargetTensor

GATE_AND_UP = "mlp.experts.gate_and_up_projs"
DOWN = "mlp.experts.down_projs"
NATIVE_EXPERTS = re.compile(r"^(?P<layer>(?:.*\.)?layers\.\d+)\.(?P<kind>mlp\.experts\.(?:gate_and_up|down)_projs)$")
"""A native grouped-expert stack, with the layer's name (`model.layers.3`) before it."""


@dataclass(frozen=True)
class ExpertSlab:
    """One expert's HF weight: columns [first, first + rows) of slab `expert` of a stack [E, A, B], transposed.

    The HF tensor is [rows, A]: its dim 0 runs along the stack's dim 2, its dim 1 along dim 1.
    """

    name: str
    fqn: str
    expert: int
    first: int
    shape: tuple[int, int]

    @property
    def sources(self) -> tuple[str, ...]:
        return (self.fqn,)

    def target(self, dtype: DType) -> TargetTensor:
        piece = Piece(self.fqn, (self.expert, 0, self.first), (0, 0), self.shape, (2, 1))
        return TargetTensor(self.name, self.shape, dtype, (piece,))


def native_expert_names(names: Iterable[str]) -> list[str]:
    """The names, sorted, of native grouped-expert stacks."""
    return sorted(n for n in names if NATIVE_EXPERTS.match(n))


def _layer_experts(model: MegatronModel, layer: str) -> list[ExpertSlab]:
    """The HF expert weights of one MoE layer, from its two stacks (shapes checked against each other)."""
    fused, down = f"{layer}.{GATE_AND_UP}", f"{layer}.{DOWN}"
    for name in (fused, down):
        if name not in model.entries:
            raise CheckpointError(model.ckpt.path, f"{model.prefix}{name} is missing: NeMo Automodel saves "
                                                   f"{GATE_AND_UP} and {DOWN} together")
        if len(model.entries[name].shape) != 3:
            raise CheckpointError(model.entries[name].fqn, f"shape {list(model.entries[name].shape)} is not a "
                                                           "stack of expert matrices [E, …, …]")
    (experts, hidden, width), (down_experts, inter, down_hidden) = (model.entries[fused].shape,
                                                                    model.entries[down].shape)
    if (down_experts, down_hidden) != (experts, hidden) or width not in (inter, 2 * inter):
        raise CheckpointError(model.ckpt.path, f"{model.prefix}{fused} {[experts, hidden, width]} and {DOWN} "
                                               f"{[down_experts, inter, down_hidden]} are not one expert layout "
                                               "([E, H, 2I] or [E, H, I] with [E, I, H])")
    parts = (("gate_proj", 0), ("up_proj", inter)) if width == 2 * inter else (("up_proj", 0),)
    out = []
    for e in range(experts):
        base = f"{layer}.mlp.experts.{e}"
        out.extend(ExpertSlab(f"{base}.{proj}.weight", model.entries[fused].fqn, e, first, (inter, hidden))
                   for proj, first in parts)
        out.append(ExpertSlab(f"{base}.down_proj.weight", model.entries[down].fqn, e, 0, (hidden, inter)))
    return out


@dataclass(frozen=True)
class AutomodelFamily(RawFamily):
    """`--arch raw` but for the native expert stacks, each exported as its per-expert HF tensors."""

    name: str = "automodel"

    def to_hf(self, ctx: ExportContext) -> dict[str, RawTensor | ExpertSlab]:
        out: dict[str, RawTensor | ExpertSlab] = super().to_hf(ctx)
        layers = sorted({NATIVE_EXPERTS.match(n)["layer"] for n in native_expert_names(out)})
        for name in native_expert_names(out):
            del out[name]
        for layer in layers:
            out.update((t.name, t) for t in _layer_experts(ctx.model, layer))
        return out


AUTOMODEL = AutomodelFamily()
