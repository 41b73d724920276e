"""`import-hf`: a Hugging Face safetensors model folder → a DCP checkpoint laid out for training.

The reverse of export-hf for the layout a `fully_shard`ed transformers model saves and
loads (`--to fsdp2`): every tensor under its HF name behind `--prefix` (`model.` as
`dcp.save({"model": model.state_dict()})` writes it), cut into FSDP2 `Shard(0)` row
chunks at `--world-size` ranks, one `__{rank}_0.distcp` file per rank. Each chunk is
streamed from the safetensors records with positioned reads (the folder is opened as a
checkpoint of whole-row chunks, `formats.safetensors_in`) by the same planner and engine
as reshard: bounded memory, atomic output, `--verify` re-reading every tensor and decoding
every source block with the safetensors library.

Closed world, as export-hf: the names are checked against the model transformers builds
for the folder's `config.json`. A name the model has no place for, or a weight it needs
that the folder lacks, is refused; a tied parameter (`lm_head.weight` of a model that
ties it) is written as a second entry of its source's bytes, because `model.state_dict()`
lists it and `dcp.load` wants every key it lists. A model transformers holds in another
form in memory than on disk (fused MoE experts) is refused: a `fully_shard`ed one loads
the in-memory form, which needs a conversion import-hf does not make.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence, cast

from ckptctl.dtypes import DType
from ckptctl.engine.dist import LOCAL, Comm
from ckptctl.errors import CheckpointError, UsageError
from ckptctl.formats.dcp_writer import DcpOutput, layout_dcp
from ckptctl.formats.safetensors_in import open_safetensors_folder
from ckptctl.gc_pause import gc_paused
from ckptctl.hf.expected import ExpectedNames, expected_names, shown, transformers_available
from ckptctl.model import Checkpoint
from ckptctl.placement import fsdp2
from ckptctl.plan import TargetTensor, identity_target, source_view
from ckptctl.progress import ProgressObserver
from ckptctl.reshard import (
    ReshardOptions, ReshardReport, cast_dtype, new_report, refuse_empty_selection, selected, write_dcp_output,
)
from ckptctl.wording import counted

TARGETS = ("fsdp2",)
"""Layouts import-hf writes (`--to`)."""
PLANNED_TARGETS = {"torchtitan": "torchtitan's names and RoPE row order",
                   "megatron-fsdp": "Megatron names, fused QKV and TP×DP boxes"}
"""Layouts users ask for that need a family's rules in the import direction: refused, saying so."""
CONFIG_NAME = "config.json"


@dataclass
class ImportOptions:
    world_size: int | None
    to: str = "fsdp2"
    prefix: str = "model."
    include: Sequence[str] = ()
    exclude: Sequence[str] = ()
    dtype: DType | None = None
    workers: int = 4
    device: str = "auto"
    sync: bool = True
    name_check: bool = True

    def engine(self) -> ReshardOptions:
        """The engine settings the run shares with reshard."""
        return ReshardOptions(world_size=self.world_size, workers=self.workers, device=self.device, sync=self.sync)


@dataclass
class ImportReport(ReshardReport):
    """What an import did: reshard's figures, the model class its names were checked against, notes."""

    model_class: str | None = None
    notes: list[str] = field(default_factory=list)


@dataclass
class ImportPlan:
    output: DcpOutput
    model_class: str | None
    notes: list[str]


def folder_config(src: Path) -> dict[str, Any] | None:
    """The folder's `config.json` (beside a single `.safetensors` file), or None when there is none."""
    path = (src.parent if src.is_file() else src) / CONFIG_NAME
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CheckpointError(path, f"not a readable JSON config ({type(exc).__name__})") from None
    if not isinstance(data, dict):
        raise CheckpointError(path, "not a JSON object (is this a config.json?)")
    return data


def expected_for(src: Path, config: dict[str, Any] | None, name_check: bool) -> ExpectedNames | None:
    """What transformers' model for the folder's config expects, or None with `--no-name-check`."""
    if not name_check:
        return None
    bypass = "or --no-name-check to import the names unchecked"
    if config is None:
        raise UsageError(f"{src}: no {CONFIG_NAME}; import-hf checks the tensor names against the model it "
                         f"describes ({bypass})")
    if not transformers_available():
        raise UsageError("import-hf checks the tensor names against transformers' model for config.json, and "
                         f"transformers is not installed (pip install transformers; {bypass})")
    return expected_names(config)


def check_names(ckpt: Checkpoint, expected: ExpectedNames, narrowed: bool) -> dict[str, str]:
    """Refuse names the model has no place for and (unless `--include`/`--exclude` narrowed the
    import) weights it needs that are missing; return the tied parameters to write as copies
    of their source (name → source), those the folder does not hold itself."""
    names = set(ckpt.stored_names.values()) if ckpt.stored_names else set()
    cls = expected.model_class
    if expected.in_memory and expected.in_memory != expected.required:
        fused = shown(sorted(expected.in_memory - expected.required))
        raise UsageError(f"{ckpt.path}: a {cls} holds some weights in another form in memory than on disk "
                         f"({fused}); a fully_shard'ed {cls} loads that form, which import-hf --to fsdp2 does not "
                         "convert to yet")
    unclaimed = expected.unclaimed(names)
    if unclaimed:
        verb = "has" if len(unclaimed) == 1 else "have"
        raise CheckpointError(ckpt.path, f"{counted(len(unclaimed), 'tensor')} {verb} no place in a {cls}: "
                                         f"{shown(unclaimed)} (is config.json this model's?)")
    missing = [] if narrowed else expected.missing(names)
    if missing:
        verb = "is" if len(missing) == 1 else "are"
        raise CheckpointError(ckpt.path, f"{counted(len(missing), 'weight')} a {cls} expects {verb} missing: "
                                         f"{shown(missing)}")
    return {name: source for name, source in sorted(expected.tied.items()) if name not in names and source in names}


def plan_import(src: Path, opts: ImportOptions) -> tuple[Checkpoint, ImportPlan]:
    """Open the folder, check its names and plan the whole DCP output. Reads headers only."""
    if opts.to in PLANNED_TARGETS:
        raise UsageError(f"--to {opts.to} is not supported yet (it needs {PLANNED_TARGETS[opts.to]}); "
                         f"import-hf writes: {', '.join(TARGETS)}")
    if opts.to not in TARGETS:
        raise UsageError(f"--to must be one of {', '.join(TARGETS)} (got {opts.to!r})")
    if opts.world_size is None:
        raise UsageError("--world-size is required (the number of ranks the output is laid out for)")
    if opts.world_size < 1:
        raise UsageError(f"--world-size must be at least 1 (got {opts.world_size})")
    config = folder_config(src)
    ckpt = open_safetensors_folder(src, opts.prefix)
    expected = expected_for(src, config, opts.name_check)
    notes: list[str] = []
    if expected is None:
        notes.append("tensor names not checked against transformers' model (--no-name-check)")
    names = ckpt.stored_names or {}
    with gc_paused():
        views = {fqn: source_view(entry) for fqn, entry in ckpt.tensors.items()}
        kept = [fqn for fqn in views if selected(names[fqn], opts.include, opts.exclude)]
        refuse_empty_selection(len(kept), len(views), opts.include, opts.exclude, "tensors")
        tied = check_names(ckpt, expected, bool(opts.include or opts.exclude)) if expected else {}
        targets: list[TargetTensor] = []
        for fqn in kept:
            src_view = views[fqn]
            targets.append(identity_target(src_view, dtype=cast_dtype(src_view.dtype, opts.dtype)))
        for name, source in tied.items():
            src_view = views[opts.prefix + source]
            targets.append(identity_target(src_view, opts.prefix + name, cast_dtype(src_view.dtype, opts.dtype)))
            notes.append(f"{opts.prefix}{name} written as a copy of {opts.prefix}{source} "
                         f"({expected.model_class} ties them; model.state_dict() lists both)")
        targets.sort(key=lambda t: t.fqn)
        placements = {t.fqn: fsdp2(t.shape, opts.world_size) for t in targets}
        output = layout_dcp(targets, placements, views, [], None)
    return ckpt, ImportPlan(output, expected.model_class if expected else None, notes)


def import_hf(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    opts: ImportOptions,
    *,
    force: bool = False,
    verify: bool = False,
    dry_run: bool = False,
    progress: ProgressObserver | None = None,
    comm: Comm = LOCAL,
) -> ImportReport:
    """Run an import end to end and report what happened (under torchrun, collective as reshard)."""
    started = time.perf_counter()
    src, dst = Path(src), Path(dst)
    ckpt, plan = plan_import(src, opts)
    engine = opts.engine()
    report = cast(ImportReport, new_report(ckpt, plan.output, src, dst, opts.world_size or 1, engine, dry_run, comm,
                                           ImportReport, model_class=plan.model_class, notes=plan.notes))
    if not dry_run:
        write_dcp_output(ckpt, plan.output, src, dst, report, engine, started, force=force, verify=verify,
                         progress=progress, comm=comm)
    return report
