"""Execute a copy plan with CPU threads: positioned reads, optional casts, CRC, positioned writes.

Each output record is streamed in bounded blocks in destination order, so a record of
any size costs one block of memory per worker, and the CRC-32 a torch.save archive needs
is computed on the way. Runs from one source chunk that lie close together are fetched
with one read. Reads, CRC and writes release the GIL, so a small thread pool keeps the
disk busy; records are independent, so workers take them in any order. Copies without a
cast are plain byte moves; torch is imported only to cast or add.
"""

from __future__ import annotations

import contextlib
import math
import struct
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence, TypeVar

from ckptctl.core.dtypes import DType, float32
from ckptctl.engine.crc import crc32
from ckptctl.util.errors import CastOverflowError, CheckpointError, OutputError, UsageError
from ckptctl.formats.dcp.items import ItemReader, RawRecord
from ckptctl.storage.store import WriteHandle, store_for
from ckptctl.formats.safetensors.quantized import DEQUANT, dequantized_chunk, dequantized_into
from ckptctl.formats.safetensors.quantize_fp8 import Fp8Codes, quantize_fp8, scale_bytes, stored_scales
from ckptctl.formats.safetensors.writer import item_boxes
from ckptctl.core.geometry import Box, flat_boxes, strides, transposed_order, transposed_source
from ckptctl.core.checkpoint import Checkpoint, Chunk
from ckptctl.core.plan import (CopyItem, LowRank, SourceRead, SourceTensor, StreamItem, TargetTensor, TransposedRead, missing_elements,
                          plan_box)

T = TypeVar("T")

BLOCK_BYTES = 256 << 10
"""A record is streamed through a block this small so the block stays in the core's L2 cache.

Each byte is read into the block, checksummed and written out from it; with a cache-resident
block those passes do not touch main memory, so the copy costs what `cp`'s in-kernel copy
costs. Measured on the 2.2 GB bench reshard (2 workers, alternating runs): 16 MB blocks
1.9 s median, 256 KB blocks 0.59 s; 128 KB pays more Python per byte, 512 KB+ spill the
cache. Memory-bandwidth contention on a shared host is what the big blocks were exposed to.
"""
TRANSPOSE_BLOCK_BYTES = 16 << 20
"""A record with transposed pieces is streamed in blocks this large. A block of output rows
reads a tile of source columns, one run per source row, so the runs grow with the block: a
256 KB block of a bf16 [768, 2048] expert transposed would read runs of 64 elements."""
TILE_SPAN_BYTES = 32 << 20
"""A transposed tile is fetched with one read of the chunk bytes it spans when they are at
most this many (bounded memory); a wider tile is halved along its first dim until it fits."""
STRIPE_BYTES = 64
"""A cache line: the width of each stripe of a transposed copy (`_striped_copy`)."""
ASSEMBLE_BYTES = 16 << 20
"""Verification assembles and compares boxes of about this size: fewer boxes, less planning per byte."""
GAP_BYTES = 256 << 10
DEQUANT_BLOCK_BYTES = 1 << 20
"""A record of dequantized chunks is streamed in blocks this large, each decoded straight into its
block: a decode's fixed costs (its scale rows read, a dozen torch calls) are paid per block, and the
block, its codes and their widened values (7 bytes a value) should stay near the core. Measured on
the bench's FP8 import (2.1 GB FP8 → 4.3 GB bf16, 2 workers, CPU seconds user + system): 256 KiB
3.8 + 1.6, 512 KiB 3.2 + 1.3, 1 MiB 2.9 + 1.3, 2 MiB 3.2 + 3.5 (the writes from a block that has
left the cache)."""
DECODED_CACHE_BYTES = 256 << 20
RECORDS_REMEMBERED = 1 << 16
COALESCE_BYTES = 1 << 20
"""Small records that follow one another in a file are written together, up to this many bytes."""
WRITEBACK_BYTES = 4 << 20
"""A thread's run of writes to a file is handed to the disk in pieces this large (see `storage.local_disk`)."""


class ChunkSource:
    """Serves element ranges of source chunks: positioned reads, or decoded items for transformed ones."""

    def __init__(self, ckpt: Checkpoint) -> None:
        self.ckpt = ckpt
        self.reader = ItemReader(ckpt)
        self._records: dict[tuple[str, str, int], RawRecord | None] = {}
        """(fqn, file, offset) → where the chunk's bytes are: the fqn too, since a SAFETENSORS-format
        DCP records every tensor of a file at the same offset (its blob's start)."""
        self._decoded: dict[tuple[str, str, int], memoryview] = {}
        """Chunks decoded lately: views of the decoded tensors' own bytes (a copy costs a fifth of a decode)."""
        self._decoded_bytes = 0
        self._lock = threading.Lock()

    def close(self) -> None:
        self.reader.close()

    def record(self, fqn: str, chunk: Chunk) -> RawRecord | None:
        """Where the chunk's bytes are; remembered for the chunks read lately (a record's blocks,
        neighbouring records), not for all: a checkpoint may have millions."""
        key = (fqn, chunk.file, chunk.offset)
        try:
            return self._records[key]
        except KeyError:
            pass
        record = self.reader.locate(self.ckpt.tensors[fqn], chunk)
        if len(self._records) >= RECORDS_REMEMBERED:
            self._records.clear()
        self._records[key] = record
        return record

    def decoded(self, fqn: str, chunk: Chunk) -> memoryview:
        key = (fqn, chunk.file, chunk.offset)
        with self._lock:
            data = self._decoded.get(key)
        if data is None:
            import torch  # decoding a transformed (zstd) item goes through torch.load

            entry = self.ckpt.tensors[fqn]
            tensor = (dequantized_chunk(entry, chunk, self.reader.handle) if DEQUANT in chunk.transforms
                      else self.reader.read_chunk(entry, chunk))
            flat = tensor.reshape(-1).view(torch.uint8)
            owned = flat.untyped_storage().nbytes() == flat.numel()  # keeps alive no more than it counts
            data = memoryview(flat.numpy() if owned else flat.numpy().tobytes())
            with self._lock:
                if self._decoded_bytes + len(data) > DECODED_CACHE_BYTES:
                    self._decoded.clear()
                    self._decoded_bytes = 0
                self._decoded[key] = data
                self._decoded_bytes += len(data)
        return memoryview(data)

    def float8_scale(self, fqn: str, chunk: Chunk) -> bytes | None:
        """The scale_inv (four bytes) of a chunk read as a TE Float8Tensor item; None for any other."""
        return self.reader.located_scale(chunk)

    def read_into(self, fqn: str, chunk: Chunk, byte_start: int, out: memoryview) -> None:
        """Fill `out` with the chunk's bytes starting at `byte_start` (relative to element 0)."""
        if DEQUANT in chunk.transforms and dequantized_into(self.ckpt.tensors[fqn], chunk, byte_start, out,
                                                            self.reader.handle):
            return  # an FP8 weight's rows, decoded into place
        if (fqn, chunk.file, chunk.offset) not in self._records:  # a small item like a validated one: one read
            data = self.reader.small_data(self.ckpt.tensors[fqn], chunk)
            if data is not None:
                out[:] = data[byte_start:byte_start + len(out)]
                return
        rec = self.record(fqn, chunk)
        if rec is None:
            out[:] = self.decoded(fqn, chunk)[byte_start: byte_start + len(out)]
            return
        try:
            got = self.reader.handle(chunk.file).readinto_at(out, rec.byte_offset + byte_start)
        except OSError as exc:
            raise CheckpointError(rec.path, f"cannot read at byte {rec.byte_offset + byte_start}: "
                                            f"{exc.strerror or exc}") from None
        if got != len(out):
            raise CheckpointError(rec.path, f"short read at byte {rec.byte_offset + byte_start}")


@dataclass
class _Segment:
    read: SourceRead
    src: int
    dst: int
    length: int


def _segments(item: StreamItem) -> list[_Segment]:
    segs = [_Segment(read, r.src, r.dst, r.length) for read in item.reads if isinstance(read, SourceRead)
            for r in read.runs]
    segs.sort(key=lambda s: s.dst)
    return segs


def transposed_reads(item: StreamItem) -> list[TransposedRead]:
    return [read for read in item.reads if isinstance(read, TransposedRead)]


def is_complete(item: StreamItem, transposed: list[TransposedRead]) -> bool:
    """Whether a record's reads cover all of it; asked once per record that has transposed reads
    (the plain ones are counted per block, from their runs)."""
    return not transposed or not missing_elements(item.box, item.reads)


def read_spans(segs: list[_Segment], max_bytes: int | None = None) -> Iterator[tuple[list[_Segment], int, int]]:
    """Segments grouped by source chunk into spans close enough to fetch with one read: (segments, start, stop).

    A span covers at most `max_bytes` (default BLOCK_BYTES) of its source.
    """
    cap = BLOCK_BYTES if max_bytes is None else max_bytes
    by_chunk: dict[tuple[str, str, int], list[_Segment]] = {}
    for s in segs:
        by_chunk.setdefault((s.read.fqn, s.read.chunk.file, s.read.chunk.offset), []).append(s)
    for group in by_chunk.values():
        isz = group[0].read.dtype.itemsize
        group.sort(key=lambda s: s.src)
        i = 0
        while i < len(group):
            j, stop = i + 1, group[i].src + group[i].length
            while j < len(group) and (group[j].src - stop) * isz <= GAP_BYTES \
                    and (group[j].src + group[j].length - group[i].src) * isz <= cap:
                stop = max(stop, group[j].src + group[j].length)
                j += 1
            yield group[i:j], group[i].src, stop
            i = j


def adds_before_cast(src: DType, dtype: DType) -> bool:
    """A target's `add` is computed in the wider dtype: before a narrowing cast, after a widening one.

    So an export of fp32 gamma to bf16 writes bf16(gamma + 1), not bf16(gamma) + 1 (an ulp off).
    """
    return src.itemsize >= dtype.itemsize


def _fill_block(sources: ChunkSource, out: memoryview, dtype: DType, b0: int, segs: list[_Segment],
                add: float = 0.0) -> None:
    """Assemble destination elements [b0, b0 + len(out) / itemsize) of `dtype` from the segments that overlap them.

    `add` (a target's) goes to every placed element; elements no segment covers stay as they are.
    """
    out_isz = dtype.itemsize
    for run, base, stop in read_spans(segs):
        read = run[0].read
        isz = read.dtype.itemsize
        if len(run) == 1 and read.dtype == dtype:
            s = run[0]
            placed = out[(s.dst - b0) * out_isz: (s.dst - b0 + s.length) * out_isz]
            sources.read_into(read.fqn, read.chunk, s.src * isz, placed)
            if add:
                _add(placed, dtype, add)
            continue
        tmp = memoryview(_thread_buffer("span", (stop - base) * isz))[: (stop - base) * isz]
        sources.read_into(read.fqn, read.chunk, base * isz, tmp)
        if read.dtype != dtype:
            _cast_run(out, dtype, b0, tmp, read.dtype, base, run, add)
            continue
        for s in run:
            placed = out[(s.dst - b0) * isz: (s.dst - b0 + s.length) * isz]
            placed[:] = tmp[(s.src - base) * isz: (s.src - base + s.length) * isz]
            if add:
                _add(placed, dtype, add)


def _as_tensor(data: memoryview, dtype: DType) -> Any:
    import torch

    return torch.frombuffer(data, dtype=dtype.torch)


def _cast_run(out: memoryview, dtype: DType, b0: int, tmp: memoryview, src_dtype: DType, base: int,
              run: list[_Segment], add: float) -> None:
    """Cast each segment of a span read into `tmp` to its place in `out`, with `add` (the only path that needs torch)."""
    from ckptctl.engine.cast import add_into, cast_into

    out_t, src_t = _as_tensor(out, dtype), _as_tensor(tmp, src_dtype)
    before = add and adds_before_cast(src_dtype, dtype)
    for s in run:
        placed, src = out_t[s.dst - b0: s.dst - b0 + s.length], src_t[s.src - base: s.src - base + s.length]
        cast_into(placed, src + add if before else src)
        if add and not before:
            add_into(placed, add)


def fill_transposed(sources: ChunkSource, out: memoryview, dtype: DType, b0: int, shape: tuple[int, ...],
                    reads: Sequence[TransposedRead], add: float = 0.0) -> None:
    """Place the share of each transposed read in destination elements [b0, b0 + len(out) / itemsize)
    of an output box of `shape`: the block's boxes (`flat_boxes`) of the read's frame (the box,
    or a block of the target's logical shape), each met by the read, gathered tile by tile."""
    if not reads or not len(out):
        return
    out_t = _as_tensor(out, dtype)
    b1 = b0 + len(out) // dtype.itemsize
    tiled: dict[tuple[tuple[int, ...], int], list[Box]] = {}  # the block's boxes of each frame, found once
    for read in reads:
        frame, base = read.frame or (shape, 0)
        subs = tiled.get((frame, base))
        if subs is None:
            lo, hi = max(b0, base), min(b1, base + math.prod(frame))
            subs = tiled[frame, base] = [sub for _, sub in flat_boxes(frame, lo - base, hi - base)] if lo < hi else []
        steps = strides(frame)
        for sub in subs:
            dst = sub.intersect(read.dst)
            if dst is not None and dst.numel:
                src = transposed_source(dst, read.axes, read.dst.offsets, read.src.offsets, len(read.chunk_sizes))
                _place_tile(sources, read, src, dst, out_t, dtype, steps, b0 - base, add)


def _place_tile(sources: ChunkSource, read: TransposedRead, src: Box, dst: Box, out: Any, dtype: DType,
                steps: tuple[int, ...], b0: int, add: float) -> None:
    """Read chunk block `src` with one read of the bytes it spans and place it, dims reordered, at `dst`."""
    import torch

    from ckptctl.engine.cast import add_into, cast_into

    chunk_steps = strides(read.chunk_sizes)
    first = read.chunk_offset + sum(o * st for o, st in zip(src.offsets, chunk_steps))
    stop = read.chunk_offset + sum((o + n - 1) * st for o, n, st in zip(src.offsets, src.sizes, chunk_steps)) + 1
    isz = read.dtype.itemsize
    if (stop - first) * isz > TILE_SPAN_BYTES:
        k = next(i for i, n in enumerate(src.sizes) if n > 1)
        j = read.axes.index(k)
        for lo, n in ((0, src.sizes[k] // 2), (src.sizes[k] // 2, src.sizes[k] - src.sizes[k] // 2)):
            part = Box(_at(src.offsets, k, src.offsets[k] + lo), _at(src.sizes, k, n))
            placed = Box(_at(dst.offsets, j, dst.offsets[j] + lo), _at(dst.sizes, j, n))
            _place_tile(sources, read, part, placed, out, dtype, steps, b0, add)
        return
    span = memoryview(_thread_buffer("span", (stop - first) * isz))[: (stop - first) * isz]
    sources.read_into(read.fqn, read.chunk, first * isz, span)
    tile = _as_tensor(span, read.dtype).as_strided(src.sizes, chunk_steps)
    arranged = tile.permute(transposed_order(read.axes, len(src.sizes))).reshape(dst.sizes)
    placed = out.as_strided(dst.sizes, steps, sum(o * st for o, st in zip(dst.offsets, steps)) - b0)
    if read.dtype == dtype and not add:
        _striped_copy(placed, arranged)
        return
    gathered = torch.empty(dst.sizes, dtype=read.dtype.torch)
    _striped_copy(gathered, arranged)
    converted = torch.empty(dst.sizes, dtype=dtype.torch)
    before = add and adds_before_cast(read.dtype, dtype)
    cast_into(converted, gathered + add if before else gathered)
    if add and not before:
        add_into(converted, add)
    placed.copy_(converted)


def _striped_copy(out: Any, src: Any) -> None:
    """`out.copy_(src)` for a transposed `src`, in stripes of the last dim one cache line wide.

    torch walks a transposed copy element by element along the output's rows, touching a new
    source cache line for each; a stripe writes one cache line per output row and reads
    whole lines. Measured on a bf16 [2048, 768] transpose (one thread): 3.0 ms whole,
    1.2 ms in 32-element stripes; fp32 in 16-element stripes 9.7 → 3.1 ms.
    """
    if not src.dim() or src.stride(-1) == 1:
        out.copy_(src)
        return
    width = max(1, STRIPE_BYTES // src.element_size())
    for k in range(0, src.shape[-1], width):
        out[..., k:k + width].copy_(src[..., k:k + width])


def _at(values: tuple[int, ...], k: int, value: int) -> tuple[int, ...]:
    return values[:k] + (value,) + values[k + 1:]


def _add(out: memoryview, dtype: DType, value: float) -> None:
    from ckptctl.engine.cast import add_into

    if len(out):
        add_into(_as_tensor(out, dtype), value)


def _clip(segs: list[_Segment], lo: int, hi: int, start: int) -> tuple[list[_Segment], int]:
    """Segments overlapping [lo, hi), clipped; `start` is the index to resume scanning from."""
    out = []
    k = start
    while k < len(segs) and segs[k].dst + segs[k].length <= lo:
        k += 1
    m = k
    while m < len(segs) and segs[m].dst < hi:
        s = segs[m]
        a, b = max(s.dst, lo), min(s.dst + s.length, hi)
        out.append(_Segment(s.read, s.src + (a - s.dst), a, b - a))
        m += 1
    return out, k


class OutputFiles:
    """Output files created once through the directory's store, pre-sized, shared by all workers
    (positioned writes through each handle's writer, taken once).

    With `sync` (the default) `close` fsyncs, and writeback starts early: each thread's
    sequential run of writes to a file is handed to the disk every WRITEBACK_BYTES, while
    the run goes on (a record is written front to back by one thread, in small blocks).
    """

    def __init__(self, directory: Path, sizes: Mapping[str, int], sync: bool = True) -> None:
        self.directory = directory
        self.sync = sync
        self.handles: dict[str, WriteHandle] = {}
        self.writers: dict[str, Callable[[bytes | memoryview, int], int]] = {}
        self._runs = threading.local()  # per thread: file -> [start, end) written but not yet handed over
        store = store_for(directory)
        for name, size in sizes.items():
            try:
                self.handles[name] = handle = store.create(directory / name)
                self.writers[name] = handle.positioned_writer()
                handle.reserve(size)
            except OSError as exc:
                for handle in self.handles.values():
                    handle.close()
                raise self.error(name, exc) from None

    def error(self, name: str, exc: OSError) -> OutputError:
        """An OS error on an output file as the one-line error that names it (a full disk, say)."""
        return OutputError(self.directory / name, f"cannot write: {exc.strerror or exc}")

    def write(self, name: str, data: bytes | memoryview, offset: int) -> None:
        view = memoryview(data)
        start = offset
        try:
            while len(view):
                n = self.writers[name](view, offset)
                view, offset = view[n:], offset + n
        except OSError as exc:
            raise self.error(name, exc) from None
        self.wrote(name, start, offset - start)

    def wrote(self, name: str, offset: int, nbytes: int) -> None:
        """Note `nbytes` at `offset` just written to `name` (by `write`, or by an in-kernel copy)."""
        if not self.sync:
            return
        runs = getattr(self._runs, "by_file", None)
        if runs is None:
            runs = self._runs.by_file = {}
        start, end = runs.get(name, (offset, offset))
        if end != offset:  # not a continuation: a new run
            start = offset
        end = offset + nbytes
        if end - start >= WRITEBACK_BYTES:
            self.handles[name].start_writeback(start, end - start)
            start = end
        runs[name] = (start, end)

    def close(self) -> None:
        """fsync (with `sync`) and close every file; all are closed even when one fails."""
        handles, self.handles, self.writers = self.handles, {}, {}
        try:
            for name, handle in handles.items():
                if self.sync:
                    try:
                        handle.sync()
                    except OSError as exc:
                        raise self.error(name, exc) from None
        finally:
            for handle in handles.values():
                handle.close()


def reads_dequantized(item: StreamItem) -> bool:
    """Whether a record reads dequantized chunks: it is streamed in blocks of DEQUANT_BLOCK_BYTES."""
    return any(DEQUANT in read.chunk.transforms for read in item.reads if isinstance(read, SourceRead))


def block_elements(item: StreamItem, block_bytes: int | None = None) -> int:
    """Elements per block of `item`: `block_bytes` (default BLOCK_BYTES) of its widest dtype, source or target."""
    widest = max(item.target.dtype.itemsize, max((r.dtype.itemsize for r in item.reads), default=1))
    return max(1, (BLOCK_BYTES if block_bytes is None else block_bytes) // widest)


_SCRATCH = threading.local()


def _thread_buffer(use: str, nbytes: int) -> bytearray:
    """This thread's buffer for `use` ("block": a record's block; "span": a gathered or cast
    span's source bytes), at least `nbytes` long: allocated (and zero-filled) once, not per block."""
    buf = getattr(_SCRATCH, use, None)
    if buf is None or len(buf) < nbytes:
        buf = bytearray(nbytes)
        setattr(_SCRATCH, use, buf)
    return buf


def _fill_or_zero(sources: ChunkSource, out: memoryview, item: StreamItem, b0: int, segs: list[_Segment],
                  transposed: list[TransposedRead], complete: bool = True) -> None:
    """`_fill_block` and `fill_transposed` into a reused buffer: elements no read covers
    (--allow-incomplete) are zero, never what a previous record or block left there. With
    transposed reads, `complete` says whether the reads cover the whole record (`is_complete`)."""
    dtype, add = item.target.dtype, item.target.add
    try:
        if transposed:
            if not complete:
                out[:] = bytes(len(out))
            fill_transposed(sources, out, dtype, b0, item.box.sizes, transposed, add)
        elif sum(s.length for s in segs) < len(out) // dtype.itemsize:
            out[:] = bytes(len(out))
        _fill_block(sources, out, dtype, b0, segs, add)
    except CastOverflowError as exc:
        raise UsageError(f"{item.target.fqn}: {exc}") from None


def _read_direct(item: StreamItem, sources: ChunkSource, data: memoryview) -> bool:
    """Fill a small record's `data` straight from its sources when each read is one run of the
    target's dtype, with no `add`, and the runs cover the record exactly once (FSDP2 row blocks):
    one positioned read per source chunk, nothing assembled. False (nothing read) otherwise."""
    dtype = item.target.dtype
    if item.target.add:
        return False
    runs = []
    for read in item.reads:
        if not isinstance(read, SourceRead) or len(read.runs) != 1 or read.dtype != dtype:
            return False
        runs.append((read.runs[0], read))
    runs.sort(key=lambda r: r[0].dst)
    at = 0
    for run, _ in runs:
        if run.dst != at:
            return False
        at += run.length
    if at != item.box.numel:
        return False
    isz = dtype.itemsize
    for run, read in runs:
        sources.read_into(read.fqn, read.chunk, run.src * isz, data[run.dst * isz:(run.dst + run.length) * isz])
    return True


def _assemble_small(item: StreamItem, sources: ChunkSource, record: memoryview) -> int:
    """A record that fits one block assembled whole (head, data, tail) into `record`; its data's CRC-32."""
    head, nbytes = len(item.head), item.box.numel * item.target.dtype.itemsize
    record[:head] = item.head
    data = record[head:head + nbytes]
    if item.target.delta is not None:
        data[:] = merged_bytes(item, sources)
    elif not _read_direct(item, sources, data):
        transposed = transposed_reads(item)
        _fill_or_zero(sources, data, item, 0, _segments(item), transposed, is_complete(item, transposed))
    crc = 0
    if item.tail is not None:
        crc = crc32(data)
        record[head + nbytes:] = item.tail(crc)
    return crc


def _stream_small_item(item: StreamItem, sources: ChunkSource, files: OutputFiles,
                       progress: Callable[[int], None]) -> int:
    """A record that fits one block, assembled whole and written at once (one write, not three)."""
    record = memoryview(_thread_buffer("record", item.length))[:item.length]
    crc = _assemble_small(item, sources, record)
    files.write(item.file, record, item.offset)
    progress(item.nbytes)
    return crc


def _stream_merged(item: StreamItem, sources: ChunkSource, files: OutputFiles, progress: Callable[[int], None]) -> int:
    """A record of a merged target, computed whole (`merged_bytes`) and written at once."""
    data = merged_bytes(item, sources)
    at = item.offset + len(item.head)
    files.write(item.file, item.head, item.offset)
    files.write(item.file, data, at)
    crc = 0
    if item.tail is not None:
        crc = crc32(data)
        files.write(item.file, item.tail(crc), at + len(data))
    progress(item.nbytes)
    return crc


def write_small_records(items: Iterable[StreamItem], sources: ChunkSource, files: OutputFiles,
                        progress: Callable[[int], None]) -> None:
    """Records smaller than a block, each file's front to back: records that follow one another
    in a file are assembled side by side and written together, COALESCE_BYTES at a time, and
    their source items, which follow one another too in a plain reshard, are read ahead
    (`ItemReader.small_data`). A million tiny chunks: a write and a read or two per record were
    a third of the time."""
    ordered = sorted(items, key=lambda i: (i.file, i.offset))
    buf = memoryview(bytearray(min(COALESCE_BYTES, sum(i.length for i in ordered))))  # holds any one record
    file, start, used = "", 0, 0
    for item in ordered:
        size = item.length
        if item.file != file or item.offset != start + used or used + size > len(buf):
            if used:
                files.write(file, buf[:used], start)
            file, start, used = item.file, item.offset, 0
        _assemble_small(item, sources, buf[used:used + size])
        used += size
        progress(item.nbytes)
    if used:
        files.write(file, buf[:used], start)


def stream_item(item: StreamItem, sources: ChunkSource, files: OutputFiles, progress: Callable[[int], None]) -> int:
    """Write one record; returns the CRC-32 of its data (0 for raw records, which have no tail)."""
    dtype = item.target.dtype
    numel = item.box.numel
    transposed = transposed_reads(item)
    block = block_elements(item, TRANSPOSE_BLOCK_BYTES if transposed else None)
    if not transposed and reads_dequantized(item):  # whole rows: each decoded into place (`dequantized_into`)
        row = item.box.sizes[-1] if item.box.sizes else 1
        block = max(row, block_elements(item, DEQUANT_BLOCK_BYTES) // max(1, row) * row)
    if item.target.delta is not None:
        return _stream_merged(item, sources, files, progress)
    if isinstance(item.target.properties, Fp8Codes):
        return _stream_fp8(item, sources, files, progress)
    if numel <= block:
        return _stream_small_item(item, sources, files, progress)
    files.write(item.file, item.head, item.offset)
    buf = _thread_buffer("block", min(numel, block) * dtype.itemsize)
    segs = _segments(item)
    complete = is_complete(item, transposed)
    pos = item.offset + len(item.head)
    crc, resume = 0, 0
    for b0 in range(0, numel, block):
        b1 = min(numel, b0 + block)
        view = memoryview(buf)[: (b1 - b0) * dtype.itemsize]
        clipped, resume = _clip(segs, b0, b1, resume)
        _fill_or_zero(sources, view, item, b0, clipped, transposed, complete)
        if item.tail is not None:  # a torch.save record's zip tail carries the CRC; raw records need none
            crc = crc32(view, crc)
        files.write(item.file, view, pos)
        pos += len(view)
        progress(len(view))
    if item.tail is not None:
        files.write(item.file, item.tail(crc), pos)
    return crc


def copy_item(item: CopyItem, sources: ChunkSource, files: OutputFiles, progress: Callable[[int], None]) -> None:
    """Copy a byte range verbatim, in the kernel when it can (or write the item's literal `data`)."""
    if item.data is not None:
        files.write(item.file, item.data, item.offset)
        progress(len(item.data))
        return
    source, output = sources.reader.handle(item.src_file), files.handles[item.file]
    done, in_store = 0, True
    while done < item.length:
        n = 0
        if in_store:
            try:
                n = output.copy_from(source, item.length - done, item.src_offset + done, item.offset + done)
            except OSError as exc:
                raise files.error(item.file, exc) from None
            in_store = n > 0  # the store cannot (another filesystem, say): the rest by hand
        if n <= 0:
            data = source.read_at(min(BLOCK_BYTES, item.length - done), item.src_offset + done)
            if not data:
                raise CheckpointError(sources.ckpt.path / item.src_file, "short read")
            files.write(item.file, data, item.offset + done)
            n = len(data)
        else:
            files.wrote(item.file, item.offset + done, n)
        done += n
        progress(n)


def interleaved_by_file(items: Sequence[StreamItem]) -> list[StreamItem]:
    """Items round-robin across output files, each file's front to back.

    Buffered writes to one file serialize on its inode lock (ext4, xfs), so workers that
    write different files at once do not wait on each other, and each file is written
    sequentially. Measured on the 2 GB bench with 2 workers: 0.70 s instead of 0.75–1.2 s
    for largest-first order.
    """
    by_file: dict[str, list[StreamItem]] = {}
    for item in sorted(items, key=lambda i: (i.file, i.offset)):
        by_file.setdefault(item.file, []).append(item)
    queues = list(by_file.values())
    return [q[k] for k in range(max(map(len, queues), default=0)) for q in queues if k < len(q)]


def execute(
    stream_items: Iterable[StreamItem],
    copy_items: Iterable[CopyItem],
    sources: ChunkSource,
    files: OutputFiles,
    workers: int,
    progress: Callable[[int], None],
) -> None:
    """Run every item; the first failure is raised.

    Records of a block or more go to a pool of `workers` threads (in `interleaved_by_file`
    order), which spend their time in reads and writes with the GIL released. Smaller records
    cost mostly Python, which threads would only contend for: the calling thread writes those
    (`write_small_records`), while the pool works (16,000 records of 256 bytes: 2.1 s on one
    thread, 2.9 s on two).
    """
    for item in copy_items:
        copy_item(item, sources, files, progress)
    small: list[StreamItem] = []
    large: list[StreamItem] = []
    for item in stream_items:  # a quantized band writes its scales too: never coalesced with its neighbours
        (small if item.nbytes < BLOCK_BYTES and not isinstance(item.target.properties, Fp8Codes) else large
         ).append(item)
    with _torch_on_one_thread(workers > 1 and any(map(reads_dequantized, large))):
        run_on_threads(interleaved_by_file(large), lambda item: stream_item(item, sources, files, progress), workers,
                       "ckptctl", meanwhile=lambda: write_small_records(small, sources, files, progress))


@contextlib.contextmanager
def _torch_on_one_thread(wanted: bool) -> Iterator[None]:
    """Each torch operation on the calling thread alone, while `wanted`: workers that decode side
    by side already keep the cores busy, and torch's own threads would only wait for each other.
    Measured decoding the bench's FP8 folder on 2 workers, 2 cores: 0.63 s of CPU per 2.15 GB of
    bf16 instead of 0.97 s."""
    if not wanted:
        yield
        return
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


_STOPPING = threading.Event()


class Stopped(Exception):
    """Raised in a worker thread that saw `stopping()`: the run it belongs to has already failed."""


def stopping() -> bool:
    """Whether a `run_on_threads` run is stopping (a failure, or Ctrl-C): long items check it
    between blocks and raise `Stopped`, so the run ends within a block, not an item."""
    return _STOPPING.is_set()


def run_on_threads(items: Sequence[T], run: Callable[[T], object], workers: int, name: str,
                   meanwhile: Callable[[], object] | None = None) -> None:
    """`run` every item in order, on `workers` threads (inline for one), and `meanwhile` on the
    calling thread as they run; the first failure is raised.

    A failure or an interrupt (Ctrl-C) cancels the items not yet started and tells the ones in
    progress to stop (`stopping`): the run ends once they reach their next block, instead of
    working through the whole queue first.
    """
    if workers <= 1 or not items:
        if meanwhile is not None:
            meanwhile()
        for item in items:
            run(item)
        return
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name) as pool:
        futures = [pool.submit(run, item) for item in items]
        try:
            if meanwhile is not None:
                meanwhile()
            for fut in futures:
                fut.result()
        except BaseException:
            _STOPPING.set()
            try:
                pool.shutdown(wait=True, cancel_futures=True)
            finally:
                _STOPPING.clear()
            raise


def equal_tensors(chunks: ChunkSource, a: TargetTensor, b: TargetTensor, views: Mapping[str, SourceTensor],
                  block_bytes: int) -> bool:
    """Whether two targets of one shape and dtype hold the same bytes, compared row block by row
    block (`block_bytes` each), stopping at the first that differs; elements no chunk holds are
    refused, never taken for equal (a tied head checked against the tensor it is tied to)."""
    for box in item_boxes(a.shape, a.dtype.itemsize, block_bytes):
        blocks = []
        for target in (a, b):
            reads = plan_box(target, box, views)
            if missing_elements(box, reads):
                raise CheckpointError(", ".join(dict.fromkeys(p.src for p in target.pieces)),
                                      "has elements no saved chunk holds: cannot tell whether it equals the tensor "
                                      "the config ties it to")
            blocks.append(assemble_bytes(StreamItem("", 0, b"", target, box, reads), chunks))
        if blocks[0] != blocks[1]:
            return False
    return True


def assemble_bytes(item: StreamItem, sources: ChunkSource) -> bytearray:
    """The row-major bytes of `item.box` of its target (for verification): one box in memory."""
    if item.target.delta is not None:
        return merged_bytes(item, sources)
    dtype = item.target.dtype
    out = bytearray(item.box.numel * dtype.itemsize)  # zeros where no source covers (--allow-incomplete)
    _fill_block(sources, memoryview(out), dtype, 0, _segments(item), item.target.add)
    fill_transposed(sources, memoryview(out), dtype, 0, item.box.sizes, transposed_reads(item), item.target.add)
    return out


def fp8_band(item: StreamItem, sources: ChunkSource) -> tuple[Any, Any]:
    """(float8_e4m3fn codes, float32 scales) of a quantized weight's record (`Fp8Codes`): its
    rows, whole block rows, assembled as the export would write them unquantized (`Fp8Codes.values`),
    widened to float32 (exact) and quantized."""
    codes = item.target.properties
    base = replace(item.target, dtype=codes.values, properties=None)
    values = assemble_bytes(StreamItem("", 0, b"", base, item.box, item.reads), sources)
    widened = _as_tensor(memoryview(values), codes.values).view(item.box.sizes).float()
    kept = None
    if codes.kept is not None:  # like:REF: REF's scales of these block rows, kept where they code them exactly
        first = item.box.offsets[0] // codes.block[0]
        kept = stored_scales(codes.kept, first, first - (-item.box.sizes[0] // codes.block[0]))
    elif not codes.ue8m0:  # a TE Float8Tensor's scale_inv, kept (and its codes) where they code its values exactly
        kept = te_scales(item, sources, codes.block)
    out, scale = quantize_fp8(widened, codes.block, codes.ue8m0, kept, codes.values)
    bad = (~(scale.isfinite() & (scale > 0))).nonzero()
    if len(bad):  # NaN or inf in the block, or an amax below 448 × the least float32: no scale codes it
        row, col = (int(i) for i in bad[0])
        raise UsageError(f"{item.target.fqn}: its block [{item.box.offsets[0] // codes.block[0] + row}, {col}] "
                         f"({codes.block[0]}×{codes.block[1]}) has no FP8 scale (its largest magnitude gives "
                         f"{float(scale[row, col])}): a value there is not finite, or too small for a float32 scale")
    return out, scale


def te_scales(item: StreamItem, sources: Any, block: tuple[int, int]) -> Any:
    """Per block of a quantized weight's band (float32 [⌈R/bm⌉, ⌈N/bn⌉]): the scale_inv of the TE
    Float8Tensor items all its elements are read from, where they share one (NaN elsewhere); None
    when none is read from one. `quantize_fp8` keeps such a scale where it codes the block's values
    exactly: a per-tensor scale is one scale for every block, and the codes it gives back are TE's
    own (a finite e4m3 code c is the one code whose value c × s rounds to the value TE dequantizes)."""
    import torch

    rows, cols = item.box.sizes
    per = None
    for read in item.reads:
        raw = sources.float8_scale(read.fqn, read.chunk)
        if raw is None or not isinstance(read, SourceRead):  # a transposed piece of one: left NaN, quantized afresh
            continue
        if per is None:
            per = torch.full((rows * cols,), float("nan"))
        scale = struct.unpack("<f", raw)[0]
        for run in read.runs:
            per[run.dst:run.dst + run.length] = scale
    if per is None:
        return None
    (bm, bn), (gm, gn) = block, (-(-rows // block[0]), -(-cols // block[1]))
    least, most = torch.full((gm * bm, gn * bn), math.inf), torch.full((gm * bm, gn * bn), -math.inf)
    least[:rows, :cols] = most[:rows, :cols] = per.view(rows, cols)
    least, most = least.view(gm, bm, gn, bn).amin(dim=(1, 3)), most.view(gm, bm, gn, bn).amax(dim=(1, 3))
    return torch.where(least == most, least, torch.full_like(least, float("nan")))


def _stream_fp8(item: StreamItem, sources: ChunkSource, files: OutputFiles, progress: Callable[[int], None]) -> int:
    """A quantized weight's band: its codes at the record's place, its scale rows at theirs in the
    scale tensor (laid out in the same file)."""
    import torch

    props = item.target.properties
    codes, scale = fp8_band(item, sources)
    files.write(item.file, codes.view(-1).view(torch.uint8).numpy(), item.offset)
    row = scale.shape[1] * props.scale_dtype.itemsize
    data = scale_bytes(scale, props.scale_dtype)
    files.write(item.file, data, props.scale_offset + item.box.offsets[0] // props.block[0] * row)
    progress(item.nbytes + len(data))
    return 0


def merged_bytes(item: StreamItem, sources: ChunkSource) -> bytearray:
    """The bytes of `item.box` of a target with a LoRA `delta`: W + (B @ A) · scale over the whole
    tensor in float32 (`merged_whole`), the target's `blocks` of it taken (of a Megatron fused
    weight, of an expert stack whose base holds its experts one by one), cast once to the target's
    dtype. The whole result is kept per thread while boxes of it are asked for, up to the one that
    ends it (the output check's samples, `--verify`'s row blocks), so each is computed once, not
    once per box."""
    import torch

    from ckptctl.engine.cast import cast_into

    delta = item.target.delta
    kept = getattr(_SCRATCH, "merged", None)
    if kept is not None and kept[0] is delta and kept[1] is sources:
        result = kept[2]
    else:
        _SCRATCH.merged = None
        w = merged_whole(item.target.fqn, delta, sources)
        if delta.blocks is not None:  # the target's rows (q, k or v; gate or up; an expert's) of the merged weight
            whole, w = w, torch.empty(item.target.shape, dtype=torch.float32)
            for block in delta.blocks:
                w[tuple(slice(d, d + n) for d, n in zip(block.dst_start, block.sizes))] = \
                    whole[tuple(slice(s, s + n) for s, n in zip(block.src_start, block.sizes))]
            del whole
        result = w
        if item.target.dtype != float32:
            result = torch.empty(w.shape, dtype=item.target.dtype.torch)
            cast_into(result, w)
    box = item.box
    ends_it = all(o + n == size for o, n, size in zip(box.offsets, box.sizes, item.target.shape))
    _SCRATCH.merged = None if ends_it else (delta, sources, result)  # boxes are asked for in order
    part = result[tuple(slice(o, o + n) for o, n in zip(box.offsets, box.sizes))]
    return bytearray(part.contiguous().view(-1).view(torch.uint8).numpy())


WHOLES_KEPT = 2
"""Merged weights kept per thread for the targets that take blocks of one (`LowRank.blocks`): an
expert stack whose base holds its experts one by one is two stacks a layer (gate_up, down), whose
experts' tensors alternate in name order; kept, each stack is merged once a thread, not once an
expert."""


def merged_whole(fqn: str, delta: LowRank, sources: ChunkSource) -> Any:
    """W + (B @ A) · scale over the whole weight in float32 (its operands upcast exactly; of an
    expert stack, expert by expert as peft's einsum), each row then scaled by m / its L2 norm for
    DoRA. Never written to after it is returned: a whole several targets take blocks of is shared."""
    import torch

    operands = (delta.base, delta.a, delta.b)
    if delta.blocks is not None:
        for kept, kept_sources, whole in getattr(_SCRATCH, "wholes", ()):
            if kept_sources is sources and all(x is y for x, y in zip(kept, operands)):
                return whole
    w, a, b = (_as_tensor(memoryview(assemble_bytes(op, sources)), float32).view(op.box.sizes) for op in operands)
    infinite = int(w.numel() - torch.isfinite(w).sum())
    if delta.experts:  # peft's ParamWrapper: the einsum of its get_delta_weight, bit for bit
        spec = "o r e, e r i -> e i o" if delta.transposed else "o r e, e r i -> e o i"
        product = torch.einsum(spec, b.view(b.shape[0], -1, delta.experts), a.view(delta.experts, -1, a.shape[1]))
    else:
        product = torch.matmul(b, a)
    product.mul_(delta.scale)
    if delta.experts:  # W may be the stack's experts' rows one after another ([E·out, in], `per_expert_stack`)
        w.view(product.shape).add_(product)
    else:
        w.add_(product.T if delta.transposed else product)
    del product
    if delta.magnitude is not None:
        magnitude = _as_tensor(memoryview(assemble_bytes(delta.magnitude, sources)), float32)
        w.mul_((magnitude / torch.linalg.norm(w, dim=1)).view(-1, 1))
    grown = int(w.numel() - torch.isfinite(w).sum()) - infinite
    if grown > 0 and bool(torch.isfinite(a).all()) and bool(torch.isfinite(b).all()):
        raise UsageError(f"{fqn}: {grown} finite value{'s' if grown != 1 else ''} become inf or NaN when its LoRA "
                         f"adapter is merged (W + (B @ A) · {delta.scale:g} in float32): check the LoRA α")
    if delta.blocks is not None:
        others = [kept for kept in getattr(_SCRATCH, "wholes", ()) if kept[1] is sources]  # this run's only
        _SCRATCH.wholes = [(operands, sources, w), *others][:WHOLES_KEPT]
    return w
