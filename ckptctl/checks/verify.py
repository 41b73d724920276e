"""`--verify`: re-read an output and compare every tensor with the source, streaming.

Both sides are assembled in bounded blocks of global rows and hashed in row-major order,
so verification of any size costs a block of memory per worker, and compares values
(after the requested cast), not layouts.

That comparison reads the source through the same `ChunkSource` the copy used: a mistake
in locating a source item's bytes would be made twice and agree with itself. So
`check_decoded_source` also reads every source chunk as its format's own reader lays it out
(torch's loader finds a torch.save item's record and view, without reading the data; a
safetensors header its record; stream-transformed items are decoded whole by torch), never
through ckptctl's item reader, and compares it block by block (cast as asked) with the same
elements read back from the output. Memory is a few blocks per worker, never an item, and
every block counts in the verifying bar.
"""

from __future__ import annotations

import hashlib
import io
import math
import threading
from pathlib import Path
from typing import Any, Callable, Mapping

from ckptctl.engine.cpu import (DECODED_CACHE_BYTES, ChunkSource, Stopped, assemble_bytes, run_on_threads,
                                stopping)
from ckptctl.util.errors import CheckpointError
from ckptctl.core.dtypes import BY_SAFETENSORS
from ckptctl.formats.safetensors.quantized import DEQUANT, Fp8Weight
from ckptctl.formats.safetensors.quantize_fp8 import Fp8Codes, Fp8Scales, band_rows, scale_bytes
from ckptctl.checks.quantized_output import requantized
from ckptctl.checks.float8_output import verify_float8
from ckptctl.checks.torch_standins import load_subclass_item, names_subclass
from ckptctl.formats.dcp.te_float8 import float8_of
from ckptctl.formats.dcp.items import MAX_ZIP_READ, ItemReader
from ckptctl.storage.file_window import window
from ckptctl.formats.safetensors.reader import blob_header
from ckptctl.formats.dcp.metadata import open_checkpoint
from ckptctl.formats.dcp.writer import DcpOutput
from ckptctl.formats.safetensors.writer import SafetensorsFile, item_boxes
from ckptctl.core.analysis import source_tensors
from ckptctl.core.geometry import (Box, box_flat_ranges, flat_boxes, full_box, region_bounds, rows_box, unravel,
                              transposed_order)
from ckptctl.core.checkpoint import Checkpoint, Chunk, TensorEntry
from ckptctl.util.progress import Advance
from ckptctl.core.plan import Piece, SourceTensor, StreamItem, TargetTensor, identity_target, plan_box, source_view
from ckptctl.storage.store import ReadHandle, store_for


VERIFY_BLOCK_BYTES = 4 << 20
"""Bytes of a tensor each worker assembles and hashes at once, on each side: with the decoded
blocks, verification adds a few tens of megabytes to the run (and torch), whatever the model."""


def row_blocks(shape: tuple[int, ...], itemsize: int) -> list[Box]:
    """Boxes of whole rows covering `shape` in order, each about VERIFY_BLOCK_BYTES."""
    if not shape or shape[0] == 0:
        return [full_box(shape)]
    row = math.prod(shape[1:]) * itemsize
    step = max(1, VERIFY_BLOCK_BYTES // max(row, 1))
    return [rows_box(shape, r, min(shape[0], r + step)) for r in range(0, shape[0], step)]


def tensor_digest(target: TargetTensor, sources: Mapping[str, SourceTensor], chunks: ChunkSource) -> str:
    """SHA-256 of the target's global row-major bytes, assembled block by block.

    SHA-256 because OpenSSL runs it on the CPU's SHA extensions: 1.7 GB/s on the bench
    machine, against 1.1 GB/s for blake2b.
    """
    digest = hashlib.sha256()
    for box in row_blocks(target.shape, target.dtype.itemsize):
        if stopping():
            raise Stopped
        digest.update(assemble_bytes(StreamItem("", 0, b"", target, box, plan_box(target, box, sources)), chunks))
    return digest.hexdigest()


class Digests:
    """`tensor_digest` of one side's tensors (the source views, or the output's), each taken once:
    the master check compares tensors the copy check has hashed already."""

    def __init__(self, sources: Mapping[str, SourceTensor], chunks: ChunkSource) -> None:
        self.sources, self.chunks = sources, chunks
        self._taken: dict[TargetTensor, str] = {}

    def __call__(self, target: TargetTensor) -> str:
        found = self._taken.get(target)
        if found is None:
            found = self._taken[target] = tensor_digest(target, self.sources, self.chunks)
        return found


def verify_dcp(src: Checkpoint, src_chunks: ChunkSource, out: DcpOutput, written: Path, workers: int = 1,
               advance: Advance | None = None, views: Mapping[str, SourceTensor] | None = None) -> None:
    """Raise CheckpointError unless every tensor and bytes entry at `written` equals its source,
    and every master copy the plan rebuilt its weight (`check_master`).

    `views` are the source views the targets' pieces address (default: each tensor as reshard
    sees it). Tensors are checked on `workers` threads (reads and hashing release the GIL);
    `advance` counts each checked tensor's output bytes twice (hashed, then compared with the
    decoded source), and each master's weight's: `verified_bytes(out)` in all.
    """

    src_sources = views if views is not None else source_tensors(src)
    dst = open_checkpoint(written)
    dst_chunks = ChunkSource(dst)
    try:
        dst_sources = {fqn: source_view(e) for fqn, e in dst.tensors.items()}
        missing = next((fqn for fqn in out.targets if fqn not in dst.tensors), None)
        if missing is not None:
            raise CheckpointError(written, f"{missing}: missing from the output")

        source, output = Digests(src_sources, src_chunks), Digests(dst_sources, dst_chunks)
        kept_fp8 = [t for t in out.targets.values() if float8_of(t) is not None]  # codes and scales, by torch
        copied = {fqn: t for fqn, t in out.targets.items() if float8_of(t) is None}

        def check(fqn: str) -> None:
            if source(out.targets[fqn]) != output(identity_target(dst_sources[fqn])):
                raise CheckpointError(written, f"{fqn}: verification failed (output differs from the source)")
            if advance is not None:
                advance(out.targets[fqn].nbytes)

        run_on_threads(list(copied), check, workers, "ckptctl-verify")
        check_decoded_source(src, copied, src_sources, dcp_read_back(dst, dst_chunks, dst_sources), written,
                             workers, advance)
        run_on_threads(kept_fp8, lambda t: verify_float8(src, src_chunks.reader, dst, dst_chunks.reader, t, written,
                                                         advance), workers, "ckptctl-verify")

        def check_pair(pair: tuple[str, TargetTensor]) -> None:
            check_master(*pair, source, output, written)
            if advance is not None:
                advance(pair[1].nbytes)

        run_on_threads(list(out.masters.items()), check_pair, workers, "ckptctl-verify")
        for fqn, copy in out.bytes_entries.items():
            entry = dst.bytes_entries.get(fqn)
            if entry is None:
                raise CheckpointError(written, f"{fqn}: bytes entry missing from the output")
            expected = copy.data if copy.data is not None else \
                src_chunks.reader.read_item_bytes(copy.src_file, copy.src_offset, copy.length, ())
            if expected != dst_chunks.reader.read_item_bytes(entry.file, entry.offset, entry.length, ()):
                raise CheckpointError(written, f"{fqn}: verification failed (bytes entry differs)")
    finally:
        dst_chunks.close()


def check_master(master: str, weight: TargetTensor, source: Digests, output: Digests, written: Path) -> None:
    """Raise unless output tensor `master`, cast to its weight's dtype, is `weight` (read from the
    source) bit for bit.

    A DistributedOptimizer copies its fp32 masters into the weights after each step, so a save
    holds both: where a master was laid out from buckets or fragments whose map the checkpoint
    does not record (params of one size in another order pass every structural check), equality
    with the weight is the proof the map was right, and with it the Adam states laid out alike.
    """
    got = output.sources[master]
    if got.shape != weight.shape:
        raise CheckpointError(written, f"{master}: shaped {list(got.shape)}, its param {weight.fqn} "
                                       f"{list(weight.shape)}")
    if output(identity_target(got, dtype=weight.dtype)) != source(weight):
        raise CheckpointError(written, f"{master}: verification failed (the rebuilt master copy, cast to "
                                       f"{weight.dtype.name}, is not its param {weight.fqn}: the source's optimizer "
                                       "state was not laid out as rebuilt)")


ITEM_OVERHEAD_BYTES = 1 << 20
"""A torch.save item holds its tensor's bytes plus a few kB of zip records and alignment:
an item's transforms may undo to at most numel × itemsize + this, or it is refused."""

ReadBack = Callable[[TargetTensor, Box], bytes | bytearray]
"""The output's row-major bytes of `box` of a target, in its stored shape (`shape`, not `logical_shape`)."""


def dcp_read_back(dst: Checkpoint, dst_chunks: ChunkSource,
                  views: Mapping[str, SourceTensor] | None = None) -> ReadBack:
    """Read boxes of a written DCP checkpoint's tensors back (the output side: ckptctl's reader);
    `views` are `dst`'s source views when the caller already has them."""
    if views is None:
        views = {fqn: source_view(e) for fqn, e in dst.tensors.items()}

    def read(target: TargetTensor, box: Box) -> bytearray:
        view = views.get(target.fqn)
        if view is None:
            raise CheckpointError(dst.path, f"{target.fqn}: missing from the output")
        whole = identity_target(view)
        return assemble_bytes(StreamItem("", 0, b"", whole, box, plan_box(whole, box, views)), dst_chunks)

    return read


def tensor_read_back(tensor_of: Callable[[str], Any]) -> ReadBack:
    """Read boxes back from outputs torch or safetensors opened: `tensor_of(fqn)` is the stored
    tensor, or anything sliceable like one (`safe_open(...).get_slice(name)`)."""
    import torch

    def read(target: TargetTensor, box: Box) -> bytes:
        got = tensor_of(target.fqn)[tuple(slice(o, o + n) for o, n in zip(box.offsets, box.sizes))]
        return raw_bytes(torch.as_tensor(got))

    return read


DECODED_BLOCK_BYTES = 4 << 20
"""Bytes of a source chunk decoded and compared at once by one worker (`check_decoded_source`):
verification holds a few blocks per worker, never a whole item."""


def check_decoded_source(src: Checkpoint, targets: Mapping[str, TargetTensor], sources: Mapping[str, SourceTensor],
                         read_back: ReadBack, shown: Path, workers: int = 1, advance: Advance | None = None) -> int:
    """Compare every block every target takes from every saved source chunk, decoded by the
    item's own format's reader (torch's loader for a torch.save item, safetensors' for a
    safetensors record) and cast (and shifted) as the target asks, with the same elements
    read back from the output: whole copies, fused splits, re-blocked TP shards and flat
    optimizer buffers alike. `sources` are the views the targets' pieces use.

    A chunk is decoded in blocks of DECODED_BLOCK_BYTES, each a job of one of `workers`
    threads (so memory is a few blocks per worker, and a stop ends the run within a block);
    `advance` counts the output bytes each compares. Raises CheckpointError naming `shown` on
    the first difference or undecodable item; returns the number of source chunks checked.
    """
    uses: dict[tuple[str, int], list[tuple[TargetTensor, Piece]]] = {}
    for target in targets.values():
        for piece in target.pieces:
            view = sources[piece.src]
            wanted = piece.source_box
            for index, (chunk, region) in enumerate(view.chunks):
                if chunk.numel and region_bounds(region, view.shape).intersect(wanted) is not None:
                    uses.setdefault((piece.src, index), []).append((target, piece))
    jobs = [(key, first, part) for key in uses
            for first, part in _chunk_blocks(sources[key[0]], key[1], DECODED_BLOCK_BYTES)]

    def check(job: tuple[tuple[str, int], int, Box]) -> None:
        (fqn, index), first, part = job
        view = sources[fqn]
        chunk, _ = view.chunks[index]
        values = decoded.elements(src.tensors[view.fqn], chunk, first, part.numel).reshape(part.sizes)
        for target, piece in uses[(fqn, index)]:
            both = part.intersect(piece.source_box)
            if both is None:
                continue
            block = values[_slices(both, part.offsets)]
            dst = piece.destination(both)
            if piece.axes is not None:
                block = block.permute(transposed_order(piece.axes, block.dim())).reshape(dst.sizes)
            want = raw_bytes(_as_target(block, target))
            pieces = [read_back(target, b) for b in _boxes_in(dst, target.logical_shape or target.shape,
                                                               target.shape)]
            got = pieces[0] if len(pieces) == 1 else b"".join(pieces)  # one box when the shapes agree: no copy
            if got != want:
                raise CheckpointError(shown, f"{target.fqn}: verification failed (the chunk at "
                                             f"{list(chunk.offsets)} of {view.fqn}, decoded by torch from {chunk.file}, "
                                             "differs from the output)")
            if advance is not None:
                advance(len(want))

    decoded = DecodedChunks(src)
    try:
        run_on_threads(jobs, check, workers, "ckptctl-verify-decoded")
    finally:
        decoded.close()
    return len(uses)


def decoded_bytes(targets: Mapping[str, TargetTensor]) -> int:
    """What `check_decoded_source` counts: every target's bytes, each compared once."""
    return sum(t.nbytes for t in targets.values())


def verified_bytes(out: DcpOutput) -> int:
    """What `verify_dcp` counts: every target hashed and compared with the decoded source, and
    every master's weight."""
    return 2 * decoded_bytes(out.targets) + sum(t.nbytes for t in out.masters.values())


def _chunk_blocks(view: SourceTensor, index: int, block_bytes: int) -> list[tuple[int, Box]]:
    """Chunk `index` of `view` as boxes of the view, each contiguous in the chunk's element order
    and of about `block_bytes` at most, with its first element's index in the chunk: the chunk's
    own box cut along its first long dim, or a flat (1-D item-coordinate) chunk cut into
    row-contiguous boxes of the view's shape first."""
    chunk, region = view.chunks[index]
    if isinstance(region, Box):
        parts = [(0, region)]
    else:  # a flat buffer's chunk, or rows read as the item range they hold
        lo, hi = max(region.start, 0), min(region.end, math.prod(view.shape))  # a window of a bucket sees part of it
        parts = [(first - region.start + region.skip, box) for first, box in flat_boxes(view.shape, lo, hi)]
    most = max(1, block_bytes // max(1, view.dtype.itemsize))
    out = []
    for first, box in parts:
        dim = next((d for d, n in enumerate(box.sizes) if n > 1), None)
        if dim is None or box.numel <= most:
            out.append((first, box))
            continue
        row = math.prod(box.sizes[dim + 1:])
        step = max(1, most // row)
        for a in range(0, box.sizes[dim], step):
            n = min(step, box.sizes[dim] - a)
            offsets = box.offsets[:dim] + (box.offsets[dim] + a,) + box.offsets[dim + 1:]
            out.append((first + a * row, Box(offsets, box.sizes[:dim] + (n,) + box.sizes[dim + 1:])))
    return out


class DecodedChunks:
    """Source chunks read as their format's own reader lays them out, a block of elements at a
    time: a torch.save item's record and view (storage offset, strides) as torch's loader finds
    them (`torch.load(map_location="meta")`: no data read), once per distinct `data.pkl`; a
    SAFETENSORS-format record or a safetensors folder's tensor by its header. An item torch lays
    out otherwise (strided, big-endian, stream-transformed) is decoded whole by torch."""

    def __init__(self, src: Checkpoint) -> None:
        self.src = src
        self._files = ItemReader(src)  # lends its open handles only
        self._places: dict[tuple[str, str, int], Any] = {}
        self._decoded_bytes = 0
        """Bytes of the whole decoded chunks `_places` holds: at most DECODED_CACHE_BYTES."""
        self._lock = threading.Lock()

    def close(self) -> None:
        self._files.close()

    def elements(self, entry: TensorEntry, chunk: Chunk, first: int, count: int) -> Any:
        """Elements [first, first + count) of the chunk, in its row-major order, as a 1-D tensor."""
        import torch

        key = (entry.fqn, chunk.file, chunk.offset)
        with self._lock:
            place = self._places.get(key)
        if place is None:
            place = self._locate(entry, chunk)
            size = place.nbytes if isinstance(place, torch.Tensor) else 0
            with self._lock:  # a chunk's blocks are jobs in a row: its decoded whole is kept for them, not for ever
                if len(self._places) >= MAX_TORCH_LAYOUTS or self._decoded_bytes + size > DECODED_CACHE_BYTES:
                    self._places.clear()
                    self._decoded_bytes = 0
                self._places[key] = place
                self._decoded_bytes += size
        if isinstance(place, torch.Tensor):
            return place.reshape(-1)[first:first + count]
        isz = entry.itemsize
        data = bytearray(self._files.positioned_reader(chunk.file)(count * isz, place + first * isz))
        if len(data) != count * isz:
            raise CheckpointError(self.src.path / chunk.file, f"item at byte {chunk.offset}: short read")
        return torch.frombuffer(data, dtype=entry.dtype.torch) if data else torch.empty(0, dtype=entry.dtype.torch)

    def _locate(self, entry: TensorEntry, chunk: Chunk) -> Any:
        """Where the chunk's dense bytes start in its file, or the chunk decoded whole."""
        path = self.src.path / chunk.file
        if chunk.transforms:
            return decode_source_item(self.src, entry, chunk, self._files)
        handle = self._files.handle(chunk.file)
        if chunk.file in self.src.dense_files:  # rows of a joined folder's tensor (`hf_base`), checked there
            return chunk.offset
        if self.src.safetensors_folder:
            return _safetensors_folder_rows(path, entry, chunk)
        if handle.read_at(4, chunk.offset) != b"PK\x03\x04":
            return _safetensors_record_start(handle, chunk, entry, path)
        try:
            start = _torch_record_start(handle, chunk, entry)
        except Exception as exc:  # noqa: BLE001 - torch raises many types for a corrupt item
            raise CheckpointError(path, f"item at byte {chunk.offset}: torch cannot load it for verification "
                                        f"({type(exc).__name__})") from None
        return start if start is not None else decode_source_item(self.src, entry, chunk, self._files)


def _slices(box: Box, origin: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(o - a, o - a + n) for o, a, n in zip(box.offsets, origin, box.sizes))


def _as_target(values: Any, target: TargetTensor) -> Any:
    """Source values as the target holds them: cast, then shifted by the target's `add`."""
    out = _cast(values, target.dtype)
    if target.add:
        from ckptctl.engine.cast import add_into

        out = out.clone() if out is values else out
        add_into(out, target.add)
    return out


def _boxes_in(box: Box, shape: tuple[int, ...], stored: tuple[int, ...]) -> list[Box]:
    """`box` of a `shape` tensor as boxes of the same elements of a `stored` tensor (same item
    order), in order: itself when the shapes agree."""
    if tuple(shape) == tuple(stored):
        return [box]
    return [b for r in box_flat_ranges(box, shape) for _, b in flat_boxes(stored, r.start, r.end)]


def _cast(tensor: Any, dtype: Any) -> Any:
    if tensor.dtype == dtype.torch:
        return tensor
    import torch

    from ckptctl.engine.cast import cast_into

    out = torch.empty(tensor.shape, dtype=dtype.torch)
    cast_into(out, tensor)
    return out


def raw_bytes(tensor: Any) -> bytes:
    import torch

    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def safetensors_dequantized(entry: TensorEntry, chunk: Chunk) -> Any:
    """A box of a quantized folder's weight (a dequantized chunk, or rows of one) decoded
    independently of the copy's decoder: codes and scales read by the safetensors library (only
    the box's), the scales expanded to one per value, the product in float32 for FP8 (the
    producers' product) and in float64 for MXFP4 (exact), rounded once to the entry's dtype."""
    import torch
    from safetensors import safe_open

    weight = entry.properties

    def part(st: Any, index: tuple[Any, ...]) -> Any:
        with safe_open(st.file, framework="pt") as f:
            return f.get_slice(st.name)[index] if st.shape else f.get_tensor(st.name)

    if isinstance(weight, Fp8Weight):
        lead, r0, n = chunk.offsets[:-2], chunk.offsets[-2], chunk.sizes[-2]
        codes = part(weight.data, (*lead, slice(r0, r0 + n))).to(torch.float32)
        if weight.block is None:
            factors = part(weight.scale, (slice(0, 1),)).reshape(1, 1)
        else:
            bm, bn = weight.block
            grid = part(weight.scale, (*lead, slice(r0 // bm, -(-(r0 + n) // bm))))
            factors = grid.repeat_interleave(bm, 0)[r0 % bm:r0 % bm + n]
            factors = factors.repeat_interleave(bn, 1)[:, :codes.shape[-1]]
        if factors.dtype == torch.uint8:
            factors = torch.exp2(factors.to(torch.float32) - 127)
        return (codes * factors.to(torch.float32)).to(entry.dtype.torch).reshape(chunk.sizes)
    (e0, i0, o0), (experts, inputs, outputs) = chunk.offsets, chunk.sizes  # the codes are [E, out, in/32, 16]
    g0, g1 = i0 // 32, -(-(i0 + inputs) // 32)
    box = (slice(e0, e0 + experts), slice(o0, o0 + outputs), slice(g0, g1))
    codes = part(weight.blocks, box).to(torch.int64)
    nibbles = torch.stack((codes & 15, codes >> 4), dim=-1).flatten(-2)
    magnitude = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6], dtype=torch.float64)[nibbles & 7]
    powers = torch.pow(2.0, part(weight.scales, box).to(torch.float64) - 127)
    values = (torch.where(nibbles >= 8, -magnitude, magnitude) * powers[..., None]).flatten(-2)
    values = values[..., i0 - g0 * 32:i0 - g0 * 32 + inputs]
    return values.to(entry.dtype.torch).transpose(1, 2).contiguous()


def dequantized_elements(entry: TensorEntry, chunk: Chunk, first: int, count: int) -> bytes:
    """Elements [first, first + count) of a dequantized chunk, in its row-major order, decoding
    only the rows they lie in (`safetensors_dequantized`): an output check's sample of one
    element reads one row of codes, not the chunk."""
    from dataclasses import replace

    axis = len(chunk.sizes) - 2  # FP8 [..., rows, cols]; MXFP4 [E, in, out], a row one (expert, input)
    step = chunk.sizes[-1]
    lo, hi = first // step, -(-(first + count) // step)
    per = chunk.sizes[axis]
    if lo // per != (hi - 1) // per:  # rows of several leading indexes: those whole
        axis, step = axis - 1, step * per
        lo, hi = lo // per, (hi - 1) // per + 1
    lead = unravel(lo // chunk.sizes[axis], chunk.sizes[:axis]) if axis else ()
    offsets = (*(o + i for o, i in zip(chunk.offsets, lead)), chunk.offsets[axis] + lo % chunk.sizes[axis],
               *chunk.offsets[axis + 1:])
    sizes = (*(1 for _ in lead), hi - lo, *chunk.sizes[axis + 1:])
    rows = safetensors_dequantized(entry, replace(chunk, offsets=offsets, sizes=sizes))
    skip = first - lo * step
    return raw_bytes(rows.reshape(-1)[skip:skip + count])


def decode_source_item(src: Checkpoint, entry: TensorEntry, chunk: Chunk, files: ItemReader | None = None) -> Any:
    """A torch.save item decoded whole by torch, its stream transforms undone first (not by
    ckptctl's item reader: `files`, when given, only lends its open handles)."""
    import torch

    if DEQUANT in chunk.transforms:
        return safetensors_dequantized(entry, chunk)
    path = src.path / chunk.file
    handle = files.handle(chunk.file) if files is not None else store_for(path).open_read(path)
    try:
        raw = handle.read_at(chunk.length, chunk.offset)
    finally:
        if files is None:
            handle.close()
    if len(raw) != chunk.length:
        raise CheckpointError(path, f"item at byte {chunk.offset}: short read")
    if chunk.transforms:
        raw = _undo_transforms(raw, chunk, entry, path)
    if raw[:4] != b"PK\x03\x04":
        raise CheckpointError(path, f"item at byte {chunk.offset}: {entry.fqn}: not a torch.save archive")
    try:
        tensor = _torch_load(raw)
    except Exception as exc:  # noqa: BLE001 - torch raises many types for a corrupt item
        raise CheckpointError(path, f"item at byte {chunk.offset}: torch cannot load it for verification "
                                    f"({type(exc).__name__})") from None
    if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != chunk.sizes or tensor.dtype != entry.dtype.torch:
        raise CheckpointError(path, f"item at byte {chunk.offset}: {entry.fqn}: torch decodes it as another tensor "
                                    "than the metadata names")
    return tensor


_TORCH_LAYOUTS: dict[bytes, tuple[str, Any, tuple[int, ...], tuple[int, ...], int]] = {}
"""`data.pkl` bytes → (storage record, dtype, size, stride, storage offset) as torch's own
`torch.load` decoded them once: an item with the same pickle is the same view of its record."""
MAX_TORCH_LAYOUTS = 4096


def _torch_load(raw: bytes) -> Any:
    """The tensor of a torch.save archive, decoded by torch: its zip by torch's C++ reader, its
    `data.pkl` by `torch.load(weights_only=True)` — once per distinct pickle (a sharded
    tensor's items repeat a few), later items of that pickle as the same view of their record
    (a full load costs ~15 times more). Big-endian archives are always loaded whole."""
    import torch

    reader = torch._C.PyTorchFileReader(io.BytesIO(raw))
    pickled = reader.get_record("data.pkl")
    little = not reader.has_record("byteorder") or reader.get_record("byteorder") == b"little"
    if names_subclass(pickled):  # an FP8 training subclass: torch's loader with the allowed stand-ins
        return load_subclass_item(raw)
    layout = _TORCH_LAYOUTS.get(pickled) if little else None
    if layout is None:
        tensor = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
        records = [n for n in reader.get_all_records() if n.startswith("data/")]
        if little and isinstance(tensor, torch.Tensor) and len(records) == 1 \
                and len(_TORCH_LAYOUTS) < MAX_TORCH_LAYOUTS:
            _TORCH_LAYOUTS[pickled] = (records[0], tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()),
                                       tensor.storage_offset())
        return tensor
    record, dtype, size, stride, offset = layout
    data = bytearray(reader.get_record(record))
    flat = torch.frombuffer(data, dtype=dtype) if data else torch.empty(0, dtype=dtype)
    return flat.as_strided(size, stride, offset)


def _undo_transforms(raw: bytes, chunk: Chunk, entry: TensorEntry, path: Path) -> bytes:
    from torch.distributed.checkpoint._extension import ExtensionRegistry, StreamTransformExtension

    limit = chunk.numel * entry.dtype.itemsize + ITEM_OVERHEAD_BYTES
    stream: Any = io.BytesIO(raw)
    try:
        for ext in ExtensionRegistry().from_descriptor_list(list(chunk.transforms)):
            if isinstance(ext, StreamTransformExtension):
                stream = ext.transform_from(stream)
        data = stream.read(limit + 1)
    except Exception as exc:  # noqa: BLE001 - unknown descriptors and corrupt streams alike
        raise CheckpointError(path, f"item at byte {chunk.offset}: cannot undo transforms "
                                    f"{list(chunk.transforms)} for verification ({type(exc).__name__})") from None
    if len(data) > limit:
        raise CheckpointError(path, f"item at byte {chunk.offset}: transforms undo to more than {limit} bytes")
    return data


_META_LAYOUTS: dict[bytes, tuple[str, Any, tuple[int, ...], bool, int]] = {}
"""`data.pkl` bytes → (storage record, dtype, size, contiguous, storage offset) as torch's loader
lays the tensor out (`map_location="meta"`: no data read), for items of the same pickle."""


def _torch_record_start(handle: ReadHandle, chunk: Chunk, entry: TensorEntry) -> int | None:
    """Where a torch.save item's tensor data starts in its file, found by torch: its zip read by
    torch's C++ reader (`get_record_offset`), its view by `torch.load` to the meta device. None
    when torch would not read it as dense little-endian bytes (it is then decoded whole)."""
    import torch

    item = window(handle.positioned_reader(), chunk.offset, chunk.length, MAX_ZIP_READ)
    reader = torch._C.PyTorchFileReader(item)
    if reader.has_record("byteorder") and reader.get_record("byteorder") != b"little":
        return None
    pickled = reader.get_record("data.pkl")
    if names_subclass(pickled):
        return None  # decoded whole (`_torch_load`)
    layout = _META_LAYOUTS.get(pickled)
    if layout is None:
        item.seek(0)
        tensor = torch.load(item, map_location="meta", weights_only=True)
        records = [n for n in reader.get_all_records() if n.startswith("data/")]
        if not isinstance(tensor, torch.Tensor) or len(records) != 1:
            return None
        layout = (records[0], tensor.dtype, tuple(tensor.shape), tensor.is_contiguous(), tensor.storage_offset())
        if len(_META_LAYOUTS) < MAX_TORCH_LAYOUTS:
            _META_LAYOUTS[pickled] = layout
    record, dtype, size, contiguous, offset = layout
    if size != chunk.sizes or dtype != entry.dtype.torch:
        raise CheckpointError(entry.fqn, f"item at byte {chunk.offset}: torch decodes it as another tensor than "
                                         "the metadata names")
    if not contiguous:
        return None
    start = reader.get_record_offset(record) + offset * entry.itemsize
    if start + chunk.numel * entry.itemsize > chunk.length:
        raise ValueError("record runs past the item")
    return chunk.offset + start


def _safetensors_start(handle: ReadHandle, at: int, name: str, path: Path) -> tuple[int, dict]:
    """(where tensor `name`'s data starts, its header entry) in the safetensors blob at byte `at`,
    as the header says, the range checked against the file."""
    bad = CheckpointError(path, f"blob at byte {at}: no safetensors record of {name} to verify against")
    try:
        header, data = blob_header(handle, at)
        info = header[name]
        start, end = (int(v) for v in info["data_offsets"])
    except (ValueError, KeyError, TypeError, RecursionError):
        raise bad from None
    if not 0 <= start <= end or data + end > handle.size:
        raise bad
    return data + start, info


def _safetensors_record_start(handle: ReadHandle, chunk: Chunk, entry: TensorEntry, path: Path) -> int:
    """A SAFETENSORS-format item (its offset is its blob's start): where its record's data starts."""
    start, info = _safetensors_start(handle, chunk.offset, entry.fqn, path)
    if BY_SAFETENSORS.get(info["dtype"]) != entry.dtype or tuple(info["shape"]) != chunk.sizes:
        raise CheckpointError(path, f"item at byte {chunk.offset}: {entry.fqn}: its safetensors record is another "
                                    "tensor than the metadata names")
    return start


def _safetensors_folder_rows(path: Path, entry: TensorEntry, chunk: Chunk) -> int:
    """A safetensors model file's tensor: where the rows `chunk` covers start."""
    with store_for(path).open_read(path) as handle:
        start, info = _safetensors_start(handle, 0, entry.stored_name, path)
    if BY_SAFETENSORS.get(info["dtype"]) != entry.dtype or tuple(info["shape"]) != entry.shape:
        raise CheckpointError(path, f"{entry.fqn}: its header names another tensor than the checkpoint's")
    return start + (chunk.offsets[0] * math.prod(entry.shape[1:]) * entry.itemsize if entry.shape else 0)


# --------------------------------------------------------------------------------------
# A written safetensors file, read back through safetensors' own lazy reader
# --------------------------------------------------------------------------------------


REOPEN_BYTES = 64 << 20
"""`--verify` reopens a safetensors file after reading this much of it through its memory map."""


class _Reader:
    """safetensors' lazy reader, reopened after every REOPEN_BYTES read (its memory map's touched
    pages count as resident until the file is closed, so this bounds verification memory)."""

    def __init__(self, path: Path) -> None:
        from safetensors import safe_open

        self._open = lambda: safe_open(str(path), framework="pt")
        self._handle = None
        self._mapped = 0

    def get(self, nbytes: int):
        if self._handle is None or (self._mapped and self._mapped + nbytes > REOPEN_BYTES):
            self.close()
            self._handle = self._open().__enter__()
        self._mapped += nbytes
        return self._handle

    def close(self) -> None:
        if self._handle is not None:
            self._handle.__exit__(None, None, None)
            self._handle, self._mapped = None, 0


def verify_safetensors_file(path: Path, file: SafetensorsFile, targets: Mapping[str, TargetTensor],
                sources: Mapping[str, SourceTensor], chunks: ChunkSource, workers: int = 1,
                advance: Advance | None = None) -> int:
    """Re-read every tensor of a written file in row blocks and compare bytes with the source assembly.

    Tensors are dealt round-robin to `workers` threads, each with its own reader; `advance`
    counts each checked tensor's bytes. Returns the number of tensors checked; raises
    CheckpointError at the first difference.
    """
    names = list(file.offsets)

    def check(group: list[str]) -> None:
        reader = _Reader(path)
        try:
            for name in group:
                _verify_tensor(path, reader, targets[name], sources, chunks)
                if advance is not None:
                    advance(targets[name].nbytes)
        finally:
            reader.close()

    reader = _Reader(path)
    try:
        head = reader.get(0)
        if (head.metadata() or {}).get("format") != "pt":
            raise CheckpointError(path, "header metadata lacks format=pt")
        if sorted(head.keys()) != sorted(names):
            raise CheckpointError(path, "holds other tensors than planned")
        reader.close()
        groups = [names[k::workers] for k in range(max(1, workers))]
        run_on_threads([g for g in groups if g], check, workers, "ckptctl-verify")
    except CheckpointError:
        raise
    except Exception as exc:  # safetensors raises its own error types for unreadable files
        raise CheckpointError(path, f"cannot re-read for verification ({type(exc).__name__}: {exc})") from exc
    finally:
        reader.close()
    return len(names)


def _verify_tensor(path: Path, reader: _Reader, target: TargetTensor, sources: Mapping[str, SourceTensor],
                   chunks: ChunkSource) -> None:
    name = target.fqn
    shape = tuple(reader.get(0).get_slice(name).get_shape())
    if shape != target.shape:
        raise CheckpointError(path, f"{name}: shape {list(shape)} instead of {list(target.shape)}")
    if isinstance(target.properties, Fp8Scales):  # compared with its codes, band by band
        return
    if isinstance(target.properties, Fp8Codes):
        _verify_fp8(path, reader, target, sources, chunks)
        return
    for box in item_boxes(target.shape, target.dtype.itemsize, VERIFY_BLOCK_BYTES):
        if stopping():
            raise Stopped
        want = assemble_bytes(StreamItem("", 0, b"", target, box, plan_box(target, box, sources)), chunks)
        handle = reader.get(len(want))
        got = handle.get_tensor(name) if not target.shape else \
            handle.get_slice(name)[box.offsets[0]: box.offsets[0] + box.sizes[0]]
        if got.dtype != target.dtype or tuple(got.shape) != box.sizes or want != _row_major_view(got):
            raise CheckpointError(path, f"{name}: verification failed (rows from {box.offsets[:1]} "
                                        f"differ from the source)")


def _verify_fp8(path: Path, reader: _Reader, target: TargetTensor, sources: Mapping[str, SourceTensor],
                chunks: ChunkSource) -> None:
    """A quantized weight's codes and its scales, read back band by band, against the source's
    rows quantized again (`quantized_output.requantized`): FP8's exactness is its bytes."""
    props = target.properties
    block = props.block[0]
    step = band_rows(*target.shape, block, VERIFY_BLOCK_BYTES) // block
    for first in range(0, -(-target.shape[0] // block), step):
        if stopping():
            raise Stopped
        stop = min(-(-target.shape[0] // block), first + step)
        codes, scale = requantized(target, first, stop, sources, chunks)
        handle = reader.get(codes.numel() + scale.numel() * 4)
        got = handle.get_slice(target.fqn)[first * block:min(target.shape[0], stop * block)]
        got_scale = handle.get_slice(props.scale)[first:stop]
        if got.dtype != codes.dtype or bytes(_row_major_view(got)) != bytes(_row_major_view(codes)):
            raise CheckpointError(path, f"{target.fqn}: verification failed (FP8 codes of rows from "
                                        f"{first * block} differ from the source's, quantized again)")
        if bytes(_row_major_view(got_scale)) != scale_bytes(scale, props.scale_dtype):
            raise CheckpointError(path, f"{props.scale}: verification failed (scales of block rows from {first} "
                                        "differ from the source's, quantized again)")


def _row_major_view(t: Any) -> memoryview:
    """The tensor's row-major bytes as a view (compared in place with the assembled box, not copied)."""
    import torch

    return memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())
