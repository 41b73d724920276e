"""`ckptctl export-hf SRC DST --hf-config REF`: thin layer over `ckptctl.commands.export_hf`."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer

from ckptctl.cli import app
from ckptctl.cli.common import (
    NameCell, ProgressDisplay, device_option, dist_backend_option, dtype_option, emit_json, human_bytes,
    hub_timeout_option, no_sync_option, run_distributed, say, stdout, timing_json, timing_summary, write_out,
)
from ckptctl.cli.help import ARCHES, completes
from ckptctl.cli.reshard_cmd import parse_dtype
from ckptctl.util.wording import counted

if TYPE_CHECKING:  # imported when the command runs: other commands do not pay for the HF families
    from ckptctl.engine.dist import Comm
    from ckptctl.commands.export_hf import ExportPreview, ExportReport, PlannedTensor, SourceRows

ROW_RANGES_SHOWN = 3
"""Row ranges of one source listed per mapping line before `(+N more)`."""


def report_json(report: ExportReport) -> dict:
    return {
        "src": report.src, "dst": report.dst, "arch": report.arch, "tp": report.tp, "dtype": report.dtype,
        "tensors": report.tensors, "parameters": report.parameters, "files": report.files,
        "bytes": report.bytes_written, **timing_json(report), "verified": report.verified, "notes": report.notes,
        "processes": report.processes, "device": report.device, "quantization": report.quantization,
    }


def preview_json(preview: ExportPreview) -> dict:
    """`--dry-run --json`: the run's summary fields, with `files` listed and the name mapping."""
    return {
        "dry_run": True, "src": preview.src, "dst": preview.dst, "arch": preview.arch, "tp": preview.tp,
        "dtype": preview.dtype, "tensors": len(preview.tensors), "parameters": preview.parameters,
        "bytes": preview.bytes,
        "files": [{"name": f.name, "bytes": f.bytes, "tensors": f.tensors} for f in preview.files],
        "side_files": preview.side_files, "weight_map": preview.weight_map, "mapping": preview.mapping,
        "merged": {t.name: {"lora_A": t.merged[0], "lora_B": t.merged[1], "scale": t.merged[2],
                            "magnitude": t.merged[3]}
                   for t in preview.tensors if t.merged is not None},
        "quantization": preview.quantization, "notes": preview.notes,
    }


def source_text(rows: SourceRows) -> str:
    """`FQN` for a whole source tensor, else `FQN rows 0:4, 8:12 (+2 more)`."""
    if rows.whole:
        return rows.fqn
    shown = ", ".join(f"{a}:{b}" for a, b in rows.rows[:ROW_RANGES_SHOWN])
    more = f" (+{len(rows.rows) - ROW_RANGES_SHOWN} more)" if len(rows.rows) > ROW_RANGES_SHOWN else ""
    return f"{rows.fqn} rows {shown}{more}"


def merged_text(tensor: PlannedTensor) -> str:
    """`+ (B @ A) · s` of a weight merged with its LoRA adapter, FQNs in full (DoRA: `, rows × m / norm`)."""
    a, b, scale, magnitude = tensor.merged
    dora = f", rows × {magnitude} / norm" if magnitude is not None else ""
    return f"+ ({b} @ {a}) · {scale!r}{dora}"


def summary_line(preview: ExportPreview) -> str:
    tp = f", TP {preview.tp}" if preview.tp is not None else ""
    return (f"{preview.arch}{tp}, {preview.dtype or 'dtype kept'}: {counted(len(preview.tensors), 'tensor')} "
            f"({counted(preview.parameters, 'parameter')}), {preview.bytes} bytes in "
            f"{counted(len(preview.files), 'safetensors file')}")


def print_preview_plain(preview: ExportPreview) -> None:
    """Plain lines for a pipe: summary, one line per file, side files, one line per HF tensor."""
    out = [f"dry run: nothing written to {preview.dst}", summary_line(preview)]
    out += [f"{f.name}  {f.bytes} bytes  {counted(f.tensors, 'tensor')}" for f in preview.files]
    out.append("also " + ", ".join(preview.side_files))
    weights = (preview.quantization or {}).get("weights", {})
    scales = {scale: weight for weight, scale in weights.items()}
    for t in preview.tensors:
        if t.name in scales:
            out.append(f"{t.name} ← the scales of {scales[t.name]}'s blocks")
            continue
        add = f" + {t.add:g}" if t.add else ""
        merged = f" {merged_text(t)}" if t.merged is not None else ""
        fp8 = ", quantized to FP8" if t.name in weights else ""
        out.append(f"{t.name} ← " + " + ".join(source_text(s) for s in t.sources) + add + merged + fp8)
    write_out("\n".join(out) + "\n")


def print_preview_table(preview: ExportPreview) -> None:
    """rich tables for a terminal: summary, files, then each HF tensor with its sources."""
    from rich import box
    from rich.table import Table
    from rich.text import Text

    console = stdout()
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column()
    for key, value in (("Dry run", f"nothing written to {preview.dst}"), ("Source", preview.src),
                       ("Arch", preview.arch + (f" (TP {preview.tp})" if preview.tp is not None else "")),
                       ("Dtype", preview.dtype or "kept"),
                       ("Tensors", f"{len(preview.tensors)} ({preview.parameters:,} parameters), "
                                   f"{human_bytes(preview.bytes)} in {counted(len(preview.files), 'file')}"),
                       ("Also", ", ".join(preview.side_files))):
        grid.add_row(key, Text(value))
    console.print(grid)
    files = Table(title=counted(len(preview.files), "safetensors file"), title_justify="left")
    files.add_column("#", justify="right", no_wrap=True)
    files.add_column("file", no_wrap=True)
    files.add_column("size", justify="right", no_wrap=True)
    files.add_column("tensors", justify="right", no_wrap=True)
    number = {}
    for i, f in enumerate(preview.files, 1):
        number[f.name] = str(i)
        files.add_row(number[f.name], Text(f.name), human_bytes(f.bytes), str(f.tensors))
    console.print(files)
    tensors = Table(title=counted(len(preview.tensors), "tensor"), title_justify="left", box=box.SIMPLE_HEAD)
    tensors.add_column("HF tensor", ratio=2)
    tensors.add_column("shape", no_wrap=True)
    tensors.add_column("#", justify="right", no_wrap=True)
    tensors.add_column("← source rows", ratio=3)
    for t in preview.tensors:
        sources = "\n".join(source_text(s) for s in t.sources) + (f"\n+ {t.add:g}" if t.add else "")
        if t.merged is not None:
            sources += f"\n{merged_text(t)}"
        tensors.add_row(NameCell(t.name), str(list(t.shape)), number[t.file], NameCell(sources))
    console.print(tensors)


@app.command("export-hf")
def export_hf_command(
    src: Path = typer.Argument(..., help="Source DCP checkpoint directory, or an HF Trainer / accelerate "
                                         "checkpoint-N folder (its model part), or a NeMo Automodel PEFT step folder (its model/ "
                                         "adapters on the base model's weights; opened read-only)."),
    dst: Path = typer.Argument(..., help="Output Hugging Face model folder (written atomically)."),
    hf_config: str = typer.Option(..., "--hf-config", metavar="<ref>",
                                  help="HF model folder with config.json, the config file, or a Hub model id "
                                       "(Qwen/Qwen3-8B: from the Hugging Face cache, else its config and "
                                       "tokenizer files are downloaded; HF_HUB_OFFLINE=1 never downloads)."),
    arch: str = typer.Option("auto", "--arch", metavar="ARCH", autocompletion=completes(*ARCHES),
                             help=f"The model family: {', '.join(ARCHES)}. auto: torchtitan names pick a "
                                  "torchtitan family, Megatron names the config's model_type, HF names raw, or "
                                  "automodel with NeMo Automodel's native experts."),
    tp: Optional[int] = typer.Option(None, "--tp", help="Training TP size, for fused TP-blocked tensors "
                                                         "(default: the checkpoint's args, else its geometry)."),
    dtype: str = dtype_option(),
    max_shard_size: str = typer.Option("5GB", "--max-shard-size",
                                       help="Largest safetensors file, as transformers reads it: 5GB (10^9 bytes), "
                                            "5GiB (2^30), 500MB, 500MiB, 1.5GB, or plain bytes; Gb/Mb/Kb are bits."),
    include: Optional[list[str]] = typer.Option(None, "--include", metavar="<glob>",
                                                help="Write only HF tensors whose name matches this glob "
                                                     "(repeatable; fnmatch, e.g. 'model.layers.0.*')."),
    exclude: Optional[list[str]] = typer.Option(None, "--exclude", metavar="<glob>",
                                                help="Leave out HF tensors whose name matches this glob "
                                                     "(repeatable; applied after --include)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Write nothing (DST may exist): show tensors, bytes, "
                                                          "shard files and the source tensors of each HF tensor."),
    workers: int = typer.Option(min(4, os.cpu_count() or 1), "--workers", help="Copy threads."),
    verify: bool = typer.Option(False, "--verify", help="Re-read every output tensor and compare it with the source, "
                                                        "and the written names with those the model expects."),
    no_name_check: bool = typer.Option(False, "--no-name-check",
                                       help="Skip checking the output names against transformers' model for the "
                                            "config (for models transformers does not know; the output may not "
                                            "load)."),
    drop_expert_bias: bool = typer.Option(False, "--drop-expert-bias",
                                          help="Leave out torchtitan's load-balancing expert bias even when it is "
                                               "not zero (the HF model routes without one: routing changes)."),
    drop_tied_head: bool = typer.Option(False, "--drop-tied-head",
                                        help="Leave out a trained output head (lm_head) the config ties to the "
                                             "embeddings even when it differs from them (by default it must equal "
                                             "them bit for bit: the HF model's head is the embeddings)."),
    merge_adapters: bool = typer.Option(False, "--merge-adapters",
                                        help="For a peft LoRA checkpoint: write each adapted weight merged, "
                                             "W + (B @ A) · α/r (α/√r with --rslora) computed whole in float32 on "
                                             "the CPU and cast once (DoRA: each row then × m / its norm): bit for "
                                             "bit peft's float32 merge_and_unload() (in bf16: that merge cast to "
                                             "bf16, not peft's own bf16 merge, which rounds twice)."),
    adapter_only: bool = typer.Option(False, "--adapter-only",
                                      help="For a peft LoRA checkpoint: write the adapters alone as a PEFT folder "
                                           "that PeftModel.from_pretrained loads on the --hf-config base model."),
    lora_alpha: Optional[float] = typer.Option(None, "--lora-alpha", metavar="α",
                                               help="The run's LoRA alpha (not in the tensors; or "
                                                    "--adapter-config; a Megatron-Bridge checkpoint's "
                                                    "run_config.yaml has it, and must agree)."),
    rslora: bool = typer.Option(False, "--rslora", help="With --lora-alpha: the run used rsLoRA (scale α/√r)."),
    adapter_name: Optional[str] = typer.Option(None, "--adapter-name", metavar="NAME",
                                               help="The peft adapter to merge or export, of a checkpoint holding "
                                                    "several (the others are left out)."),
    adapter_config: Optional[Path] = typer.Option(None, "--adapter-config", metavar="<json>",
                                                  help="The run's peft adapter_config.json: α, rsLoRA and r from it "
                                                       "(r is checked against the adapters)."),
    base: Optional[Path] = typer.Option(None, "--base", metavar="<ckpt>",
                                        help="For a Megatron-Bridge LoRA save (the adapters alone): the pretrained "
                                             "Megatron torch_dist checkpoint the run started from (its "
                                             "pretrained_checkpoint), whose weights the adapters are merged into "
                                             "(--merge-adapters) or laid out by (--adapter-only); for a NeMo "
                                             "Automodel PEFT save, the pretrained model's Hugging Face folder "
                                             "(default: the --hf-config folder)."),
    layout: str = typer.Option("hf", "--layout", metavar="LAYOUT", autocompletion=completes("hf", "distributed"),
                               help="hf (a model folder) or distributed (each of --world-size ranks' shard files of "
                                    "every model file, as torch's Hugging Face storage writer saves FSDP2 with "
                                    "save_distributed; torch's consolidation merges them)."),
    world_size: Optional[int] = typer.Option(None, "--world-size", "-n", help="Ranks of --layout distributed."),
    quantize: Optional[str] = typer.Option(None, "--quantize", metavar="SCHEME",
                                           help="Write the linear layers' weights as FP8: fp8-block (float8_e4m3fn, "
                                                "one float32 weight_scale_inv per 128×128 block, as DeepSeek-V3 "
                                                "publishes; norms, embeddings, router gates, biases and lm_head "
                                                "kept), or like:REF (the quantized weights, block and scales of the "
                                                "FP8 model folder REF; a block REF's scale codes exactly keeps it, "
                                                "so unchanged weights come back bit for bit). The values quantized "
                                                "are those written otherwise (after --dtype)."),
    force: bool = typer.Option(False, "--force", help="Replace an existing DST."),
    json_out: bool = typer.Option(False, "--json", help="Print a JSON summary on stdout (with --dry-run: the plan)."),
    hub_timeout: float = hub_timeout_option(),
    device: str = device_option(),
    no_sync: bool = no_sync_option(),
    dist_backend: str = dist_backend_option(),
) -> None:
    """Write a Hugging Face safetensors model folder from a Megatron-FSDP or FSDP2 checkpoint, streaming.

    Under torchrun each worker writes a share of the safetensors files; rank 0 reports.

    Examples:
      ckptctl export-hf demo/ckpt /tmp/hf --hf-config demo/hf-config --dtype bf16
      ckptctl export-hf demo/ckpt /tmp/hf --hf-config demo/hf-config --dry-run
      ckptctl export-hf ckpt/step-1000 hf/ --hf-config Qwen/Qwen3-8B --dtype bf16
      ckptctl export-hf ft/ hf/ --hf-config base/ --merge-adapters --lora-alpha 8
      ckptctl export-hf ft/ ad/ --hf-config base/ --adapter-only --lora-alpha 8
      ckptctl export-hf lora/ hf/ --hf-config base/ --base pre/ --merge-adapters
      ckptctl export-hf ft/ hf-fp8/ --hf-config base/ --quantize fp8-block
    """

    def options():
        from ckptctl.commands.export_hf import ExportOptions, parse_size
        from ckptctl.formats.safetensors.quantize_fp8 import parse_quantize

        return ExportOptions(arch=arch, tp=tp, dtype=parse_dtype(dtype), max_shard_size=parse_size(max_shard_size),
                             include=tuple(include or ()), exclude=tuple(exclude or ()), workers=max(1, workers),
                             device=device, sync=not no_sync, name_check=not no_name_check,
                             drop_expert_bias=drop_expert_bias, drop_tied_head=drop_tied_head, hub_timeout=hub_timeout,
                             merge_adapters=merge_adapters, adapter_only=adapter_only, lora_alpha=lora_alpha,
                             rslora=rslora, adapter_config=adapter_config, adapter_name=adapter_name, base=base,
                             layout=layout,
                             world_size=world_size, quantize=parse_quantize(quantize))

    def run(comm: Comm, progress: ProgressDisplay) -> ExportReport | ExportPreview:
        from ckptctl.commands.export_hf import export_hf, preview_export
        from ckptctl.storage.trainer_folder import model_part

        source = model_part(src)  # an HF Trainer / accelerate checkpoint-N/: its model's DCP part
        if Path(source) != Path(src):  # DST inside the folder would add an entry no reshard of it carries
            from ckptctl.storage.atomic import overlapped_input
            from ckptctl.util.errors import UsageError

            if overlapped_input(Path(dst), [Path(src)]) is not None:
                raise UsageError(f"{dst}: destination overlaps the source {src}; the source is never modified")
        if dry_run:
            return preview_export(source, dst, hf_config, options(), preparing=progress.preparing)
        return export_hf(source, dst, hf_config, options(), force=force, verify=verify, progress=progress, comm=comm,
                         preparing=progress.preparing)

    def show(report: ExportReport | ExportPreview) -> None:
        if dry_run:
            show_preview(report)
            return
        if json_out:
            emit_json(report_json(report))
            return
        for note in report.notes:
            say(f"note: {note}")
        say(f"wrote {dst} ({report.arch}, {counted(report.tensors, 'tensor')} in "
            f"{counted(report.files, 'safetensors file')}, "
            f"{human_bytes(report.bytes_written)})" + timing_summary(report))

    def show_preview(preview: ExportPreview) -> None:
        if json_out:
            emit_json(preview_json(preview))
            return
        for note in preview.notes:
            say(f"note: {note}")
        if sys.stdout.isatty():
            print_preview_table(preview)
        else:
            print_preview_plain(preview)

    run_distributed(json_out, dist_backend, run, show, cast="keep" if dry_run else dtype)
