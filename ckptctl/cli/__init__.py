"""The `ckptctl` command line: a thin typer layer over the library.

Errors are turned into exit statuses here and only here: a `CkptctlError` prints one line
naming the file and the problem and exits 2; `--debug` (anywhere on the line) shows the
traceback instead. `-q/--quiet` (anywhere on the line, or `CKPTCTL_NO_PROGRESS=1`) turns
progress bars off.
"""

from __future__ import annotations

from ckptctl.util.interrupt import exit_on_interrupt, finish

exit_on_interrupt()  # the console script's first import: Ctrl-C while typer and the rest load is one line too

import sys  # noqa: E402
from typing import NoReturn  # noqa: E402

import typer  # noqa: E402

from ckptctl.cli import common  # noqa: E402
from ckptctl.cli.help import Command, Group  # noqa: E402
from ckptctl.util.gc_pause import freeze_after_pauses  # noqa: E402

app = typer.Typer(
    name="ckptctl",
    cls=Group,
    no_args_is_help=True,
    add_completion=True,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


GLOBAL_FLAGS = {"--debug": "DEBUG", "-q": "QUIET", "--quiet": "QUIET"}
"""Flags accepted anywhere on the line (before or after the command): taken out before typer parses."""


def _print_version(value: bool) -> None:
    if value:
        from ckptctl import __version__

        common.write_out(f"ckptctl {__version__}\n")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "-V", "--version", callback=_print_version, is_eager=True,
                                 help="Print the version and exit."),
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks for errors (accepted anywhere on the line)."),
    quiet: bool = typer.Option(False, "-q", "--quiet", help="No progress bars (accepted anywhere on the line; "
                               "also CKPTCTL_NO_PROGRESS=1)."),
) -> None:
    """Inspect, reshard and export PyTorch Distributed Checkpoints offline.

    Exit status: 0 done (diff: equal), 1 problems found (inspect --check) or differences
    (diff), 2 bad input or unwritable output (one line names the file), 130 interrupted.
    """


def _register() -> None:
    from ckptctl.cli import commands  # noqa: F401  (each module adds its command to `app`)

    for info in app.registered_commands:  # every command's help flows, its usage reads SRC DST
        info.cls = Command


def main(argv: list[str] | None = None) -> None:
    exit_on_interrupt()
    args = list(sys.argv[1:] if argv is None else argv)
    cut = args.index("--") if "--" in args else len(args)  # after `--` every word is an argument, never a flag
    head, tail = args[:cut], args[cut:]
    for flag, name in GLOBAL_FLAGS.items():
        if flag in head:
            setattr(common, name, True)
    args = [a for a in head if a not in GLOBAL_FLAGS] + tail
    try:
        _register()
        app(args=args, prog_name="ckptctl", standalone_mode=True)
    except SystemExit as exc:
        raise SystemExit(exc.code) from None


def run() -> NoReturn:
    """The `ckptctl` program: `main`, then `interrupt.finish` (a Ctrl-C as the process ends never
    kills it by signal); `main` is the entry for programs that call ckptctl in-process. This
    process runs the one command, so the objects its phases build are frozen (`gc_pause`)."""
    freeze_after_pauses()
    try:
        main()
    except SystemExit as exc:
        finish(exc.code)
    finish(None)
