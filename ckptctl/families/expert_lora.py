"""LoRA on MoE experts as PEFT writes it for transformers 5's fused expert parameters (`target_parameters`).

transformers 5 holds a layer's experts as 3-D parameters of one module (`mlp.experts.gate_up_proj`
[E, 2F, H], `down_proj` [E, H, F]: `families.experts.STACKED`), not as linears, so a PEFT LoRA on
`mlp.experts.<e>.gate_proj` finds no module to wrap. PEFT adapts such a parameter with a
`ParamWrapper` (LoraConfig `target_parameters`, peft ≥ 0.17): `lora_A` [E·r, in], expert e's A its
rows e·r …; `lora_B` [out, r·E], expert e's B its columns e, E + e, 2E + e … (peft's
`get_delta_weight`: A reshaped [E, r, in], B reshaped [out, r, E]), merged as
W_e + (α / r) · B_e @ A_e. Two parameters of one module are wrapped one inside the other in the
order the module registers them (peft's nesting; transformers registers gate_up_proj, then
down_proj): the first is the inner one, its tensors under `mlp.experts.base_layer.`, the outer
one's under `mlp.experts.`. The wrappers are `Adapter`s of a parameter, which `peft_config`
writes as `target_parameters`. A ParamWrapper adapts every expert of its stack at one rank, so
some experts left out, experts of one stack at different ranks, or gate and up with different A
(canonical LoRA's adapter_gate / adapter_up) are refused by name; so are experts at another rank
than the other modules (`normalize_moe_lora`), whose `rank_pattern` entry is not proven to load.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import replace

from ckptctl.core.plan import Piece, TargetTensor
from ckptctl.families.adapters import PEFT_PREFIX, Adapter
from ckptctl.families.experts import STACKED, stacked_parts
from ckptctl.util.errors import CheckpointError

_EXPERT_MODULE = re.compile(r"^(?P<layer>.*\.)mlp\.experts\.(?P<e>\d+)\.(?P<leaf>[^.]+)$")
_PER_EXPERT = re.compile(r"\.experts\.\d+\.")


def is_per_expert(name: str) -> bool:
    """Whether HF name `name` is one expert's (`…mlp.experts.<e>.…`), which transformers 5 may fuse."""
    return _PER_EXPERT.search(name) is not None


def _parts() -> dict[str, tuple[str, int]]:
    """An expert's HF module leaf → (its stacked parameter, its place among that one's parts)."""
    return {part.removesuffix(".weight"): (stacked, i) for stacked, parts in STACKED.items()
            for i, part in enumerate(parts)}


def fuse_expert_adapters(tensors: Mapping[str, TargetTensor], adapters: Sequence[Adapter],
                         targets: Mapping[str, TargetTensor], in_memory: Collection[str] | None, where: str
                         ) -> tuple[dict[str, TargetTensor], list[Adapter]]:
    """The PEFT folder's tensors with every per-expert module's LoRA (`mlp.experts.<e>.gate_proj` …)
    moved into its layer's ParamWrapper tensors (module docstring), and the adapters: those on
    modules as they were, the ParamWrappers' as `Adapter`s of a parameter (which `peft_config`
    writes as `target_parameters`). `targets`: the HF model's tensors, which say each stack's
    experts and rows; `in_memory`: the names transformers' model holds in memory where they differ
    from those it saves (empty: the same, so each expert is a linear PEFT wraps as it is; None: not
    known, and expert adapters are refused); `where`: what refusals name."""
    if in_memory is not None and not in_memory:
        return dict(tensors), list(adapters)
    parts = _parts()
    out = dict(tensors)
    kept: list[Adapter] = []
    stacks: dict[tuple[str, str], dict[int, dict[int, Adapter]]] = {}
    for adapter in adapters:
        match = _EXPERT_MODULE.match(adapter.module)
        if match is None or match["leaf"] not in parts:
            if is_per_expert(adapter.module):
                raise CheckpointError(where, f"{adapter.module}: a LoRA adapter on one expert's linear, which "
                                             "transformers 5 holds in a fused expert parameter PEFT's "
                                             "target_parameters adapts only for mlp.experts.{gate_up,down}_proj")
            kept.append(adapter)
            continue
        stacked, part = parts[match["leaf"]]
        stacks.setdefault((match["layer"], stacked), {}).setdefault(int(match["e"]), {})[part] = adapter
    adapted: dict[str, list[str]] = {}
    for (layer, stacked), experts in sorted(stacks.items()):
        wanted = _experts_of(targets, layer, stacked)
        first = next(iter(next(iter(experts.values())).values()))
        if in_memory is None or f"{layer}{stacked}" not in in_memory:
            why = ("transformers' model for the config is not known (the name check is off), nor so how it holds "
                   "the experts" if in_memory is None else f"transformers' model holds no {layer}{stacked} to adapt")
            raise CheckpointError(where, f"{first.module}: a LoRA adapter on an expert, but {why}")
        missing = [f"{layer}mlp.experts.{e}.{p.removesuffix('.weight')}" for e in range(wanted)
                   for i, p in enumerate(STACKED[stacked]) if i not in experts.get(e, {})]
        if missing or len(experts) != wanted:
            raise CheckpointError(where, f"{first.module}: LoRA on some of {layer}mlp.experts' experts but not "
                                         f"{missing[0] if missing else 'all'}: PEFT's target_parameters adapts every "
                                         "expert of the fused parameter")
        odd = next((a for by_part in experts.values() for a in by_part.values() if a.rank != first.rank), None)
        if odd is not None:
            raise CheckpointError(where, f"{odd.module}: LoRA rank {odd.rank}, {first.module}'s {first.rank}: the "
                                         "fused parameter's ParamWrapper has one rank for every expert")
        for by_part in experts.values():
            if len({out[a.a].pieces for a in by_part.values()}) != 1:
                raise CheckpointError(where, f"{by_part[1].module}: its lora_A is not {by_part[0].module}'s: the "
                                             f"fused {stacked.rsplit('.', 1)[-1]} has one A per expert")
        out.update(_wrapper_tensors(out, layer, stacked, experts, first.rank, wanted))
        for by_part in experts.values():
            for adapter in by_part.values():
                del out[adapter.a], out[adapter.b]
        adapted.setdefault(layer, []).append(stacked)
    wrapped: list[Adapter] = []
    for layer, params in adapted.items():  # peft nests a module's wrappers as it registers them, the first
        params.sort(key=list(STACKED).index)  # innermost (transformers registers gate_up_proj, then down_proj)
        for i, stacked in enumerate(params):
            module, parameter = f"{layer}{stacked}".rsplit(".", 1)
            count = _experts_of(targets, layer, stacked)
            adapter = Adapter(module, "", "", _rank(out, layer, stacked, count), parameter=parameter, experts=count,
                              depth=len(params) - 1 - i)
            names = {f: f"{PEFT_PREFIX}{adapter.wrapped}.{f}.weight" for f in ("lora_A", "lora_B")}
            for factor, name in names.items():
                out[name] = replace(out.pop(f"{PEFT_PREFIX}{layer}{stacked}.{factor}.weight"), fqn=name)
            wrapped.append(replace(adapter, a=names["lora_A"], b=names["lora_B"]))
    odd = next((w for w in wrapped if any(a.rank != w.rank for a in (*kept, *wrapped))), None)
    if odd is not None:
        ranks = ", ".join(map(str, sorted({a.rank for a in (*kept, *wrapped)})))
        raise CheckpointError(where, f"{odd.weight}: LoRA ranks {ranks} in one folder, the experts' among them "
                                     "(normalize_moe_lora?): a rank_pattern entry for a ParamWrapper is not written "
                                     "yet")
    return out, kept + wrapped


def _rank(tensors: Mapping[str, TargetTensor], layer: str, stacked: str, experts: int) -> int:
    """The rank of a layer's stacked parameter's ParamWrapper: its lora_A's rows over its experts."""
    return tensors[f"{PEFT_PREFIX}{layer}{stacked}.lora_A.weight"].shape[0] // experts


def _experts_of(targets: Mapping[str, TargetTensor], layer: str, stacked: str) -> int:
    """How many experts the HF model's layer has (its `mlp.experts.<e>.<part>` tensors)."""
    first = STACKED[stacked][0]
    count = 0
    while f"{layer}mlp.experts.{count}.{first}" in targets:
        count += 1
    return count


def _wrapper_tensors(tensors: Mapping[str, TargetTensor], layer: str, stacked: str,
                     experts: Mapping[int, Mapping[int, Adapter]], rank: int, count: int) -> dict[str, TargetTensor]:
    """One layer's stacked parameter's `lora_A` [E·r, in] and `lora_B` [out, r·E] (module docstring),
    made of the per-expert modules' tensors' pieces (temporarily named `<layer><stacked>.lora_*`)."""
    a0 = tensors[experts[0][0].a]
    a_pieces, b_pieces = [], []
    rows = sum(tensors[experts[0][i].b].shape[0] for i in range(len(STACKED[stacked])))
    for e in range(count):
        a = tensors[experts[e][0].a]
        a_pieces += [replace(p, dst_start=(e * rank + p.dst_start[0], *p.dst_start[1:])) for p in a.pieces]
        offset = 0
        for i in range(len(STACKED[stacked])):
            b = tensors[experts[e][i].b]
            for p in b.pieces:
                for k in range(rank):
                    b_pieces.append(Piece(p.src, (p.src_start[0], p.src_start[1] + k),
                                          (offset + p.dst_start[0], k * count + e), (p.sizes[0], 1)))
            offset += b.shape[0]
    a_name, b_name = (f"{PEFT_PREFIX}{layer}{stacked}.{f}.weight" for f in ("lora_A", "lora_B"))
    return {a_name: TargetTensor(a_name, (count * rank, a0.shape[1]), a0.dtype, tuple(a_pieces)),
            b_name: TargetTensor(b_name, (rows, rank * count), tensors[experts[0][0].b].dtype, tuple(b_pieces))}


def per_expert_stack(weight: str, views: Mapping[str, tuple[str, tuple[int, ...]]], wanted: Collection[str]
                     ) -> tuple[tuple[int, ...], tuple[Piece, ...], dict[str, tuple[Piece, ...]]] | None:
    """A fused stack (`<layer>mlp.experts.gate_up_proj`) where the base holds its experts one by
    one (`views`: HF name → its source's name and shape): the stack seen as its experts' rows one
    after another, each's parts in order ([E·2F, H], as transformers' [E, 2F, H] lies in memory,
    which peft's merge of the stack gives), its pieces, and each of the `wanted` per-expert
    tensors' block of it (gate of expert e: rows e·2F … e·2F + F); None when the base does not
    hold the stack so (`families.experts.stacked_parts`)."""
    experts = stacked_parts(weight, set(views))
    if not experts:
        return None
    rows = sum(views[p][1][0] for p in experts[0])
    trailing = views[experts[0][0]][1][1:]
    zeros = tuple(0 for _ in trailing)
    pieces, blocks = [], {}
    for e, parts in enumerate(experts):
        at = e * rows
        for part in parts:
            source, shape = views[part]
            pieces.append(Piece(source, (0, *zeros), (at, *zeros), shape))
            if part in wanted:
                blocks[part] = (Piece(weight, (at, *zeros), (0, *zeros), shape),)
            at += shape[0]
    return (len(experts) * rows, *trailing), tuple(pieces), blocks
