"""The one interface reshard's planners answer, so that reshard picks a planner and asks it one thing.

Each planner has a request type, made from reshard's options by `from_options`, which refuses
the options it cannot honour (one line each) before anything is planned; the request then
plans the whole output of a checkpoint (`plan`), with the source views the plan reads and
the number of ranks it is laid out for. No I/O beyond the metadata and small items.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Protocol, Sequence

from ckptctl.core.checkpoint import Checkpoint
from ckptctl.core.dtypes import DType
from ckptctl.core.plan import SourceTensor
from ckptctl.formats.dcp.writer import DcpOutput


class ReshardChoices(Protocol):
    """What a reshard was asked for, as a planner reads it (`commands.reshard.ReshardOptions`,
    a layer up, answers it)."""

    world_size: int | None
    layout: str
    tp: int | None
    dp: int | None
    source_tp: int | None
    split_fused: bool
    fuse: bool
    flat_optimizer: bool
    hf_config: Path | None
    hub_timeout: float
    include: Sequence[str]
    exclude: Sequence[str]
    dtype: DType | None
    keep_common_ranks: bool
    """Keep the per-DP RNG state of the DP ranks both sizes have (Megatron-FSDP)."""

    @property
    def megatron(self) -> bool:
        """Whether any Megatron-aware option is set."""


@dataclass(frozen=True)
class PlannedReshard:
    output: DcpOutput
    world_size: int
    """How many ranks the output is laid out for."""
    views: Mapping[str, SourceTensor] | None = None
    """The source views the output's pieces read, when they are not each tensor as reshard sees it
    (a torch_dist rewrite reads windows of its optimizer buckets)."""


class ReshardRequest(Protocol):
    def plan(self, ckpt: Checkpoint) -> PlannedReshard:
        """The whole output: targets, their placement and every copy run."""
