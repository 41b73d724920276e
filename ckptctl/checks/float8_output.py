"""`--verify` of TE Float8Tensor and block-scaled items a reshard kept: codes and scales, bit for bit, by torch.

A kept Float8Tensor's value is its codes times its scale, so comparing values would let a wrong
code hide where two codes give one value (±0) or none (NaN). Every output item and every source
item is instead loaded by `torch.load(weights_only=True)` with stand-ins allowed under TE's names
that keep the reconstructor's arguments (`torch_standins.load_float8_parts`); an output item must
name the same FP8 format, logical dtype and reduce form as the source, hold the source's codes
for its rows and the scale_inv of each source item its rows come from. An MXFP8Tensor or
Float8BlockwiseQTensor output item (`load_block_parts`) must hold its source rows' codes, their
scales where TE's layout puts them (rows, columns or 128-row blocks) with zero padding, and the
source's quantizer fields. ckptctl's item reader is used for nothing
but bytes. A source item is decoded once per output item it meets (one in memory).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from ckptctl.checks.torch_standins import BlockParts, Float8Parts, load_block_parts, load_float8_parts
from ckptctl.core.checkpoint import Checkpoint, Chunk, TensorEntry
from ckptctl.core.plan import TargetTensor
from ckptctl.formats.dcp.items import ItemReader
from ckptctl.formats.dcp.te_float8 import TE_CODE, float8_of
from ckptctl.formats.dcp.block_scaled import MXFP8
from ckptctl.formats.dcp.te_block_items import TeBlockTarget
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
    if isinstance(float8, TeBlockTarget):
        _verify_blocks(src, src_items, source, dst, dst_items, dst_entry, float8, written, advance)
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


def _verify_blocks(src: Checkpoint, src_items: ItemReader, source: TensorEntry, dst: Checkpoint,
                   dst_items: ItemReader, dst_entry: TensorEntry, kept: TeBlockTarget, written: Path,
                   advance: Advance | None) -> None:
    import torch

    held = sorted(((c.offsets[0], c.offsets[0] + c.sizes[0], c) for c in source.chunks if c.numel),
                  key=lambda r: r[0])
    decoded: tuple[Chunk, BlockParts] | None = None
    fqn, kind, block = kept.fqn, kept.scaling.kind, kept.scaling.block
    for chunk in dst_entry.chunks:
        got = _parts(dst, dst_items, dst_entry, chunk, load_block_parts)
        lo, hi = chunk.offsets[0], chunk.offsets[0] + chunk.sizes[0]
        form = (got.kind, got.fp8, got.dtype_module, str(got.dtype), got.args, got.shape, str(got.scales.dtype),
                tuple(got.scales.shape), got.two_d, got.columnwise)
        want = (kind, TE_CODE[kept.fp8], kept.dtype_module, str(kept.logical.torch), kept.args, chunk.sizes,
                "torch.uint8" if kind == MXFP8 else "torch.float32", kept.scale_shape(hi - lo),
                None if kind == MXFP8 else block == (128, 128), False)
        if form != want:
            raise CheckpointError(written, f"{fqn}: verification failed (the item at {list(chunk.offsets)} "
                                           f"is a {kind} of another form: {form} instead of {want})")
        scales = torch.zeros_like(got.scales)  # what the rows' saved scales make, TE's zero padding around them
        filled: set[int] = set()
        covered = 0
        for start, end, source_chunk in held:
            if end <= lo or start >= hi:
                continue
            if decoded is None or decoded[0] is not source_chunk:
                decoded = source_chunk, _parts(src, src_items, source, source_chunk, load_block_parts)
            saved = decoded[1]
            a, b = max(lo, start), min(hi, end)
            if saved.scales.dtype != got.scales.dtype or saved.quantizer != got.quantizer \
                    or not saved.codes[a - start:b - start].equal(got.codes[a - lo:b - lo]):
                raise CheckpointError(written, f"{fqn}: verification failed (rows [{a}, {b}) of the item at "
                                               f"{list(chunk.offsets)}, decoded by torch, are not the codes, scale "
                                               "dtype and quantizer of the source's item at "
                                               f"{list(source_chunk.offsets)})")
            if block == (1, 32):
                scales[a - lo:b - lo] = saved.scales[a - start:b - start]
            elif block == (1, 128):
                scales[:, a - lo:b - lo] = saved.scales[:, a - start:b - start]
            else:
                for b0 in range((a - lo) // 128 * 128 + lo, b, 128):
                    first, last = max(a, b0), min(b, b0 + 128) - 1
                    if (first - start) // 128 != (last - start) // 128 or (b0 - lo) // 128 in filled:
                        raise CheckpointError(written, f"{fqn}: verification failed (the item at "
                                                       f"{list(chunk.offsets)} keeps a 128-row block of rows from "
                                                       "saved blocks of other scales)")
                    filled.add((b0 - lo) // 128)
                    scales[(b0 - lo) // 128] = saved.scales[(first - start) // 128]
            covered += b - a
        if covered != hi - lo:
            raise CheckpointError(written, f"{fqn}: verification failed (rows [{lo}, {hi}) are not all "
                                           "held by the source)")
        if not _bits(scales).equal(_bits(got.scales)):
            raise CheckpointError(written, f"{fqn}: verification failed (the scales of the item at "
                                           f"{list(chunk.offsets)}, decoded by torch, are not its source rows' "
                                           "scales padded with zeros as TE pads them)")
        if advance is not None:
            advance(2 * chunk.numel)


def _bits(scales: Any) -> Any:
    """float32 scales as their bits (NaN and ±0 compared exactly); byte scales as they are."""
    import torch

    return scales.view(torch.int32) if scales.dtype == torch.float32 else scales


def _parts(ckpt: Checkpoint, items: ItemReader, entry: TensorEntry, chunk: Chunk,
           load: Callable[[bytes], Any] = load_float8_parts) -> Any:
    path = ckpt.path / chunk.file
    raw = items.read_item_bytes(chunk.file, chunk.offset, chunk.length, chunk.transforms,
                                3 * chunk.numel + (1 << 20))  # codes, a columnwise copy, scales
    try:
        return load(raw)
    except Exception as exc:  # noqa: BLE001 - torch raises many types for a corrupt or foreign item
        kind = "Float8Tensor" if load is load_float8_parts else "block-scaled tensor"
        raise CheckpointError(path, f"item at byte {chunk.offset}: {entry.fqn}: torch cannot load it as a "
                                    f"Transformer Engine {kind} for verification "
                                    f"({type(exc).__name__})") from None
