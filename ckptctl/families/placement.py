"""Where output chunks go: which rank owns which box of each tensor in a target layout.

Pure functions of shapes, names and rank counts. `fsdp2` reproduces what `fully_shard` at
N ranks saves (dim-0 `torch.chunk` rows; ranks past the end own nothing; 0-d tensors
once, on rank 0); `fsdp2_saved` keeps the empty shards, as DCP saves them. `megatron_fsdp`
reproduces Megatron-FSDP's TP×DP chunks, and `flat` turns any placement into the flat
item-coordinate chunks of CPU-offloaded optimizer buffers.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Sequence

from ckptctl.util.errors import UsageError
from ckptctl.core.geometry import Box, box_flat_ranges, chunk_rows, even_row_cuts, full_box, rows_box
from ckptctl.families.registry import parallel_dim


@dataclass(frozen=True, slots=True)
class Placed:
    """One output chunk: `box` of the tensor, written by `rank`."""

    rank: int
    box: Box


def fsdp2(shape: tuple[int, ...], world_size: int) -> list[Placed]:
    """FSDP2 `Shard(0)` chunks at `world_size` ranks; empty shards are left out."""
    return list(_fsdp2(tuple(shape), world_size))


def fsdp2_saved(shape: tuple[int, ...], world_size: int) -> list[Placed]:
    """Every rank's FSDP2 `Shard(0)` chunk as DCP saves it, empty ones too (at row `shape[0]`, where
    DTensor puts a shard past the end); a 0-d tensor once, on rank 0. torch's own
    `HuggingFaceStorageWriter(save_distributed=True)` writes each rank's, so a folder written so
    has the files and records an FSDP2 save has."""
    if not shape:
        return [Placed(0, full_box(()))]
    return [Placed(rank, rows_box(tuple(shape), start, stop))
            for rank, (start, stop) in enumerate(chunk_rows(shape[0], world_size))]


@functools.lru_cache(maxsize=1024)
def _fsdp2(shape: tuple[int, ...], world_size: int) -> tuple[Placed, ...]:
    """`fsdp2`, built once per shape: a model's layers repeat a few shapes, and the chunks are immutable."""
    if not shape or shape[0] == 0 or 0 in shape:
        return (Placed(0, full_box(shape)),)
    return tuple(Placed(rank, rows_box(shape, start, stop))
                 for rank, (start, stop) in enumerate(chunk_rows(shape[0], world_size)) if stop > start)


def megatron_fsdp(shape: tuple[int, ...], name: str, tp: int, dp: int) -> list[Placed]:
    """Megatron-FSDP chunks at TP `tp` × DP `dp`, rank = dp_rank·tp + tp_rank; empty shards left out.

    `name` is the param's name (for an optimizer state, its param's): `megatron.rows.parallel_dim`
    decides ColumnParallel (TP cuts dim 0 into `tp` equal blocks), RowParallel (TP cuts
    dim 1) or TP-duplicated (DP only, written by the tp_rank 0 rank of each DP rank). DP
    then cuts the rows of each TP block into `dp` whole-row cuts as even as possible.
    0-d and empty tensors go once to rank 0.
    """
    if not shape or 0 in shape:
        return [Placed(0, full_box(shape))]
    dim = parallel_dim(name)
    if dim is not None and dim >= len(shape):
        dim = None
    if dim is not None and shape[dim] % tp:
        raise UsageError(f"{name}: dim {dim} of {list(shape)} does not divide by TP {tp}")
    width = shape[dim] // tp if dim is not None else 0
    rows = width if dim == 0 else shape[0]
    placed = []
    for t in range(tp if dim is not None else 1):
        for d, (start, stop) in enumerate(even_row_cuts(rows, dp)):
            if stop == start:
                continue
            offsets, sizes = [start, *(0 for _ in shape[1:])], [stop - start, *shape[1:]]
            if dim == 0:
                offsets[0] += t * width
            elif dim is not None:
                offsets[dim], sizes[dim] = t * width, width
            placed.append(Placed(d * tp + t, Box(tuple(offsets), tuple(sizes))))
    return sorted(placed, key=lambda p: (p.rank, p.box.offsets))


def flat(placed: Sequence[Placed], shape: Sequence[int]) -> list[Placed]:
    """The same chunks stored flat: each box becomes its maximal contiguous item ranges (1-D boxes)."""
    return [Placed(p.rank, Box((r.start,), (r.length,))) for p in placed for r in box_flat_ranges(p.box, shape)]
