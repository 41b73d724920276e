"""What every command shares: one-line errors, JSON output and the progress bar."""

from __future__ import annotations

import contextlib
import functools
import json
import sys
from typing import TYPE_CHECKING, Any, Callable, Iterator, TypeVar

import typer

from ckptctl.errors import CkptctlError

if TYPE_CHECKING:
    from rich.console import Console

DEBUG = False
EXIT_BAD_INPUT = 2
T = TypeVar("T")


@functools.cache
def stdout() -> Console:
    """The rich console on stdout, made (and rich imported) on first use: start-up stays short."""
    from rich.console import Console

    return Console(soft_wrap=True)


@functools.cache
def stderr() -> Console:
    """The rich console on stderr (progress bars, summaries, notes), made on first use."""
    from rich.console import Console

    return Console(stderr=True, soft_wrap=True)


def say(text: str) -> None:
    """One status line on stderr: through rich on a terminal, plain (and without importing rich) in a pipe."""
    if sys.stderr.isatty():
        stderr().print(text)
    else:
        sys.stderr.write(text + "\n")
        sys.stderr.flush()


def run_guarded(fn: Callable[[], T]) -> T:
    """Run a command body; a CkptctlError becomes one line on stderr and exit status 2."""
    try:
        return fn()
    except CkptctlError as exc:
        if DEBUG:
            raise
        if not getattr(exc, "quiet", False):  # a torchrun worker stopped by another's failure stays silent
            sys.stderr.write(f"ckptctl: error: {exc}\n")  # one write: torchrun workers share the stream
            sys.stderr.flush()
        raise SystemExit(EXIT_BAD_INPUT) from None
    except KeyboardInterrupt:
        print("ckptctl: interrupted", file=sys.stderr)
        raise SystemExit(130) from None


def human_bytes(n: int | float) -> str:
    """Decimal units, like the progress bars: 38424 → `38.4 kB`."""
    if n < 1000:
        return f"{int(n)} B"
    value = float(n)
    for unit in ("kB", "MB", "GB", "TB"):
        value /= 1000
        if value < 1000:
            return f"{value:.1f} {unit}"
    return f"{value / 1000:.1f} PB"


def emit_json(doc: Any) -> None:
    """Print one JSON document on stdout (what `--json` promises scripts)."""
    sys.stdout.write(json.dumps(doc, indent=2, sort_keys=False) + "\n")
    sys.stdout.flush()


def device_option() -> Any:
    """`--device`, shared by every command that executes a copy plan."""
    return typer.Option("auto", "--device", help="auto|cpu|cuda: where blocks are assembled and cast (auto = cuda when available).")


def no_sync_option() -> Any:
    """`--no-sync`, shared by every command that writes an output directory."""
    return typer.Option(False, "--no-sync", help="Skip fsync before the atomic rename (as cp does): faster, and a killed "
                        "run still leaves DST absent or complete, but a machine crash may not.")


def dist_backend_option() -> Any:
    """`--dist-backend`, for runs under torchrun (a plain run ignores it)."""
    return typer.Option("gloo", "--dist-backend", help="torchrun process-group backend: gloo|nccl (workers exchange only control messages).")


class ByteProgress:
    """Progress in bytes with GB/s and ETA on a terminal; silent in pipes and with --json."""

    def __init__(self, total: int, description: str, enabled: bool) -> None:
        self._progress = None
        self._task = None
        if enabled and sys.stderr.isatty():
            from rich.progress import (
                BarColumn,
                DownloadColumn,
                Progress,
                TextColumn,
                TimeRemainingColumn,
                TransferSpeedColumn,
            )

            self._progress = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                DownloadColumn(binary_units=False),
                TransferSpeedColumn(),
                TimeRemainingColumn(),
                console=stderr(),
                transient=False,
            )
            self._task = self._progress.add_task(description, total=total)

    def reset_total(self, total: int) -> None:
        if self._progress is not None:
            self._progress.update(self._task, total=total)

    def advance(self, nbytes: int) -> None:
        if self._progress is not None:
            self._progress.advance(self._task, nbytes)

    @contextlib.contextmanager
    def shown(self) -> Iterator["ByteProgress"]:
        if self._progress is None:
            yield self
            return
        with self._progress:
            yield self


def run_distributed(
    name: str,
    quiet: bool,
    dist_backend: str,
    work: Callable[[Any, Callable[[int], Callable[[int], None]]], T],
    show: Callable[[T], None],
) -> None:
    """The shape of every writing command: join torchrun's process group (or run alone), run
    `work(comm, progress_factory)` under a byte progress bar that only the lead rank shows,
    then let the lead rank `show` its report; errors become one line (`run_guarded`)."""
    from ckptctl.engine.dist import distributed_from_env

    def body() -> None:
        with distributed_from_env(dist_backend) as comm:
            progress = ByteProgress(0, name, enabled=not quiet and comm.is_lead)

            def factory(total: int) -> Callable[[int], None]:
                progress.reset_total(total)
                return progress.advance

            with progress.shown():
                report = work(comm, factory)
            lead = comm.is_lead
        if lead:
            show(report)

    run_guarded(body)
