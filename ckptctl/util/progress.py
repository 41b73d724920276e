"""Phases of a long run and their byte counts: what progress bars draw and reports quote.

A run moves bytes in phases (`writing`, then `verifying`; `comparing` for diff). Each
phase is announced to an optional observer (the CLI's progress bar) with its total, and
timed here with the same clock the bar uses, so the speed a bar shows and the rate a
final line or `--json` reports come from the same bytes over the same seconds.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable, Protocol

from ckptctl.util.resources import peak_rss_bytes

Advance = Callable[[int], None]


class ProgressObserver(Protocol):
    """What watches a run (the CLI's progress bars): told as each phase starts and ends."""

    def phase(self, name: str, total: int) -> Advance:
        """A phase of `total` bytes starts; the returned counter is advanced as bytes are done."""

    def end(self, phase: "Phase") -> None:
        """The running phase ended: all its bytes are counted and `phase.seconds` is final."""


@dataclass
class Phase:
    """One finished (or running) phase: its bytes and wall seconds."""

    name: str
    total: int
    started: float
    seconds: float = 0.0
    counted: int = 0

    @property
    def bytes_per_s(self) -> float:
        return self.total / self.seconds if self.seconds > 0 else 0.0


class Phases:
    """Times consecutive phases and forwards their progress to the observer, if any."""

    def __init__(self, observer: ProgressObserver | None = None) -> None:
        self._observer = observer
        self.done: dict[str, Phase] = {}
        self._current: Phase | None = None
        self._forward: Advance = _ignore
        self._lock = threading.Lock()

    def start(self, name: str, total: int) -> Advance:
        """End the running phase and begin `name`; returns the byte counter to advance (thread-safe)."""
        self.stop()
        phase = self._current = Phase(name, total, time.monotonic())
        if self._observer is None:  # nobody to forward bytes to: nothing to count
            self._forward = _ignore
            return _ignore
        forward = self._forward = self._observer.phase(name, total)
        lock = self._lock

        def advance(nbytes: int) -> None:  # per block from worker threads: one uncontended lock
            with lock:
                phase.counted += nbytes
            forward(nbytes)

        return advance

    def stop(self) -> None:
        """End the running phase: bytes it did not count one by one (record heads and tails
        around the streamed data) are counted now, so the bar ends at its total."""
        phase = self._current
        if phase is None:
            return
        if phase.counted < phase.total:
            self._forward(phase.total - phase.counted)
        phase.seconds = time.monotonic() - phase.started
        self.done[phase.name] = phase
        self._current = None
        if self._observer is not None:
            self._observer.end(phase)

    def seconds(self, name: str) -> float:
        phase = self.done.get(name)
        return phase.seconds if phase is not None else 0.0


@dataclass(kw_only=True)
class RunTiming:
    """The time and memory figures every writing command reports (`--json` and its final line)."""

    seconds: float = 0.0
    write_bytes: int = 0
    """Bytes this process wrote (its share under torchrun) in `write_seconds`."""
    write_seconds: float = 0.0
    verify_seconds: float = 0.0
    check_seconds: float = 0.0
    """What reading the output back before it took its name cost (`output_check`, every run)."""
    verified: bool = False
    peak_rss_bytes: int = 0
    processes: int = 1
    device: str = "cpu"

    @property
    def bytes_per_s(self) -> float:
        """The writing phase's rate: the figure its progress bar shows."""
        return self.write_bytes / self.write_seconds if self.write_seconds else 0.0

    def finish(self, phases: Phases, started: float) -> None:
        """Record the run's wall time since `started` (perf_counter), its phases and peak memory."""
        self.seconds = time.perf_counter() - started
        self.write_seconds, self.verify_seconds = phases.seconds("writing"), phases.seconds("verifying")
        self.peak_rss_bytes = peak_rss_bytes()


def timed_check(report: RunTiming, check: Callable[..., None]) -> Callable[..., None]:
    """`check`, its seconds added to `report.check_seconds` each time it runs."""
    def run(*args: object) -> None:
        began = time.perf_counter()
        try:
            check(*args)
        finally:
            report.check_seconds += time.perf_counter() - began

    return run


def _ignore(nbytes: int) -> None:
    """The counter of a run nobody watches."""
