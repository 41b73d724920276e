"""transformers 5's in-memory MoE experts: one tensor per expert on disk, one per layer in memory.

A Qwen2/Qwen3-MoE-style checkpoint keeps `mlp.experts.<e>.gate_proj.weight`, `up_proj.weight`
([F, H] each) and `down_proj.weight` ([H, F]). transformers 5 loads them as
`mlp.experts.gate_up_proj` [E, 2F, H] — the experts stacked, gate then up within each (its
`MergeModulelist(dim=0)` then `Concatenate(dim=1)`) — and `mlp.experts.down_proj`
[E, H, F], and a `fully_shard`ed model's state dict holds that form. Each in-memory tensor
is, expert by expert, the on-disk tensors' rows one after another: pure row geometry.
"""

from __future__ import annotations

from collections.abc import Mapping

STACKED = {"mlp.experts.gate_up_proj": ("gate_proj.weight", "up_proj.weight"),
           "mlp.experts.down_proj": ("down_proj.weight",)}
"""In-memory name (under a layer) → the on-disk tensors of each expert it stacks, in row order."""


def stacked_parts(name: str, on_disk: set[str]) -> list[tuple[str, ...]] | None:
    """For an in-memory expert tensor `<layer>mlp.experts.gate_up_proj` (or `down_proj`): per
    expert 0, 1, …, the on-disk names whose rows make it, in order; None when `name` is not
    of this form or its experts are not all on disk (0 … E-1, every part)."""
    for suffix, parts in STACKED.items():
        if not name.endswith(suffix):
            continue
        layer = name[: -len(suffix)]
        experts: list[tuple[str, ...]] = []
        while all(f"{layer}mlp.experts.{len(experts)}.{p}" in on_disk for p in parts):
            experts.append(tuple(f"{layer}mlp.experts.{len(experts)}.{p}" for p in parts))
        stray = [n for n in on_disk if n.startswith(f"{layer}mlp.experts.{len(experts)}.")]
        return experts if experts and not stray else None
    return None


def stacked_shapes(module: str, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """The in-memory stacks of a layer's experts module (`<layer>mlp.experts`) that its on-disk
    per-expert tensors (`shapes`, by HF name) make, by parameter (`gate_up_proj` [E, 2F, H]);
    none where they are not all there or do not stack (parts of differing columns or experts of
    differing rows)."""
    found: dict[str, tuple[int, ...]] = {}
    if not (module == "mlp.experts" or module.endswith(".mlp.experts")):
        return found
    for stacked in STACKED:
        experts = stacked_parts(module.removesuffix("mlp.experts") + stacked, set(shapes))
        if not experts:
            continue
        first = shapes[experts[0][0]]
        rows = {sum(shapes[p][0] for p in parts) for parts in experts}
        if len(rows) == 1 and all(len(shapes[p]) == len(first) and shapes[p][1:] == first[1:]
                                  for parts in experts for p in parts):
            found[stacked.rsplit(".", 1)[-1]] = (len(experts), rows.pop(), *first[1:])
    return found
