"""Execute a copy plan on a CUDA device: the same plan and outputs as the CPU engine, GPU arithmetic.

Each output record is streamed in blocks, as on the CPU. For a block, the source spans
it needs are read from disk into a pinned host buffer, copied to the device, assembled
there (runs placed, dtype casts, the target's `add`), copied back into pinned memory, and
written from it; the record's CRC-32 is computed on those pinned bytes, exactly the bytes
written. Every worker thread drives two slots (pinned + device buffers, its own CUDA
stream), so while block k's copies and kernels run, the thread writes block k-1 and reads
block k+1: disk reads, host↔device copies and writes overlap.

Blocks that need no arithmetic (no cast, no add) gain nothing from a round trip through
the device; with `identity_on_gpu=False` they are assembled straight into the pinned
output buffer by positioned reads instead.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import torch

from ckptctl.engine.cast import add_into, cast_into
from ckptctl.engine.crc import crc32
from ckptctl.engine.cpu import (
    ChunkSource,
    OutputFiles,
    _clip,
    _fill_or_zero,
    _Segment,
    _segments,
    adds_before_cast,
    block_elements,
    copy_item,
    interleaved_by_file,
    is_complete,
    read_spans,
    run_on_threads,
    transposed_reads,
)
from ckptctl.core.plan import CopyItem, StreamItem

ALIGN = 64
BLOCK_BYTES = 16 << 20
"""Bytes per pinned staging block: a GPU copy has a fixed launch cost, so blocks are big (the CPU engine's are small)."""


@dataclass
class _Span:
    """Source elements [start, stop) of one chunk, staged at byte `at` of the slot's input buffer."""

    segs: list[_Segment]
    start: int
    stop: int
    at: int


def _spans(segs: list[_Segment]) -> tuple[list[_Span], int]:
    """Group a block's segments into spans read with one positioned read each; returns spans and staged bytes."""
    spans: list[_Span] = []
    at = 0
    for run, start, stop in read_spans(segs, BLOCK_BYTES):
        spans.append(_Span(run, start, stop, at))
        at += -(-(stop - start) * run[0].read.dtype.itemsize // ALIGN) * ALIGN
    return spans, at


class _CudaRuntime:
    """Every CUDA runtime call the pipeline makes, in one place (tests drive the pipeline on a host stand-in)."""

    def stream(self, device: torch.device) -> torch.cuda.Stream:
        return torch.cuda.Stream(device)

    def event(self) -> torch.cuda.Event:
        return torch.cuda.Event()

    def use_stream(self, stream: torch.cuda.Stream):
        return torch.cuda.stream(stream)

    def use_device(self, device: torch.device):
        return torch.cuda.device(device)

    def pinned(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


RUNTIME = _CudaRuntime()


def _pinned(n: int) -> torch.Tensor:
    return RUNTIME.pinned(max(n, ALIGN))


class _Slot:
    """One in-flight block: pinned and device buffers, a stream, and what is left to write."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = RUNTIME.stream(device)
        self.done = RUNTIME.event()
        self.pin_in = _pinned(0)
        self.pin_out = _pinned(0)
        self.dev_in = torch.empty(0, dtype=torch.uint8, device=device)
        self.dev_out = torch.empty(0, dtype=torch.uint8, device=device)
        self.write: tuple[int, int] | None = None  # (file position, bytes) of pin_out awaiting its write

    def reserve(self, staged: int, out_bytes: int) -> None:
        """Grow the buffers (only when idle: callers wait on `done` first)."""
        if self.pin_in.numel() < staged:
            self.pin_in = _pinned(staged)
        if self.pin_out.numel() < out_bytes:
            self.pin_out = _pinned(out_bytes)
        with RUNTIME.use_stream(self.stream):
            if self.dev_in.numel() < staged:
                self.dev_in = torch.empty(staged, dtype=torch.uint8, device=self.device)
            if self.dev_out.numel() < out_bytes:
                self.dev_out = torch.empty(out_bytes, dtype=torch.uint8, device=self.device)


class _Worker:
    """A thread's pipeline: two slots used in turn, so one block's device work overlaps the next block's I/O."""

    def __init__(self, device: torch.device, identity_on_gpu: bool) -> None:
        self.device = device
        self.identity_on_gpu = identity_on_gpu
        with RUNTIME.use_device(device):
            self.slots = (_Slot(device), _Slot(device))

    def stream_item(self, item: StreamItem, sources: ChunkSource, files: OutputFiles,
                    progress: Callable[[int], None]) -> int:
        """Write one record; returns the CRC-32 of its data (as the CPU engine's `stream_item`)."""
        with RUNTIME.use_device(self.device):
            return self._stream(item, sources, files, progress)

    def _stream(self, item: StreamItem, sources: ChunkSource, files: OutputFiles,
                progress: Callable[[int], None]) -> int:
        files.write(item.file, item.head, item.offset)
        dtype = item.target.dtype
        numel = item.box.numel
        block = block_elements(item, BLOCK_BYTES)
        segs = _segments(item)
        pos = item.offset + len(item.head)
        crc, resume, k = 0, 0, 0
        pending: _Slot | None = None
        transposed = transposed_reads(item)  # gathered on the host, as by the CPU engine
        complete = is_complete(item, transposed)
        gpu = not transposed and (self.identity_on_gpu or bool(item.target.add)
                                  or any(r.dtype != dtype for r in item.reads))
        try:
            for b0 in range(0, numel, block):
                b1 = min(numel, b0 + block)
                slot = self.slots[k % 2]
                k += 1
                slot.done.synchronize()
                clipped, resume = _clip(segs, b0, b1, resume)
                nbytes = (b1 - b0) * dtype.itemsize
                if gpu:
                    self._launch(slot, item, sources, clipped, b0, b1)
                else:
                    slot.reserve(0, nbytes)
                    _fill_or_zero(sources, memoryview(slot.pin_out.numpy())[:nbytes], item, b0, clipped, transposed,
                                  complete)
                    slot.done.record(slot.stream)
                slot.write = (pos, nbytes)
                pos += nbytes
                if pending is not None:
                    crc = self._flush(pending, item, files, crc, progress)
                pending = slot
            if pending is not None:
                crc = self._flush(pending, item, files, crc, progress)
                pending = None
        finally:
            for slot in self.slots:
                slot.done.synchronize()
                slot.write = None
        if item.tail is not None:
            files.write(item.file, item.tail(crc), pos)
        return crc

    def _launch(self, slot: _Slot, item: StreamItem, sources: ChunkSource, segs: list[_Segment], b0: int, b1: int) -> None:
        """Stage the block's source spans in pinned memory and queue its device work on the slot's stream."""
        dtype = item.target.dtype
        nbytes = (b1 - b0) * dtype.itemsize
        spans, staged = _spans(segs)
        slot.reserve(staged, nbytes)
        host = memoryview(slot.pin_in.numpy())
        for span in spans:
            read = span.segs[0].read
            isz = read.dtype.itemsize
            sources.read_into(read.fqn, read.chunk, span.start * isz,
                              host[span.at: span.at + (span.stop - span.start) * isz])
        with RUNTIME.use_stream(slot.stream):
            if staged:
                slot.dev_in[:staged].copy_(slot.pin_in[:staged], non_blocking=True)
            out = slot.dev_out[:nbytes].view(dtype.torch)
            if sum(s.length for s in segs) < b1 - b0:
                out.zero_()  # elements no source covers (--allow-incomplete) are zero, as on the CPU
            for span in spans:
                read = span.segs[0].read
                isz = read.dtype.itemsize
                src = slot.dev_in[span.at: span.at + (span.stop - span.start) * isz].view(read.dtype.torch)
                add = item.target.add
                if read.dtype != dtype:  # cast the span once (with any add), then place its runs with plain copies
                    before = add and adds_before_cast(read.dtype, dtype)
                    converted = torch.empty(src.numel(), dtype=dtype.torch, device=self.device)
                    cast_into(converted, src + add if before else src)
                    if add and not before:
                        add_into(converted, add)
                    src = converted
                elif add:
                    add_into(src, add)  # the span's own staging slice
                for s in span.segs:
                    out[s.dst - b0: s.dst - b0 + s.length].copy_(src[s.src - span.start: s.src - span.start + s.length])
            slot.pin_out[:nbytes].copy_(slot.dev_out[:nbytes], non_blocking=True)
            slot.done.record(slot.stream)

    @staticmethod
    def _flush(slot: _Slot, item: StreamItem, files: OutputFiles, crc: int, progress: Callable[[int], None]) -> int:
        """Wait for the slot's block to land in pinned memory, then CRC and write exactly those bytes."""
        slot.done.synchronize()
        pos, nbytes = slot.write
        view = memoryview(slot.pin_out.numpy())[:nbytes]
        if item.tail is not None:  # as on the CPU: raw (safetensors) records carry no CRC
            crc = crc32(view, crc)
        files.write(item.file, view, pos)
        slot.write = None
        progress(nbytes)
        return crc


def default_device(local_rank: int = 0) -> torch.device:
    """This worker's GPU: LOCAL_RANK modulo the visible devices."""
    return torch.device("cuda", local_rank % max(1, torch.cuda.device_count()))


def execute(
    stream_items: Sequence[StreamItem],
    copy_items: Iterable[CopyItem],
    sources: ChunkSource,
    files: OutputFiles,
    workers: int,
    progress: Callable[[int], None],
    *,
    device: torch.device | str | None = None,
    identity_on_gpu: bool = True,
) -> None:
    """Run every item on `workers` threads, each with its own CUDA streams; the first failure is raised.

    Same contract as `ckptctl.engine.cpu.execute`; output files are byte-identical to it.
    """
    dev = torch.device(device) if device is not None else default_device()
    for item in copy_items:
        copy_item(item, sources, files, progress)
    order = interleaved_by_file(stream_items)
    local = threading.local()

    def run(item: StreamItem) -> int:
        if not hasattr(local, "worker"):
            local.worker = _Worker(dev, identity_on_gpu)
        return local.worker.stream_item(item, sources, files, progress)

    run_on_threads(order, run, workers, "ckptctl-cuda")
