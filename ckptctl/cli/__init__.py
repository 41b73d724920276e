"""The `ckptctl` command line: a thin typer layer over the library.

Errors are turned into exit statuses here and only here: a `CkptctlError` prints one line
naming the file and the problem and exits 2; `--debug` (anywhere on the line) shows the
traceback instead.
"""

from __future__ import annotations

import sys

import typer

from ckptctl.cli import common

app = typer.Typer(
    name="ckptctl",
    help="Inspect, reshard and export PyTorch Distributed Checkpoints offline.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.callback()
def _root(
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks for errors (accepted anywhere on the line)."),
) -> None:
    """Inspect, reshard and export PyTorch Distributed Checkpoints offline."""


def _register() -> None:
    from ckptctl.cli import commands  # noqa: F401  (each module adds its command to `app`)


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    common.DEBUG = "--debug" in args
    args = [a for a in args if a != "--debug"]
    _register()
    try:
        app(args=args, prog_name="ckptctl", standalone_mode=True)
    except SystemExit as exc:
        raise SystemExit(exc.code) from None
