"""`ckptctl reshard SRC DST --world-size N`: thin layer over `ckptctl.commands.reshard`."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer

from ckptctl.cli import app
from ckptctl.cli.help import LAYOUTS, completes
from ckptctl.cli.common import (
    device_option,
    dtype_option,
    dist_backend_option,
    emit_json,
    file_lines,
    files_text,
    human_bytes,
    hub_timeout_option,
    no_sync_option,
    run_distributed,
    say,
    show_plan,
    timing_json,
    timing_summary,
)
from ckptctl.util.errors import UsageError
from ckptctl.core.dtypes import CAST_CHOICES
from ckptctl.util.wording import counted

if TYPE_CHECKING:  # the library is imported when the command runs: `ckptctl --help` stays quick
    from ckptctl.engine.dist import Comm
    from ckptctl.util.progress import ProgressObserver
    from ckptctl.commands.dcp_write import DcpReport
    from ckptctl.commands.reshard import ReshardReport
    from ckptctl.commands.trainer_folder import FolderReport


def report_json(report: DcpReport) -> dict:
    return {
        "src": report.src, "dst": report.dst, "world_size": report.world_size,
        "dry_run": report.dry_run, "tensors": report.tensors, "bytes_entries": report.bytes_entries,
        "files": report.files, "bytes_read": report.bytes_read, "bytes_written": report.bytes_written,
        **timing_json(report), "predicted_peak_bytes": report.predicted_peak_bytes,
        "verified": report.verified, "processes": report.processes, "device": report.device,
    }


def folder_json(report: FolderReport) -> dict:
    """A Trainer checkpoint folder's reshard: each DCP part's report, and the files copied or dropped."""
    return {"src": report.src, "dst": report.dst, "world_size": report.world_size, "dry_run": report.dry_run,
            "parts": {name: report_json(part) for name, part in report.parts.items()},
            "copied": report.copied, "dropped": list(report.dropped), **timing_json(report),
            "verified": report.verified}


def plan_rows(report: DcpReport, dtype: str) -> list[tuple[str, str]]:
    """A DCP output's plan, for `--dry-run` (reshard, import-hf)."""
    return [("World size", str(report.world_size)), ("Dtype", "kept" if dtype == "keep" else dtype),
            ("Entries", f"{counted(report.tensors, 'tensor')}, "
                        f"{counted(report.bytes_entries, 'bytes entry', 'bytes entries')}"),
            ("Files", f"{files_text(report.data_files, report.files)}, {human_bytes(report.bytes_written)}"),
            *(("", line) for line in file_lines(report.file_sizes)),
            ("Read", human_bytes(report.bytes_read)),
            ("Peak memory", f"{human_bytes(report.predicted_peak_bytes)} (predicted)")]


def parse_dtype(value: str) -> object:
    if value not in CAST_CHOICES:
        raise UsageError(f"--dtype must be one of {', '.join(CAST_CHOICES)} (got {value!r})")
    return CAST_CHOICES[value]


@app.command("reshard")
def reshard_command(
    src: Path = typer.Argument(..., help="Source DCP checkpoint directory (opened read-only)."),
    dst: Path = typer.Argument(..., help="Output directory (written atomically)."),
    world_size: Optional[int] = typer.Option(
        None, "--world-size", "-n",
        help="Number of ranks the output is laid out for (required for fsdp2; TP×DP or omitted for megatron-fsdp)."),
    include: Optional[list[str]] = typer.Option(None, "--include", help="Keep only FQNs matching this glob (repeatable)."),
    exclude: Optional[list[str]] = typer.Option(None, "--exclude", help="Drop FQNs matching this glob (repeatable; in "
                                                "an HF Trainer / accelerate checkpoint-N folder also its files)."),
    keep_common_ranks: bool = typer.Option(False, "--keep-common-ranks",
                                           help="Keep a Trainer / accelerate folder's per-rank RNG files, or a "
                                                "Megatron-FSDP checkpoint's per-DP RNG state, of the ranks both "
                                                "sizes have (the other ranks start theirs afresh)."),
    dtype: str = dtype_option(),
    workers: int = typer.Option(min(4, os.cpu_count() or 1), "--workers", help="Copy threads."),
    verify: bool = typer.Option(False, "--verify", help="Re-read the output and compare every tensor with the source."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the plan summary; write nothing."),
    force: bool = typer.Option(False, "--force", help="Replace an existing DST."),
    allow_incomplete: bool = typer.Option(False, "--allow-incomplete", help="Go on despite coverage gaps or lost optimizer state."),
    json_out: bool = typer.Option(False, "--json", help="Print a JSON summary on stdout."),
    device: str = device_option(),
    no_sync: bool = no_sync_option(),
    dist_backend: str = dist_backend_option(),
    layout: str = typer.Option("fsdp2", "--layout", metavar="LAYOUT", autocompletion=completes(*LAYOUTS),
                               help="fsdp2 (dim-0 rows), megatron-fsdp (TP outer × DP inner boxes, one file per rank; a "
                               "torch_dist checkpoint converted to Megatron-FSDP's fsdp_dtensor) or "
                               "torch-dist (a Megatron-FSDP fsdp_dtensor checkpoint as megatron-core's torch_dist, "
                               "fully_reshardable optimizer)."),
    tp: Optional[int] = typer.Option(None, "--tp", help="TARGET tensor-parallel size: Megatron-FSDP layout, and fused "
                                     "tensors are re-blocked (or --fuse'd) for it."),
    dp: Optional[int] = typer.Option(None, "--dp", help="Data-parallel size for --layout megatron-fsdp."),
    source_tp: Optional[int] = typer.Option(None, "--source-tp", help="TP size the source's fused tensors are blocked "
                                            "for (default: args, else RowParallel chunk geometry)."),
    split_fused: bool = typer.Option(False, "--split-fused", help="Write SwiGLU fc1 as weight_w/_v and GDN in_proj/"
                                     "conv1d as .query/.key/…, params and optimizer states alike."),
    fuse: bool = typer.Option(False, "--fuse", help="Inverse of --split-fused: fuse components, TP-blocked for --tp."),
    flat_optimizer: bool = typer.Option(False, "--flat-optimizer", help="Write per-param optimizer states flat "
                                        "(1-D, item coordinates) as CPU-offloaded Megatron-FSDP saves them."),
    hf_config: Optional[Path] = typer.Option(None, "--hf-config", help="HF model folder, its config.json, or a Hub model id, giving the model "
                                             "dims a split needs (GDN heads/dims, hidden_act); default: args."),
    hub_timeout: float = hub_timeout_option(),
) -> None:
    """Rewrite a checkpoint as FSDP2 would save it at --world-size ranks, streaming and bit-exact.

    Megatron options split, fuse or re-block fused TP-blocked tensors (fc1, GDN) with their optimizer states, and lay the output out as Megatron-FSDP saves it at --tp × --dp.

    Under torchrun each worker writes a share of the rank files; rank 0 reports.

    Examples:
      ckptctl reshard demo/ckpt /tmp/ckpt-ws2 --world-size 2 --verify
      ckptctl reshard demo/ckpt /tmp/ckpt-ws8 -n 8 --dtype bf16 --dry-run
    """

    def run(comm: Comm, progress: ProgressObserver) -> ReshardReport | FolderReport:
        from ckptctl.commands.reshard import ReshardOptions, reshard
        from ckptctl.commands.trainer_folder import reshard_folder
        from ckptctl.storage.trainer_folder import trainer_folder

        opts = ReshardOptions(world_size=world_size, include=include or (), exclude=exclude or (),
                              dtype=parse_dtype(dtype), workers=max(1, workers), allow_incomplete=allow_incomplete,
                              device=device, sync=not no_sync, layout=layout, tp=tp, dp=dp, source_tp=source_tp,
                              split_fused=split_fused, fuse=fuse, flat_optimizer=flat_optimizer, hf_config=hf_config,
                              hub_timeout=hub_timeout)
        if (folder := trainer_folder(src)) is not None:
            return reshard_folder(folder, dst, opts, force=force, verify=verify, dry_run=dry_run, progress=progress,
                                  comm=comm, keep_common_ranks=keep_common_ranks)
        opts.keep_common_ranks = keep_common_ranks  # a Megatron-FSDP checkpoint's per-DP RNG state
        return reshard(src, dst, opts, force=force, verify=verify, dry_run=dry_run, progress=progress,
                       comm=comm)

    def show(report: ReshardReport | FolderReport) -> None:
        from ckptctl.commands.trainer_folder import FolderReport

        if isinstance(report, FolderReport):
            show_folder(report)
            return
        if json_out:
            emit_json(report_json(report))
            return
        if dry_run:
            show_plan([("Source", str(src)), *plan_rows(report, dtype)], dst, force)
            return
        say(f"wrote {dst} ({counted(report.tensors, 'tensor')}, {human_bytes(report.bytes_written)} in "
            f"{files_text(report.data_files, report.files)})" + timing_summary(report))

    def show_folder(report: FolderReport) -> None:
        if json_out:
            emit_json(folder_json(report))
            return
        parts = "; ".join(f"{name}: {counted(r.tensors, 'tensor')}, {human_bytes(r.bytes_written)} in "
                          f"{files_text(r.data_files, r.files)}" for name, r in report.parts.items())
        copied = f"; {counted(len(report.copied), 'file')} copied" if report.copied else ""
        dropped = f"; dropped {', '.join(report.dropped)}" if report.dropped else ""
        if dry_run:
            show_plan([("Source", str(src)), *((name, f"{counted(r.tensors, 'tensor')}, "
                                                      f"{files_text(r.data_files, r.files)} at world size "
                                                      f"{r.world_size}") for name, r in report.parts.items()),
                       ("Copied", ", ".join(report.copied) or "-"), ("Dropped", ", ".join(report.dropped) or "-")],
                      dst, force)
            return
        say(f"wrote {dst} ({parts}{copied}{dropped})" + timing_summary(report))

    run_distributed(json_out, dist_backend, run, show, cast="keep" if dry_run else dtype)
