"""`ckptctl export-torch SRC OUT.pt`: thin layer over `ckptctl.commands.export_torch`."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer

from ckptctl.cli import app
from ckptctl.cli.common import (
    device_option, dtype_option, emit_json, human_bytes, no_sync_option, run_distributed, say, show_plan,
    timing_json, timing_summary,
)
from ckptctl.cli.reshard_cmd import parse_dtype
from ckptctl.util.errors import UsageError
from ckptctl.util.wording import counted

if TYPE_CHECKING:
    from ckptctl.engine.dist import Comm
    from ckptctl.util.progress import ProgressObserver
    from ckptctl.commands.export_torch import ExportTorchReport


def report_json(report: ExportTorchReport) -> dict:
    return {
        "src": report.src, "out": report.out, "tensors": report.tensors, "values": report.values,
        "bytes": report.bytes_written, **timing_json(report), "verified": report.verified, "device": report.device,
        "dry_run": report.dry_run, "dequantized_fp8": report.dequantized,
    }


@app.command("export-torch")
def export_torch_command(
    src: Path = typer.Argument(..., help="Source DCP checkpoint directory (opened read-only)."),
    out: Path = typer.Argument(..., help="Output torch.save file, e.g. model.pt (written atomically)."),
    include: Optional[list[str]] = typer.Option(None, "--include", help="Keep only FQNs matching this glob (repeatable)."),
    exclude: Optional[list[str]] = typer.Option(None, "--exclude", help="Drop FQNs matching this glob (repeatable)."),
    dtype: str = dtype_option(),
    workers: int = typer.Option(min(4, os.cpu_count() or 1), "--workers", help="Copy threads."),
    verify: bool = typer.Option(False, "--verify", help="Re-read OUT with torch.load and compare every entry with "
                                "the source."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print what would be written; write nothing."),
    force: bool = typer.Option(False, "--force", help="Replace an existing OUT."),
    json_out: bool = typer.Option(False, "--json", help="Print a JSON summary on stdout."),
    device: str = device_option(),
    no_sync: bool = no_sync_option(),
) -> None:
    """Write the checkpoint as one torch.save file, as torch's dcp_to_torch_save does, streaming.

    The nested state dict of full tensors; torch.load(OUT) reads it. Non-tensor entries are
    decoded without running code from the checkpoint; one that cannot be is refused by name
    (leave it out with --exclude). Megatron's args (an argparse.Namespace) is kept, as torch
    keeps it: torch.load with weights_only needs argparse.Namespace allowed through
    torch.serialization.safe_globals for such a file, or pass --exclude args. Transformer
    Engine Float8Tensor weights are written as their values (float32 code × scale_inv, in
    their logical dtype, as TE dequantizes), named in the summary and --json.

    Examples:
      ckptctl export-torch demo/ckpt /tmp/model.pt
      ckptctl export-torch demo/ckpt /tmp/m.pt --include 'model.*' --dtype bf16
    """

    def run(comm: Comm, progress: ProgressObserver) -> ExportTorchReport:
        from ckptctl.commands.export_torch import ExportTorchOptions, export_torch

        if comm.world_size > 1:
            raise UsageError("export-torch writes one file from one process: run it without torchrun")
        opts = ExportTorchOptions(include=include or (), exclude=exclude or (), dtype=parse_dtype(dtype),
                                  workers=max(1, workers), device=device, sync=not no_sync)
        return export_torch(src, out, opts, force=force, verify=verify, progress=progress, dry_run=dry_run)

    def show(report: ExportTorchReport) -> None:
        if json_out:
            emit_json(report_json(report))
            return
        tensors = counted(report.tensors, "tensor")
        others = counted(report.values, "other entry", "other entries")
        if dry_run:
            show_plan([("Source", str(src)), ("Dtype", "kept" if dtype == "keep" else dtype),
                       ("Entries", f"{tensors}, {others}"),
                       ("File", f"one torch.save file, {human_bytes(report.bytes_written)}")], out, force)
            return
        fp8 = f"; {counted(len(report.dequantized), 'Transformer Engine Float8Tensor')} dequantized to their values" \
            if report.dequantized else ""
        say(f"wrote {out} ({tensors}, {others}, {human_bytes(report.bytes_written)}{fp8})" + timing_summary(report))

    run_distributed(json_out, "gloo", run, show, cast="keep" if dry_run else dtype)
