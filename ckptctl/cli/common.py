"""What every command shares: one-line errors, JSON output and the progress bar."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import sys
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, NoReturn, TypeVar

import typer

from ckptctl.cli.help import completes
from ckptctl.core.dtypes import CAST_CHOICES
from ckptctl.util.errors import CkptctlError
from ckptctl.storage.hub import DEFAULT_HUB_TIMEOUT
from ckptctl.util.interrupt import EXIT_INTERRUPTED, MESSAGE, during_body
from ckptctl.util.progress import Phase, RunTiming
from ckptctl.util.wording import counted

if TYPE_CHECKING:
    from rich.console import Console

DEBUG = False
QUIET = False
EXIT_BAD_INPUT = 2
T = TypeVar("T")


def reader_gone() -> None:
    """stdout's reader has closed the pipe (`ckptctl inspect CKPT | head -1`): what is left to
    print goes nowhere, and the command ends with the status its work earns, not an error."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def write_out(text: str) -> None:
    """Text on stdout, flushed; a closed pipe is no error (`reader_gone`)."""
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:
        reader_gone()


def write_line(text: str) -> None:
    """One line of a report on stdout: `folded` on a terminal, as it is in a pipe."""
    write_out((folded(text, stdout()) if sys.stdout.isatty() else text) + "\n")


@functools.cache
def stdout() -> Console:
    """The rich console on stdout, made (and rich imported) on first use: start-up stays short.
    A closed pipe is no error (`reader_gone`), where rich would exit 1."""
    from rich.console import Console

    class Stdout(Console):
        def on_broken_pipe(self) -> None:
            reader_gone()

    return Stdout(soft_wrap=True)


@functools.cache
def stderr() -> Console:
    """The rich console on stderr (progress bars, summaries, notes), made on first use."""
    from rich.console import Console

    return Console(stderr=True, soft_wrap=True)


@functools.cache
def _figures() -> Any:
    """rich's highlighter of values, which also colours a number with its unit whole: `0.14s`,
    `116.5 kB`, `2.07 GB/s` (its own colours only `0.` of `0.14s`)."""
    from rich.highlighter import ReprHighlighter

    class Figures(ReprHighlighter):
        highlights = [*ReprHighlighter.highlights,
                      r"(?<![\w.])(?P<number>\d+(?:\.\d+)?(?:s|%| [kMGTP]?B(?:/s)?))(?![\w.])"]

    return Figures()


_UNIT_SPACE = re.compile(r"(?<=\d) (?=[kMGTP]?B(?:/s)?(?!\w))")
"""The space between a figure and its unit (`7.0 MB/s`, `366.2 MB`, `12 B`)."""


def folded(text: str, console: Console) -> str:
    """`text` folded at spaces to the terminal's width, its next lines indented: a terminal left to
    wrap a long line cuts a word (a path, a tensor name, a figure) at its edge. A figure keeps its
    unit on its line (`7.0` / `MB/s` reads as two things): that space is held by a NUL, which no
    path holds, while textwrap folds. A dumb terminal's width is unknown (rich says 80), so its
    lines are left whole."""
    if console.is_dumb_terminal:
        return text
    held = text if "\0" in text else _UNIT_SPACE.sub("\0", text)
    return textwrap.fill(held, width=console.width, subsequent_indent="  ", break_on_hyphens=False).replace("\0", " ")


def fold_name(name: str, width: int) -> list[str]:
    """`name` in lines of at most `width`, broken after dots (`model.layers.0.` / `mlp.weight`); a
    part longer than a line is broken after its underscores, and cut only where they do not do."""
    lines, line = [], ""
    for part in re.findall(r"[^.]*\.|[^.]+$", name):
        for piece in re.findall(r"[^_]*_|[^_]+$", part) if len(part) > width else [part]:
            if line and len(line) + len(piece) > width:
                lines.append(line)
                line = ""
            line += piece
            while len(line) > width:
                lines.append(line[:width])
                line = line[width:]
    return [*lines, line] if line or not lines else lines


def fold_words(text: str, width: int) -> list[str]:
    """`text`'s lines folded at spaces to `width`, a word longer than a line (a tensor name) broken
    by `fold_name`: the names in a table's cell break after dots, never mid-word."""
    lines = []
    for paragraph in text.split("\n"):
        line = ""
        for word in paragraph.split(" "):
            if line and len(line) + 1 + len(word) <= width:
                line += " " + word
                continue
            if line:
                lines.append(line)
            *whole, line = fold_name(word, width)
            lines += whole
        lines.append(line)
    return lines


class NameCell:
    """A table cell of names and words, folded by `fold_words` at the width the table gives its
    column (rich's `overflow="fold"` cuts `…q_proj.wei` / `ght` at the column's edge). It asks for
    no less than its longest dotted part, so a name breaks at its dots when it can."""

    def __init__(self, text: str, style: str = "") -> None:
        self.text = text
        self.style = style

    def __rich_measure__(self, console: Console, options: Any) -> Any:
        from rich.measure import Measurement

        parts = [len(part) for word in self.text.split() for part in re.findall(r"[^.]*\.|[^.]+$", word)]
        return Measurement(max(parts, default=1), max(len(line) for line in self.text.split("\n")))

    def __rich_console__(self, console: Console, options: Any) -> Iterator[Any]:
        from rich.text import Text

        yield Text("\n".join(fold_words(self.text, options.max_width)), style=self.style)


def say(text: str) -> None:
    """One status line on stderr: through rich and `folded` on a terminal, plain (and without
    importing rich) in a pipe."""
    if sys.stderr.isatty():
        stderr().print(_figures()(folded(text, stderr())))
    else:
        sys.stderr.write(text + "\n")
        sys.stderr.flush()


def run_guarded(fn: Callable[[], T]) -> T:
    """Run a command body; a CkptctlError becomes one line on stderr and exit status 2."""
    try:
        with during_body():
            return fn()
    except CkptctlError as exc:
        if DEBUG:
            raise
        if not getattr(exc, "quiet", False):  # a torchrun worker stopped by another's failure stays silent
            line = f"ckptctl: error: {exc}"
            if sys.stderr.isatty():
                line = folded(line, stderr())
            sys.stderr.write(line + "\n")  # one write: torchrun workers share the stream
            sys.stderr.flush()
        raise SystemExit(EXIT_BAD_INPUT) from None
    except KeyboardInterrupt:
        interrupted()
    except Exception as exc:
        if not _wraps_an_interrupt(exc):
            raise
        interrupted()


def interrupted() -> NoReturn:
    """End a command that Ctrl-C stopped: one line, exit status 130."""
    sys.stderr.write(MESSAGE.decode())
    sys.stderr.flush()
    raise SystemExit(EXIT_INTERRUPTED) from None


def _wraps_an_interrupt(exc: BaseException) -> bool:
    """Whether `exc` was raised by a Ctrl-C that Python wrapped: a KeyboardInterrupt in a class's
    `__set_name__` (a module imported while the command runs) comes out as a RuntimeError."""
    seen = 0
    cause: BaseException | None = exc.__cause__ or exc.__context__
    while cause is not None and seen < 16:
        if isinstance(cause, KeyboardInterrupt):
            return True
        cause, seen = cause.__cause__ or cause.__context__, seen + 1
    return False


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


class Streamed(dict):
    """A JSON object whose entries are made as `emit_json` writes them, never all held at once
    (a checkpoint's tensors with their millions of chunks): its length, and `items()` anew."""

    def __init__(self, count: int, items: Callable[[], Iterator[tuple[str, Any]]]) -> None:
        super().__init__()
        self._count, self._items = count, items

    def __len__(self) -> int:
        return self._count

    def __iter__(self) -> Iterator[str]:
        return (key for key, _ in self._items())

    def items(self) -> Iterator[tuple[str, Any]]:  # type: ignore[override]
        return self._items()

    def values(self) -> Iterator[Any]:  # type: ignore[override]
        return (value for _, value in self._items())


class Fragment:
    """JSON text its maker writes for the level it is put at (`pieces(level)`), for a part of a
    document so uniform and so large that one formatter beats the generic encoder (a tensor's
    chunk records). Its text must be what `json.dumps(..., indent=2)` writes for the value."""

    __slots__ = ("pieces",)

    def __init__(self, pieces: Callable[[int], Iterator[str]]) -> None:
        self.pieces = pieces


_JSON_WRITE_CHARS = 1 << 20
"""Encoded text gathered before a write: small pieces are joined, and never much more is held."""


def emit_json(doc: Any) -> None:
    """Print one JSON document on stdout (what `--json` promises scripts), written as it is
    encoded: `Streamed` parts are never held whole. The text is `json.dumps(doc, indent=2)`'s."""
    pieces: list[str] = []
    held = 0
    for piece in indented_json(doc):
        pieces.append(piece)
        held += len(piece)
        if held >= _JSON_WRITE_CHARS:
            write_out("".join(pieces))
            pieces.clear()
            held = 0
    write_out("".join(pieces) + "\n")


def _float_text(value: float) -> str:
    """A float as `json.dumps` writes it (its repr; NaN and the infinities as JavaScript names them)."""
    if value != value:
        return "NaN"
    if value in (float("inf"), float("-inf")):
        return "Infinity" if value > 0 else "-Infinity"
    return float.__repr__(value)


_SCALAR_TEXT: dict[type, Callable[[Any], str]] = {
    str: json.encoder.encode_basestring_ascii, int: int.__repr__, float: _float_text,
    bool: lambda value: "true" if value else "false", type(None): lambda value: "null"}
"""Each scalar type's JSON text, as `json.dumps` writes it (strings through C's escaper)."""


def json_scalar(value: Any) -> str:
    """A scalar's JSON text, as `json.dumps` writes it."""
    return _SCALAR_TEXT[type(value)](value)


def indented_json(value: Any, level: int = 0) -> Iterator[str]:
    """`json.dumps(value, indent=2)` in pieces, for the types documents hold (dicts with str keys,
    `Streamed`, lists, tuples, str, int, float, bool, None). The standard library's indented
    encoder is pure Python and generic; this one writes each flat container (`_flat`: a chunk's
    record with its offsets, most of a large document) as one piece."""
    flat = _flat(value, level)
    if flat is not None:
        yield flat
    elif isinstance(value, Fragment):
        yield from value.pieces(level)
    elif isinstance(value, dict):
        inner = "\n" + "  " * (level + 1)
        sep = "{" + inner
        for key, item in value.items():
            yield f"{sep}{_key(key)}: "
            yield from indented_json(item, level + 1)
            sep = "," + inner
        yield "\n" + "  " * level + "}"
    elif isinstance(value, (list, tuple)):
        inner = "\n" + "  " * (level + 1)
        sep = "[" + inner
        for item in value:
            yield sep
            yield from indented_json(item, level + 1)
            sep = "," + inner
        yield "\n" + "  " * level + "]"
    else:
        raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


def _flat(value: Any, level: int) -> str | None:
    """The indented text of a scalar, an empty container, a list of scalars, or a dict whose values
    are those (not a `Streamed` one: never held whole); None for anything deeper."""
    text = _SCALAR_TEXT.get(type(value))
    if text is not None:
        return text(value)
    if isinstance(value, (list, tuple)):
        if not value:
            return "[]"
        if not all(type(item) in _SCALAR_TEXT for item in value):
            return None
        inner = "\n" + "  " * (level + 1)
        return "[" + inner + ("," + inner).join(map(json_scalar, value)) + "\n" + "  " * level + "]"
    if type(value) is dict:
        if not value:
            return "{}"
        inner = "\n" + "  " * (level + 1)
        parts = []
        for key, item in value.items():
            text = _SCALAR_TEXT.get(type(item))
            part = text(item) if text is not None else _flat(item, level + 1) if type(item) in (list, tuple) else None
            if part is None:
                return None
            parts.append(f"{_key(key)}: {part}")
        return "{" + inner + ("," + inner).join(parts) + "\n" + "  " * level + "}"
    if isinstance(value, dict) and not len(value):
        return "{}"
    return None


def _key(key: Any) -> str:
    """A dict key as `json.dumps` writes it: a string, or a scalar key made one."""
    if type(key) is str:
        return json.encoder.encode_basestring_ascii(key)
    text = _SCALAR_TEXT.get(type(key))
    if text is None:
        raise TypeError(f"keys must be str, int, float, bool or None, not {type(key).__name__}")
    return f'"{text(key)}"'



def device_option() -> Any:
    """`--device`, shared by every command that executes a copy plan."""
    return typer.Option("auto", "--device", help="auto|cpu|cuda: where blocks are assembled and cast (auto = cuda when available).")


def dtype_option() -> Any:
    """`--dtype`, shared by every command that writes tensors."""
    return typer.Option("keep", "--dtype", metavar="DTYPE", autocompletion=completes(*CAST_CHOICES),
                        help="Cast floating tensors to bf16 (or bfloat16), fp16 (float16) or fp32 (float32); "
                             "keep: no cast.")


def no_sync_option() -> Any:
    """`--no-sync`, shared by every command that writes an output directory."""
    return typer.Option(False, "--no-sync", help="Skip fsync before the atomic rename (as cp does): faster, and a killed "
                        "run still leaves DST absent or complete, but a machine crash may not.")


def hub_timeout_option() -> Any:
    """`--hub-timeout`, shared by every command that takes a Hugging Face Hub model id."""
    return typer.Option(DEFAULT_HUB_TIMEOUT, "--hub-timeout", metavar="SECONDS", min=0.001,
                        help="How long a Hub model id's config may take to download, connecting and reading, "
                             "before the command gives up (a cached one is not downloaded).")


def dist_backend_option() -> Any:
    """`--dist-backend`, for runs under torchrun (a plain run ignores it)."""
    return typer.Option("gloo", "--dist-backend", help="torchrun process-group backend: gloo|nccl (workers exchange only control messages).")


def timing_summary(report: RunTiming) -> str:
    """The tail of a writing command's final line: total time, then the writing phase's own rate
    (what its bar showed), the verification time, workers and peak memory."""
    return (f" in {report.seconds:.2f}s (writing {human_rate(report.bytes_per_s)}"
            + (f", verifying {report.verify_seconds:.2f}s" if report.verified else "")
            + (f", {report.processes} workers" if report.processes > 1 else "")
            + f"), peak RSS {human_bytes(report.peak_rss_bytes)}" + (", verified" if report.verified else ""))


def timing_json(report: RunTiming) -> dict[str, Any]:
    """The timing fields every writing command's `--json` shares."""
    return {"seconds": round(report.seconds, 6), "write_seconds": round(report.write_seconds, 6),
            "verify_seconds": round(report.verify_seconds, 6), "check_seconds": round(report.check_seconds, 6),
            "bytes_per_s": round(report.bytes_per_s, 3),
            "gb_per_s": round(report.bytes_per_s / 1e9, 6), "peak_rss_bytes": report.peak_rss_bytes}


PROGRESS_ENV = "CKPTCTL_NO_PROGRESS"
"""Set (to anything but empty or 0) to turn progress bars off, as `-q/--quiet` does."""


def progress_wanted(json_out: bool) -> bool:
    """Bars only for a person: a terminal on stderr, not --json, not -q, not the env switch, not TERM=dumb."""
    env = os.environ.get(PROGRESS_ENV, "")
    return (not json_out and not QUIET and env in ("", "0") and sys.stderr.isatty()
            and os.environ.get("TERM", "") != "dumb")


FILES_LISTED = 8
"""More data files than this are summarised in one line (inspect's `--json` lists them all)."""


def file_lines(files: dict[str, int]) -> list[str]:
    """Each file and its size; for many (one per rank at scale), the range of names and sizes."""
    if len(files) <= FILES_LISTED:
        return [f"{name}  {human_bytes(size)}" for name, size in files.items()]
    names = list(files)
    span = f"{names[0]} … {names[-1]}"
    small, large = min(files, key=files.__getitem__), max(files, key=files.__getitem__)
    if files[small] == files[large]:
        return [f"{span}  {human_bytes(files[small])} each"]
    return [f"{span}  {human_bytes(files[small])} ({small}) to {human_bytes(files[large])} ({large})"]


def files_text(data_files: int, files: int) -> str:
    """A DCP output's files, counted as `inspect` counts them: `3 data files + .metadata`."""
    others = files - data_files - 1
    return f"{counted(data_files, 'data file')} + .metadata" + (f" + {counted(others, 'other file')}" if others else "")


def show_plan(rows: list[tuple[str, str]], dst: Path, force: bool) -> None:
    """A dry run's plan on stdout, as export-hf's starts: what a run would write, and whether it
    would meet an existing DST. A grid on a terminal; aligned plain lines in a pipe."""
    exists = os.path.lexists(dst)
    rows = [("Dry run", f"nothing written to {dst}"),
            *((("Destination", "exists: " + ("--force replaces it" if force else
                                             "a run stops unless --force, which replaces it")),) if exists else ()),
            *rows]
    show_rows(rows, {"Destination": "yellow"})


def show_rows(rows: list[tuple[str, str]], styles: Mapping[str, str] = {}) -> None:
    """Key-value rows on stdout: a grid on a terminal (a key's value in `styles[key]`), aligned plain
    lines with nothing trailing in a pipe."""
    if not stdout().is_terminal:
        width = max(len(key) for key, _ in rows)
        write_out("".join(f"{key:<{width}}  {value}\n" for key, value in rows))
        return
    from rich.table import Table
    from rich.text import Text

    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column()
    for key, value in rows:
        grid.add_row(key, Text(value, style=styles.get(key, "")))
    stdout().print(grid)


def human_rate(bytes_per_s: float) -> str:
    """A throughput in the unit that fits: `2.07 GB/s`, `45.3 MB/s`, `812 B/s`."""
    if bytes_per_s >= 1e9:
        return f"{bytes_per_s / 1e9:.2f} GB/s"
    return human_bytes(bytes_per_s) + "/s"


class ProgressDisplay:
    """A progress bar per phase (bytes, average speed, ETA) on a terminal; nothing otherwise.

    It is the library's `ProgressObserver`. The speed shown is the phase's bytes over its
    elapsed time (not a moving window); once a phase ends its bar shows the library's own
    figure for it, the one the final line and `--json` report.
    """

    def __init__(self, enabled: bool) -> None:
        self._progress = None
        self._task = None
        self._final: dict[Any, float] = {}
        if enabled:
            from rich.progress import (
                BarColumn, DownloadColumn, Progress, ProgressColumn, TextColumn, TimeRemainingColumn,
            )
            from rich.text import Text

            final = self._final

            class AverageSpeedColumn(ProgressColumn):
                def render(self, task):  # type: ignore[no-untyped-def]
                    rate = final.get(task.id)
                    if rate is None:
                        rate = task.completed / task.elapsed if task.elapsed else 0.0
                    return Text(human_rate(rate), style="progress.data.speed")

            class Counted(ProgressColumn):
                """A column of byte counts, blank on a bar that counts none (`preparing`)."""

                def __init__(self, column: ProgressColumn) -> None:
                    super().__init__()
                    self.column = column

                def render(self, task):  # type: ignore[no-untyped-def]
                    return Text("") if task.total is None else self.column(task)  # its own refresh pace

            class Bars(Progress):
                """The bars of bytes in one grid, each `preparing` line in a grid of its own: a long
                line saying what the run waits on never squeezes the bars drawn above it."""

                def get_renderables(self):  # type: ignore[no-untyped-def]
                    counted = [task for task in self.tasks if task.total is not None]
                    if counted:
                        yield self.make_tasks_table(counted)
                    for task in self.tasks:
                        if task.total is None:
                            yield self.make_tasks_table([task])

            self._progress = Bars(
                TextColumn("[bold]{task.description:<10}"), BarColumn(), Counted(DownloadColumn(binary_units=False)),
                Counted(AverageSpeedColumn()), Counted(TimeRemainingColumn()), console=stderr(), transient=False,
            )

    def phase(self, name: str, total: int) -> Callable[[int], None]:
        """Start a bar for `name` (`writing`, `verifying`, …)."""
        if self._progress is None:
            return _ignore
        progress = self._progress
        task = self._task = progress.add_task(name, total=total)
        return lambda nbytes: progress.advance(task, nbytes)

    @contextlib.contextmanager
    def preparing(self, what: str) -> Iterator[None]:
        """A bar without bytes saying `what` the run does while no bytes move; gone once done.
        Drawn at once and taken away at once: a wait shorter than a refresh is still shown."""
        if self._progress is None:
            yield
            return
        task = self._progress.add_task(what, total=None)
        self._progress.refresh()
        try:
            yield
        finally:
            self._progress.remove_task(task)
            self._progress.refresh()

    def end(self, phase: Phase) -> None:
        """Freeze the running bar at the phase's own rate."""
        if self._progress is not None and self._task is not None:
            self._final[self._task] = phase.bytes_per_s
            self._progress.stop_task(self._task)
            self._progress.refresh()
            self._task = None

    @contextlib.contextmanager
    def shown(self) -> Iterator["ProgressDisplay"]:
        if self._progress is None:
            yield self
            return
        with self._progress:
            yield self


def _ignore(nbytes: int) -> None:
    """The counter of a bar nobody sees."""


def torch_for_cast(progress: ProgressDisplay, dtype: str) -> None:
    """Import torch before a cast's writing bar starts, under a bar that says so: imported by the
    first block cast, it would hold the writing bar at 0 bytes for seconds and halve its rate."""
    if CAST_CHOICES.get(dtype) is not None:
        with progress.preparing(f"starting torch for the {dtype} cast"):
            import torch  # noqa: F401


def run_distributed(
    json_out: bool,
    dist_backend: str,
    work: Callable[[Any, Callable[[int], Callable[[int], None]]], T],
    show: Callable[[T], None],
    cast: str = "keep",
) -> None:
    """The shape of every writing command: join torchrun's process group (or run alone), run
    `work(comm, progress)` under progress bars that only the lead rank shows (torch started
    first for a `cast`: `torch_for_cast`), then let the lead rank `show` its report; errors
    become one line (`run_guarded`)."""
    from ckptctl.engine.dist import distributed_from_env

    def body() -> None:
        with distributed_from_env(dist_backend) as comm:
            progress = ProgressDisplay(progress_wanted(json_out) and comm.is_lead)
            with progress.shown():
                torch_for_cast(progress, cast)
                report = work(comm, progress)
            lead = comm.is_lead
        if lead:
            show(report)

    run_guarded(body)
