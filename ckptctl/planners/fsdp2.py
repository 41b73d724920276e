"""reshard's plain planner: every selected tensor as it is (cast as asked), cut in FSDP2 `Shard(0)`
rows over `--world-size` ranks, its bytes entries and planner data kept; a Transformer Engine
Float8Tensor's codes and scale kept as TE's items (`planners.te_float8`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ckptctl.core.analysis import source_tensors
from ckptctl.core.checkpoint import Checkpoint
from ckptctl.core.dtypes import DType, cast_dtype
from ckptctl.core.plan import TargetTensor, identity_target
from ckptctl.core.rank_state import megatron_rng, plain_reshard_rng_selection, refuse_dp_change
from ckptctl.core.selection import selected
from ckptctl.families.placement import fsdp2
from ckptctl.formats.dcp.items import ItemReader
from ckptctl.formats.megatron_args import context_parallel
from ckptctl.formats.dcp.writer import place_dcp_records
from ckptctl.planners.request import PlannedReshard, ReshardChoices
from ckptctl.planners.te_float8 import block_form, codes_view, float8_form, settle_scales
from ckptctl.util.errors import UsageError


@dataclass(frozen=True)
class Fsdp2Reshard:
    world_size: int
    include: Sequence[str] = ()
    exclude: Sequence[str] = ()
    dtype: DType | None = None
    keep_common_ranks: bool = False

    @classmethod
    def from_options(cls, ckpt: Checkpoint, opts: ReshardChoices) -> Fsdp2Reshard:
        if opts.world_size is None:
            raise UsageError("--world-size is required (the number of ranks the output is laid out for)")
        if opts.world_size < 1:
            raise UsageError(f"--world-size must be at least 1 (got {opts.world_size})")
        return cls(opts.world_size, opts.include, opts.exclude, opts.dtype, opts.keep_common_ranks)

    def plan(self, ckpt: Checkpoint) -> PlannedReshard:
        sources = source_tensors(ckpt)
        targets: list[TargetTensor] = []
        refuse_dp_change(ckpt.bytes_entries, lambda f: selected(f, self.include, self.exclude), self.world_size)
        keep = plain_reshard_rng_selection(megatron_rng([*ckpt.tensors, *ckpt.bytes_entries]),
                                           lambda f: selected(f, self.include, self.exclude), self.world_size,
                                           self.keep_common_ranks, lambda: context_parallel(ckpt))
        with ItemReader(ckpt) as reader:
            for fqn, src in sources.items():
                if not keep(fqn):
                    continue
                float8 = float8_form(ckpt.tensors[fqn], src, reader) or block_form(ckpt.tensors[fqn], src, reader)
                if float8 is None:
                    targets.append(identity_target(src, dtype=cast_dtype(src.dtype, self.dtype),
                                                   properties=ckpt.tensors[fqn].properties))
                    continue
                if cast_dtype(src.dtype, self.dtype) != src.dtype:
                    raise UsageError(f"--dtype {self.dtype.name}: {fqn} is a {float8.kind}, whose FP8 codes reshard "
                                     "keeps as they are (export-hf dequantizes it)")
                sources[fqn] = codes_view(src)  # its codes are copied; its records are TE's items again
                targets.append(identity_target(sources[fqn], properties=float8))
        placements = {t.fqn: fsdp2(t.shape, self.world_size) for t in targets}
        settle_scales(targets, placements)
        kept_bytes = [e for f, e in ckpt.bytes_entries.items() if keep(f)]
        planner = None
        if isinstance(ckpt.planner_data, dict):
            keep = {t.fqn for t in targets} | {e.fqn for e in kept_bytes}
            planner = {k: v for k, v in ckpt.planner_data.items() if k in keep}
        return PlannedReshard(place_dcp_records(targets, placements, sources, kept_bytes, planner), self.world_size,
                              sources)
