"""`reshard`: rewrite a DCP checkpoint laid out as FSDP2 would save it at another world size.

Builds the targets (filtered, cast, flat optimizer buffers seen in their param's shape),
places them, plans every run, then streams them into an atomic output directory. Source
problems that would lose data (coverage gaps, the plain-tensor optimizer bug) are refused
with the `inspect --check` diagnosis unless the caller allows them.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Mapping

from ckptctl.storage.atomic import recorded_reads
from ckptctl.engine.dist import LOCAL, Comm, shared_analysis
from ckptctl.core.dtypes import cast_dtype
from ckptctl.util.errors import IncompleteCheckpointError, UsageError
from ckptctl.formats.dcp.metadata import open_checkpoint
from ckptctl.formats.dcp.writer import DcpOutput, layout_dcp
from ckptctl.core.analysis import analysis, source_tensors
from ckptctl.core.checkpoint import Checkpoint
from ckptctl.families.placement import fsdp2
from ckptctl.util.progress import ProgressObserver
from ckptctl.core.plan import SourceTensor, TargetTensor, identity_target
from ckptctl.util.gc_pause import gc_paused
from ckptctl.storage.hub import DEFAULT_HUB_TIMEOUT
from ckptctl.core.selection import refuse_empty_selection, selected
from ckptctl.core.rank_state import refuse_dp_change
from ckptctl.commands.dcp_write import DcpReport, write_dcp_output
from ckptctl.commands.options import RunOptions

if TYPE_CHECKING:  # planning a Megatron-aware reshard imports it; a plain one never does
    from ckptctl.planners.megatron_fsdp import MegatronRequest

TORCH_DIST_LAYOUT = "torch-dist"
"""`--layout torch-dist`: a Megatron-FSDP fsdp_dtensor checkpoint written as megatron-core's torch_dist."""


@dataclass
class ReshardOptions(RunOptions):
    """What a reshard writes: the ranks and layout of the output, and what Megatron-aware planning
    does with fused tensors and optimizer states."""

    world_size: int | None
    allow_incomplete: bool = False
    layout: str = "fsdp2"
    tp: int | None = None
    """Target TP (Megatron-FSDP layout; fused tensors are re-blocked for it)."""
    dp: int | None = None
    source_tp: int | None = None
    split_fused: bool = False
    fuse: bool = False
    flat_optimizer: bool = False
    hf_config: Path | None = None
    hub_timeout: float = DEFAULT_HUB_TIMEOUT
    """Seconds a Hub model id's config may take to download (`--hf-config`)."""

    @property
    def megatron(self) -> bool:
        """True when any Megatron-aware option is set: planning goes to `planners.megatron_fsdp`
        (imported only then)."""
        return bool(self.split_fused or self.fuse or self.flat_optimizer or self.hf_config is not None
                    or self.layout != "fsdp2" or any(v is not None for v in (self.tp, self.dp, self.source_tp)))

    def megatron_request(self) -> "MegatronRequest":
        """The Megatron-aware options parsed and checked once, as Megatron planning takes them."""
        from ckptctl.planners.megatron_fsdp import MegatronRequest

        return MegatronRequest.parse(layout=self.layout, world_size=self.world_size, tp=self.tp, dp=self.dp,
                                     source_tp=self.source_tp, split_fused=self.split_fused, fuse=self.fuse,
                                     flat_optimizer=self.flat_optimizer, hf_config=self.hf_config,
                                     include=self.include, exclude=self.exclude, dtype=self.dtype,
                                     hub_timeout=self.hub_timeout)


@dataclass
class ReshardReport(DcpReport):
    """What a reshard did, for `--json` and the summary line: the figures of every DCP write."""


def refuse_if_incomplete(ckpt: Checkpoint, allow: bool) -> list[str]:
    """The source's data-loss problems; raises unless `allow`."""
    problems = [p.message for p in analysis(ckpt).problems]
    if problems and not allow:
        raise IncompleteCheckpointError(ckpt.path, problems, allowable=True)
    return problems


def plan_reshard(ckpt: Checkpoint, opts: ReshardOptions) -> DcpOutput:
    """The whole output: targets, their placement and every copy run. No I/O."""
    return _planned(ckpt, opts)[0]


def _planned(ckpt: Checkpoint, opts: ReshardOptions) -> tuple[DcpOutput, Mapping[str, SourceTensor] | None, int]:
    """`plan_reshard`, the source views the plan's pieces read when they are not each tensor
    as reshard sees it (a torch_dist rewrite reads windows of its optimizer buckets), and the
    number of ranks the output is laid out for.

    Planned with the collector paused (`gc_pause`): a few acyclic objects per output chunk."""
    views, world_size = None, opts.world_size
    with gc_paused():
        if ckpt.megatron_backend is not None and opts.layout == "megatron-fsdp":  # torch_dist to fsdp_dtensor
            from ckptctl.planners import torch_dist_to_fsdp_dtensor

            torch_dist_to_fsdp_dtensor.refuse_options(opts)
            out, views, world_size = torch_dist_to_fsdp_dtensor.plan_to_fsdp_dtensor(ckpt, opts.tp, opts.dp,
                                                                                      opts.world_size)
        elif ckpt.megatron_backend is not None:  # torch_dist: rewritten at its own layout, optimizer in model space
            from ckptctl.planners import torch_dist

            torch_dist.refuse_options(opts.world_size, ckpt.saved_world_size, opts.megatron, opts.layout,
                                      opts.include, opts.exclude, opts.dtype)
            out, views = torch_dist.plan_torch_dist(ckpt)
            world_size = ckpt.saved_world_size
        elif opts.layout == TORCH_DIST_LAYOUT:  # Megatron-FSDP's fsdp_dtensor to megatron-core's torch_dist
            from ckptctl.planners import fsdp_dtensor_to_torch_dist

            fsdp_dtensor_to_torch_dist.refuse_options(opts)
            world_size = opts.world_size or 1
            out, views = fsdp_dtensor_to_torch_dist.plan_from_fsdp_dtensor(ckpt, world_size)
        elif opts.megatron:
            from ckptctl.planners import megatron_fsdp

            request = opts.megatron_request()
            out = megatron_fsdp.plan_megatron(ckpt, request)
            world_size = megatron_fsdp.output_world_size(ckpt, request)
        else:
            out = _plan_fsdp2(ckpt, opts)
    refuse_empty_selection(len(out.targets) + len(out.bytes_entries), len(ckpt.tensors) + len(ckpt.bytes_entries),
                           opts.include, opts.exclude)
    return out, views, world_size


def _plan_fsdp2(ckpt: Checkpoint, opts: ReshardOptions) -> DcpOutput:
    if opts.world_size is None:
        raise UsageError("--world-size is required (the number of ranks the output is laid out for)")
    if opts.world_size < 1:
        raise UsageError(f"--world-size must be at least 1 (got {opts.world_size})")
    sources = source_tensors(ckpt)
    targets: list[TargetTensor] = []
    for fqn, src in sources.items():
        if selected(fqn, opts.include, opts.exclude):
            targets.append(identity_target(src, dtype=cast_dtype(src.dtype, opts.dtype),
                                           properties=ckpt.tensors[fqn].properties))
    placements = {t.fqn: fsdp2(t.shape, opts.world_size) for t in targets}
    kept_bytes = [e for f, e in ckpt.bytes_entries.items() if selected(f, opts.include, opts.exclude)]
    refuse_dp_change(ckpt.bytes_entries, lambda f: selected(f, opts.include, opts.exclude), opts.world_size)
    planner = None
    if isinstance(ckpt.planner_data, dict):
        keep = {t.fqn for t in targets} | {e.fqn for e in kept_bytes}
        planner = {k: v for k, v in ckpt.planner_data.items() if k in keep}
    return layout_dcp(targets, placements, sources, kept_bytes, planner)


@recorded_reads()
def reshard(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    opts: ReshardOptions,
    *,
    force: bool = False,
    verify: bool = False,
    dry_run: bool = False,
    progress: ProgressObserver | None = None,
    comm: Comm = LOCAL,
) -> ReshardReport:
    """Run a reshard end to end and report what happened.

    Under torchrun pass the run's `comm` (collective: every worker calls this with the same
    arguments); each worker then writes its share of the rank files and rank 0 the metadata.
    """
    started = time.perf_counter()
    src, dst = Path(src), Path(dst)
    ckpt = open_checkpoint(src)
    shared_analysis(ckpt, comm)  # under torchrun each worker analyses a share of the tensors
    refuse_if_incomplete(ckpt, opts.allow_incomplete)
    out, views, world_size = _planned(ckpt, opts)
    report = ReshardReport.planned(ckpt, out, src, dst, world_size, opts, dry_run, comm)
    if dry_run:
        return report
    write_dcp_output(ckpt, out, src, dst, report, opts, started, force=force, verify=verify, progress=progress,
                     comm=comm, views=views)
    return report
