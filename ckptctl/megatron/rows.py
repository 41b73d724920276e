"""Megatron row geometry shared by export-hf, import-hf and Megatron-aware reshard: fused layouts.

Megatron keeps some tensors *fused and TP-blocked*: rank t of a TP group holds
`[c0_t; c1_t; …]` (each component's t-th row slice), and the global tensor concatenates
the ranks. Splitting or re-blocking such a tensor is a set of row-block translations,
computed here once in global row coordinates (never from a local shard's size).
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from typing import Sequence

from ckptctl.util.errors import UsageError

class TpKind(str, enum.Enum):
    """How Megatron lays a tensor over its tensor-parallel ranks: the one vocabulary of the family
    rules, the optimizer buckets and the placements. A fused kind is column-parallel per component:
    each TP rank holds its rows of every component, concatenated (`FUSED_PARTS` names them)."""

    COLUMN = "column"  # dim 0 cut in TP blocks (ColumnParallelLinear)
    ROW = "row"  # dim 1 cut in TP blocks (RowParallelLinear)
    REPLICATED = "replicated"  # the same on every TP rank
    SWIGLU = "swiglu"  # fc1: [W; V] when gated, else column
    GDN_IN_PROJ = "gdn_in_proj"
    GDN_CONV1D = "gdn_conv1d"
    MAMBA_IN_PROJ = "mamba_in_proj"
    MAMBA_CONV1D = "mamba_conv1d"

    __str__ = str.__str__  # the value, as a plain string would print, on every Python
    __format__ = str.__format__


LAYERS = "decoder.layers."
"""Megatron's decoder layers: torch_dist stacks each param of them under it (`decoder.layers.<name>`
[L, …]) or keys it per layer (`decoder.layers.<l>.<name>`)."""
WORD_EMBEDDING = "embedding.word_embeddings.weight"
BUFFERS = (".mlp.router.expert_bias",)
"""Megatron-Core model tensors that are persistent buffers, not params (the router's aux-loss-free
load-balancing bias): in no DDP buffer, with no optimizer state or group; a layer stack of them in
torch_dist, a whole plain tensor per layer in fsdp_dtensor."""


@dataclass(frozen=True)
class RowBlock:
    """`rows` rows at `src_row` of one layout correspond to `rows` rows at `dst_row` of another."""

    src_row: int
    dst_row: int
    rows: int


def tp_blocked_split(component_rows: Sequence[int], tp: int) -> list[list[RowBlock]]:
    """For a fused tensor TP-blocked at `tp`, the row blocks of each component (src = fused row).

    Component i has `component_rows[i]` global rows; on each TP rank it contributes
    `component_rows[i] / tp` rows, in component order.
    """
    for rows in component_rows:
        if rows % tp:
            raise UsageError(f"a fused component of {rows} rows cannot be split over TP {tp}")
    per_rank = [rows // tp for rows in component_rows]
    stride = sum(per_rank)
    out: list[list[RowBlock]] = [[] for _ in component_rows]
    for t in range(tp):
        at = t * stride
        for i, rows in enumerate(per_rank):
            if rows:
                out[i].append(RowBlock(at, t * rows, rows))
            at += rows
    return out


def select_rows(blocks: Sequence[RowBlock], start: int, count: int) -> list[RowBlock]:
    """The part of a row map landing in dst rows [start, start+count), re-based so dst starts at 0.

    With `blocks` from `tp_blocked_split` (src = fused row, dst = component row) this gives
    the fused rows of any slice of a component, e.g. one attention head or one key group.
    """
    out = []
    for b in blocks:
        lo, hi = max(b.dst_row, start), min(b.dst_row + b.rows, start + count)
        if lo < hi:
            out.append(RowBlock(b.src_row + lo - b.dst_row, lo - start, hi - lo))
    return sorted(out, key=lambda b: b.dst_row)


def tp_reblock(component_rows: Sequence[int], source_tp: int, target_tp: int) -> list[RowBlock]:
    """Row blocks mapping a fused tensor TP-blocked at `source_tp` to the same tensor at `target_tp`."""
    src = tp_blocked_split(component_rows, source_tp)
    dst = tp_blocked_split(component_rows, target_tp)
    blocks: list[RowBlock] = []
    for s_blocks, d_blocks in zip(src, dst):
        for s in s_blocks:
            for d in d_blocks:
                lo, hi = max(s.dst_row, d.dst_row), min(s.dst_row + s.rows, d.dst_row + d.rows)
                if lo < hi:
                    blocks.append(RowBlock(s.src_row + lo - s.dst_row, d.src_row + lo - d.dst_row, hi - lo))
    return sorted(blocks, key=lambda b: b.dst_row)


# Fused tensors Megatron keeps TP-blocked, and the names of their saved components.
SWIGLU_PARTS = ("_w", "_v")
GDN_IN_PROJ_PARTS = (".query", ".key", ".value", ".z", ".beta", ".alpha")
GDN_CONV1D_PARTS = (".query", ".key", ".value")
MAMBA_IN_PROJ_PARTS = (".z", ".x", ".B", ".C", ".dt")
MAMBA_CONV1D_PARTS = (".x", ".B", ".C")
FUSED_PARTS: dict[TpKind, tuple[str, ...]] = {
    TpKind.SWIGLU: SWIGLU_PARTS, TpKind.GDN_IN_PROJ: GDN_IN_PROJ_PARTS, TpKind.GDN_CONV1D: GDN_CONV1D_PARTS,
    TpKind.MAMBA_IN_PROJ: MAMBA_IN_PROJ_PARTS, TpKind.MAMBA_CONV1D: MAMBA_CONV1D_PARTS,
}
WRITTEN_SPLIT = frozenset({TpKind.SWIGLU, TpKind.GDN_IN_PROJ, TpKind.GDN_CONV1D})
"""Fused kinds an output may write as components (`--split-fused`): Megatron-FSDP's save splits
SwiGLU fc1 and Megatron-Bridge's training GDN. Mamba's are split only by megatron-core's
torch_dist save, so they are read either way but written fused."""


def mixer_part_rows(mamba: bool, proj: int, conv: int, heads: int, inner_sizes: Sequence[int | None],
                    args: object, tp: int) -> dict[str, tuple[tuple[str, int], ...]] | None:
    """Each fused param of a Mamba mixer (`mamba`) or GDN layer → (part, rows per TP rank at `tp`),
    in the order each rank holds them, from the layer's fused rows: `proj` (in_proj), `conv` (the
    conv weight), `heads` (A_log). Mamba's `in_proj` has 2·inner + 2·G·N + H rows, its conv
    inner + 2·G·N; GDN's `in_proj` 2·qk + 2·v + 2·nv, its conv 2·qk + v. Each of `inner_sizes`
    (sizes the layer holds that must be `inner`: out_proj's columns, Mamba's norm; None where
    absent) and, for Mamba, args' `mamba_*` sizes where given must agree. None when they do not, or
    `tp` does not divide them.
    One geometry: Megatron-FSDP's fused save cut into torch_dist's parts and back."""
    inner = proj - conv - heads if mamba else proj - 2 * heads - conv
    pair = conv - inner
    ok = inner > 0 and pair > 0 and pair % 2 == 0 and not (inner % tp or (pair // 2) % tp or heads % tp) and all(
        got is None or got == inner for got in inner_sizes)
    if mamba:
        given = {a: getattr(args, a, None) for a in ("mamba_num_heads", "mamba_head_dim", "mamba_num_groups",
                                                     "mamba_state_dim")}
        if type(given["mamba_num_heads"]) is int:
            ok = ok and given["mamba_num_heads"] == heads
            if type(given["mamba_head_dim"]) is int:
                ok = ok and given["mamba_head_dim"] * heads == inner
        if type(given["mamba_num_groups"]) is int and type(given["mamba_state_dim"]) is int:
            ok = ok and given["mamba_num_groups"] * given["mamba_state_dim"] * 2 == pair
    if not ok:
        return None
    inner, half, heads = inner // tp, pair // 2 // tp, heads // tp
    if mamba:
        in_proj, conv1d = zip(MAMBA_IN_PROJ_PARTS, (inner, inner, half, half, heads)), zip(MAMBA_CONV1D_PARTS,
                                                                                            (inner, half, half))
    else:
        in_proj, conv1d = zip(GDN_IN_PROJ_PARTS, (half, half, inner, inner, heads, heads)), zip(GDN_CONV1D_PARTS,
                                                                                                 (half, half, inner))
    in_proj, conv1d = (tuple((p.lstrip("."), r) for p, r in parts) for parts in (in_proj, conv1d))
    return {"in_proj.weight": in_proj, "conv1d.weight": conv1d, "conv1d.bias": conv1d}


def is_expert(name: str) -> bool:
    """Routed-expert params (expert tensor parallel, not the dense TP)."""
    return ".mlp.experts." in name or name.startswith("mlp.experts.")



@dataclass(frozen=True)
class Spelling:
    """One Megatron module name that megatron-core releases spell two ways: `old` until a
    release, `new` from `since` on. Rules, bucket tables and component names are written in the
    old spelling (megatron-core's torch_dist keys keep it in every release); a name in the new
    spelling is read as the old one (`canonical`), and an output for a release that uses it is
    written in it (`respelled`)."""

    old: str
    new: str
    since: tuple[int, int]

    def pattern(self, spelling: str) -> re.Pattern[str]:
        return re.compile(rf"(?:^|(?<=\.)){re.escape(spelling)}(?=\.|$)")


SPELLINGS = (Spelling("mixer.conv1d.weight", "mixer.conv1d_weight", (0, 19)),
             Spelling("mixer.conv1d.bias", "mixer.conv1d_bias", (0, 19)))
"""megatron-core 0.19's MambaMixer registers its conv as parameters of its own (`conv1d_weight`,
`conv1d_bias`; 0.16's was an `nn.Conv1d`, `conv1d.weight`): a module's `state_dict()` names
(Megatron-FSDP's fsdp_dtensor saves, Megatron-Bridge's mappings) follow the release, while its
`sharded_state_dict()` maps them back to `conv1d.weight` / `.bias`, so torch_dist keys do not."""
CURRENT_RELEASE = (0, 19)
"""The megatron-core release an output is spelled for unless told otherwise (import-hf `--megatron-core`)."""
_OLD = [(s, s.pattern(s.old)) for s in SPELLINGS]
_NEW = [(s, s.pattern(s.new)) for s in SPELLINGS]


def canonical(name: str) -> str:
    """`name` (a param, a saved component of one, or an optimizer state naming one) in the spelling
    rules are written in."""
    for spelling, pattern in _NEW:
        if spelling.new in name:
            name = pattern.sub(spelling.old, name)
    return name


def respelled(name: str, release: tuple[int, int]) -> str:
    """Rule-spelled `name` as megatron-core `release` names the module (`Spelling.since`)."""
    for spelling, pattern in _OLD:
        if release >= spelling.since and spelling.old in name:
            name = pattern.sub(spelling.new, name)
    return name


def spellings(name: str) -> tuple[str, ...]:
    """Rule-spelled `name` in every spelling a release gives it, its own first."""
    return tuple(dict.fromkeys((name, *(respelled(name, s.since) for s in SPELLINGS))))


def parse_release(text: str) -> tuple[int, int]:
    """A megatron-core release `MAJOR.MINOR[.PATCH…]` as (major, minor); UsageError otherwise."""
    found = re.fullmatch(r"(\d{1,4})\.(\d{1,4})(?:\.\w{1,16})*", text.strip())
    if found is None:
        example = ".".join(map(str, CURRENT_RELEASE))
        raise UsageError(f"--megatron-core takes a release such as {example} (got {text!r})")
    return int(found[1]), int(found[2])
