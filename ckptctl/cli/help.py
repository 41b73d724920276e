"""How `--help` reads and what the shell completes.

typer's rich help keeps every line break of a docstring, so text wrapped for the source
breaks raggedly on a narrow terminal, and its usage line names arguments `{src} {dst}`.
Here prose paragraphs flow to the terminal's width (indented lines, the examples, stay
lines of their own), usage reads `SRC DST`, and options with a fixed set of values
complete them in the shell.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any, Callable, Iterator

from typer.core import TyperCommand, TyperGroup


def reflow(text: str | None) -> str | None:
    """A docstring with each paragraph's lines joined into one; an indented line (an example)
    keeps its line, in bold, its indent kept (typer dedents the text after the first paragraph)."""
    if not text:
        return text
    paragraphs = []
    for paragraph in inspect.cleandoc(text).split("\n\n"):
        lines: list[str] = []
        for line in paragraph.split("\n"):
            if line.startswith(" "):
                lines.append(f"[bold]{line}[/bold]")
            elif lines and not lines[-1].startswith("[bold]"):
                lines[-1] += " " + line
            else:
                lines.append(line)
        paragraphs.append("\n".join(lines))
    return "\n\n".join(paragraphs)


@contextlib.contextmanager
def _reader_may_leave() -> Iterator[None]:
    """Help printed into a pipe its reader has closed (`ckptctl -h | head -1`) is no error: rich,
    the only thing that exits while help is printed, would end the process with status 1."""
    try:
        yield
    except SystemExit as exc:
        if exc.code != 1:
            raise
        raise SystemExit(0) from None


class Command(TyperCommand):
    """A command whose help flows (`reflow`) and whose usage names its arguments `SRC DST`."""

    def __init__(self, *args: Any, help: str | None = None, **kwargs: Any) -> None:  # noqa: A002 (click's name)
        super().__init__(*args, help=reflow(help), **kwargs)

    def format_help(self, ctx: Any, formatter: Any) -> None:
        with _reader_may_leave():
            super().format_help(ctx, formatter)

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        pieces = [self.options_metavar] if self.options_metavar else []
        for param in self.get_params(ctx):
            if param.param_type_name == "argument":
                name = (param.name or "").upper()
                pieces.append(name if param.required else f"[{name}]")
        return pieces


class Group(TyperGroup):
    """The `ckptctl` group: its help flows as a command's does."""

    def __init__(self, *args: Any, help: str | None = None, **kwargs: Any) -> None:  # noqa: A002
        super().__init__(*args, help=reflow(help), **kwargs)

    def format_help(self, ctx: Any, formatter: Any) -> None:
        with _reader_may_leave():
            super().format_help(ctx, formatter)


def completes(*choices: str) -> Callable[[str], list[str]]:
    """The shell completion of an option that takes one of `choices`."""
    return lambda incomplete: [c for c in choices if c.startswith(incomplete)]



ARCHES = ("auto", "llama", "qwen2", "qwen3", "qwen3-moe", "qwen3-next", "qwen3.5", "deepseek-v3", "mixtral", "gemma2",
          "gemma3", "nemotron-h", "gpt-oss", "torchtitan-llama3", "torchtitan-qwen3", "torchtitan-deepseek-v3",
          "automodel", "raw")
"""export-hf's `--arch` values, `families.registry.ARCHES` spelt out so that help and completion import no
family (a test keeps the two equal); import-hf takes all but the last two."""
LAYOUTS = ("fsdp2", "megatron-fsdp", "torch-dist")
"""reshard's `--layout` values."""
TARGETS = ("fsdp2", "torchtitan", "megatron-fsdp")
"""import-hf's `--to` values (`import_hf.TARGETS`)."""
