"""What the commands whose output is a DCP checkpoint (reshard, import-hf) share once planned.

Each plans its own `DcpOutput`; from there on a run is the same: its report's counts and
predicted peak memory (`DcpReport.planned`), then one write-and-verify sequence
(`write_dcp_output`): the destination checked, the output streamed into an atomic directory,
read back before it takes its name (`DcpCheck`), verified when asked, the run timed. Kept
here, not in either command, so neither command's module is the other's library.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, TypeVar

from ckptctl.checks.output_check import DcpCheck, located_ends
from ckptctl.checks.verify import verified_bytes, verify_dcp
from ckptctl.commands.options import RunOptions
from ckptctl.core.checkpoint import Checkpoint, file_rank
from ckptctl.core.plan import SourceTensor, source_bytes
from ckptctl.engine import helper, resolve_device, working_bytes
from ckptctl.engine.cpu import ChunkSource
from ckptctl.engine.dist import Comm
from ckptctl.engine.output import write_output
from ckptctl.formats.dcp.te_float8 import code_sources
from ckptctl.formats.dcp.writer import DcpOutput
from ckptctl.storage.atomic import check_destination
from ckptctl.util.progress import Phases, ProgressObserver, RunTiming, timed_check
from ckptctl.util.resources import peak_rss_bytes

Report = TypeVar("Report", bound="DcpReport")


@dataclass
class DcpReport(RunTiming):
    """What a run that writes a DCP checkpoint did, for `--json` and the summary line; each
    command's report adds its own figures to these."""

    src: str
    dst: str
    world_size: int
    tensors: int
    bytes_entries: int
    files: int
    """Every file the output holds: `data_files`, `.metadata`, and Megatron's own (`common.pt`, `metadata.json`)."""
    bytes_read: int
    bytes_written: int
    dry_run: bool = False
    predicted_peak_bytes: int = 0
    file_sizes: dict[str, int] = field(default_factory=dict)
    """Each `.distcp` file's size by name, in rank order: the data files, as `inspect` counts them."""

    @property
    def data_files(self) -> int:
        return len(self.file_sizes)

    @classmethod
    def planned(cls: type[Report], ckpt: Checkpoint, out: DcpOutput, src: Path, dst: Path, world_size: int,
                opts: RunOptions, dry_run: bool, comm: Comm, **figures: Any) -> Report:
        """The report of a run that writes `out`, before it does: counts and the predicted peak
        memory, and the command's own `figures`."""
        device = resolve_device(opts.device)
        return cls(
            src=str(src), dst=str(dst), world_size=world_size, tensors=len(out.targets) + len(out.literal_tensors),
            bytes_entries=len(out.bytes_entries), files=len(out.files) + 1 + len(out.extra_files),
            file_sizes=dict(sorted(out.files.items(), key=lambda item: (file_rank(item[0]) or 0, item[0]))),
            bytes_read=sum(source_bytes(t, numel, out.sources) for t, numel in out.records.target_elements())
            + sum(c.length for c in out.copy_items),
            bytes_written=out.total_bytes + sum(map(len, out.extra_files.values())), dry_run=dry_run,
            processes=comm.world_size, device=device,
            # this process as planning left it (interpreter, metadata, plan), plus what the copy adds
            predicted_peak_bytes=peak_rss_bytes() + working_bytes(out.targets.values(), out.sources, opts.workers,
                                                                  device),
            **figures,
        )


class LocatingAhead:
    """The output check's first source reads, done by a process forked before the run plans.

    Planning a big checkpoint keeps one core busy for seconds while a second one idles; the
    check, later, competes with the writing for both. So a plain run of many chunks on a machine
    of several cores forks a helper (`engine.helper`) that locates, in the source's archives, the
    items that hold each tensor's ends (`located_ends`), and the check starts from those places.
    What it could not locate, or a helper that failed, only leaves the check more to do."""

    def __init__(self, ckpt: Checkpoint, comm: Comm) -> None:
        chunks = sum(len(entry.chunks) for entry in ckpt.tensors.values())
        wanted = comm.world_size == 1 and helper.wanted(chunks)
        self._helper = helper.start(lambda report, deliver: located_ends(ckpt), _no_progress) if wanted else None

    def result(self) -> bytes | None:
        """What the helper located, once it has (None: nothing was located)."""
        if self._helper is None:
            return None
        try:
            return self._helper.join()
        except helper.HelperFailedError:
            return None
        finally:
            self.stop()

    def stop(self) -> None:
        if self._helper is not None:
            self._helper.stop()


def _no_progress(nbytes: int) -> None:
    """Locating reports no bytes."""


def write_dcp_output(ckpt: Checkpoint, out: DcpOutput, src: Path, dst: Path, report: DcpReport, opts: RunOptions,
                     started: float, *, force: bool, verify: bool, progress: ProgressObserver | None, comm: Comm,
                     views: Mapping[str, SourceTensor] | None = None, located: bytes | None = None) -> None:
    """Stream `out` from `ckpt` into an atomic DCP directory at `dst` (this worker's share of the
    rank files; rank 0 the metadata), verify it when asked (against `views`, the source views
    the plan used; default as reshard sees the source), and time the run into `report`
    (`located`: what a `LocatingAhead` found for the check)."""
    check_destination(dst, force, src)
    sources = ChunkSource(ckpt)
    sources.reader.fp8_codes = code_sources(out.targets.values())  # TE Float8Tensor items kept: their codes copied

    def verify_output(tmp: Path) -> None:
        verify_dcp(ckpt, sources, out, tmp, opts.workers,
                   phases.start("verifying", verified_bytes(out)),
                   views)
        phases.stop()
        report.verified = True

    phases = Phases(progress)
    check = DcpCheck(ckpt, out, views, located)
    try:
        report.write_bytes = write_output(out.output_plan(), dst, sources, phases, device=resolve_device(opts.device),
                                          workers=opts.workers, force=force, sync=opts.sync,
                                          check=timed_check(report, check), overlapped=check, comm=comm,
                                          verify=verify_output if verify else None)
    finally:
        check.close()
        sources.close()
    report.check_seconds += check.within_seconds  # this process's files, checked before the helper's end
    report.finish(phases, started)
