"""`ckptctl export-hf SRC DST --hf-config REF`: thin layer over `ckptctl.export_hf`."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer

from ckptctl.cli import app
from ckptctl.cli.common import (
    device_option, dist_backend_option, emit_json, human_bytes, no_sync_option, run_distributed, say,
    timing_json, timing_summary,
)
from ckptctl.cli.reshard_cmd import parse_dtype
from ckptctl.engine.dist import Comm
from ckptctl.progress import ProgressObserver

if TYPE_CHECKING:  # imported when the command runs: other commands do not pay for the HF families
    from ckptctl.export_hf import ExportReport


def report_json(report: ExportReport) -> dict:
    return {
        "src": report.src, "dst": report.dst, "arch": report.arch, "tp": report.tp, "dtype": report.dtype,
        "tensors": report.tensors, "files": report.files, "bytes": report.bytes_written,
        **timing_json(report), "verified": report.verified, "notes": report.notes,
        "processes": report.processes, "device": report.device,
    }


@app.command("export-hf")
def export_hf_command(
    src: Path = typer.Argument(..., help="Source DCP checkpoint directory (opened read-only)."),
    dst: Path = typer.Argument(..., help="Output Hugging Face model folder (written atomically)."),
    hf_config: Path = typer.Option(..., "--hf-config", help="HF model folder with config.json, or the config file."),
    arch: str = typer.Option("auto", "--arch", help="auto|llama|qwen2|qwen3|qwen3-moe|qwen3-next|raw."),
    tp: Optional[int] = typer.Option(None, "--tp", help="Training TP size, for fused TP-blocked tensors "
                                                         "(default: the checkpoint's args, else its geometry)."),
    dtype: str = typer.Option("keep", "--dtype", help="keep|bf16|fp16|fp32: cast floating tensors."),
    max_shard_size: str = typer.Option("5GB", "--max-shard-size", help="Largest safetensors file, e.g. 5GB, 500MB."),
    workers: int = typer.Option(min(4, os.cpu_count() or 1), "--workers", help="Copy threads."),
    verify: bool = typer.Option(False, "--verify", help="Re-read every output tensor and compare it with the source."),
    force: bool = typer.Option(False, "--force", help="Replace an existing DST."),
    json_out: bool = typer.Option(False, "--json", help="Print a JSON summary on stdout."),
    device: str = device_option(),
    no_sync: bool = no_sync_option(),
    dist_backend: str = dist_backend_option(),
) -> None:
    """Write a Hugging Face safetensors model folder from a Megatron-FSDP or FSDP2 checkpoint, streaming.

    Under torchrun each worker writes a share of the safetensors files; rank 0 reports.
    """

    def run(comm: Comm, progress: ProgressObserver) -> ExportReport:
        from ckptctl.export_hf import ExportOptions, export_hf, parse_shard_size

        opts = ExportOptions(arch=arch, tp=tp, dtype=parse_dtype(dtype),
                             max_shard_size=parse_shard_size(max_shard_size), workers=max(1, workers), device=device,
                             sync=not no_sync)
        return export_hf(src, dst, hf_config, opts, force=force, verify=verify, progress=progress, comm=comm)

    def show(report: ExportReport) -> None:
        if json_out:
            emit_json(report_json(report))
            return
        for note in report.notes:
            say(f"note: {note}")
        say(f"wrote {dst} ({report.arch}, {report.tensors} tensors in {report.files} safetensors files, "
            f"{human_bytes(report.bytes_written)})" + timing_summary(report))

    run_distributed(json_out, dist_backend, run, show)
