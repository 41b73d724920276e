"""Which of a checkpoint's tensors are Transformer Engine Float8Tensor items, for a reshard that keeps them.

A tensor whose first item is a Float8Tensor (`ItemReader.holds_float8`: one small read a tensor) is
read item by item: every chunk must be a Float8Tensor of the same FP8 format, logical dtype and
reduce form, in whole rows (FSDP2's `Shard(0)`), each with its scale_inv. The tensor is then
planned as its codes (uint8) with a `TeFloat8Target` form (`formats.dcp.te_float8`), and every
placed chunk's scale is settled here, before anything is written: one that would join shards of
different scales is refused by name.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Mapping, Sequence

from ckptctl.core.checkpoint import TensorEntry
from ckptctl.core.plan import SourceTensor, TargetTensor
from ckptctl.families.placement import Placed
from ckptctl.formats.dcp.items import ItemReader
from ckptctl.formats.dcp.te_float8 import CODES, Float8Rows, TeFloat8Target, float8_of
from ckptctl.formats.pickle.subclass import TE_FLOAT8
from ckptctl.util.errors import CheckpointError


def float8_form(entry: TensorEntry, view: SourceTensor, reader: ItemReader) -> TeFloat8Target | None:
    """`entry`'s Float8Tensor form when its items are TE Float8Tensors, None when its first is not
    a subclass item; refused when its items disagree or are not whole rows."""
    if not reader.holds_float8(entry):
        return None
    if view.whole_rows is None:
        raise CheckpointError(entry.fqn, f"{TE_FLOAT8} items that are not whole rows: reshard keeps FP8 codes "
                                         "of FSDP2's row shards only")
    rows, forms = [], set()
    for chunk in entry.chunks:
        found = reader.float8_item(entry, chunk)
        if found is None:
            raise CheckpointError(reader.ckpt.path / chunk.file, f"item at byte {chunk.offset}: {entry.fqn}: not a "
                                                                 f"{TE_FLOAT8} item, where its tensor's others are")
        spec, scale = found
        forms.add((spec.fp8, spec.dtype, spec.dtype_module, spec.args))
        rows.append(Float8Rows(chunk.offsets[0], chunk.offsets[0] + chunk.sizes[0], scale))
    if len(forms) != 1:
        raise CheckpointError(entry.fqn, f"its {TE_FLOAT8} items differ in FP8 format or reduce form "
                              f"({', '.join(sorted(f'{f[0].name}/{f[2]}/{f[3]} args' for f in forms))})")
    fp8, logical, module, args = forms.pop()
    return TeFloat8Target(entry.fqn, logical, fp8, module, args, tuple(sorted(rows, key=lambda r: r.start)),
                          bool(getattr(entry.properties, "requires_grad", False)))


def codes_view(view: SourceTensor) -> SourceTensor:
    """A Float8Tensor tensor's view as its codes: the same chunks, one byte an element."""
    return replace(view, dtype=CODES)


def settle_scales(targets: Sequence[TargetTensor], placements: Mapping[str, Sequence[Placed]]) -> None:
    """Every placed chunk of a Float8Tensor target has its scale (`TeFloat8Target.scale_of`), or
    the plan is refused now, before any byte is written."""
    for target in targets:
        float8 = float8_of(target)
        if float8 is not None:
            for placed in placements[target.fqn]:
                float8.scale_of(placed.box)
