"""Write any `OutputPlan`: atomically, a share per torchrun worker, with a helper process where it pays.

Every writing command ends here once it has its plan: the output directory is filled under a
temporary name (`engine.dist.write_atomically`), each worker writes its share of the files
(the copies, then its records, planned a batch at a time), the plan's `finish` writes what comes
last, the caller's `check` and `verify` read the result back, and only then does the directory
take its name. When `finish` does not need the records' CRCs it runs while the files are written,
by the process that takes a smaller share of them for it (`OutputPlan.finish_load`): under torchrun
the first worker; in a plain run with many records on a CPU with a second core, a forked helper
(`engine.helper`) that writes the last files while the run writes the rest. That helper also runs
the part of the check that reads only what `finish` wrote (`early_check`: re-reading a `.metadata`
of a million chunks takes seconds), so that the check after the writing is short.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Container

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


def write_output(plan: OutputPlan, dst: Path, chunks: ChunkSource, phases: Phases, *, device: str, workers: int,
                 force: bool, sync: bool, check: Callable[..., None], comm: Comm = LOCAL,
                 verify: Callable[[Path], None] | None = None, start_check: Callable[[], None] | None = None,
                 early_check: Callable[[Path], bytes] | None = None, early_check_load: int = 0) -> int:
    """Fill directory `dst` with `plan` atomically; `check(tmp)` reads the whole output back
    before it takes its name (every run), `verify(tmp)` compares every byte (when asked).
    `early_check(tmp)`, where given, is the part of the check that reads only the source and
    what `finish` wrote: a helper that runs `finish` runs it next, while the files are written
    (it costs `early_check_load` bytes of files), and the check is then called as
    `check(tmp, result)`. Without such a helper, `start_check()`, where given, begins in a
    thread what the check can read before the output exists; the process that checks calls it
    once any helper is forked (a thread must not be running across the fork). Returns the
    bytes this worker wrote.

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
    early_result: bytes | None = None

    def write_share(tmp: Path, names: frozenset[str]) -> None:
        nonlocal finished, early_result
        if lead_finishes and comm.is_lead:  # while the others write: its share is the smaller for it
            plan.finish(tmp)
            finished = True
        alone = comm.world_size == 1 and device == "cpu"
        checks_early = early and early_check is not None
        load = (plan.finish_load + (early_check_load if checks_early else 0)) if early else 0
        theirs = helper.share({n: plan.files[n] for n in names}, load) \
            if alone and helper.wanted(plan.record_count) else frozenset()
        advance = phases.start("writing", plan.share_bytes(names))

        def helper_work(report: Callable[[int], None]) -> bytes | None:
            result = None
            if early:
                plan.finish(tmp)
                if checks_early:
                    result = early_check(tmp)
            write_files(plan, tmp, theirs, execute, chunks, workers, sync, report)
            return result

        running = helper.start(helper_work, advance) if theirs else None
        if start_check is not None and comm.is_lead and not (running is not None and checks_early):
            start_check()
        if running is not None:  # a second core: the helper writes `finish`'s files and its share meanwhile
            try:
                write_files(plan, tmp, names - theirs, execute, chunks, workers, sync, advance)
                early_result = running.join()
            finally:
                running.stop()
            finished = early
        else:
            write_files(plan, tmp, names, execute, chunks, workers, sync, advance)
        phases.stop()

    def finish(tmp: Path) -> None:
        if not finished and plan.finish is not None:
            plan.finish(tmp)
        if early_result is None:
            check(tmp)
        else:
            check(tmp, early_result)
        if verify is not None:
            verify(tmp)

    write_atomically(dst, force, plan.files, write_share, finish, comm, sync, lead_load)
    return plan.share_bytes(mine)
