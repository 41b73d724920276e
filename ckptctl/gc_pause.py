"""Pause the cyclic garbage collector while a phase builds millions of small objects.

A big checkpoint's metadata, its analysis and its output plan are millions of small objects
without cycles; allocating them makes the collector rescan the growing heap again and
again. Paused, reading the metadata of 160,000 chunks takes 0.7 s instead of 2.2 s, and
analysing them 0.5 s instead of 1.5 s.

On resuming, what the phase built is frozen (`gc.freeze`): left in the youngest generation,
it would be scanned by the next collections all the same, two or three times over (1.4 s of a
163,840-chunk reshard, 0.1 s frozen). Frozen objects are still freed when their last reference
goes; only a cycle among them would outlive its use, and these are acyclic.
"""

from __future__ import annotations

import contextlib
import gc
from typing import Iterator


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.freeze()
            gc.enable()
