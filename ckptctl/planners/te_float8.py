"""Which of a checkpoint's tensors are TE Float8Tensor or block-scaled items, for a reshard that keeps them.

A tensor whose first item is a Float8Tensor (`ItemReader.holds_float8`: one small read a tensor) is
read item by item: every chunk must be a Float8Tensor of the same FP8 format, logical dtype and
reduce form, in whole rows (FSDP2's `Shard(0)`), each with its scale_inv. The tensor is then
planned as its codes (uint8) with a `TeFloat8Target` form (`formats.dcp.te_float8`), and every
placed chunk's scale is settled here, before anything is written: one that would join shards of
different scales is refused by name. An MXFP8Tensor or Float8BlockwiseQTensor tensor
(`block_form`) is planned the same way with a `TeBlockTarget` form (`formats.dcp.te_block_items`):
its scales follow its rows. NVFP4Tensor is refused here by name.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Mapping, Sequence

from ckptctl.core.checkpoint import Chunk, TensorEntry
from ckptctl.core.dtypes import DType
from ckptctl.core.plan import SourceTensor, TargetTensor
from ckptctl.families.placement import Placed
from ckptctl.formats.dcp.items import ItemReader
from ckptctl.formats.dcp.block_scaled import BLOCKWISE, MXFP8
from ckptctl.formats.dcp.te_float8 import CODES, Float8Rows, TeFloat8Target, float8_of
from ckptctl.formats.dcp.te_block_items import BlockRows, TeBlockTarget
from ckptctl.formats.pickle.te_blocks import BlockScaledRecordSpec
from ckptctl.formats.pickle.subclass import TE_FLOAT8
from ckptctl.formats.pickle.subclass import _TeDType
from ckptctl.util.errors import CheckpointError

_PLAIN = (type(None), bool, int, float, str, DType, _TeDType)
"""Quantizer fields reshard writes again (TE's MXFP8Quantizer and Float8BlockQuantizer hold only these)."""


def float8_form(entry: TensorEntry, view: SourceTensor, reader: ItemReader) -> TeFloat8Target | None:
    """`entry`'s Float8Tensor form when its items are TE Float8Tensors, None when its first is not
    a subclass item; refused when its items disagree or are not whole rows."""
    if not reader.holds_float8(entry):
        return None
    if view.whole_rows is None:
        raise CheckpointError(entry.fqn, f"{TE_FLOAT8} items that are not whole rows: reshard keeps FP8 codes "
                                         "of FSDP2's row shards only")
    items = _items(entry, reader, reader.float8_item, TE_FLOAT8,
                   lambda spec: (spec.fp8, spec.dtype, spec.dtype_module, spec.args))
    forms = {form for _, form, _ in items}
    rows = [Float8Rows(chunk.offsets[0], chunk.offsets[0] + chunk.sizes[0], scale) for chunk, _, scale in items]
    if len(forms) != 1:
        raise CheckpointError(entry.fqn, f"its {TE_FLOAT8} items differ in FP8 format or reduce form "
                              f"({', '.join(sorted(f'{f[0].name}/{f[2]}/{f[3]} args' for f in forms))})")
    fp8, logical, module, args = forms.pop()
    return TeFloat8Target(entry.fqn, logical, fp8, module, args, tuple(sorted(rows, key=lambda r: r.start)),
                          bool(getattr(entry.properties, "requires_grad", False)))


def block_form(entry: TensorEntry, view: SourceTensor, reader: ItemReader) -> TeBlockTarget | None:
    """`entry`'s block-scaled form when its first item is a TE block-scaled tensor, None when it is
    none; refused for the kinds not kept, and when its items disagree or are not whole rows."""
    first = next((c for c in entry.chunks if c.length), None)
    if first is None or not reader.names_subclass(first) or reader.block_item(entry, first) is None:
        return None
    items = _items(entry, reader, reader.block_item, "TE block-scaled", lambda spec: _kept_form(entry.fqn, spec))
    forms = {form for _, form, _ in items}
    rows = [BlockRows(chunk.offsets[0], chunk.offsets[0] + chunk.sizes[0], scales) for chunk, _, scales in items]
    kind = next(iter(forms))[0].kind
    if view.whole_rows is None or len(entry.shape) != 2:
        raise CheckpointError(entry.fqn, f"{kind} items that are not whole rows of a matrix: reshard keeps the "
                                         "codes and scales of FSDP2's row shards only")
    if len(forms) != 1:
        raise CheckpointError(entry.fqn, f"its {kind} items differ in format or reduce form")
    scaling, logical, module, args, quantizer = forms.pop()
    return TeBlockTarget(entry.fqn, scaling, logical, module, args, quantizer, entry.shape[-1],
                         tuple(sorted(rows, key=lambda r: r.start)),
                         bool(getattr(entry.properties, "requires_grad", False)))


def _items(entry: TensorEntry, reader: ItemReader, read: Callable[[TensorEntry, Chunk], tuple[Any, bytes] | None],
           what: str, form: Callable[[Any], tuple]) -> list[tuple[Chunk, tuple, bytes]]:
    """Each chunk of `entry` with its item's form (`form` of the spec `read` finds: refused there for
    what reshard does not keep) and its scales' bytes; refused naming the first item `read` finds
    none in."""
    found = []
    for chunk in entry.chunks:
        item = read(entry, chunk)
        if item is None:
            raise CheckpointError(reader.ckpt.path / chunk.file, f"item at byte {chunk.offset}: {entry.fqn}: not a "
                                                                 f"{what} item, where its tensor's others are")
        spec, scales = item
        found.append((chunk, form(spec), scales))
    return found


def _kept_form(fqn: str, spec: BlockScaledRecordSpec) -> tuple:
    """The reduce form an item is written again in; refused for what reshard does not keep."""
    kind = spec.scaling.kind
    if kind not in (MXFP8, BLOCKWISE):
        raise CheckpointError(fqn, f"a {spec.kind} ({spec.describe()}): reshard keeps TE's Float8Tensor, "
                                   f"MXFP8Tensor and Float8BlockwiseQTensor items, not {kind}'s yet (export-hf "
                                   "dequantizes it)")
    reduce = spec.reduce
    if reduce is None:
        raise CheckpointError(fqn, f"{kind} in TE ≤ 2.15's classmethod form: reshard writes TE ≥ 2.16's "
                                   "items only (export-hf dequantizes it)")
    quantizer = reduce.quantizer
    if quantizer is not None and any(not isinstance(v, _PLAIN) for _, v in quantizer.fields):
        raise CheckpointError(fqn, f"{kind} whose {quantizer.name} holds a tensor: reshard keeps plain "
                                   "quantizer fields only")
    return spec.scaling, spec.dtype, reduce.dtype_module, reduce.args, quantizer


def codes_view(view: SourceTensor) -> SourceTensor:
    """A Float8Tensor tensor's view as its codes: the same chunks, one byte an element."""
    return replace(view, dtype=CODES)


def settle_scales(targets: Sequence[TargetTensor], placements: Mapping[str, Sequence[Placed]]) -> None:
    """Every placed chunk of a kept TE target has its scales (`KeptTeTensor.settle`), or the
    plan is refused now, before any byte is written."""
    for target in targets:
        float8 = float8_of(target)
        if float8 is not None:
            for placed in placements[target.fqn]:
                float8.settle(placed.box)
