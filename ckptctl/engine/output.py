"""Write any `OutputPlan`: atomically, a share per torchrun worker, with a helper process where it pays.

Every writing command ends here once it has its plan: the output directory is filled under a
temporary name (`engine.dist.write_atomically`), each worker writes its share of the files
(the copies, then its records, planned a batch at a time), the plan's `finish` writes what comes
last, the caller's `check` and `verify` read the result back, and only then does the directory
take its name. When `finish` does not need the records' CRCs it runs while the files are written,
by the process that takes a smaller share of them for it (`OutputPlan.finish_load`): under torchrun
the first worker; in a plain run with many records on a CPU with a second core, a forked helper
(`engine.helper`) that writes the last files while the run writes the rest. That helper also runs
the part of the check that reads only the source and what `finish` wrote (`OverlappedCheck.early`:
re-reading a `.metadata` of a million chunks takes seconds), and each process checks the files it
wrote as soon as they are (`within`), so that the check after the writing is short.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Container, Protocol

from ckptctl.engine import Execute, executor, helper
from ckptctl.engine.cpu import ChunkSource, OutputFiles
from ckptctl.engine.dist import LOCAL, Comm, assign_files, write_atomically
from ckptctl.core.output_plan import OutputPlan
from ckptctl.core.plan import planned_batches
from ckptctl.util.progress import Phases


def write_files(plan: OutputPlan, directory: Path, names: Container[str], execute: Execute, chunks: ChunkSource,
                workers: int, sync: bool, advance: Callable[[int], None]) -> None:
    """Write the named files of `plan` into `directory`: their copies, then their records."""
    files = OutputFiles(directory, {n: size for n, size in plan.files.items() if n in names}, sync)
    try:
        execute([], [c for c in plan.copies if c.file in names], chunks, files, workers, advance)
        for batch in planned_batches(plan.records(names), plan.sources, plan.whole_records):
            execute(batch, [], chunks, files, workers, advance)
    finally:
        files.close()


class OverlappedCheck(Protocol):
    """The parts of an output's check that run while the output is written (`DcpCheck`)."""

    early_load: int
    """What `early` costs, in bytes of files that take as long to write."""

    def start(self) -> None:
        """Begin, in a thread, what the check reads before the output exists (no helper runs `early`)."""

    def early(self, tmp: Path) -> bytes:
        """Check what `finish` wrote, before the files are complete: in the helper, right after `finish`."""

    def within(self, tmp: Path, early: bytes | None, names: frozenset[str]) -> bytes:
        """Check what lies in files `names`, once they are written, by the process that wrote them
        (the helper passes None: it holds what its `early` found); what was found, for the check."""


def write_output(plan: OutputPlan, dst: Path, chunks: ChunkSource, phases: Phases, *, device: str, workers: int,
                 force: bool, sync: bool, check: Callable[..., None], comm: Comm = LOCAL,
                 verify: Callable[[Path], None] | None = None, overlapped: OverlappedCheck | None = None) -> int:
    """Fill directory `dst` with `plan` atomically; `check(tmp)` reads the whole output back
    before it takes its name (every run), `verify(tmp)` compares every byte (when asked).

    `overlapped`, where given, is the part of that check that runs meanwhile. A helper that runs
    `finish` runs `overlapped.early(tmp)` next, while the files are written (its share of them is
    smaller by `early_load` bytes), and delivers the result at once; each process then checks the
    files it wrote as soon as they are (`within`), and the check is called as
    `check(tmp, early, (within, …))`. Without such a helper, `overlapped.start()` begins in a
    thread what the check can read before the output exists; the process that checks calls it
    once any helper is forked (a thread must not be running across the fork). Returns the bytes
    this worker wrote.

    Collective under torchrun: every worker calls it with the same plan and writes its share of
    the files; rank 0 runs `check` and `verify` (and `finish`, unless it ran first) once every
    worker succeeded.
    """
    execute = executor(device, comm.local_rank)
    workers = max(1, workers)
    early = plan.finish is not None and not plan.finish_reads_records
    lead_finishes = early and comm.world_size > 1
    lead_load = plan.finish_load if lead_finishes else 0
    mine = assign_files(plan.files, comm.world_size, lead_load)[comm.rank]
    finished = False
    found: tuple[bytes, list[bytes]] | None = None  # what the helper's early check found; what each `within` found

    def write_share(tmp: Path, names: frozenset[str]) -> None:
        nonlocal finished, found
        if lead_finishes and comm.is_lead:  # while the others write: its share is the smaller for it
            plan.finish(tmp)
            finished = True
        alone = comm.world_size == 1 and device == "cpu"
        checks_early = early and overlapped is not None
        load = (plan.finish_load + (overlapped.early_load if checks_early else 0)) if early else 0
        theirs = helper.share({n: plan.files[n] for n in names}, load) \
            if alone and helper.wanted(plan.record_count) else frozenset()
        advance = phases.start("writing", plan.share_bytes(names))

        def helper_work(report: Callable[[int], None], deliver: Callable[[bytes], None]) -> bytes | None:
            if early:
                plan.finish(tmp)
                if checks_early:
                    deliver(overlapped.early(tmp))
            write_files(plan, tmp, theirs, execute, chunks, workers, sync, report)
            return overlapped.within(tmp, None, theirs) if checks_early else None

        running = helper.start(helper_work, advance) if theirs else None
        checked_early = running is not None and checks_early
        if overlapped is not None and comm.is_lead and not checked_early:
            overlapped.start()
        if running is not None:  # a second core: the helper writes `finish`'s files and its share meanwhile
            try:
                write_files(plan, tmp, names - theirs, execute, chunks, workers, sync, advance)
                if checked_early:
                    result = running.delivered()
                    ours = overlapped.within(tmp, result, names - theirs) if result is not None else None
                    helpers = running.join()
                    found = (result, [ours, helpers]) if result is not None and helpers is not None else None
                else:
                    running.join()
            finally:
                running.stop()
            finished = early
        else:
            write_files(plan, tmp, names, execute, chunks, workers, sync, advance)
        phases.stop()

    def finish(tmp: Path) -> None:
        if not finished and plan.finish is not None:
            plan.finish(tmp)
        if found is None:
            check(tmp)
        else:
            check(tmp, *found)
        if verify is not None:
            verify(tmp)

    write_atomically(dst, force, plan.files, write_share, finish, comm, sync, lead_load)
    return plan.share_bytes(mine)
