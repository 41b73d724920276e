"""The options every command that writes a checkpoint takes, declared once.

reshard, import-hf and export-torch each add their own (a layout, a world size, names) to
these: which entries are written (`--include` / `--exclude`), the cast (`--dtype`) and the
engine's settings (`--workers`, `--device`, `--no-sync`). Keyword-only, so each command's
own first field (reshard's and import-hf's `world_size`) stays its first positional one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ckptctl.core.dtypes import DType


@dataclass(kw_only=True)
class RunOptions:
    include: Sequence[str] = ()
    exclude: Sequence[str] = ()
    dtype: DType | None = None
    workers: int = 4
    device: str = "auto"
    sync: bool = True
    """fsync the output before the atomic rename (`--no-sync`: leave it to the kernel, as `cp` does)."""
