"""`--include`/`--exclude` globs, as every command that writes applies them."""

from __future__ import annotations

import fnmatch
from typing import Sequence

from ckptctl.util.errors import UsageError


def selected(fqn: str, include: Sequence[str], exclude: Sequence[str]) -> bool:
    """FQN filter: kept when it matches an include glob (or none are given) and no exclude glob."""
    if include and not any(fnmatch.fnmatchcase(fqn, g) for g in include):
        return False
    return not any(fnmatch.fnmatchcase(fqn, g) for g in exclude)


def refuse_empty_selection(kept: int, total: int, include: Sequence[str], exclude: Sequence[str],
                           what: str = "entries") -> None:
    """`--include`/`--exclude` that keep nothing are a mistake, never an empty output with exit 0."""
    if kept == 0 and (include or exclude):
        shown = " ".join([f"--include {g!r}" for g in include] + [f"--exclude {g!r}" for g in exclude])
        raise UsageError(f"{shown} selects none of the {total} {what}")
