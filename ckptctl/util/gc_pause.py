"""Pause the cyclic garbage collector while a phase builds millions of small objects.

A big checkpoint's metadata, its analysis and its output plan are millions of small objects
without cycles; allocating them makes the collector rescan the growing heap again and
again. Paused, reading the metadata of 160,000 chunks takes 0.7 s instead of 2.2 s, and
analysing them 0.5 s instead of 1.5 s.

In a process that runs one command and exits (the CLI: `freeze_after_pauses`), what a phase
built is frozen on resuming (`gc.freeze`): left in the youngest generation, it would be scanned
by the next collections all the same (0.32 s of collections in a 163,840-chunk reshard, 0.015 s
frozen). A frozen object is never scanned again, so a cycle among the frozen outlives its use:
freezing the heap of a long-lived caller of the library would keep every cycle of garbage it
held at that moment (a fuzzing loop grew by 0.3 MB a checkpoint), so only the CLI freezes, and
not after a failed phase.
"""

from __future__ import annotations

import contextlib
import gc
from typing import Iterator

_freeze = False


def freeze_after_pauses() -> None:
    """This process runs one command and exits: what paused phases build may be frozen."""
    global _freeze
    _freeze = True


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
        if _freeze and was_enabled:  # only after a phase that succeeded
            gc.freeze()
    finally:
        if was_enabled:
            gc.enable()
