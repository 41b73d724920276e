"""`ckptctl diff A B`: thin layer over `ckptctl.commands.diff` — a table of what is not equal, a summary line.

Exit status 0 when every tensor (and bytes entry) is equal or close, 1 when anything
differs or is on one side only, 2 on bad input. On a terminal: a table of the entries that
are not equal (name, status, detail), then the summary line; in a pipe the same as plain
`name: status: detail` lines, no colour. Notes (what a DCP-vs-safetensors compare left
out, the family rules that mapped names, what `--compare-as` cast) go to stderr. The
comparing bar appears only when there are bytes to compare. The summary line is

    {T} tensors: {e} equal, {c} close, {d} differs[, {s} shape differs][, {t} dtype differs]
        [; {k} bytes entries: {be} equal, {bd} differs][; {x} only in A][; {y} only in B]

on one line, where T counts the tensors both sides hold, k the bytes entries both hold,
x and y the names (tensors and bytes entries) one side lacks; bracketed parts appear when
their count is not zero ("1 tensor", "1 bytes entry" in the singular).

`--json` prints one document (sizes in bytes, indices row-major in the logical shape):

    {
      "a": str, "b": str,
      "formats": {"a": "dcp" | "safetensors", "b": ...},
      "stripped_prefixes": {"a": "model." | null, "b": ...},   # a DCP side compared by its model tensors
      "mapped_by": {"a": "torchtitan-llama3" | null, "b": ...},  # the family whose export-hf rules named
                                                                #   the side's tensors as HF ones
      "compare_as": "bfloat16" | "float16" | "float32" | null,
      "atol": float, "rtol": float,
      "equal": bool,                                            # true exactly when exit status is 0
      "counts": {"equal": n, "close": n, "differs": n, "shape differs": n, "dtype differs": n,
                 "missing in A": n, "missing in B": n},         # tensors; every key present
      "bytes_counts": {"equal": n, "differs": n, "missing in A": n, "missing in B": n},
      "tensors": {name: {
          "status": one of the counts' keys,
          "shape": [int] | null, "dtype": str | null,           # null unless both sides agree
          "max_abs_diff": float | "inf" | "nan" | null,         # max |a-b|; 0.0 when equal; null when
                                                                #   not compared; "nan": NaN on one side
          "first_diff_index": [int] | null,                     # first element outside tolerance (differs)
          "mismatches": int | null,                             # elements outside tolerance
          "compared_as": str | null,                            # the dtype compared in, when a side was cast
          "a": {"name": str, "shape": [int], "dtype": str} | null,   # as side A holds it (its own name;
                                                                #   a mapped tensor: its sources, ", "-joined)
          "b": {...} | null}},
      "bytes_entries": {name: {"status": ..., "first_diff_index": [byte offset] | null,
                               "a": {"name": str, "nbytes": int} | null, "b": ...}},
      "notes": [str],
      "bytes_compared": int, "seconds": float
    }

Non-finite `max_abs_diff` values are strings so that the document is strict JSON.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import typer

from ckptctl.cli import app
from ckptctl.cli.common import (
    NameCell, ProgressDisplay, emit_json, hub_timeout_option, progress_wanted, run_guarded, say, stdout, write_out,
)
from ckptctl.cli.help import ARCHES, completes
from ckptctl.core.checkpoint import dtype_name
from ckptctl.util.wording import counted

if TYPE_CHECKING:  # the library is imported when the command runs
    from ckptctl.commands.diff import BytesInfo, DiffReport, EntryDiff, TensorInfo

EXIT_DIFFERENT = 1
COMPARE_AS = ("bf16", "fp16", "fp32", "bfloat16", "float16", "float32")
"""`--compare-as` values (`core.dtypes.CAST_CHOICES` but keep)."""
_STYLES = {"close": "yellow", "differs": "bold red", "shape differs": "bold red", "dtype differs": "bold red",
           "missing in A": "magenta", "missing in B": "magenta"}


def _number(value: float | None) -> float | str | None:
    if value is None or math.isfinite(value):
        return value
    return "nan" if math.isnan(value) else "inf"


def _side_json(info: TensorInfo | BytesInfo | None) -> dict[str, Any] | None:
    from ckptctl.commands.diff import TensorInfo

    if info is None:
        return None
    if isinstance(info, TensorInfo):
        return {"name": info.name, "shape": list(info.shape), "dtype": dtype_name(info.dtype)}
    return {"name": info.name, "nbytes": info.nbytes}


def _tensor_json(e: EntryDiff) -> dict[str, Any]:
    agree = e.a is not None and e.b is not None
    return {
        "status": e.status,
        "shape": list(e.a.shape) if agree and e.a.shape == e.b.shape else None,
        "dtype": dtype_name(e.a.dtype) if agree and e.a.dtype == e.b.dtype else None,
        "max_abs_diff": _number(e.max_abs_diff),
        "first_diff_index": list(e.first_diff_index) if e.first_diff_index is not None else None,
        "mismatches": e.mismatches,
        "compared_as": dtype_name(e.compared_as) if e.compared_as is not None else None,
        "a": _side_json(e.a), "b": _side_json(e.b),
    }


def report_json(report: DiffReport) -> dict[str, Any]:
    """The `--json` document (schema in the module docstring)."""
    return {
        "a": report.a, "b": report.b,
        "formats": {"a": report.a_format, "b": report.b_format},
        "stripped_prefixes": {"a": report.a_prefix, "b": report.b_prefix},
        "mapped_by": {"a": report.a_family, "b": report.b_family},
        "compare_as": dtype_name(report.compare_as) if report.compare_as is not None else None,
        "atol": report.atol, "rtol": report.rtol,
        "equal": report.equal, "counts": report.counts, "bytes_counts": report.bytes_counts,
        "tensors": {e.name: _tensor_json(e) for e in report.tensors},
        "bytes_entries": {e.name: {"status": e.status,
                                   "first_diff_index": list(e.first_diff_index) if e.first_diff_index else None,
                                   "a": _side_json(e.a), "b": _side_json(e.b)} for e in report.bytes_entries},
        "notes": report.notes,
        "bytes_compared": report.bytes_compared, "seconds": round(report.seconds, 6),
    }


def summary_line(report: DiffReport) -> str:
    """`12 tensors: 10 equal, 1 close, 1 differs; 1 only in A` (format in the module docstring)."""
    counts, bcounts = report.counts, report.bytes_counts
    both = sum(counts[s] for s in ("equal", "close", "differs", "shape differs", "dtype differs"))
    parts = [f"{counts['equal']} equal", f"{counts['close']} close", f"{counts['differs']} differs"]
    parts += [f"{counts[s]} {s}" for s in ("shape differs", "dtype differs") if counts[s]]
    line = f"{counted(both, 'tensor')}: {', '.join(parts)}"
    bytes_both = bcounts["equal"] + bcounts["differs"]
    if bytes_both:
        line += f"; {counted(bytes_both, 'bytes entry', 'bytes entries')}: {bcounts['equal']} equal, " \
                f"{bcounts['differs']} differs"
    only_a = counts["missing in B"] + bcounts["missing in B"]
    only_b = counts["missing in A"] + bcounts["missing in A"]
    line += f"; {only_a} only in A" if only_a else ""
    line += f"; {only_b} only in B" if only_b else ""
    return line


def _described(info: TensorInfo | BytesInfo) -> str:
    from ckptctl.commands.diff import TensorInfo

    if isinstance(info, TensorInfo):
        return f"{list(info.shape)} {dtype_name(info.dtype)}"
    return f"bytes entry, {info.nbytes} bytes"


def _max(value: float | None) -> str:
    return "" if value is None else f"max |a-b| {value:.6g}"


def detail(e: EntryDiff) -> str:
    """The table's detail cell: sizes, shapes, dtypes, or where and how much the values differ."""
    from ckptctl.commands.diff import BytesInfo

    if e.a is None:
        return f"B: {_described(e.b)}"
    if e.b is None:
        return f"A: {_described(e.a)}"
    if e.status == "shape differs":
        return f"A {list(e.a.shape)}, B {list(e.b.shape)}"
    if e.status == "dtype differs":
        return f"A {dtype_name(e.a.dtype)}, B {dtype_name(e.b.dtype)}"
    if isinstance(e.a, BytesInfo):
        sizes = "" if e.a.nbytes == e.b.nbytes else f"A {e.a.nbytes} bytes, B {e.b.nbytes} bytes, "
        return f"{sizes}first difference at byte {e.first_diff_index[0]}" if e.first_diff_index else ""
    cast = f" (as {dtype_name(e.compared_as)})" if e.compared_as is not None else ""
    if e.status == "close":
        return _max(e.max_abs_diff) + cast
    if e.status == "differs":
        numel = math.prod(e.a.shape)
        parts = [f"first at {list(e.first_diff_index)}", _max(e.max_abs_diff),
                 f"{e.mismatches} of {numel} elements"]
        return ", ".join(p for p in parts if p) + cast
    return ""


def _print_text(report: DiffReport) -> None:
    shown = [e for e in (*report.tensors, *report.bytes_entries) if e.status != "equal"]
    if not sys.stdout.isatty():  # a pipe: plain lines, rich never imported
        write_out("".join(f"{e.name}: {e.status}" + (f": {d}" if (d := detail(e)) else "") + "\n"
                          for e in shown) + summary_line(report) + "\n")
        return
    if shown:
        from rich.table import Table
        from rich.text import Text

        table = Table(title=f"{len(shown)} not equal", title_justify="left")
        table.add_column("name")
        table.add_column("status", no_wrap=True)
        table.add_column("detail", overflow="fold")
        for e in shown:
            table.add_row(NameCell(e.name), Text(e.status, style=_STYLES.get(e.status, "")), Text(detail(e)))
        stdout().print(table)
    stdout().print(summary_line(report), markup=False, highlight=False,
                   style="bold green" if report.equal else "bold red")


@app.command("diff")
def diff_command(
    a: Path = typer.Argument(..., help="Checkpoint A: DCP directory, safetensors model folder or .safetensors file."),
    b: Path = typer.Argument(..., help="Checkpoint B (any of the same kinds)."),
    atol: float = typer.Option(0.0, "--atol", help="Absolute tolerance: close when |a-b| <= atol + rtol*|b|."),
    rtol: float = typer.Option(0.0, "--rtol", help="Relative tolerance (default 0 with atol 0: exact)."),
    compare_as: Optional[str] = typer.Option(
        None, "--compare-as", metavar="DTYPE", autocompletion=completes(*COMPARE_AS),
        help="Compare floating-point values in this dtype (bf16, fp16, fp32): a side in another dtype is cast to "
             "it as export-hf --dtype casts (round to nearest even), then the bits are compared (or the values, "
             "within --atol/--rtol)."),
    arch: str = typer.Option(
        "auto", "--arch", metavar="ARCH", autocompletion=completes(*ARCHES),
        help="auto: a DCP checkpoint's torchtitan or Megatron names are mapped to the other side's HF names by "
             "the family's export-hf rules (fused tensors compared by their views); raw: names as saved; or a "
             "family, as export-hf --arch."),
    hf_config: Optional[str] = typer.Option(
        None, "--hf-config", metavar="<ref>",
        help="The model's config for mapping names: folder, config.json or Hub model id (default: the config.json "
             "beside the safetensors side; needed against a DCP side)."),
    tp: Optional[int] = typer.Option(None, "--tp", help="Training TP size of a Megatron checkpoint with fused "
                                                         "TP-blocked tensors (as export-hf --tp)."),
    include: Optional[list[str]] = typer.Option(None, "--include", help="Compare only names matching this glob "
                                                "(repeatable; names as compared, prefix stripped)."),
    exclude: Optional[list[str]] = typer.Option(None, "--exclude",
                                                help="Leave out names matching this glob (repeatable)."),
    workers: int = typer.Option(min(4, os.cpu_count() or 1), "--workers", help="Comparing threads."),
    hub_timeout: float = hub_timeout_option(),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON document on stdout."),
) -> None:
    """Compare two checkpoints tensor by tensor (DCP or safetensors, any layout); exit 1 if they differ.

    Examples:
      ckptctl diff demo/ckpt demo/ckpt-ws3
      ckptctl diff demo/ckpt demo/hf --atol 1e-6
      ckptctl diff demo/ckpt demo/hf-bf16 --compare-as bf16
      ckptctl diff titan/step-0 Llama-3.1-8B/
    """

    def body() -> DiffReport:
        from ckptctl.commands.diff import diff

        display = ProgressDisplay(progress_wanted(json_out))
        with display.shown():
            return diff(a, b, atol=atol, rtol=rtol, include=include or (), exclude=exclude or (),
                        progress=display, workers=max(1, workers), compare_as=compare_as, arch=arch,
                        hf_config=hf_config, tp=tp, hub_timeout=hub_timeout, preparing=display.preparing)

    report = run_guarded(body)
    if json_out:
        emit_json(report_json(report))
    else:
        for note in report.notes:
            say(f"note: {note}")
        _print_text(report)
    if not report.equal:
        raise typer.Exit(EXIT_DIFFERENT)
