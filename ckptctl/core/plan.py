"""Copy plans: which source elements land where in each output piece. Pure data, no I/O.

A *source tensor* is a checkpoint entry seen in its logical shape: its chunks are boxes, or
flat item ranges (an optimizer buffer saved 1-D in item coordinates; rows read as row pairs). A *target
tensor* is an output tensor defined by pieces, each a translated block of one source
(identity for a reshard; row blocks of a fused tensor for a split; per-group rows for an
HF export), or a transposed one (its dims reordered: Automodel's grouped experts, RoPE row
pairs). For any output box, `plan_box` lists the contiguous element runs to copy from each
source chunk, and each transposed block to gather — the engines only execute these lists.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import math
import operator
from array import array
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

from ckptctl.core.dtypes import DType, as_dtype
from ckptctl.util.errors import CheckpointError, IncompleteCheckpointError
from ckptctl.util.gc_pause import gc_paused
from ckptctl.core.geometry import (Box, FlatRange, Region, Run, box_flat_ranges, copy_runs, flat_boxes, region_bounds,
                              transposed_destination, transposed_source, whole_rows)
from ckptctl.core.checkpoint import Chunk, ChunkTable, TensorEntry, TupleView


class SourceChunks(TupleView):
    """A source's chunks, each paired with the region of the source it holds: a read-only sequence
    of (Chunk, Region). Planning asks it for what it needs (a chunk, row bounds, whether all are
    whole rows or any is transformed), which a table answers from its columns, without a pair per
    chunk."""

    __slots__ = ()

    def chunk(self, index: int) -> Chunk:
        return self[index][0]

    @property
    def transformed(self) -> bool:
        """Whether any chunk must be decoded to be read."""
        return any(chunk.transforms for chunk, _ in self)

    def row_bounds(self, shape: tuple[int, ...]) -> tuple[array, array]:
        """Each chunk's first row, and its row end, in a source of `shape`, in saved order."""
        boxes = [region_bounds(region, shape) for _, region in self]
        starts = array("q", (box.offsets[0] for box in boxes))
        return starts, array("q", map(operator.add, starts, (box.sizes[0] for box in boxes)))

    def whole_rows(self, shape: tuple[int, ...]) -> bool:
        """Whether every chunk is a box of whole rows of a source of `shape` (as FSDP2's Shard(0) saves)."""
        trailing, zeros = shape[1:], (0,) * (len(shape) - 1)
        return all(isinstance(region, Box) and region.sizes[1:] == trailing and region.offsets[1:] == zeros
                   for _, region in self)


class RegionChunks(SourceChunks):
    """Chunks paired with any regions (boxes, or flat item ranges of an optimizer buffer), held as pairs."""

    __slots__ = ("pairs",)

    def __init__(self, pairs: Iterable[tuple[Chunk, Region]]) -> None:
        self.pairs = tuple(pairs)

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, index: int | slice) -> Any:
        return self.pairs[index]

    def __iter__(self) -> Iterator[tuple[Chunk, Region]]:
        return iter(self.pairs)


class BoxedChunks(SourceChunks):
    """A chunk table's chunks, each with its own box (a tensor seen as saved), made when read: a
    tensor of thousands of chunks holds no pair, box or `Chunk` per chunk."""

    __slots__ = ("table",)

    def __init__(self, table: ChunkTable) -> None:
        self.table = table

    def __len__(self) -> int:
        return len(self.table)

    def __getitem__(self, index: int | slice) -> Any:
        if isinstance(index, slice):
            return tuple((c, Box(c.offsets, c.sizes)) for c in self.table[index])
        c = self.table[index]
        return c, Box(c.offsets, c.sizes)  # the chunk's own tuples: no copy

    def __iter__(self) -> Iterator[tuple[Chunk, Box]]:
        return ((c, Box(c.offsets, c.sizes)) for c in self.table)

    def chunk(self, index: int) -> Chunk:
        return self.table[index]

    @property
    def transformed(self) -> bool:
        return self.table.transformed

    def row_bounds(self, shape: tuple[int, ...]) -> tuple[array, array]:
        starts = array("q", map(operator.itemgetter(0), self.table.offsets))
        return starts, array("q", map(operator.add, starts, map(operator.itemgetter(0), self.table.sizes)))

    def whole_rows(self, shape: tuple[int, ...]) -> bool:
        return whole_rows(shape, self.table.offsets, self.table.sizes)


@dataclass(frozen=True)
class SourceTensor:
    """A checkpoint tensor in its logical shape, each chunk paired with the region it holds
    (given as pairs, they are held as `RegionChunks`)."""

    fqn: str
    shape: tuple[int, ...]
    dtype: DType
    chunks: SourceChunks

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", as_dtype(self.dtype))
        if not isinstance(self.chunks, SourceChunks):
            object.__setattr__(self, "chunks", RegionChunks(self.chunks))

    @property
    def transformed(self) -> bool:
        """Whether any chunk must be decoded to be read."""
        return self.chunks.transformed

    @cached_property
    def _by_rows(self) -> tuple[array, array, array, array]:
        """Chunks sorted by first row: their saved indexes, first rows, row ends, and each prefix's
        furthest row end (arrays of integers, 32 bytes a chunk, kept while the view lives: a
        tensor may have thousands of chunks, a checkpoint millions)."""
        starts, ends = self.chunks.row_bounds(self.shape)
        order = array("q", range(len(starts)))
        if any(map(operator.gt, starts, itertools.islice(starts, 1, None))):  # not saved in row order
            order = array("q", sorted(order, key=starts.__getitem__))
            starts, ends = array("q", map(starts.__getitem__, order)), array("q", map(ends.__getitem__, order))
        return order, starts, ends, array("q", itertools.accumulate(ends, max))

    def rows_near(self, lo: int, hi: int) -> list[tuple[int, int, int]]:
        """Chunks whose bounds may meet rows [lo, hi), in saved order, as (saved index, first row,
        row end).

        A bisection instead of a scan: with R ranks, planning a tensor costs R log R, not R².
        """
        order, starts, ends, furthest = self._by_rows
        first, last = bisect.bisect_right(furthest, lo), bisect.bisect_left(starts, hi)
        return sorted(zip(order[first:last], starts[first:last], ends[first:last]))

    def chunk(self, index: int) -> Chunk:
        """Saved chunk `index` (a table's row made a `Chunk` without its box)."""
        return self.chunks.chunk(index)

    def chunks_in_rows(self, lo: int, hi: int) -> list[tuple[Chunk, Region, Box]]:
        """Chunks whose bounds may meet rows [lo, hi), in saved order, with their bounds."""
        chunks, shape = self.chunks, self.shape
        if not shape:
            return [(c, r, region_bounds(r, shape)) for c, r in chunks]
        return [(c, r, region_bounds(r, shape)) for c, r in (chunks[i] for i, _, _ in self.rows_near(lo, hi))]

    @cached_property
    def whole_rows(self) -> tuple[tuple[int, ...], int] | None:
        """(trailing dims, elements per row) when every chunk is a box of whole rows, as FSDP2's
        Shard(0) saves; else None. Such chunks are planned with integer arithmetic on rows."""
        if not self.shape or not self.chunks.whole_rows(self.shape):
            return None
        return self.shape[1:], math.prod(self.shape[1:])


def source_view(entry: TensorEntry, logical_shape: Sequence[int] | None = None) -> SourceTensor:
    """View an entry as a source. Given another `logical_shape` of its elements, a 1-D entry is a
    flat item-coordinate buffer, and so is an entry saved whole (a safetensors tensor: GPT-OSS's
    [E, H, 2F] read as [E, H, F, 2])."""
    shape = tuple(entry.shape if logical_shape is None else logical_shape)
    flat = shape != entry.shape
    if flat and (math.prod(shape) != entry.numel or not (len(entry.shape) == 1 or all(
            not any(c.offsets) and tuple(c.sizes) == tuple(entry.shape) for c in entry.chunks))):
        raise ValueError(f"{entry.fqn}: cannot view {list(entry.shape)} as {list(shape)}")
    if not flat and type(entry.chunks) is ChunkTable:
        return SourceTensor(entry.fqn, shape, entry.dtype, BoxedChunks(entry.chunks))
    regions = tuple(
        (c, (FlatRange(c.offsets[0], c.sizes[0]) if len(entry.shape) == 1 else FlatRange(0, entry.numel)) if flat
         else Box(c.offsets, c.sizes)) for c in entry.chunks
    )
    return SourceTensor(entry.fqn, shape, entry.dtype, regions)


class ItemWindows:
    """An entry's chunks as runs of items (row-major), for views of item ranges of it: one
    param's range of a Megatron optimizer bucket, or one TP fragment of a model-space state.
    The runs are sorted once, so each window costs a bisection, not a scan of every chunk."""

    def __init__(self, entry: TensorEntry) -> None:
        self.entry = entry
        runs = []
        for c in entry.chunks:
            if not c.numel:
                continue
            items = box_flat_ranges(Box(c.offsets, c.sizes), entry.shape)
            if len(items) != 1:
                raise CheckpointError(entry.fqn, f"a chunk at {list(c.offsets)} of {list(c.sizes)} is not one run "
                                                 "of items, which a flat optimizer state must be")
            runs.append((items[0].start, c))
        runs.sort(key=lambda r: r[0])
        self.runs = runs
        self.starts = [first for first, _ in runs]
        self.reach = list(itertools.accumulate((first + c.numel for first, c in runs), max))

    def window(self, start: int, end: int, shape: Sequence[int]) -> SourceTensor:
        """Items [start, end) seen in `shape`: each chunk that meets them is the flat range it
        holds, counted from `start` (one that begins before it starts below 0)."""
        near = self.runs[bisect.bisect_right(self.reach, start): bisect.bisect_left(self.starts, end)]
        chunks = tuple((c, FlatRange(first - start, c.numel)) for first, c in near)
        return SourceTensor(self.entry.fqn, tuple(shape), self.entry.dtype, chunks)


def layer_stacked_view(entry: TensorEntry, depth: int = 1) -> SourceTensor:
    """A stack [L, R, …] (a Megatron-Core torch_dist layer stack, torchtitan's grouped experts)
    seen as [L·R, …]: every slab's rows one after another, the same elements in the same order,
    so a chunk one slab deep, or of whole slabs, is one box of it. `depth` 2 reads a stack of
    stacks [L, E, R, …] (torch_dist experts) as [L·E·R, …] the same way. A chunk cut inside
    several slabs (torchtitan's experts under expert parallelism with FSDP `Shard(1)`,
    megatron-core's legacy GroupedMLP, whose chunk holds every local expert's rows of a TP rank)
    holds a run of rows of each slab: whole rows, it is paired with each run, a flat range of
    the view read from its place in the chunk; cut on a trailing dim too, it is refused."""
    lead = entry.shape[:depth + 1]
    rows = math.prod(lead)
    shape = (rows, *entry.shape[depth + 1:])
    row = math.prod(shape[1:])
    regions: list[tuple[Chunk, Region]] = []
    for c in entry.chunks:
        start = sum(o * math.prod(lead[i + 1:]) for i, o in enumerate(c.offsets[:depth + 1]))
        deep = next((i for i in range(depth + 1) if c.sizes[i] != 1), depth)
        cut = next((i for i in range(depth, deep, -1) if c.offsets[i] or c.sizes[i] != lead[i]), None)
        if cut is None:
            count = c.sizes[deep] * math.prod(lead[deep + 1:])
            regions.append((c, Box((start, *c.offsets[depth + 1:]), (count, *c.sizes[depth + 1:]))))
            continue
        if c.offsets[depth + 1:] != (0,) * (len(shape) - 1) or c.sizes[depth + 1:] != shape[1:]:
            raise CheckpointError(entry.fqn, f"a chunk at {list(c.offsets)} of {list(c.sizes)} cuts dim {cut} "
                                             f"inside {math.prod(c.sizes[:cut])} slabs of the stack and its rows "
                                             "too, which ckptctl cannot read slab by slab yet")
        run = c.sizes[cut] * math.prod(lead[cut + 1:]) * row  # one slab's share: contiguous in the view
        for k, outer in enumerate(itertools.product(*(range(o, o + n) for o, n in zip(c.offsets[:cut],
                                                                                        c.sizes[:cut])))):
            first = sum(o * math.prod(lead[i + 1:]) for i, o in enumerate((*outer, c.offsets[cut])))
            regions.append((c, FlatRange(first * row, run, k * run)))
    return SourceTensor(entry.fqn, shape, entry.dtype, tuple(regions))


def row_groups_view(entry: TensorEntry, group: int) -> SourceTensor | None:
    """A tensor [R, …] seen as [R / group, group, …] (row pairs, for llama's RoPE order): the same
    elements in the same order. A chunk of whole rows cut on a group boundary is one box of it;
    one cut mid-group is the flat item range it holds (planned as the boxes that range tiles).
    None when a chunk is cut on a trailing dim (its rows are not contiguous), or none is saved."""
    if not entry.shape or not entry.chunks or group < 1 or entry.shape[0] % group:
        return None
    trailing, zeros = entry.shape[1:], (0,) * (len(entry.shape) - 1)
    row = math.prod(trailing)
    regions: list[tuple[Chunk, Region]] = []
    for c in entry.chunks:
        if c.sizes[1:] != trailing or c.offsets[1:] != zeros:
            return None
        if c.offsets[0] % group or c.sizes[0] % group:
            regions.append((c, FlatRange(c.offsets[0] * row, c.sizes[0] * row)))
        else:
            regions.append((c, Box((c.offsets[0] // group, 0, *zeros), (c.sizes[0] // group, group, *trailing))))
    return SourceTensor(entry.fqn, (entry.shape[0] // group, group, *trailing), entry.dtype, tuple(regions))


def unsqueezed_view(view: SourceTensor) -> SourceTensor:
    """A source seen with a leading unit dim ([F, H] as [1, F, H]): the same elements in the same
    order, so a piece of it can be a box of a stacked target (one expert of [E, F, H])."""
    regions = []
    for chunk, region in view.chunks:
        if not isinstance(region, Box):
            raise ValueError(f"{view.fqn}: a flat buffer cannot be stacked")
        regions.append((chunk, Box((0, *region.offsets), (1, *region.sizes))))
    return SourceTensor(view.fqn, (1, *view.shape), view.dtype, tuple(regions))


@dataclass(frozen=True, slots=True)
class Piece:
    """A block of `sizes` elements taken from source `src` at `src_start`, placed at `dst_start`.

    With `axes` the block is transposed: destination dim i runs along source dim `axes[i]`
    (None: a unit dim the source has not), and source dims no destination dim runs along are
    unit dims (one expert of a stack [E, H, I] placed as [I, H]: `axes` (2, 1)).
    """

    src: str
    src_start: tuple[int, ...]
    dst_start: tuple[int, ...]
    sizes: tuple[int, ...]
    axes: tuple[int | None, ...] | None = None

    @property
    def source_box(self) -> Box:
        """The block of the source the piece reads."""
        if self.axes is None:
            return Box(self.src_start, self.sizes)
        return transposed_source(Box(self.dst_start, self.sizes), self.axes, self.dst_start, self.src_start,
                                 len(self.src_start))

    def destination(self, src: Box) -> Box:
        """The block of the target that block `src` of the source (inside `source_box`) fills."""
        if self.axes is None:
            return Box(tuple(o - s + d for o, s, d in zip(src.offsets, self.src_start, self.dst_start)), src.sizes)
        return transposed_destination(src, self.axes, self.src_start, self.dst_start)


@dataclass(frozen=True)
class TargetTensor:
    """An output tensor and where each of its blocks comes from."""

    fqn: str
    shape: tuple[int, ...]
    dtype: DType
    pieces: tuple[Piece, ...]
    properties: object = field(default=None, compare=False)
    add: float = 0.0
    """Added to every element after assembly (HF's GDN norm is Megatron's zero-centred gamma + 1)."""
    logical_shape: tuple[int, ...] | None = None
    """Set when the target is stored in `shape` while its pieces are in this shape of the same
    elements in the same order: flat (1-D, item coordinates) optimizer buffers, or a tensor
    read as row pairs (llama's RoPE order)."""
    delta: LowRank | None = field(default=None, compare=False)
    """A LoRA update merged into the assembled pieces (`export-hf --merge-adapters`)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", as_dtype(self.dtype))

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class LowRank:
    """A target computed, not copied: cast(W + (B @ A) · scale), each operand its exact float32
    upcast, in that order, with one rounding at the end (peft's fp32 `merge_and_unload`, bit for
    bit). Its three operands are planned whole (records reading all of W, A and B): the product
    is computed over the whole tensor at once, since a matmul of a few rows need not give the
    bits of the same rows of the whole one."""

    base: StreamItem
    a: StreamItem
    b: StreamItem
    scale: float
    magnitude: StreamItem | None = None
    """DoRA's magnitude m [out]: the merged rows are then scaled by m / ‖W + (B @ A) · s‖ (each
    row's L2 norm), as peft's DoRA merge does."""
    transposed: bool = False
    """W + ((B @ A) · scale)ᵀ: an embedding's adapter (A [r, vocab], B [dim, r]); of an expert
    stack's, each expert's product transposed (a stack held as [E, in, out])."""
    experts: int = 0
    """W is a stack of this many experts' matrices [E, …], A [E·r, in] and B [out, r·E] (peft's
    ParamWrapper): expert e's product is B[:, :, e] @ A[e] with B seen as [out, r, E] and A as
    [E, r, in], computed as peft's `einsum` computes it (W may be given as [E·out, in], its
    experts' rows one after another, as a base of per-expert tensors makes it); 0: W is a matrix."""
    blocks: tuple[Piece, ...] | None = None
    """The target is these blocks of the merged W, not W itself: a Megatron fused weight (linear_qkv,
    linear_fc1) merged whole, as Megatron-Bridge's `LoRAMerge` does, then split like its base
    (`src`: W's name; `src_start`: in W; `dst_start`: in the target)."""


def whole_item(target: TargetTensor, sources: Mapping[str, SourceTensor]) -> StreamItem:
    """All of `target` as one record written nowhere, its copy runs planned (an operand of a `LowRank`)."""
    box = Box(tuple(0 for _ in target.shape), target.shape)
    return StreamItem("", 0, b"", target, box, plan_box(target, box, sources))


def identity_target(src: SourceTensor, fqn: str | None = None, dtype: DType | None = None,
                    properties: object = None) -> TargetTensor:
    """The whole source, unchanged in shape (a plain reshard, possibly with a cast), with the
    saved entry's `properties` when given."""
    zero = tuple(0 for _ in src.shape)
    return TargetTensor(fqn or src.fqn, src.shape, dtype or src.dtype, (Piece(src.fqn, zero, zero, src.shape),),
                        properties)


@dataclass(frozen=True, slots=True)
class SourceRead:
    """Runs to copy from one source chunk: `src` offsets count elements of the chunk, `dst` of the output box."""

    fqn: str
    chunk: Chunk
    dtype: DType
    runs: tuple[Run, ...]

    @property
    def numel(self) -> int:
        return sum(r.length for r in self.runs)

    @property
    def run_count(self) -> int:
        return len(self.runs)


@dataclass(frozen=True, slots=True)
class TransposedRead:
    """A block of one source chunk placed with its dims reordered (a transposed `Piece`).

    `src` is the block in the chunk's own coordinates (the chunk is a row-major array of
    `chunk_sizes`); `dst` is the block it fills in the output box (or in `frame`); destination
    dim i runs along chunk dim `axes[i]` (None: a unit dim). The engines gather it tile by tile.
    """

    fqn: str
    chunk: Chunk
    dtype: DType
    src: Box
    chunk_sizes: tuple[int, ...]
    dst: Box
    axes: tuple[int | None, ...]
    chunk_offset: int = 0
    """Elements of the chunk before the array `src` is a block of (a flat chunk is read as the
    boxes it tiles, each an array of `chunk_sizes` of its own)."""
    frame: tuple[tuple[int, ...], int] | None = None
    """What `dst` is a block of, when not the output box itself: the shape of a block of the
    target's logical shape, and the position of its first element in the output box."""

    @property
    def numel(self) -> int:
        return self.src.numel

    @property
    def run_count(self) -> int:
        """Contiguous source runs: one per row of the block."""
        return self.src.numel // self.src.sizes[-1] if self.src.sizes and self.src.sizes[-1] else 0


Read = SourceRead | TransposedRead


def plan_box(target: TargetTensor, box: Box, sources: Mapping[str, SourceTensor]) -> tuple[Read, ...]:
    """Every run that fills `box` of `target`, from whichever source chunks intersect it."""
    if target.logical_shape is not None:
        return _plan_logical_box(target, box, sources)
    reads: list[Read] = []
    for piece in target.pieces:
        if piece.axes is not None:
            _plan_transposed(box, piece, sources[piece.src], reads)
            continue
        src = sources.get(piece.src)
        whole = src.whole_rows if src is not None else None
        if whole is not None and _spans_rows(box, piece, whole[0]):
            _plan_rows(box, piece, src, whole[1], reads)
            continue
        placed = Box(piece.dst_start, piece.sizes).intersect(box) if box.sizes else box
        if placed is None or placed.numel == 0:
            continue
        delta = tuple(s - d for s, d in zip(piece.src_start, piece.dst_start))
        wanted = placed.shift(delta)
        src = sources[piece.src]
        back = tuple(-d for d in delta)
        rows = (wanted.offsets[0], wanted.offsets[0] + wanted.sizes[0]) if wanted.sizes else (0, 0)
        for chunk, region, bounds in src.chunks_in_rows(*rows):
            part = bounds.intersect(wanted) if wanted.sizes else wanted
            if part is None or part.numel == 0 or region.numel == 0:
                continue
            runs = copy_runs(part, region, src.shape, box, back)
            if runs:
                reads.append(SourceRead(src.fqn, chunk, src.dtype, tuple(runs)))
    return tuple(reads)


def _plan_transposed(box: Box, piece: Piece, src: SourceTensor, reads: list[Read]) -> None:
    """`plan_box` for a transposed piece: each source chunk's share as one `TransposedRead`."""
    placed = Box(piece.dst_start, piece.sizes).intersect(box)
    if placed is None or placed.numel == 0:
        return
    wanted = transposed_source(placed, piece.axes, piece.dst_start, piece.src_start, len(piece.src_start))
    for chunk, region, bounds in src.chunks_in_rows(wanted.offsets[0], wanted.offsets[0] + wanted.sizes[0]):
        if bounds.intersect(wanted) is None:
            continue
        blocks = [(0, region)] if isinstance(region, Box) else [
            (first - region.start + region.skip, block) for first, block in flat_boxes(src.shape, region.start,
                                                                                        region.end)]
        for skip, block in blocks:
            part = block.intersect(wanted)
            if part is None or part.numel == 0:
                continue
            dst = piece.destination(part).shift(tuple(-o for o in box.offsets))
            local = part.shift(tuple(-o for o in block.offsets))
            reads.append(TransposedRead(src.fqn, chunk, src.dtype, local, block.sizes, dst, piece.axes,
                                        chunk_offset=skip))


def _spans_rows(box: Box, piece: Piece, trailing: tuple[int, ...]) -> bool:
    """Whether `box` and `piece` both take whole rows of a source whose trailing dims are `trailing`."""
    return bool(box.sizes and piece.sizes) and box.sizes[1:] == trailing and piece.sizes[1:] == trailing \
        and not any(box.offsets[1:]) and not any(piece.dst_start[1:]) and not any(piece.src_start[1:])


def _plan_rows(box: Box, piece: Piece, src: SourceTensor, row: int, reads: list[SourceRead]) -> None:
    """`plan_box` for whole rows of box, piece and source chunks: each chunk's share is one run,
    found by bisection and computed on row numbers, with no boxes built (the same runs, in the same order)."""
    shift = piece.src_start[0] - piece.dst_start[0]
    lo = max(piece.dst_start[0], box.offsets[0]) + shift
    hi = min(piece.dst_start[0] + piece.sizes[0], box.offsets[0] + box.sizes[0]) + shift
    if hi <= lo or not row:
        return
    first = box.offsets[0] + shift  # the source row that lands on the box's first row
    for i, start, stop in src.rows_near(lo, hi):
        a = start if start > lo else lo
        b = stop if stop < hi else hi
        if a < b:
            runs = _one_run((a - start) * row, (a - first) * row, (b - a) * row)
            reads.append(SourceRead(src.fqn, src.chunk(i), src.dtype, runs))


@functools.lru_cache(maxsize=1 << 16)
def _one_run(src: int, dst: int, length: int) -> tuple[Run]:
    """A read's runs when it is one run: tensors of one shape and layout repeat them, so they are shared."""
    return (Run(src, dst, length),)


def _plan_logical_box(target: TargetTensor, box: Box, sources: Mapping[str, SourceTensor]) -> tuple[Read, ...]:
    """A box of a target stored in another shape than its pieces': its item ranges, each planned
    as the boxes of the logical shape it tiles (runs shifted to their place in the box; a
    transposed read framed by its block)."""
    logical = replace(target, shape=target.logical_shape, logical_shape=None)
    reads: list[Read] = []
    at = 0
    for items in box_flat_ranges(box, target.shape):
        for first, part in flat_boxes(target.logical_shape, items.start, items.end):
            delta = at + first - items.start
            for read in plan_box(logical, part, sources):
                if isinstance(read, TransposedRead):
                    reads.append(replace(read, frame=(part.sizes, delta)))
                else:
                    reads.append(replace(read, runs=tuple(Run(r.src, r.dst + delta, r.length) for r in read.runs)))
        at += items.length
    return tuple(reads)


def missing_elements(box: Box, reads: Sequence[Read]) -> int:
    """Elements of `box` no run writes (0 for a fully covered box; runs never overlap in valid sources)."""
    covered = sorted((r.dst, r.dst + r.length) for read in reads if isinstance(read, SourceRead) for r in read.runs)
    total = sum(read.numel for read in reads if isinstance(read, TransposedRead))
    reach = 0
    for lo, hi in covered:
        if hi > reach:
            total += hi - max(lo, reach)
            reach = hi
    return box.numel - total


PLAN_RUNS, PLAN_RECORDS = 1 << 18, 1 << 14
"""Copy runs, and records, planned at once. A tensor split on dim 1 (Megatron TP) needs a run per
row and chunk, and a checkpoint of a thousand ranks millions of records: their runs are planned
a batch at a time, each written before the next is planned, and never all held (about 100 bytes
a run; a tiny record and its runs about 600: 16,384 of them keep a batch near 10 MB, and 163,840
tiny chunks resharded peak at 88 MB instead of 132 MB with batches of 131,072). A torchrun
worker plans only its own files' records."""


def planned_batches(items: Iterable["StreamItem"], sources: Mapping[str, SourceTensor], whole: bool = False,
                    max_runs: int = PLAN_RUNS, max_records: int = PLAN_RECORDS) -> Iterator[list["StreamItem"]]:
    """The records with their copy runs, about `max_runs` runs or `max_records` records at a time
    (a record is never split). With `whole`, a record its runs do not cover is refused.

    Each batch is planned with the collector paused (`gc_pause`): a few acyclic objects per
    record, which would otherwise make it rescan the checkpoint's metadata again and again
    (the 81,920 records of a 163,840-chunk reshard: 1.3 s, 0.65 s paused)."""
    pending = iter(items)
    while True:
        batch: list[StreamItem] = []
        runs = 0
        with gc_paused():
            for item in pending:
                reads = plan_box(item.target, item.box, sources)
                if whole:
                    refuse_gap(item.target, item.box, reads)
                batch.append(item.planned(reads))
                for read in reads:
                    runs += read.run_count
                if runs >= max_runs or len(batch) >= max_records:
                    break
        if not batch:
            return
        yield batch


def refuse_gap(target: TargetTensor, box: Box, reads: Sequence[Read]) -> None:
    """IncompleteCheckpointError, naming the sources, when `reads` leave elements of `box` unwritten
    (no command goes on past this: it checks what an analysis of coverage already passed)."""
    gap = missing_elements(box, reads)
    if gap:
        srcs = ", ".join(sorted({p.src for p in target.pieces}))
        raise IncompleteCheckpointError(srcs, [f"{target.fqn}: {gap} elements of rows {box.offsets[:1]}+"
                                               f"{box.sizes[:1]} are in no saved chunk"])


def source_bytes(target: TargetTensor, numel: int, sources: Mapping[str, SourceTensor]) -> int:
    """The source bytes `numel` elements of `target` read: at the itemsize of the sources its
    pieces read (one dtype per target, as every planner builds them)."""
    return numel * sources[target.pieces[0].src].dtype.itemsize if target.pieces else 0


@dataclass(frozen=True, slots=True)
class StreamItem:
    """One output record: `head`, then `box` of `target` assembled from `reads`, then `tail(crc)`.

    `tail` is None for raw records (safetensors), which need no CRC; `tail_len` is the length
    of any `tail(crc)`, known at planning so the record's size needs no tail built.
    """

    file: str
    offset: int
    head: bytes
    target: TargetTensor
    box: Box
    reads: tuple[Read, ...]
    tail: Callable[[int], bytes] | None = None
    tail_len: int = 0

    @property
    def nbytes(self) -> int:
        return self.box.numel * self.target.dtype.itemsize

    @property
    def length(self) -> int:
        """The whole record's bytes: head, data and tail."""
        return len(self.head) + self.nbytes + self.tail_len

    def planned(self, reads: tuple[Read, ...]) -> "StreamItem":
        """This record with its copy runs (`dataclasses.replace` costs more than the plan of a tiny box)."""
        return StreamItem(self.file, self.offset, self.head, self.target, self.box, reads, self.tail, self.tail_len)


@dataclass(frozen=True, slots=True)
class CopyItem:
    """Bytes copied verbatim from a source file range (bytes entries, unchanged records).

    With `data` set, those bytes are written instead (a rewritten bytes entry such as
    Megatron's `args`); `src_file`/`src_offset` are then unused.
    """

    src_file: str
    src_offset: int
    length: int
    file: str
    offset: int
    data: bytes | None = field(default=None, repr=False)
