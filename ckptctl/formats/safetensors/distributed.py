"""Lay out the folder torch's `HuggingFaceStorageWriter(save_distributed=True)` writes from FSDP2.

Each rank writes its `Shard(0)` rows of every tensor of a model file into a safetensors file of
its own, `shard-{rank + 1:05}-model-{i:05}-of-{n:05}.safetensors`, whose `__metadata__` records
`format: pt`, `DCP_VERSION: 1.0` and `DCP_SHARDING_INFO`: Python's `json.dumps` of
`{name: {"saved_offsets": [...]}}` for the file's records (a rank past a tensor's last row holds
an empty record at row `rows`, as DTensor places it). No `.metadata` and no index: torch's
`HuggingFaceStorageReader` takes each tensor's shape from the extent of its pieces, and
`consolidate_safetensors_files` merges the pieces into `model-{i:05}-of-{n:05}.safetensors` by
the `fqn_to_index_mapping` it is given. Here file `i` of `n` is the plain export's, so that
mapping rebuilds the model's own files. The records are the plain export's row blocks, cut at
the ranks' rows; the headers are `writer.placed_file`'s, safetensors' own format.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from typing import Iterator, Mapping, Sequence

from ckptctl.core.geometry import Box
from ckptctl.core.plan import StreamItem, TargetTensor
from ckptctl.families.placement import fsdp2_saved
from ckptctl.formats.safetensors.hf_sharded import OFFSETS_KEY, VERSION_KEY
from ckptctl.formats.safetensors.reader import SHARDING_KEY
from ckptctl.formats.safetensors.writer import ITEM_BYTES, SafetensorsFile, item_boxes, placed_file, write_order

VERSION = "1.0"
"""torch's `HF_DCP_VERSION`, as its writer records it (`str(1.0)`)."""
SHARD_NAME = "shard-{rank:05}-model-{index:05}-of-{count:05}.safetensors"


@dataclass(frozen=True)
class ShardFile:
    """One rank's file: where its tensors are placed, and the box of each target it holds (in the file's order)."""

    file: SafetensorsFile
    pieces: dict[str, Box]


def shard_name(rank: int, index: int, count: int) -> str:
    """torch's `_gen_file_name(index, count, shard_index=rank + 1)`."""
    return SHARD_NAME.format(rank=rank + 1, index=index, count=count)


def sharding_metadata(pieces: Mapping[str, Box]) -> dict[str, str]:
    """A shard file's `__metadata__`, its `DCP_SHARDING_INFO` JSON text as torch's `json.dumps` writes it."""
    info = json.dumps({name: {OFFSETS_KEY: list(box.offsets)} for name, box in pieces.items()})
    return {"format": "pt", SHARDING_KEY: info, VERSION_KEY: VERSION}


def placed_shards(model_files: Sequence[Sequence[TargetTensor]], world_size: int) -> list[ShardFile]:
    """Each rank's file of each model file (`model_files[i - 1]`: file i's targets), rank by rank
    within a model file; a rank that holds no record of a model file writes none of it."""
    out = []
    count = len(model_files)
    for index, targets in enumerate(model_files, 1):
        by_rank: dict[int, dict[str, tuple[TargetTensor, Box]]] = {}
        for target in targets:
            for placed in fsdp2_saved(target.shape, world_size):
                by_rank.setdefault(placed.rank, {})[target.fqn] = (target, placed.box)
        for rank in sorted(by_rank):
            held = by_rank[rank]
            stored = [replace(target, shape=box.sizes, pieces=()) for target, box in held.values()]
            pieces = {t.fqn: held[t.fqn][1] for t in write_order(stored)}  # the sharding info in file order
            out.append(ShardFile(placed_file(shard_name(rank, index, count), stored, sharding_metadata(pieces)),
                                 pieces))
    return out


def piece_boxes(box: Box, itemsize: int, item_bytes: int = ITEM_BYTES) -> list[Box]:
    """A piece's row blocks, in the tensor's coordinates: the plain export's blocks of the piece."""
    if not box.sizes:
        return [box]
    return [Box((part.offsets[0] + box.offsets[0], *box.offsets[1:]), part.sizes)
            for part in item_boxes(box.sizes, itemsize, item_bytes)]


def shard_records(shard: ShardFile, targets: Mapping[str, TargetTensor]) -> Iterator[StreamItem]:
    """Every raw record of a shard file (none for an empty piece): row blocks of its pieces."""
    for fqn, box in shard.pieces.items():
        if math.prod(box.sizes) == 0:
            continue
        target = targets[fqn]
        row = math.prod(target.shape[1:]) * target.dtype.itemsize if target.shape else 0
        for part in piece_boxes(box, target.dtype.itemsize):
            skip = (part.offsets[0] - box.offsets[0]) * row if box.sizes else 0
            yield StreamItem(shard.file.name, shard.file.offsets[fqn] + skip, b"", target, part, (), tail=None)


def record_count(shards: Sequence[ShardFile], targets: Mapping[str, TargetTensor]) -> int:
    """How many records `shard_records` makes for all the shards."""
    return sum(len(piece_boxes(box, targets[fqn].dtype.itemsize)) for shard in shards
               for fqn, box in shard.pieces.items() if math.prod(box.sizes))

