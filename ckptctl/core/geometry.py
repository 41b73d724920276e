"""Pure math on chunk geometry: boxes, flat item ranges, row splits and contiguous copy runs.

Every tensor is row-major. A saved piece is either a *box* of the global tensor or a *flat
range* of its row-major element (item) index, as Megatron-FSDP's flat optimizer buffers
are. Copying between layouts reduces to finding, for a region present in both, the
runs of elements that are contiguous on both sides — that is what `copy_runs` computes.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Iterable, Iterator, Sequence


@dataclass(frozen=True, slots=True)
class Box:
    """An axis-aligned block of an N-D tensor: `offsets` and `sizes` per dim."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    @property
    def ends(self) -> tuple[int, ...]:
        return tuple(o + s for o, s in zip(self.offsets, self.sizes))

    def intersect(self, other: "Box") -> "Box | None":
        """The common block, or None when they share no element (one pass: planning calls it per chunk pair)."""
        offsets, sizes = [], []
        for a, s, b, t in zip(self.offsets, self.sizes, other.offsets, other.sizes):
            lo, hi = max(a, b), min(a + s, b + t)
            if hi <= lo:
                return None
            offsets.append(lo)
            sizes.append(hi - lo)
        return Box(tuple(offsets), tuple(sizes))

    def shift(self, delta: Sequence[int]) -> "Box":
        return Box(tuple(o + d for o, d in zip(self.offsets, delta)), self.sizes)


@dataclass(frozen=True, slots=True)
class FlatRange:
    """Elements [start, start+length) of a tensor's row-major item index, held by a chunk from
    its element `skip` on (a chunk that holds several ranges of a view, as a stack's chunk cut
    inside several slabs does, is paired with each; otherwise 0: the range is the chunk)."""

    start: int
    length: int
    skip: int = 0

    @property
    def numel(self) -> int:
        return self.length

    @property
    def end(self) -> int:
        return self.start + self.length


Region = Box | FlatRange


@dataclass(frozen=True, slots=True)
class Run:
    """`length` contiguous elements: at `src` in the source region, at `dst` in the destination box."""

    src: int
    dst: int
    length: int


def strides(shape: Sequence[int]) -> tuple[int, ...]:
    """Row-major element strides of `shape`."""
    out, acc = [], 1
    for dim in reversed(shape):
        out.append(acc)
        acc *= dim
    return tuple(reversed(out))


def flat_index(index: Iterable[int], shape: Iterable[int]) -> int:
    """The row-major position of element `index` in a block of `shape`."""
    flat = 0
    for i, size in zip(index, shape):
        flat = flat * size + i
    return flat


def unravel(flat: int, shape: Sequence[int]) -> tuple[int, ...]:
    """The index of row-major element `flat` in a block of `shape` (`flat_index` undone)."""
    index = []
    for size in reversed(shape):
        flat, i = divmod(flat, size)
        index.append(i)
    return tuple(reversed(index))


def full_box(shape: Sequence[int]) -> Box:
    return Box(tuple(0 for _ in shape), tuple(shape))


def transposed_source(dst: Box, axes: Sequence[int | None], dst_origin: Sequence[int],
                      src_origin: Sequence[int], src_rank: int) -> Box:
    """The source block a block `dst` of a transposed piece reads.

    Destination dim i runs along source dim `axes[i]` (None: a unit dim the source has not);
    a source dim no destination dim runs along is a unit dim of the block. The piece's
    element at `dst_origin` is the source's at `src_origin`.
    """
    offsets, sizes = list(src_origin), [1] * src_rank
    for i, a in enumerate(axes):
        if a is not None:
            offsets[a] += dst.offsets[i] - dst_origin[i]
            sizes[a] = dst.sizes[i]
    return Box(tuple(offsets), tuple(sizes))


def transposed_destination(src: Box, axes: Sequence[int | None], src_origin: Sequence[int],
                           dst_origin: Sequence[int]) -> Box:
    """The destination block a source block `src` of a transposed piece fills (`transposed_source` inverted)."""
    offsets = tuple(d if a is None else d + src.offsets[a] - src_origin[a] for d, a in zip(dst_origin, axes))
    sizes = tuple(1 if a is None else src.sizes[a] for a in axes)
    return Box(offsets, sizes)


def transposed_order(axes: Sequence[int | None], src_rank: int) -> tuple[int, ...]:
    """The source dims in the order a transposed block's elements go out: `permute` a source
    block by it, then reshape to the destination block (which only drops or adds unit dims)."""
    kept = tuple(a for a in axes if a is not None)
    return kept + tuple(a for a in range(src_rank) if a not in kept)


def whole_rows(shape: tuple[int, ...], offsets: Sequence[tuple[int, ...]], sizes: Sequence[tuple[int, ...]]) -> bool:
    """Whether every box (`offsets[i]`, `sizes[i]`) holds whole rows of `shape` (FSDP2's Shard(0)):
    told from the columns with `map`, a million boxes without a Python step each."""
    tail = operator.itemgetter(slice(1, None))
    return all(map(((0,) * (len(shape) - 1)).__eq__, map(tail, offsets))) and all(
        map(tuple(shape[1:]).__eq__, map(tail, sizes)))


def chunk_rows(rows: int, parts: int) -> list[tuple[int, int]]:
    """`torch.chunk` row ranges: ceil(rows/parts) rows each; parts past the end get (rows, rows)."""
    step = -(-rows // parts) if rows else 0
    return [(min(rows, i * step), min(rows, (i + 1) * step)) for i in range(parts)]


def even_row_cuts(rows: int, parts: int) -> list[tuple[int, int]]:
    """Whole-row cuts as even as possible (the first `rows % parts` parts get one more row)."""
    base, extra = divmod(rows, parts)
    out, start = [], 0
    for i in range(parts):
        stop = start + base + (1 if i < extra else 0)
        out.append((start, stop))
        start = stop
    return out


def rows_box(shape: Sequence[int], start: int, stop: int) -> Box:
    """Rows [start, stop) of a tensor with all of its trailing dims (no generators: placement calls it per rank)."""
    return Box((start,) + (0,) * (len(shape) - 1), (stop - start, *shape[1:]))


def region_bounds(region: Region, shape: Sequence[int]) -> Box:
    """The smallest box holding `region` (a flat range covers whole rows of dim 0)."""
    if isinstance(region, Box):
        return region
    if not shape:
        return Box((), ())
    row = math.prod(shape[1:])
    if row == 0:
        return Box(tuple(0 for _ in shape), tuple(0 for _ in shape))
    first, last = region.start // row, -(-region.end // row)
    return rows_box(shape, first, last)


def _split_dim(part: Box, *containers: Sequence[int]) -> int:
    """First dim k such that every dim after it is whole in `part` and all `containers`."""
    k = len(part.sizes)
    while k > 0:
        size = part.sizes[k - 1]
        for c in containers:
            if c[k - 1] != size:
                return k - 1
        k -= 1
    return 0


def _lines(part: Box, k: int) -> Iterator[tuple[int, ...]]:
    """Start coordinates of each line of `part`: every index over dims [0, k), the offset after."""
    if k == 0 or not part.sizes:
        yield part.offsets
        return
    ranges = [range(o, o + s) for o, s in zip(part.offsets[:k], part.sizes[:k])]
    tail = part.offsets[k:]
    idx = [r.start for r in ranges]
    total = math.prod(len(r) for r in ranges)
    for _ in range(total):
        yield (*idx, *tail)
        for d in range(k - 1, -1, -1):
            idx[d] += 1
            if idx[d] < ranges[d].stop:
                break
            idx[d] = ranges[d].start


def _offset(coords: Sequence[int], origin: Sequence[int], steps: Sequence[int]) -> int:
    """Row-major element offset of `coords` from `origin` (a loop: planning calls this per run)."""
    total = 0
    for c, o, s in zip(coords, origin, steps):
        total += (c - o) * s
    return total


def copy_runs(part: Box, src: Region, src_shape: Sequence[int], dst: Box, shift: Sequence[int]) -> list[Run]:
    """Contiguous runs copying `part` (source coordinates) from `src` into `dst` (destination coordinates).

    `shift` maps source coordinates to destination ones (dst = src + shift). `part` must lie
    inside `region_bounds(src)` and `part.shift(shift)` inside `dst`; for a flat `src` only
    the elements of `part` inside the flat range are copied. Adjacent runs are merged.
    """
    if part.numel == 0:
        return []
    if isinstance(src, FlatRange):
        rows = region_bounds(src, src_shape)
        clipped = part.intersect(rows) if part.sizes else part
        if clipped is None:
            return []
        part = clipped
    src_sizes = src.sizes if isinstance(src, Box) else tuple(src_shape)
    k = _split_dim(part, src_sizes, dst.sizes)
    run_len = math.prod(part.sizes[k:])
    dst_origin, dst_steps = [o - s for o, s in zip(dst.offsets, shift)], strides(dst.sizes)
    if isinstance(src, Box):
        src_origin, src_steps = src.offsets, strides(src.sizes)
    else:
        src_origin, src_steps = [0] * len(src_shape), strides(src_shape)
    runs: list[Run] = []
    for line in _lines(part, k):
        d = _offset(line, dst_origin, dst_steps)
        if isinstance(src, Box):
            _append(runs, Run(_offset(line, src_origin, src_steps), d, run_len))
            continue
        g = _offset(line, src_origin, src_steps)
        lo, hi = max(g, src.start), min(g + run_len, src.end)
        if lo < hi:
            _append(runs, Run(lo - src.start + src.skip, d + (lo - g), hi - lo))
    return runs


def _append(runs: list[Run], run: Run) -> None:
    if runs and runs[-1].src + runs[-1].length == run.src and runs[-1].dst + runs[-1].length == run.dst:
        last = runs[-1]
        runs[-1] = Run(last.src, last.dst, last.length + run.length)
    else:
        runs.append(run)


def union_volume(boxes: Sequence[Box]) -> int:
    """Number of elements covered by at least one box (exact), in O(n log n) for boxes that
    differ on at most two dims, whatever they overlap.

    Dims on which every box spans the same range only multiply the result. What is left is
    a union of intervals (sorted and merged), of rectangles (a sweep over one dim with a
    segment tree over the other), or, for boxes that differ on three or more dims (no DCP
    layout does), a sweep over the first such dim with the rectangle union of each slab.
    """
    boxes = [b for b in boxes if b.numel > 0]
    if not boxes:
        return 0
    if len(boxes[0].sizes) == 0:
        return 1
    if len(boxes) == 1:
        return boxes[0].numel
    ndim = len(boxes[0].sizes)
    first = boxes[0]
    varying = [d for d in range(ndim)
               if any(b.offsets[d] != first.offsets[d] or b.sizes[d] != first.sizes[d] for b in boxes)]
    factor = math.prod(first.sizes[d] for d in range(ndim) if d not in varying)
    if not varying:
        return factor
    spans = [tuple((b.offsets[d], b.offsets[d] + b.sizes[d]) for d in varying) for b in boxes]
    if len(varying) == 1:
        return factor * interval_union([s[0] for s in spans])
    if len(varying) == 2:
        return factor * _area_union([(*s[0], *s[1]) for s in spans])
    cuts = sorted({s[0][0] for s in spans} | {s[0][1] for s in spans})
    total = 0
    for lo, hi in zip(cuts, cuts[1:]):
        inner = [Box(tuple(a for a, _ in s[1:]), tuple(b - a for a, b in s[1:])) for s in spans
                 if s[0][0] <= lo and s[0][1] >= hi]
        total += (hi - lo) * union_volume(inner)
    return factor * total


def interval_union(spans: Sequence[tuple[int, int]]) -> int:
    """Length covered by half-open intervals."""
    total, end = 0, None
    for lo, hi in sorted(spans):
        if end is None or lo > end:
            total += hi - lo
            end = hi
        elif hi > end:
            total += hi - end
            end = hi
    return total


def _area_union(rects: Sequence[tuple[int, int, int, int]]) -> int:
    """Area covered by rectangles (x0, x1, y0, y1): a sweep over x; a segment tree over the
    distinct y cuts keeps the covered length (each node: how many rectangles cover it whole,
    and how much of it is covered), so each rectangle costs O(log n) twice."""
    ys = sorted({r[2] for r in rects} | {r[3] for r in rects})
    index = {y: i for i, y in enumerate(ys)}
    k = len(ys) - 1
    size = 1
    while size < k:
        size *= 2
    count = [0] * (2 * size)
    covered = [0] * (2 * size)
    lo_of = [ys[min(i, k)] for i in range(size)]
    hi_of = [ys[min(i + 1, k)] for i in range(size)]
    length = [0] * size + [hi - lo for lo, hi in zip(lo_of, hi_of)]  # leaves past the last cut are empty
    for n in range(size - 1, 0, -1):
        length[n] = length[2 * n] + length[2 * n + 1]
    events = []
    for x0, x1, y0, y1 in rects:
        events.append((x0, 1, index[y0], index[y1]))
        events.append((x1, -1, index[y0], index[y1]))
    events.sort()

    def update(node: int, nlo: int, nhi: int, a: int, b: int, d: int) -> None:
        if a <= nlo and nhi <= b:
            count[node] += d
        else:
            mid = (nlo + nhi) // 2
            if a < mid:
                update(2 * node, nlo, mid, a, b, d)
            if b > mid:
                update(2 * node + 1, mid, nhi, a, b, d)
        if count[node]:
            covered[node] = length[node]
        elif node >= size:
            covered[node] = 0
        else:
            covered[node] = covered[2 * node] + covered[2 * node + 1]

    total, last = 0, events[0][0]
    for x, d, a, b in events:
        total += covered[1] * (x - last)
        last = x
        update(1, 0, size, a, b, d)
    return total


def region_blocks(region: Region, shape: Sequence[int]) -> list[Box]:
    """The boxes of a `shape` tensor a region holds: the box itself, or the boxes a flat range tiles."""
    if isinstance(region, Box):
        return [region]
    return [block for _, block in flat_boxes(shape, region.start, region.end)]


def box_flat_ranges(box: Box, shape: Sequence[int]) -> list[FlatRange]:
    """The item ranges (row-major flat indices of a `shape` tensor) that `box` covers, maximal and in order."""
    if box.numel == 0:
        return []
    runs = copy_runs(box, full_box(shape), shape, box, tuple(0 for _ in shape))
    return [FlatRange(r.src, r.length) for r in runs]


def flat_boxes(shape: Sequence[int], start: int, stop: int) -> list[tuple[int, Box]]:
    """Boxes of a `shape` tensor tiling items [start, stop), each contiguous in item order, with its first item.

    The inverse of `box_flat_ranges`: a flat range that starts or ends mid-row becomes a
    partial-row box, whole rows, and a partial-row box (recursively for N-D).
    """
    shape = tuple(shape)
    if not shape:
        return [(0, Box((), ()))] if start < stop else []
    out: list[tuple[int, Box]] = []

    def walk(prefix: tuple[int, ...], dims: tuple[int, ...], a: int, b: int, base: int) -> None:
        if a >= b:
            return
        row = math.prod(dims[1:])
        ones = (1,) * len(prefix)
        whole_from, whole_to = -(-a // row), b // row
        if whole_from > whole_to:
            r = a // row
            walk(prefix + (r,), dims[1:], a - r * row, b - r * row, base + r * row)
            return
        if a < whole_from * row:
            r = whole_from - 1
            walk(prefix + (r,), dims[1:], a - r * row, row, base + r * row)
        if whole_to > whole_from:
            offsets = prefix + (whole_from,) + (0,) * (len(dims) - 1)
            out.append((base + whole_from * row, Box(offsets, ones + (whole_to - whole_from,) + dims[1:])))
        if b > whole_to * row:
            walk(prefix + (whole_to,), dims[1:], 0, b - whole_to * row, base + whole_to * row)

    walk((), shape, start, stop, 0)
    return out
