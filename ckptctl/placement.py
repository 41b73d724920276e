"""Where output chunks go: which rank owns which box of each tensor in a target layout.

Pure functions of shapes and rank counts. `fsdp2` reproduces what `fully_shard` at N ranks
saves (dim-0 `torch.chunk` rows; ranks past the end own nothing; 0-d tensors once, on
rank 0). Other layouts (Megatron-FSDP TP×DP) live beside it.
"""

from __future__ import annotations

from dataclasses import dataclass

from ckptctl.geometry import Box, chunk_rows, full_box, rows_box


@dataclass(frozen=True)
class Placed:
    """One output chunk: `box` of the tensor, written by `rank`."""

    rank: int
    box: Box


def fsdp2(shape: tuple[int, ...], world_size: int) -> list[Placed]:
    """FSDP2 `Shard(0)` chunks at `world_size` ranks; empty shards are left out."""
    if not shape or shape[0] == 0 or 0 in shape:
        return [Placed(0, full_box(shape))]
    placed = []
    for rank, (start, stop) in enumerate(chunk_rows(shape[0], world_size)):
        if stop > start:
            placed.append(Placed(rank, rows_box(shape, start, stop)))
    return placed
