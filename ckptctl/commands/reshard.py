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

from ckptctl.storage.atomic import recorded_reads
from ckptctl.engine.dist import LOCAL, Comm, shared_analysis
from ckptctl.util.errors import IncompleteCheckpointError, UsageError
from ckptctl.formats.dcp.metadata import open_checkpoint
from ckptctl.formats.dcp.writer import DcpOutput
from ckptctl.core.analysis import analysis
from ckptctl.core.checkpoint import Checkpoint
from ckptctl.util.progress import ProgressObserver
from ckptctl.util.gc_pause import gc_paused
from ckptctl.storage.hub import DEFAULT_HUB_TIMEOUT
from ckptctl.core.selection import refuse_empty_selection
from ckptctl.planners.fsdp2 import Fsdp2Reshard
from ckptctl.planners.request import PlannedReshard, ReshardRequest
from ckptctl.commands.dcp_write import DcpReport, LocatingAhead, write_dcp_output
from ckptctl.commands.options import RunOptions

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
    keep_common_ranks: bool = False
    """Keep a Megatron-FSDP checkpoint's per-DP RNG state of the DP ranks both sizes have
    (`core.rank_state.megatron_rng_selection`)."""

    @property
    def megatron(self) -> bool:
        """True when any Megatron-aware option is set: planning goes to `planners.megatron_fsdp`
        (imported only then)."""
        return bool(self.split_fused or self.fuse or self.flat_optimizer or self.hf_config is not None
                    or self.layout != "fsdp2" or any(v is not None for v in (self.tp, self.dp, self.source_tp)))


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
    return _planned(ckpt, opts).output


def _planned(ckpt: Checkpoint, opts: ReshardOptions) -> PlannedReshard:
    """`plan_reshard`, with the source views the plan's pieces read and the number of ranks the
    output is laid out for.

    Planned with the collector paused (`gc_pause`): a few acyclic objects per output chunk."""
    with gc_paused():
        planned = planner_request(ckpt, opts).plan(ckpt)
    out = planned.output
    refuse_empty_selection(len(out.targets) + len(out.bytes_entries), len(ckpt.tensors) + len(ckpt.bytes_entries),
                           opts.include, opts.exclude)
    return planned


def planner_request(ckpt: Checkpoint, opts: ReshardOptions) -> ReshardRequest:
    """The request of the planner the source and the options call for, its options checked. A
    Megatron planner is imported only when it is the one: a plain reshard never imports them."""
    if opts.keep_common_ranks and (ckpt.megatron_backend is not None or opts.layout == TORCH_DIST_LAYOUT):
        raise UsageError("--keep-common-ranks: a torch_dist checkpoint is rewritten at its own layout, its RNG state "
                         "as saved, and a conversion between torch_dist and fsdp_dtensor carries none")
    if ckpt.megatron_backend is not None and opts.layout == "megatron-fsdp":  # torch_dist to fsdp_dtensor
        from ckptctl.planners.torch_dist_to_fsdp_dtensor import ToFsdpDtensor

        return ToFsdpDtensor.from_options(ckpt, opts)
    if ckpt.megatron_backend is not None:  # torch_dist: rewritten at its own layout, optimizer in model space
        from ckptctl.planners.torch_dist import TorchDistRewrite

        return TorchDistRewrite.from_options(ckpt, opts)
    if opts.layout == TORCH_DIST_LAYOUT:  # Megatron-FSDP's fsdp_dtensor to megatron-core's torch_dist
        from ckptctl.planners.fsdp_dtensor_to_torch_dist import ToTorchDist

        return ToTorchDist.from_options(ckpt, opts)
    if opts.megatron:
        from ckptctl.planners.megatron_fsdp import MegatronRequest

        return MegatronRequest.from_options(ckpt, opts)
    return Fsdp2Reshard.from_options(ckpt, opts)


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
    ahead = None if dry_run else LocatingAhead(ckpt, comm)  # on a second core, while this one plans
    try:
        shared_analysis(ckpt, comm)  # under torchrun each worker analyses a share of the tensors
        refuse_if_incomplete(ckpt, opts.allow_incomplete)
        planned = _planned(ckpt, opts)
        report = ReshardReport.planned(ckpt, planned.output, src, dst, planned.world_size, opts, dry_run, comm)
        if ahead is None:
            return report
        located = ahead.result()
    finally:
        if ahead is not None:
            ahead.stop()
    write_dcp_output(ckpt, planned.output, src, dst, report, opts, started, force=force, verify=verify,
                     progress=progress, comm=comm, views=planned.views, located=located)
    return report
