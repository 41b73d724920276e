"""Time ckptctl's restricted `.metadata` reader against torch's own unpickling of the same bytes.

    python bench/bench_unpickle.py [RANKS:TENSORS ...]

For each size, generates DCP metadata with torch's classes (RANKS chunks of each of TENSORS
tensors, one storage entry per chunk), pickles it as DCP does, then reports the best of a
few runs of `load_metadata_pickle` and of `pickle.loads` (which builds torch's classes),
and their ratio. Default sizes: 256:300 (76,800 chunks) and 512:490 (250,880 chunks).
"""

from __future__ import annotations

import gc
import pickle
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ckptctl.formats.pickle.unpickle import load_metadata_pickle  # noqa: E402

RUNS = 3


def make_metadata(ranks: int, tensors: int) -> bytes:
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    sd, storage = {}, {}
    for t in range(tensors):
        fqn = f"model.layers.{t}.weight"
        sd[fqn] = TensorStorageMetadata(
            properties=TensorProperties(dtype=torch.float32), size=torch.Size([4 * ranks, 16]),
            chunks=[ChunkStorageMetadata(offsets=torch.Size([r * 4, 0]), sizes=torch.Size([4, 16]))
                    for r in range(ranks)])
        for r in range(ranks):
            storage[MetadataIndex(fqn, torch.Size([r * 4, 0]))] = _StorageInfo(
                relative_path=f"__{r}_0.distcp", offset=t * 1000, length=1000)
    md = Metadata(state_dict_metadata=sd, planner_data={k: (k,) for k in sd}, storage_data=storage)
    return pickle.dumps(md)


def best(fn, data: bytes) -> float:
    times = []
    for _ in range(RUNS):
        gc.collect()
        start = time.perf_counter()
        fn(data)
        times.append(time.perf_counter() - start)
    return min(times)


def torch_loads(data: bytes) -> object:
    was = gc.isenabled()
    gc.disable()  # as fair as ckptctl's reader, which pauses the collector too
    try:
        return pickle.loads(data)
    finally:
        if was:
            gc.enable()


def main(argv: list[str]) -> None:
    sizes = [tuple(map(int, a.split(":"))) for a in argv] or [(256, 300), (512, 490)]
    warnings.simplefilter("ignore")
    print(f"{'chunks':>9} {'MB':>6} {'ckptctl s':>10} {'torch s':>8} {'ratio':>6}")
    for ranks, tensors in sizes:
        data = make_metadata(ranks, tensors)
        ours, theirs = best(load_metadata_pickle, data), best(torch_loads, data)
        print(f"{ranks * tensors:>9} {len(data) / 1e6:>6.1f} {ours:>10.3f} {theirs:>8.3f} {ours / theirs:>6.2f}")


if __name__ == "__main__":
    main(sys.argv[1:])
