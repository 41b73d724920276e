"""The check every `export-hf --layout distributed` output passes before it takes its name.

The same check as a model folder's (`output_check.check_safetensors`), for rank files: each
file's header, re-parsed as JSON, names the planned pieces with their dtypes and shapes at
offsets that tile its data, and its `DCP_SHARDING_INFO` gives each piece's planned offsets;
the folder, read back by the project's reader of such folders (which takes each tensor's shape
from its pieces, as torch's reader does, and refuses pieces that overlap), holds every planned
tensor, its pieces covering it; each tensor's first and last elements, read from the piece
that holds them, are the source's.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Mapping, Sequence

from ckptctl.checks.output_check import ItemElements, check_tiling, compare_samples
from ckptctl.core.checkpoint import Checkpoint, dtype_name
from ckptctl.core.dtypes import BY_SAFETENSORS
from ckptctl.core.geometry import Box, strides, union_volume
from ckptctl.core.plan import SourceTensor, TargetTensor
from ckptctl.formats.dcp.metadata import open_checkpoint
from ckptctl.formats.safetensors.distributed import VERSION, ShardFile, sharding_metadata
from ckptctl.formats.safetensors.hf_sharded import VERSION_KEY
from ckptctl.formats.safetensors.reader import SHARDING_KEY, blob_header
from ckptctl.storage.store import store_for
from ckptctl.util.errors import CheckpointError


def check_distributed_safetensors(src: Checkpoint, folder: Path, shards: Sequence[ShardFile],
                                  targets: Mapping[str, TargetTensor], sources: Mapping[str, SourceTensor]) -> None:
    """Raise CheckpointError unless `folder` holds the planned rank files, read back as above."""
    for shard in shards:
        _check_header(folder / shard.file.name, shard, targets)
    written = open_checkpoint(folder)
    if sorted(written.tensors) != sorted(targets):
        raise CheckpointError(folder, "read back, it holds other tensors than planned")
    for fqn, target in targets.items():
        entry = written.tensors[fqn]
        if entry.shape != target.shape or entry.dtype != target.dtype:
            raise CheckpointError(folder, f"{fqn}: read back as {dtype_name(entry.dtype)} {list(entry.shape)}, "
                                          f"planned {dtype_name(target.dtype)} {list(target.shape)}")
        boxes = [Box(c.offsets, c.sizes) for c in entry.chunks if c.numel]
        if target.shape and union_volume(boxes) != entry.numel:
            raise CheckpointError(folder, f"{fqn}: its pieces cover {union_volume(boxes)} of {entry.numel} elements")
    source, output = ItemElements(src), ItemElements(written)
    try:
        compare_samples(targets.values(), sources, source, lambda t, box: _element(written, output, t, box),
                        lambda fqn: folder)
    finally:
        source.close()
        output.close()


def _check_header(path: Path, shard: ShardFile, targets: Mapping[str, TargetTensor]) -> None:
    handle = store_for(path).open_read(path)
    size = handle.size
    try:
        header, data = blob_header(handle, 0)
    except (ValueError, KeyError, TypeError, struct.error, RecursionError) as exc:
        raise CheckpointError(path, f"cannot be read back ({exc})") from None
    finally:
        handle.close()
    try:
        metadata = header.get("__metadata__") or {}
        if metadata.get("format") != "pt" or metadata.get(VERSION_KEY) != VERSION:
            raise ValueError(f"its header metadata lacks format=pt or {VERSION_KEY}={VERSION}")
        if json.loads(metadata[SHARDING_KEY]) != json.loads(sharding_metadata(shard.pieces)[SHARDING_KEY]):
            raise ValueError(f"its {SHARDING_KEY} gives other offsets than planned")
        records = {k: v for k, v in header.items() if k != "__metadata__"}
        if sorted(records) != sorted(shard.pieces):
            raise ValueError("its header names other tensors than planned")
        extents = []
        for fqn, box in shard.pieces.items():
            info, target = records[fqn], targets[fqn]
            begin, end = (int(v) for v in info["data_offsets"])
            if BY_SAFETENSORS.get(info["dtype"]) != target.dtype or tuple(info["shape"]) != box.sizes \
                    or end - begin != box.numel * target.dtype.itemsize:
                raise ValueError(f"{fqn}: header says {info['dtype']} {info['shape']}, planned "
                                 f"{target.dtype.name} {list(box.sizes)}")
            extents.append((data + begin, data + end, fqn))
    except (ValueError, KeyError, TypeError, RecursionError) as exc:
        raise CheckpointError(path, f"cannot be read back ({exc})") from None
    check_tiling(path.parent, {path.name: size}, {path.name: extents}, {path.name: data})

def _element(written: Checkpoint, output: ItemElements, target: TargetTensor, box: Box) -> bytes:
    """The element at `box` (one element) of a written tensor, read from the piece that holds it."""
    entry = written.tensors[target.fqn]
    for chunk in entry.chunks:
        if all(o <= p < o + n for p, o, n in zip(box.offsets, chunk.offsets, chunk.sizes)):
            index = sum((p - o) * s for p, o, s in zip(box.offsets, chunk.offsets, strides(chunk.sizes)))
            out = bytearray(entry.itemsize)
            output.read_into(target.fqn, chunk, index * entry.itemsize, memoryview(out))
            return bytes(out)
    raise CheckpointError(written.path, f"{target.fqn}: no piece holds element {list(box.offsets)}")
