"""`--verify` of TE Float8Tensor and MXFP8Tensor items a reshard kept: their codes and scales, bit for bit, by torch's loader.

A kept Float8Tensor's value is its codes times its scale, so comparing values would let a wrong
code hide where two codes give one value (±0) or none (NaN). Every output item and every source
item is instead loaded by `torch.load(weights_only=True)` with stand-ins allowed under TE's names
that keep the reconstructor's arguments (`torch_standins.load_float8_parts`); an output item must
name the same FP8 format, logical dtype and reduce form as the source, hold the source's codes
for its rows and the scale_inv of each source item its rows come from. An MXFP8Tensor output item
(`load_mxfp8_parts`) must hold its source rows' codes and scale rows, zero scale rows after them up
to TE's padded shape, and the source's quantizer fields. ckptctl's item reader is used for nothing
but bytes. A source item is decoded once per output item it meets (one in memory).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from ckptctl.checks.torch_standins import Float8Parts, Mxfp8Parts, load_float8_parts, load_mxfp8_parts
from ckptctl.core.checkpoint import Checkpoint, Chunk, TensorEntry
from ckptctl.core.plan import TargetTensor
from ckptctl.formats.dcp.items import ItemReader
from ckptctl.formats.dcp.te_float8 import TE_CODE, float8_of
from ckptctl.formats.dcp.te_mxfp8 import SCALE_ROWS, TeMxfp8Target
from ckptctl.util.errors import CheckpointError
from ckptctl.util.progress import Advance


def verify_float8(src: Checkpoint, src_items: ItemReader, dst: Checkpoint, dst_items: ItemReader,
                  target: TargetTensor, written: Path, advance: Advance | None = None) -> None:
    """Raise CheckpointError naming `written` unless every item of Float8Tensor target `target`
    in `dst` holds the codes and scale of the source rows it keeps."""
    float8 = float8_of(target)
    source = src.tensors[target.pieces[0].src]
    dst_entry = dst.tensors.get(target.fqn)
    if dst_entry is None:
        raise CheckpointError(written, f"{target.fqn}: missing from the output")
    if isinstance(float8, TeMxfp8Target):
        _verify_mxfp8(src, src_items, source, dst, dst_items, dst_entry, float8, written, advance)
        return
    held = sorted(((c.offsets[0], c.offsets[0] + c.sizes[0], c) for c in source.chunks if c.numel),
                  key=lambda r: r[0])
    decoded: tuple[Chunk, Float8Parts] | None = None
    for chunk in dst_entry.chunks:
        got = _parts(dst, dst_items, dst_entry, chunk)
        form = (got.fp8, got.dtype_module, str(got.dtype), got.args, got.shape)
        want = (TE_CODE[float8.fp8], float8.dtype_module, str(float8.logical.torch), float8.args, chunk.sizes)
        if form != want:
            raise CheckpointError(written, f"{target.fqn}: verification failed (the item at {list(chunk.offsets)} "
                                           f"is a Float8Tensor of another form: {form} instead of {want})")
        lo, hi = chunk.offsets[0], chunk.offsets[0] + chunk.sizes[0]
        covered = 0
        for start, end, source_chunk in held:
            if end <= lo or start >= hi:
                continue
            if decoded is None or decoded[0] is not source_chunk:
                decoded = source_chunk, _parts(src, src_items, source, source_chunk)
            kept = decoded[1]
            a, b = max(lo, start), min(hi, end)
            if not (_bits(kept.scale_inv).equal(_bits(got.scale_inv))
                    and kept.codes[a - start:b - start].equal(got.codes[a - lo:b - lo])):
                raise CheckpointError(written, f"{target.fqn}: verification failed (rows [{a}, {b}) of the item at "
                                               f"{list(chunk.offsets)}, decoded by torch, are not the codes and "
                                               f"scale_inv of the source's item at {list(source_chunk.offsets)})")
            covered += b - a
        if covered != hi - lo:
            raise CheckpointError(written, f"{target.fqn}: verification failed (rows [{lo}, {hi}) are not all "
                                           "held by the source)")
        if advance is not None:
            advance(2 * chunk.numel)


def _verify_mxfp8(src: Checkpoint, src_items: ItemReader, source: TensorEntry, dst: Checkpoint,
                  dst_items: ItemReader, dst_entry: TensorEntry, kept: TeMxfp8Target, written: Path,
                  advance: Advance | None) -> None:
    held = sorted(((c.offsets[0], c.offsets[0] + c.sizes[0], c) for c in source.chunks if c.numel),
                  key=lambda r: r[0])
    decoded: tuple[Chunk, Mxfp8Parts] | None = None
    fqn = kept.fqn
    for chunk in dst_entry.chunks:
        got = _parts(dst, dst_items, dst_entry, chunk, load_mxfp8_parts)
        lo, hi = chunk.offsets[0], chunk.offsets[0] + chunk.sizes[0]
        padded = -(-(hi - lo) // SCALE_ROWS) * SCALE_ROWS
        form = (got.fp8, got.dtype_module, str(got.dtype), got.args, got.shape, tuple(got.scales.shape))
        want = (TE_CODE[kept.fp8], kept.dtype_module, str(kept.logical.torch), kept.args, chunk.sizes,
                (padded, kept.width))
        if form != want:
            raise CheckpointError(written, f"{fqn}: verification failed (the item at {list(chunk.offsets)} "
                                           f"is an MXFP8Tensor of another form: {form} instead of {want})")
        if bool(got.scales[hi - lo:].any()):
            raise CheckpointError(written, f"{fqn}: verification failed (the item at {list(chunk.offsets)} "
                                           "pads its scales with other than the zero rows TE's FSDP2 pads with)")
        covered = 0
        for start, end, source_chunk in held:
            if end <= lo or start >= hi:
                continue
            if decoded is None or decoded[0] is not source_chunk:
                decoded = source_chunk, _parts(src, src_items, source, source_chunk, load_mxfp8_parts)
            saved = decoded[1]
            a, b = max(lo, start), min(hi, end)
            if not (saved.quantizer == got.quantizer and saved.codes[a - start:b - start].equal(got.codes[a - lo:b - lo])
                    and saved.scales[a - start:b - start].equal(got.scales[a - lo:b - lo])):
                raise CheckpointError(written, f"{fqn}: verification failed (rows [{a}, {b}) of the item at "
                                               f"{list(chunk.offsets)}, decoded by torch, are not the codes, scales "
                                               f"and quantizer of the source's item at {list(source_chunk.offsets)})")
            covered += b - a
        if covered != hi - lo:
            raise CheckpointError(written, f"{fqn}: verification failed (rows [{lo}, {hi}) are not all "
                                           "held by the source)")
        if advance is not None:
            advance(2 * chunk.numel)


def _bits(scale_inv: Any) -> Any:
    import torch

    return scale_inv.view(torch.int32)


def _parts(ckpt: Checkpoint, items: ItemReader, entry: TensorEntry, chunk: Chunk,
           load: Callable[[bytes], Any] = load_float8_parts) -> Any:
    path = ckpt.path / chunk.file
    raw = items.read_item_bytes(chunk.file, chunk.offset, chunk.length, chunk.transforms,
                                3 * chunk.numel + (1 << 20))  # codes, a columnwise copy, scales
    try:
        return load(raw)
    except Exception as exc:  # noqa: BLE001 - torch raises many types for a corrupt or foreign item
        kind = "Float8Tensor" if load is load_float8_parts else "MXFP8Tensor"
        raise CheckpointError(path, f"item at byte {chunk.offset}: {entry.fqn}: torch cannot load it as a "
                                    f"Transformer Engine {kind} for verification "
                                    f"({type(exc).__name__})") from None
