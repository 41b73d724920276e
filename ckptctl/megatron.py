"""Megatron facts shared by export-hf and Megatron-aware reshard: names, parallel dims, fused layouts.

Megatron keeps some tensors *fused and TP-blocked*: rank t of a TP group holds
`[c0_t; c1_t; …]` (each component's t-th row slice), and the global tensor concatenates
the ranks. Splitting or re-blocking such a tensor is a set of row-block translations,
computed here once in global row coordinates (never from a local shard's size).
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from typing import Sequence

from ckptctl.errors import UsageError
from ckptctl.model import Checkpoint

MODEL_PREFIXES = ("model.module.module.", "model.module.", "model.", "")

# Which dim Megatron shards a weight on under TP, by name. First match wins.
PARALLEL_RULES: tuple[tuple[str, int | None], ...] = (
    (r"(linear_proj|linear_fc2|out_proj)\.weight\d*$", 1),
    (r"(layer_norm_weight|layer_norm_bias|layernorm\.weight|layernorm\.bias|norm\.weight|norm\.bias)$", None),
    (r"(q_layernorm|k_layernorm|out_norm)\.", None),
    (r"router\.", None),
    (r"shared_experts\.gate_weight$", None),
    (r"(linear_qkv|linear_fc1|in_proj|conv1d|word_embeddings|output_layer|A_log|dt_bias)", 0),
    (r"(linear_proj|linear_fc2|out_proj)\.bias$", None),
)


def parallel_dim(name: str) -> int | None:
    """0 for ColumnParallel, 1 for RowParallel, None for TP-duplicated params."""
    for pattern, dim in PARALLEL_RULES:
        if re.search(pattern, name):
            return dim
    return None


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


def tp_from_geometry(ckpt: Checkpoint) -> int | None:
    """The TP degree seen on dim 1 of RowParallel weights (distinct column offsets), if any."""
    seen = set()
    for fqn, entry in ckpt.tensors.items():
        if len(entry.shape) == 2 and parallel_dim(fqn) == 1 and not fqn.split(".")[0].startswith("optim"):
            cols = {c.offsets[1] for c in entry.chunks if c.numel}
            if cols:
                seen.add(len(cols))
    return max(seen) if seen else None


def resolve_tp(ckpt: Checkpoint, args: argparse.Namespace | None, given: int | None, what: str = "--tp", *,
               strict: bool = False) -> int:
    """The training TP size: `given`, else `args.tensor_model_parallel_size` (the checkpoint's
    `formats.megatron_args.checkpoint_args`), else RowParallel geometry.

    RowParallel chunks that are not split on dim 1 (TP 1 seen) are weak evidence: every layout
    that is not TP-split on disk (FSDP2, a reshard to `fsdp2`) shows them. They never
    contradict `args`, and with `strict` (re-blocking fused tensors) they are not trusted at all.
    """
    if given is not None:
        return given
    from_args = getattr(args, "tensor_model_parallel_size", None) if args is not None else None
    from_geometry = tp_from_geometry(ckpt)
    if from_geometry == 1 and (strict or from_args is not None):
        from_geometry = None
    if from_args is not None and from_geometry is not None and from_args != from_geometry:
        raise UsageError(
            f"{ckpt.path}: args say TP {from_args} but RowParallel chunks show TP {from_geometry}; pass {what}")
    tp = from_args or from_geometry
    if tp is None:
        raise UsageError(f"{ckpt.path}: cannot tell the training TP size (no args entry, no RowParallel "
                         f"chunks split on dim 1); pass {what}")
    return int(tp)


# Fused tensors Megatron keeps TP-blocked, and the names of their saved components.
SWIGLU_PARTS = ("_w", "_v")
GDN_IN_PROJ_PARTS = (".query", ".key", ".value", ".z", ".beta", ".alpha")
GDN_CONV1D_PARTS = (".query", ".key", ".value")
FUSED_PARTS: dict[str, tuple[str, ...]] = {
    "swiglu": SWIGLU_PARTS, "gdn_in_proj": GDN_IN_PROJ_PARTS, "gdn_conv1d": GDN_CONV1D_PARTS,
}
FUSED_RULES: tuple[tuple[str, str], ...] = (
    (r"(^|\.)mlp\.(shared_experts\.|experts\.local_experts\.\d+\.)?linear_fc1\.(weight|bias)$", "swiglu"),
    (r"(^|\.)mlp\.experts\.linear_fc1\.(weight|bias)\d+$", "swiglu"),
    (r"(^|\.)self_attention\.(.+\.)?in_proj\.(weight|bias)$", "gdn_in_proj"),
    (r"(^|\.)self_attention\.(.+\.)?conv1d\.(weight|bias)$", "gdn_conv1d"),
)


TP_BLOCKED_UNKNOWN = re.compile(r"(^|\.)(in_proj|conv1d)\.(weight|bias)$")
"""Names Megatron fuses per TP rank in layouts ckptctl has no rule for (Mamba's `mixer.in_proj`
`[z; x; B; C; dt]` and `mixer.conv1d` `[x; B; C]`, per rank) unless `fused_kind` knows them:
their global layout depends on the TP size, so a TP change must not treat them as plain rows."""


def fused_kind(name: str) -> str | None:
    """`swiglu` (an fc1 that is fused `[W; V]` when gated), `gdn_in_proj`, `gdn_conv1d`, or None."""
    for pattern, kind in FUSED_RULES:
        if re.search(pattern, name):
            return kind
    return None


def fused_component(name: str) -> tuple[str, str, int] | None:
    """(fused name, kind, component index) when `name` is a saved component (`…weight_w`, `…weight.key`)."""
    for kind, parts in FUSED_PARTS.items():
        for index, part in enumerate(parts):
            if name.endswith(part) and fused_kind(name[: -len(part)]) == kind:
                return name[: -len(part)], kind, index
    return None


def is_expert(name: str) -> bool:
    """Routed-expert params (expert tensor parallel, not the dense TP)."""
    return ".mlp.experts." in name or name.startswith("mlp.experts.")

