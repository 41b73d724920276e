"""`ckptctl reshard SRC DST --world-size N`: thin layer over `ckptctl.reshard`."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import typer

from ckptctl.cli import app
from ckptctl.cli.common import ByteProgress, emit_json, run_guarded, stderr, stdout
from ckptctl.errors import UsageError
from ckptctl.reshard import DTYPES, ReshardOptions, ReshardReport, reshard


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n:.2f} TB"


def report_json(report: ReshardReport) -> dict:
    return {
        "src": report.src, "dst": report.dst, "world_size": report.world_size,
        "dry_run": report.dry_run, "tensors": report.tensors, "bytes_entries": report.bytes_entries,
        "files": report.files, "bytes_read": report.bytes_read, "bytes_written": report.bytes_written,
        "seconds": round(report.seconds, 6), "gb_per_s": round(report.gb_per_s, 6),
        "peak_rss_bytes": report.peak_rss_bytes, "predicted_peak_bytes": report.predicted_peak_bytes,
        "verified": report.verified,
    }


def parse_dtype(value: str) -> object:
    if value not in DTYPES:
        raise UsageError(f"--dtype must be one of {', '.join(DTYPES)} (got {value!r})")
    return DTYPES[value]


@app.command("reshard")
def reshard_command(
    src: Path = typer.Argument(..., help="Source DCP checkpoint directory (opened read-only)."),
    dst: Path = typer.Argument(..., help="Output directory (written atomically)."),
    world_size: int = typer.Option(..., "--world-size", "-n", help="Number of ranks the output is laid out for."),
    include: Optional[list[str]] = typer.Option(None, "--include", help="Keep only FQNs matching this glob (repeatable)."),
    exclude: Optional[list[str]] = typer.Option(None, "--exclude", help="Drop FQNs matching this glob (repeatable)."),
    dtype: str = typer.Option("keep", "--dtype", help="keep|bf16|fp16|fp32: cast floating tensors."),
    workers: int = typer.Option(min(4, os.cpu_count() or 1), "--workers", help="Copy threads."),
    verify: bool = typer.Option(False, "--verify", help="Re-read the output and compare every tensor with the source."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the plan summary; write nothing."),
    force: bool = typer.Option(False, "--force", help="Replace an existing DST."),
    allow_incomplete: bool = typer.Option(False, "--allow-incomplete", help="Go on despite coverage gaps or lost optimizer state."),
    json_out: bool = typer.Option(False, "--json", help="Print a JSON summary on stdout."),
) -> None:
    """Rewrite a checkpoint as FSDP2 would save it at --world-size ranks, streaming and bit-exact."""

    def body() -> None:
        opts = ReshardOptions(world_size=world_size, include=include or (), exclude=exclude or (),
                              dtype=parse_dtype(dtype), workers=max(1, workers), allow_incomplete=allow_incomplete)
        progress = ByteProgress(0, "reshard", enabled=not json_out)

        def factory(total: int):
            progress.reset_total(total)
            return progress.advance

        with progress.shown():
            report = reshard(src, dst, opts, force=force, verify=verify, dry_run=dry_run, progress_factory=factory)
        if json_out:
            emit_json(report_json(report))
            return
        if dry_run:
            stdout.print(
                f"plan: {report.tensors} tensors, {report.bytes_entries} bytes entries -> {report.files} files "
                f"at world size {report.world_size}; read {human_bytes(report.bytes_read)}, "
                f"write {human_bytes(report.bytes_written)}; predicted peak memory "
                f"{human_bytes(report.predicted_peak_bytes)} + interpreter")
            return
        stderr.print(
            f"wrote {dst} ({report.tensors} tensors, {human_bytes(report.bytes_written)}) in {report.seconds:.2f}s, "
            f"{report.gb_per_s:.2f} GB/s, peak RSS {human_bytes(report.peak_rss_bytes)}"
            + ("; verified" if report.verified else ""))

    run_guarded(body)
