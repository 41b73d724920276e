"""Single elements of saved tensors, read where they lie and cast as the engine casts.

Content probes ask for a few elements of many tensors (`megatron.buckets` finds each param's
place in a DistributedOptimizer bucket by comparing sampled weights with the bucket's fp32
masters): each element is one positioned read of its chunk, never the chunk.
"""

from __future__ import annotations

import bisect
import operator
from collections.abc import Sequence

from ckptctl.core.checkpoint import Checkpoint
from ckptctl.core.dtypes import DType
from ckptctl.core.geometry import flat_index
from ckptctl.engine.cast import CastOverflowError, cast_into
from ckptctl.engine.cpu import ChunkSource
from ckptctl.util.errors import CheckpointError


class ElementReader:
    """`read(fqn, points, dtype)`: the elements of saved tensor `fqn` at global coordinates
    `points`, each cast to `dtype` (None where the cast overflows), as raw bytes."""

    def __init__(self, ckpt: Checkpoint) -> None:
        self.ckpt = ckpt
        self._sources = ChunkSource(ckpt)
        self._boxes: dict[str, tuple[list[tuple[int, ...]], list[tuple[tuple[int, ...], tuple[int, ...], int]]]] = {}
        """fqn → its chunks' offsets, sorted, and (offsets, sizes, chunk index) in that order."""

    def close(self) -> None:
        self._sources.close()

    def __enter__(self) -> ElementReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def read(self, fqn: str, points: Sequence[tuple[int, ...]], dtype: DType) -> list[bytes | None]:
        import torch

        entry = self.ckpt.tensors[fqn]
        size = entry.dtype.itemsize
        raw = bytearray(size * len(points))
        view = memoryview(raw)
        for n, point in enumerate(points):
            index, (offsets, sizes) = self._chunk_of(fqn, point)
            flat = flat_index(map(operator.sub, point, offsets), sizes)
            self._sources.read_into(fqn, entry.chunks[index], flat * size, view[n * size:(n + 1) * size])
        src = torch.frombuffer(raw, dtype=entry.dtype.torch) if raw else torch.empty(0, dtype=entry.dtype.torch)
        out = torch.empty(len(points), dtype=dtype.torch)
        try:
            cast_into(out, src)
        except CastOverflowError:  # one element too large: cast them one by one
            return [self.read(fqn, [p], dtype)[0] if len(points) > 1 else None for p in points]
        data = out.view(torch.uint8).numpy().tobytes()
        return [data[n * dtype.itemsize:(n + 1) * dtype.itemsize] for n in range(len(points))]

    def _chunk_of(self, fqn: str, point: tuple[int, ...]) -> tuple[int, tuple[tuple[int, ...], tuple[int, ...]]]:
        """The index and box of the chunk of `fqn` holding `point` (chunks sorted by offsets once)."""
        if fqn not in self._boxes:
            boxes = sorted((tuple(o), tuple(s), i) for i, (o, s) in enumerate(self.ckpt.tensors[fqn].boxes()))
            self._boxes[fqn] = ([b[0] for b in boxes], boxes)
        starts, boxes = self._boxes[fqn]
        at = bisect.bisect_right(starts, point)
        for offsets, sizes, index in reversed(boxes[:at]):  # the chunk holding it starts at or before it
            if all(o <= p < o + s for o, s, p in zip(offsets, sizes, point)):
                return index, (offsets, sizes)
        raise CheckpointError(self.ckpt.path, f"{fqn}: no saved chunk holds element {list(point)}")
