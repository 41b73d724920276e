"""`export-hf --merge-adapters` and `--adapter-only` of Megatron-Bridge LoRA adapters in a Megatron checkpoint.

Megatron-Bridge merges an adapter into its Megatron weight whole (`LoRAMerge.merge`:
W + (α / dim) · (linear_out @ linear_in)) and only then splits a fused weight (linear_qkv's
q, k, v; linear_fc1's gate and up) into HF tensors. Each HF target here is computed the same
way: the whole merged Megatron weight of its layer in float32, then the target's blocks of it,
taken where the family rule takes the base's (a row subset of a matmul need not have the bits
of the same rows of the whole one, so B is never split first). A PEFT folder gives each HF
module the shared A and the rows of B the rule gives it of the base: copied, nothing computed.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Mapping, Sequence

from ckptctl.core.checkpoint import Checkpoint
from ckptctl.core.dtypes import DType, cast_dtype, float32
from ckptctl.core.plan import LowRank, Piece, SourceTensor, StreamItem, TargetTensor, whole_item
from ckptctl.families.adapters import PEFT_PREFIX, Adapter
from ckptctl.families.base import MegatronModel, RowView
from ckptctl.families.bridge_adapters import BridgeAdapter, find_bridge_adapters
from ckptctl.util.errors import CheckpointError, UsageError
from ckptctl.util.wording import counted


def bridge_lora(ckpt: Checkpoint, model: MegatronModel, flags: Sequence[str], alpha: float | None,
                peft_only: Sequence[str]) -> tuple[tuple[BridgeAdapter, ...], float] | None:
    """The Megatron model's Megatron-Bridge LoRA adapters and α, or None without adapters.
    `flags`: the adapter flags given (`--merge-adapters`, `--adapter-only`); `peft_only`: the
    given flags that only a peft checkpoint takes. Adapters without either flag are refused
    (the model alone is not what was trained), as is α not given (Bridge keeps it in the run's
    run_config.yaml, not in the checkpoint). The adapters are left out of the model's names the
    family rules see."""
    shapes = {n: e.shape for n, e in model.entries.items()}
    shapes.update({n: (v.rows, *v.trailing) for n, v in model.layer_views.items()})
    found = find_bridge_adapters(shapes, ckpt.path, model.prefix)
    if not found:
        if flags:
            raise UsageError(f"{ckpt.path}: {flags[0]}, but the checkpoint holds no LoRA adapter")
        given = [*(["--lora-alpha"] if alpha is not None else []), *peft_only]
        if given:
            raise UsageError(f"{given[0]} applies to LoRA adapters only, and {ckpt.path} holds none")
        return None
    dims = ", ".join(map(str, sorted({a.dim for a in found})))
    if not flags:
        raise CheckpointError(ckpt.path, f"holds {counted(len(found), 'Megatron-Bridge LoRA adapter')} (dim {dims}): "
                                         "pass --merge-adapters --lora-alpha ALPHA to export the model with them "
                                         "merged, or --adapter-only --lora-alpha ALPHA to export them as a PEFT "
                                         "adapter folder")
    if peft_only:
        raise UsageError(f"{peft_only[0]} applies to peft adapters, not to Megatron-Bridge's")
    if alpha is None:
        raise UsageError(f"{ckpt.path}: LoRA α is not in a Megatron-Bridge checkpoint: pass --lora-alpha (the run's "
                         "run_config.yaml has it as peft.alpha)")
    if not math.isfinite(alpha):
        raise UsageError(f"--lora-alpha {alpha:g} is not a finite number")
    for adapter in found:
        for name in (adapter.a, adapter.b):
            entry = model.entries.get(name)
            dtype = entry.dtype if entry is not None else ckpt.tensors[model.layer_views[name].fqn].dtype
            if not dtype.is_floating_point:
                raise CheckpointError(ckpt.path, f"{model.prefix}{name}: {dtype.name} is no LoRA factor's dtype")
            model.used.add(name)
    return found, alpha


def refuse_unplaced_adapters(model: MegatronModel, adapters: Sequence[BridgeAdapter], unused: Sequence[str],
                             family: str) -> None:
    """Refuse, by the adapter's name, an adapter on a Megatron weight the family's rules have no
    place for (`unused`: the model's names they did not take)."""
    left = set(unused)
    unplaced = [a for a in adapters if a.weight in left]
    if unplaced:
        more = f" (+{counted(len(unplaced) - 1, 'more adapter')})" if len(unplaced) > 1 else ""
        raise CheckpointError(model.ckpt.path, f"{model.prefix}{unplaced[0].a}: a Megatron-Bridge LoRA adapter on "
                                               f"{model.prefix}{unplaced[0].module}, which a {family} model has no "
                                               f"place for{more}")


def _operand(model: MegatronModel, name: str, views: dict[str, SourceTensor]) -> tuple[RowView, StreamItem]:
    """A tensor of the model (a layer's slab of a stack), whole, as a float32 operand."""
    view = model.layer_views[name] if name in model.layer_views else model.view(name)
    views.setdefault(view.fqn, model.source_view(view.fqn))
    return view, whole_item(TargetTensor(view.fqn, (view.rows, *view.trailing), float32, _whole_rows(view)), views)


def _blocks_of(target: TargetTensor, base: RowView) -> tuple[Piece, ...] | None:
    """The target's pieces as blocks of the base weight `base` (rows in it), or None when it reads
    none of it; refused when it reads it otherwise than whole rows, or reads other tensors too."""
    mine = [p for p in target.pieces if p.src == base.fqn and any(
        b.src_row <= p.src_start[0] < b.src_row + b.rows for b in base.blocks)]
    if not mine:
        return None
    blocks = []
    for piece in target.pieces:
        at = next((b for b in base.blocks if b.src_row <= piece.src_start[0] < b.src_row + b.rows), None) \
            if piece.src == base.fqn else None
        whole_rows = (piece.axes is None and not any(piece.src_start[1:]) and piece.sizes[1:] == base.trailing
                      and at is not None and piece.src_start[0] + piece.sizes[0] <= at.src_row + at.rows)
        if not whole_rows or target.add or target.logical_shape is not None:
            raise CheckpointError(target.fqn, f"takes {base.fqn} otherwise than whole rows of one layer's weight, "
                                              "which export-hf does not merge a Megatron-Bridge adapter into yet")
        row = at.dst_row + piece.src_start[0] - at.src_row
        blocks.append(Piece(base.fqn, (row, *piece.src_start[1:]), piece.dst_start, piece.sizes))
    return tuple(blocks)


def merge_bridge_adapters(model: MegatronModel, targets: dict[str, TargetTensor], adapters: Sequence[BridgeAdapter],
                          alpha: float, selected: bool) -> str:
    """Give each HF target made of an adapted Megatron weight the `delta` that merges its adapter
    over the whole weight (one layer's), then takes the target's blocks; the note that says so.
    An adapter no target takes is refused unless `--include`/`--exclude` left its weights out."""
    merged = 0
    for adapter in adapters:
        views: dict[str, SourceTensor] = {}
        base, w = _operand(model, adapter.weight, views)
        taken = {name: blocks for name, t in targets.items() if (blocks := _blocks_of(t, base)) is not None}
        if not taken:
            if selected:
                continue
            raise CheckpointError(model.ckpt.path, f"{model.prefix}{adapter.a}: a Megatron-Bridge LoRA adapter on "
                                                   f"{model.prefix}{adapter.module}, which no HF tensor is made of")
        (_, a), (_, b) = _operand(model, adapter.a, views), _operand(model, adapter.b, views)
        for name, blocks in taken.items():
            targets[name] = replace(targets[name], delta=LowRank(w, a, b, alpha / adapter.dim, blocks=blocks))
            merged += 1
    return (f"{counted(merged, 'weight')} merged with {counted(len(adapters), 'Megatron-Bridge LoRA adapter')} "
            f"(s = α / dim, α {alpha:g} from --lora-alpha): W + (B @ A) · s in float32 over each whole Megatron "
            "weight, as Megatron-Bridge's LoRAMerge, then split as the base and cast once")


def _rows_of(view: RowView, row: int, count: int) -> tuple[int, int]:
    """The source row of row `row` of `view`, and that the `count` rows from it lie in one block."""
    block = next((b for b in view.blocks if b.dst_row <= row < b.dst_row + b.rows), None)
    if block is None or row + count > block.dst_row + block.rows:
        raise CheckpointError(view.fqn, f"rows {row}..{row + count} are not in one block of the layer's view")
    return block.src_row + row - block.dst_row, count


def bridge_adapter_tensors(model: MegatronModel, targets: Mapping[str, TargetTensor],
                           adapters: Sequence[BridgeAdapter], wanted: DType | None,
                           sources: dict[str, SourceTensor]) -> tuple[dict[str, TargetTensor], list[Adapter]]:
    """`--adapter-only`: each HF module made of an adapted Megatron weight gets the shared A
    (`linear_in`) whole and its rows of B (`linear_out`), the rows the family rule gives it of
    the base (q, k, v of linear_qkv; gate, up of linear_fc1), under PEFT's names, copied; and the
    peft `Adapter` each is; `wanted`: `--dtype`."""
    out: dict[str, TargetTensor] = {}
    peft: list[Adapter] = []
    for adapter in adapters:
        base = model.layer_views[adapter.weight] if adapter.weight in model.layer_views else model.view(adapter.weight)
        taken = {name: blocks for name, t in targets.items() if (blocks := _blocks_of(t, base)) is not None}
        if not taken:
            raise CheckpointError(model.ckpt.path, f"{model.prefix}{adapter.a}: a Megatron-Bridge LoRA adapter on "
                                                   f"{model.prefix}{adapter.module}, which no HF tensor is made of")
        views = [model.layer_views[n] if n in model.layer_views else model.view(n) for n in (adapter.a, adapter.b)]
        a_view, b_view = views
        for view in views:
            sources.setdefault(view.fqn, model.source_view(view.fqn))
        for name, blocks in taken.items():
            module = name.removesuffix(".weight")
            a_name, b_name = f"{PEFT_PREFIX}{module}.lora_A.weight", f"{PEFT_PREFIX}{module}.lora_B.weight"
            b_pieces = []
            for block in blocks:
                row, rows = _rows_of(b_view, block.src_start[0], block.sizes[0])
                b_pieces.append(Piece(b_view.fqn, (row, 0), (block.dst_start[0], 0), (rows, adapter.dim)))
            rows = targets[name].shape[0]
            out[a_name] = TargetTensor(a_name, (a_view.rows, *a_view.trailing), cast_dtype(sources[a_view.fqn].dtype, wanted),
                                       _whole_rows(a_view))
            out[b_name] = TargetTensor(b_name, (rows, adapter.dim), cast_dtype(sources[b_view.fqn].dtype, wanted), tuple(b_pieces))
            peft.append(Adapter(module, a_name, b_name, adapter.dim))
    return out, peft


def _whole_rows(view: RowView) -> tuple[Piece, ...]:
    """The pieces of all of `view` (a layer's slab of a stack, or a tensor)."""
    zeros = tuple(0 for _ in view.trailing)
    return tuple(Piece(view.fqn, (b.src_row, *zeros), (b.dst_row, *zeros), (b.rows, *view.trailing))
                 for b in view.blocks)
