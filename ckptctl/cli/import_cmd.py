"""`ckptctl import-hf HF_DIR DST --world-size N`: thin layer over `ckptctl.commands.import_hf`."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer

from ckptctl.cli import app
from ckptctl.cli.common import (
    ProgressDisplay, device_option, dist_backend_option, dtype_option, emit_json, files_text, human_bytes,
    no_sync_option, run_distributed, say, show_plan, timing_summary,
)
from ckptctl.cli.help import ARCHES, TARGETS, completes
from ckptctl.cli.reshard_cmd import parse_dtype, plan_rows
from ckptctl.util.wording import counted
from ckptctl.cli.reshard_cmd import report_json as reshard_json

if TYPE_CHECKING:
    from ckptctl.engine.dist import Comm
    from ckptctl.commands.import_hf import ImportReport


def report_json(report: ImportReport) -> dict:
    return {**reshard_json(report), "model_class": report.model_class,
            "notes": list(report.notes), "dequantized_to": report.dequantized_to}


@app.command("import-hf")
def import_hf_command(
    src: Path = typer.Argument(..., help="Hugging Face model folder (*.safetensors, index, config.json) or one "
                                         ".safetensors file (opened read-only)."),
    dst: Path = typer.Argument(..., help="Output DCP checkpoint directory (written atomically)."),
    world_size: Optional[int] = typer.Option(None, "--world-size", "-n",
                                             help="Number of ranks the output is laid out for (fsdp2: required; "
                                                  "megatron-fsdp: TP × DP)."),
    to: str = typer.Option("fsdp2", "--to", metavar="FORMAT", autocompletion=completes(*TARGETS),
                           help="fsdp2: HF names, as a fully_shard'ed transformers model saves them; "
                                "torchtitan: torchtitan's names and RoPE row order; "
                                "megatron-fsdp: Megatron names and TP×DP boxes."),
    prefix: Optional[str] = typer.Option(None, "--prefix",
                                         help="Put before every name (default 'model.' for fsdp2, as "
                                              "dcp.save({'model': model.state_dict()}) writes it; '' for torchtitan; "
                                              "'model.module.' for megatron-fsdp)."),
    arch: str = typer.Option("auto", "--arch", metavar="ARCH", autocompletion=completes(*ARCHES[:-2]),
                             help=f"torchtitan and megatron-fsdp: the model family, {', '.join(ARCHES[:-2])} "
                                  "(auto: the config's model_type)."),
    tp: Optional[int] = typer.Option(None, "--tp", help="megatron-fsdp: tensor-parallel size (fused tensors are "
                                                        "TP-blocked for it; default 1)."),
    dp: Optional[int] = typer.Option(None, "--dp", help="megatron-fsdp: data-parallel size (default --world-size "
                                                        "/ --tp)."),
    split_fused: bool = typer.Option(False, "--split-fused", help="megatron-fsdp: write SwiGLU fc1 as weight_w/_v "
                                                                  "and GDN in_proj/conv1d as .query/.key/…"),
    megatron_core: Optional[str] = typer.Option(None, "--megatron-core", metavar="RELEASE",
                                                help="megatron-fsdp: the megatron-core release that loads the output, "
                                                     "whose module names it gets (default 0.19, the current one: "
                                                     "Mamba's conv as mixer.conv1d_weight/_bias; before 0.19 "
                                                     "mixer.conv1d.weight/.bias)."),
    vocab_multiple: int = typer.Option(128, "--make-vocab-size-divisible-by",
                                       help="megatron-fsdp: pad the vocab to a multiple of this × TP, as Megatron "
                                            "does (its option of the same name)."),
    adapter: Optional[Path] = typer.Option(None, "--adapter", metavar="FOLDER",
                                           help="fsdp2: a PEFT LoRA folder (adapter_config.json, "
                                                "adapter_model.safetensors) to import with the model, as the state "
                                                "dict of get_peft_model(model, its LoraConfig) names them, to go on "
                                                "training the adapter."),
    adapter_name: str = typer.Option("default", "--adapter-name", metavar="NAME",
                                     help="With --adapter: the peft adapter name its tensors take "
                                          "(get_peft_model's adapter_name)."),
    include: Optional[list[str]] = typer.Option(None, "--include", metavar="<glob>",
                                                help="Import only HF tensors whose name matches this glob "
                                                     "(repeatable)."),
    exclude: Optional[list[str]] = typer.Option(None, "--exclude", metavar="<glob>",
                                                help="Leave out HF tensors whose name matches this glob "
                                                     "(repeatable)."),
    dtype: str = dtype_option(),
    workers: int = typer.Option(min(4, os.cpu_count() or 1), "--workers", help="Copy threads."),
    verify: bool = typer.Option(False, "--verify", help="Re-read the output and compare every tensor with the "
                                                        "safetensors source, decoded by the safetensors library."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the plan summary; write nothing."),
    no_name_check: bool = typer.Option(False, "--no-name-check",
                                       help="Skip checking the names against transformers' model for config.json "
                                            "(for models transformers does not know)."),
    force: bool = typer.Option(False, "--force", help="Replace an existing DST."),
    json_out: bool = typer.Option(False, "--json", help="Print a JSON summary on stdout."),
    device: str = device_option(),
    no_sync: bool = no_sync_option(),
    dist_backend: str = dist_backend_option(),
) -> None:
    """Write a DCP checkpoint from a Hugging Face model folder, as FSDP2, torchtitan or Megatron-FSDP saves it, streaming.

    Every name is checked against the model transformers builds for the folder's config.json
    (fsdp2: a tied lm_head is written as a copy of the embeddings, model.state_dict() lists it;
    megatron-fsdp: the family's rules must claim every HF tensor and make every Megatron row).
    A quantized folder (config.json quantization_config fp8 or mxfp4) is dequantized while
    streaming, to bf16 unless --dtype says fp32 or fp16; quantized tensors are never read as values.
    Under torchrun each worker writes a share of the rank files; rank 0 reports.

    Examples:
      ckptctl import-hf demo/hf /tmp/ckpt --world-size 2
      ckptctl import-hf Qwen3-8B/ ckpt/step-0 --world-size 8 --dtype fp32
      ckptctl import-hf Llama-3.1-8B/ step-0/ --to torchtitan --world-size 8
      ckptctl import-hf Qwen3-8B/ ckpt/step-0 --to megatron-fsdp --tp 2 --dp 4
      ckptctl import-hf Qwen3-8B-FP8/ ckpt/step-0 --world-size 8
      ckptctl import-hf Llama-3.1-8B/ step-0/ --adapter lora/ --world-size 8
    """

    def run(comm: Comm, progress: ProgressDisplay) -> ImportReport:
        from ckptctl.commands.import_hf import ImportOptions, import_hf

        opts = ImportOptions(world_size=world_size, to=to, prefix=prefix, include=tuple(include or ()),
                             exclude=tuple(exclude or ()), dtype=parse_dtype(dtype), workers=max(1, workers),
                             device=device, sync=not no_sync, name_check=not no_name_check, arch=arch, tp=tp, dp=dp,
                             split_fused=split_fused, vocab_multiple=vocab_multiple, megatron_core=megatron_core,
                             adapter=adapter, adapter_name=adapter_name)
        return import_hf(src, dst, opts, force=force, verify=verify, dry_run=dry_run, progress=progress, comm=comm,
                         preparing=progress.preparing)

    def show(report: ImportReport) -> None:
        if json_out:
            emit_json(report_json(report))
            return
        for note in report.notes:
            say(f"note: {note}")
        checked = f"names checked against {report.model_class}" if report.model_class else "names not checked"
        if dry_run:
            rows = [(key, f"{value}; quantized weights dequantized to {report.dequantized_to}"
                     if key == "Dtype" and report.dequantized_to and dtype == "keep" else value)
                    for key, value in plan_rows(report, dtype)]
            show_plan([("Source", str(src)), ("As", to), *rows, ("Names", checked)], dst, force)
            return
        say(f"wrote {dst} ({counted(report.tensors, 'tensor')}, {human_bytes(report.bytes_written)} in "
            f"{files_text(report.data_files, report.files)}; {checked})" + timing_summary(report))

    run_distributed(json_out, dist_backend, run, show, cast="keep" if dry_run else dtype)
