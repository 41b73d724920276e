"""Executors of copy plans. `cpu` is the default; `cuda` does the arithmetic on a GPU; both write the same bytes.

`executor(device)` picks one for `--device auto|cpu|cuda`; every executor has the signature
of `ckptctl.engine.cpu.execute`.
"""

from __future__ import annotations

import functools
import glob
import sys
from typing import TYPE_CHECKING, Callable, Iterable, Mapping

if TYPE_CHECKING:
    from ckptctl.core.plan import SourceTensor, TargetTensor

DEVICES = ("auto", "cpu", "cuda")

Execute = Callable[..., None]


GPU_DEVICE_FILES = ("/dev/nvidia[0-9]*", "/dev/kfd", "/dev/dxg")
"""Device nodes of NVIDIA, ROCm and WSL GPUs: without any, `auto` is the CPU, decided without importing torch."""


def resolve_device(device: str) -> str:
    """`auto` → `cuda` when torch sees a CUDA device, else `cpu`; `cuda` without one is a usage error."""
    from ckptctl.util.errors import UsageError

    if device not in DEVICES:
        raise UsageError(f"--device must be one of {', '.join(DEVICES)} (got {device!r})")
    if device == "cpu":
        return "cpu"
    if device == "auto" and "torch" not in sys.modules and not any(glob.glob(p) for p in GPU_DEVICE_FILES):
        return "cpu"  # no GPU device node: skip the second-long torch import
    import torch

    available = torch.cuda.is_available()
    if device == "cuda" and not available:
        raise UsageError("--device cuda: torch sees no CUDA device (use --device cpu or auto)")
    return "cuda" if available else "cpu"


def executor(device: str, local_rank: int = 0) -> Execute:
    """The `execute` function for `device` (auto|cpu|cuda); a torchrun worker takes GPU LOCAL_RANK mod count."""
    if resolve_device(device) == "cpu":
        from ckptctl.engine.cpu import execute

        return execute
    from ckptctl.engine import cuda

    return functools.partial(cuda.execute, device=cuda.default_device(local_rank))


TORCH_RSS_BYTES = 220 << 20
"""What torch adds to a process's resident memory once imported and casting (2.13 CPU build, x86-64: 207–211 MiB)."""


def working_bytes(targets: Iterable[TargetTensor], sources: Mapping[str, SourceTensor], workers: int,
                  device: str) -> int:
    """Memory writing `targets` adds to a process that already holds its plan.

    Each worker's block buffers (two: its block and, on cast or gathered paths, a span
    scratch), the buffer small records are assembled in and the read-ahead windows on small
    source items, the cache of decoded items when some must be decoded, and torch itself when
    the run imports it: to cast, add, decode zstd items or drive a GPU (whose driver's own
    host memory is not counted). Told from the targets' pieces and their sources, before any
    record's copy runs are planned.
    """
    from ckptctl.engine.cpu import (BLOCK_BYTES, COALESCE_BYTES, DECODED_CACHE_BYTES, TILE_SPAN_BYTES,
                                    TRANSPOSE_BLOCK_BYTES)
    from ckptctl.formats.dcp.items import READ_AHEAD, READ_WINDOWS

    block = BLOCK_BYTES
    if device == "cuda":
        from ckptctl.engine.cuda import BLOCK_BYTES as block  # two pinned slots, input and output
    transposes = computes = False
    read: set[str] = set()
    for target in targets:
        for piece in target.pieces:
            transposes = transposes or piece.axes is not None
            computes = computes or bool(target.add) or sources[piece.src].dtype != target.dtype
            read.add(piece.src)
    decodes = any(sources[name].transformed for name in read)
    computes = computes or transposes
    if transposes:  # a transposed record's block, its tile span, and the tile rearranged
        block = max(block, TRANSPOSE_BLOCK_BYTES + TILE_SPAN_BYTES)
    return (workers * 2 * block + COALESCE_BYTES + READ_WINDOWS * READ_AHEAD + (DECODED_CACHE_BYTES if decodes else 0)
            + (TORCH_RSS_BYTES if decodes or computes or device == "cuda" else 0))
