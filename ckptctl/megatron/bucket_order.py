"""Each param's place in a DistributedOptimizer bucket, found by content.

A `dp_reshardable` bucket saves its params' fp32 masters flat, in an order the checkpoint does
not record: the reverse of the model's registration order, which differs between specs
(megatron-core's local spec, Transformer Engine's, a custom one). A DistributedOptimizer copies
its masters into the weights after each step, so each master, cast to its weight's dtype, IS
its weight: at each aligned start of a bucket, the one param whose sampled weight elements (the
first, the last and `SAMPLES` between) all equal the masters there is the param that lies there.
None is refused (the bucket holds something else); several (params of one size whose sampled
masters are equal, such as untrained norms) are refused naming them, unless the buffer so far
followed the local spec's table, whose next param is one of them (the table decides as it did
before content was read). The samples pick; verification (`checks.verify.check_master`)
compares every rebuilt master with its weight in full.

Pure: the elements are read through `ReadElements`, which the caller provides.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ckptctl.core.checkpoint import Checkpoint, TensorEntry
from ckptctl.core.dtypes import DType
from ckptctl.megatron.buckets import BufferOrder, LocalParam, OrderFor, Window, keyed_places, local_shape
from ckptctl.util.errors import CheckpointError

SAMPLES = 16
"""Elements compared per param, its first and last among them (fewer in a smaller param)."""

ReadElements = Callable[[str, Sequence[tuple[int, ...]], DType], list[bytes | None]]
"""(saved tensor, global coordinates, dtype) → each element cast to the dtype, as bytes (None
where the cast overflows)."""


def sample_indices(numel: int) -> list[int]:
    """The flat indices of a block of `numel` elements compared: first, last and evenly between."""
    return sorted({0, numel - 1, *(numel * k // SAMPLES for k in range(1, SAMPLES))}) if numel else []


def param_name(param: LocalParam) -> str:
    """A param as messages name it: its key, with its layer (and expert) index in a stack."""
    return param.key + (f"[{', '.join(map(str, param.lead))}]" if param.lead else "")


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
    following: bool = True
    """Every param placed so far was the table's next one."""

    def next(self, entry: TensorEntry, start: int, length: int, first: bool) -> LocalParam | None:
        if not self.left_ids:
            return None
        firsts: dict[DType, bytes | None] = {}
        found = []
        for n, c in self.left_ids.items():
            if start + c.numel > length or (c.param.alone and not first):
                continue
            if c.dtype not in firsts:
                firsts[c.dtype] = self.read(entry.fqn, [(start,)], c.dtype)[0]
            if firsts[c.dtype] is None or firsts[c.dtype] != c.weights[0]:
                continue
            if self.read(entry.fqn, [(start + i,) for i in c.offsets], c.dtype) == c.weights:
                found.append(n)
        table_next = len(self.table) - len(self.left_ids)
        if len(found) > 1 and self.following and id(self.table[table_next]) in found:
            found = [id(self.table[table_next])]
        if len(found) != 1:
            if found:
                names = " and ".join(param_name(self.left_ids[n].param) for n in found)
                raise CheckpointError(self.ckpt.path, f"{entry.fqn}: at element {start}, {names} are of one size with "
                                                 "equal fp32 masters: their places in the bucket cannot be told apart "
                                                 "by content, nor by megatron-core's local spec order")
            raise CheckpointError(self.ckpt.path, f"{entry.fqn}: at element {start} the fp32 masters are no param's "
                                             f"weights ({len(self.left_ids)} left to place, "
                                             f"{param_name(next(iter(self.left_ids.values())).param)} first): "
                                             "another model or a bucket not laid out as megatron-core lays it")
        param = self.left_ids.pop(found[0]).param
        self.following = self.following and param is self.table[table_next]
        return param

    def left(self) -> list[LocalParam]:
        return [c.param for c in self.left_ids.values()]


def content_order(ckpt: Checkpoint, read: ReadElements) -> OrderFor:
    """`OrderFor` that places each param by content, reading through `read`."""

    def order_for(order: list[LocalParam], tp_rank: int, tp: int) -> BufferOrder:
        table = list(reversed(order))
        found = ContentOrder(read, ckpt, table)
        for param in table:
            found.left_ids[id(param)] = _candidate(ckpt, read, param, tp_rank, tp)
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
        coords = _unravel(flat, shape)
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


def _unravel(flat: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    out = []
    for n in reversed(shape):
        flat, at = divmod(flat, n)
        out.append(at)
    return tuple(reversed(out))
