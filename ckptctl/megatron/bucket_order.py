"""Each param's place in a DistributedOptimizer bucket, found by content.

A `dp_reshardable` bucket saves its params' fp32 masters flat, in an order the checkpoint does
not record: the reverse of the model's registration order, which differs between specs
(megatron-core's local spec, Transformer Engine's, a custom one). A DistributedOptimizer copies
its masters into the weights after each step, so each master, cast to its weight's dtype, IS
its weight: at each aligned start of a bucket, the one param whose sampled weight elements (the
first, the last and `SAMPLES` - 1 evenly between) all equal the masters there is the param that
lies there.
None is refused (the bucket holds something else); several (params of one size whose sampled
masters are equal, such as untrained norms) are refused naming them, unless the buffer so far
followed the local spec's table, whose next param is one of them (the table decides as it did
before content was read). A buffer on TP rank > 0 follows the order found on TP rank 0
(`TpRankOrder`). Transformer Engine ≥ 2.14's single grouped weight (one param of a layer's
local experts, `buckets.grouped_next`) holds its experts' blocks back to back: where a block
ends off the 64-element grid, the next expert's is looked for right there, unpadded, before
the aligned start (refused where both would match). The samples pick, on every run; `--verify`
(`checks.verify.check_master`) compares every rebuilt master with its weight in full.

Pure: the elements are read through `ReadElements`, which the caller provides.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ckptctl.core.checkpoint import Checkpoint, TensorEntry
from ckptctl.core.dtypes import DType
from ckptctl.core.geometry import unravel
from ckptctl.megatron.buckets import (
    ALIGN, REPLICATED, BufferOrder, LocalParam, OrderFor, Window, grouped_next, keyed_places, local_shape,
)
from ckptctl.util.errors import CheckpointError

SAMPLES = 16
"""Parts a param is sampled at: its first element, each part's start after, and its last (17
elements; fewer in a smaller param)."""

ReadElements = Callable[[str, Sequence[tuple[int, ...]], DType], list[bytes | None]]
"""(saved tensor, global coordinates, dtype) → each element cast to the dtype, as bytes (None
where the cast overflows)."""


def sample_indices(numel: int) -> list[int]:
    """The flat indices of a block of `numel` elements compared: first, last and evenly between."""
    return sorted({0, numel - 1, *(numel * k // SAMPLES for k in range(1, SAMPLES))}) if numel else []


@dataclass
class _Candidate:
    param: LocalParam
    numel: int
    dtype: DType
    offsets: list[int]
    """The flat indices compared (`sample_indices`)."""
    weights: list[bytes | None]
    """The saved weight's elements there."""


@dataclass
class ContentOrder:
    """`BufferOrder` by content: see the module docstring."""

    read: ReadElements
    ckpt: Checkpoint
    table: list[LocalParam]
    """The buffer's params in the local spec's order (the table's fill order)."""
    left_ids: dict[int, _Candidate] = field(default_factory=dict)
    """The params not placed yet, by id, in the table's order."""
    by_first: dict[tuple[DType, bytes | None], dict[int, None]] = field(default_factory=dict)
    """(dtype, first element) → the ids of the params left that start so: a bucket's first master
    at a start picks its candidates without comparing it with every param left."""
    following: bool = True
    """Every param placed so far was the table's next one."""
    placed: list[LocalParam] = field(default_factory=list)
    """The params placed, in their order."""
    grouped: set[int] = field(default_factory=set)
    """The ids of those placed right after the one before, unaligned: slabs of a single grouped weight."""

    def add(self, candidate: _Candidate) -> None:
        n = id(candidate.param)
        self.left_ids[n] = candidate
        first = candidate.weights[0] if candidate.weights else None  # an empty param never matches
        self.by_first.setdefault((candidate.dtype, first), {})[n] = None

    def next(self, entry: TensorEntry, start: int, length: int, first: bool) -> LocalParam | None:
        if not self.left_ids:
            return None
        found = []
        for dtype in {dtype for dtype, _ in self.by_first}:
            master = self.read(entry.fqn, [(start,)], dtype)[0]
            for n in self.by_first.get((dtype, master), {}) if master is not None else ():
                c = self.left_ids[n]
                if start + c.numel <= length and (first or not c.param.alone) and \
                        self.read(entry.fqn, [(start + i,) for i in c.offsets], dtype) == c.weights:
                    found.append(n)
        table_next = self.table[len(self.table) - len(self.left_ids)]
        if len(found) > 1 and self.following and id(table_next) in found:
            found = [id(table_next)]
        if len(found) != 1:
            if found:
                names = " and ".join(self.left_ids[n].param.shown for n in sorted(found, key=self._rank))
                raise CheckpointError(self.ckpt.path, f"{entry.fqn}: at element {start}, {names} are of one size "
                                                      "with equal fp32 masters: their places in the bucket cannot be "
                                                      "told apart by content, nor by megatron-core's local spec order")
            raise CheckpointError(self.ckpt.path, f"{entry.fqn}: at element {start} the fp32 masters are no param's "
                                                  f"weights ({len(self.left_ids)} left to place, "
                                                  f"{next(iter(self.left_ids.values())).param.shown} first): "
                                                  "another model or a bucket not laid out as megatron-core lays it")
        return self._take(found[0], table_next)

    def packed(self, entry: TensorEntry, cursor: int, length: int) -> LocalParam | None:
        """The next expert's slab of the single grouped weight the param placed last is a slab of,
        when its sampled weights are the masters at unaligned `cursor` (right after it, no padding);
        refused when they are also the masters at the aligned start after (content cannot tell
        a grouped weight from padded params)."""
        before = self.placed[-1] if self.placed else None
        n = next((n for n, c in self.left_ids.items() if before is not None and grouped_next(before, c.param)), None)
        if n is None:
            return None
        c = self.left_ids[n]
        if not self._matches(entry, c, cursor, length):
            return None
        aligned = -(-cursor // ALIGN) * ALIGN
        if self._matches(entry, c, aligned, length):
            raise CheckpointError(self.ckpt.path, f"{entry.fqn}: at elements {cursor} and {aligned} the fp32 masters "
                                                  f"are both {c.param.shown}'s weights: whether it is a slab of a "
                                                  "single grouped weight or a param of its own cannot be told apart "
                                                  "by content")
        self.grouped.add(n)
        return self._take(n, self.table[len(self.table) - len(self.left_ids)])

    def _matches(self, entry: TensorEntry, c: _Candidate, start: int, length: int) -> bool:
        return start + c.numel <= length and \
            self.read(entry.fqn, [(start + i,) for i in c.offsets], c.dtype) == c.weights

    def _take(self, n: int, table_next: LocalParam) -> LocalParam:
        """Place param id `n` (left to place) next."""
        placed = self.left_ids.pop(n)
        key = (placed.dtype, placed.weights[0] if placed.weights else None)
        del self.by_first[key][n]
        if not self.by_first[key]:
            del self.by_first[key]
        self.following = self.following and placed.param is table_next
        self.placed.append(placed.param)
        return placed.param

    def _rank(self, n: int) -> int:
        """Where param id `n` comes in the table's order (messages name params in it)."""
        return next(i for i, m in enumerate(self.left_ids) if m == n)

    def left(self) -> list[LocalParam]:
        return [c.param for c in self.left_ids.values()]


@dataclass
class TpRankOrder:
    """`BufferOrder` of a buffer on TP rank > 0: the order content found in TP rank 0's buffer of
    the same params (the same modules register them in the same order), each checked by content
    but a replicated one: its copy on another TP rank may have drifted from the one saved
    (megatron-core does not all-reduce over TP the gradient of every replicated param, such as
    Gated DeltaNet's `out_norm`, whose input is TP-split), and its state is not the one rebuilt."""

    read: ReadElements
    ckpt: Checkpoint
    sequence: list[LocalParam]
    """TP rank 0's params in the order found there."""
    candidates: dict[int, _Candidate]
    """This rank's blocks of the params it checks, by id."""
    grouped: set[int] = field(default_factory=set)
    """The ids of the params TP rank 0's buffer holds as slabs of a single grouped weight."""
    count: int = 0
    """How many are placed."""

    def next(self, entry: TensorEntry, start: int, length: int, first: bool) -> LocalParam | None:
        if self.count == len(self.sequence) or (self.sequence[self.count].alone and not first):
            return None
        if id(self.sequence[self.count]) in self.grouped:
            raise CheckpointError(self.ckpt.path, f"{entry.fqn}: at element {start}, "
                                                  f"{self.sequence[self.count].shown} is a slab of a single grouped "
                                                  "weight in TP rank 0's buffer, a param of its own here")
        return self._check(entry, start)

    def packed(self, entry: TensorEntry, cursor: int, length: int) -> LocalParam | None:
        if self.count == len(self.sequence) or id(self.sequence[self.count]) not in self.grouped:
            return None
        return self._check(entry, cursor)

    def _check(self, entry: TensorEntry, start: int) -> LocalParam:
        param = self.sequence[self.count]
        c = self.candidates.get(id(param))
        if c is not None and self.read(entry.fqn, [(start + i,) for i in c.offsets], c.dtype) != c.weights:
            raise CheckpointError(self.ckpt.path, f"{entry.fqn}: at element {start} the fp32 masters are not the "
                                                  f"weights of {param.shown}, which TP rank 0's buffer holds there: "
                                                  "a bucket not laid out as megatron-core lays it")
        self.count += 1
        return param

    def left(self) -> list[LocalParam]:
        return self.sequence[self.count:]


def content_order(ckpt: Checkpoint, read: ReadElements) -> OrderFor:
    """`OrderFor` that places each param by content, reading through `read`: on TP rank 0 by
    search (`ContentOrder`), on the other ranks in the order found there (`TpRankOrder`)."""
    on_rank_0: dict[tuple[int, ...], ContentOrder] = {}

    def order_for(order: list[LocalParam], tp_rank: int, tp: int) -> BufferOrder:
        same = tuple(map(id, order))  # the groups of one stage, chunk and EP rank share the param objects
        if tp_rank and same in on_rank_0:
            return TpRankOrder(read, ckpt, on_rank_0[same].placed,
                               {id(p): _candidate(ckpt, read, p, tp_rank, tp) for p in order if p.kind != REPLICATED},
                               on_rank_0[same].grouped)
        table = list(reversed(order))
        found = ContentOrder(read, ckpt, table)
        for param in table:
            found.add(_candidate(ckpt, read, param, tp_rank, tp))
        if not tp_rank:
            on_rank_0[same] = found
        return found

    return order_for


def _candidate(ckpt: Checkpoint, read: ReadElements, param: LocalParam, tp_rank: int, tp: int) -> _Candidate:
    """`param`'s TP block on rank `tp_rank`, with its weight's elements at the sampled indices."""
    shape = local_shape(ckpt, param, tp)
    numel = math.prod(shape)
    offsets = sample_indices(numel)
    places = keyed_places(ckpt, Window(param, tp_rank, tp, shape, 0, numel, {}))
    points: dict[str, list[tuple[int, tuple[int, ...]]]] = {}
    for n, flat in enumerate(offsets):
        coords = unravel(flat, shape)
        for key, src, dst, sizes in places:
            if all(s <= c < s + k for c, s, k in zip(coords, src, sizes)):
                at = tuple(d + c - s for c, s, d in zip(coords, src, dst))
                points.setdefault(key, []).append((n, (*param.lead, *at)))
                break
    dtypes = {ckpt.tensors[key].dtype for key in points}
    if len(dtypes) != 1:
        raise CheckpointError(ckpt.path, f"{param.key}: parts of dtypes {sorted(d.name for d in dtypes)}")
    dtype = dtypes.pop()
    weights: list[bytes | None] = [None] * len(offsets)
    for key, wanted in points.items():
        for (n, _), value in zip(wanted, read(key, [p for _, p in wanted], dtype)):
            weights[n] = value
    return _Candidate(param, numel, dtype, offsets, weights)

