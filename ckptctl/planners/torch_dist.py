"""Rewrite a Megatron-Core torch_dist checkpoint with its optimizer state in model space.

megatron-core's `dp_reshardable` optimizer format (its default DistributedOptimizer save) keeps
each model-parallel rank's DP buckets: a job at another TP or PP cannot load it. Its older
`fully_sharded_model_space` keeps each param's TP fragments: megatron-core 0.16 and newer cannot
load it at all. This writes the same checkpoint with either laid back out as
`fully_reshardable` states (`optimizer.state.{param,exp_avg,exp_avg_sq}.<key>`, shaped and
chunked like each param: `megatron.buckets`, `megatron.fragments`), which megatron-core loads at
any TP × DP (and EP: a ChainedOptimizer's dense and expert states become the one set its own
`fully_reshardable` save writes, each optimizer's param groups kept apart in the common state). Model tensors and their
`_extra_state` items are copied as they are, chunk for chunk, each in its rank's file; the
common state (`common.pt`, or megatron-core 0.19's `common_state` item) says `fully_reshardable`
and carries the optimizer's param groups, as megatron-core's own `fully_reshardable` save writes
them. It is decoded and written back without torch (`megatron_args.common_state`): values of
classes no allow-list knows, such as 0.19's enum members in args, are written back as they were
saved, never built. A checkpoint already `fully_reshardable` is copied the same way.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from ckptctl.util.errors import CheckpointError, UsageError
from ckptctl.formats.dcp.items import ItemReader
from ckptctl.formats.dcp.writer import DcpOutput, place_dcp_records
from ckptctl.formats.megatron_args import (
    COMMON, COMMON_STATE, CommonState, common_bytes, common_state, common_where, decoded_item,
)
from ckptctl.formats.pickle.unpickle import UnsafePickleError
from ckptctl.engine.elements import ElementReader
from ckptctl.core.geometry import Box
from ckptctl.core.analysis import (
    TORCH_DIST_BUCKETS, TORCH_DIST_FORMATS, TORCH_DIST_MASTERS, analysis, is_optimizer_entry, is_torch_dist_bucket,
    source_tensors,
)
from ckptctl.megatron.rows import BUFFERS
from ckptctl.megatron.buckets import (
    GROUPS_ITEM, HYBRID_FINAL_NORM, Bucket, Optimizer, Pipeline, layout_buckets, model_space_targets, parse_layout,
    registration_order,
)
from ckptctl.megatron.bucket_order import content_order
from ckptctl.megatron.fragments import fragment_targets
from ckptctl.core.checkpoint import Checkpoint, file_rank
from ckptctl.families.placement import Placed
from ckptctl.core.plan import SourceTensor, TargetTensor, identity_target
from ckptctl.planners.request import PlannedReshard, ReshardChoices
from ckptctl.storage.store import EntryKind, store_for

def plan_torch_dist(ckpt: Checkpoint) -> tuple[DcpOutput, dict[str, SourceTensor]]:
    """The rewritten checkpoint, and the source views its pieces read (bucket windows included)."""
    fmt = analysis(ckpt).optimizer_format
    unknown = next((k for k in (*ckpt.tensors, *ckpt.bytes_entries) if is_optimizer_entry(k)), None) \
        if fmt is None else None
    if unknown is not None:  # never copied as if it were what the rewrite promises
        raise CheckpointError(ckpt.path, f"{unknown}: optimizer state of no DistributedOptimizer format known "
                                         f"({', '.join(name for name, _ in TORCH_DIST_FORMATS)}): not rewritten")
    sources = source_tensors(ckpt)
    rebuilt: list[TargetTensor] = []
    replaced: set[str] = set()
    views = dict(sources)
    extra = {"metadata.json": common_bytes(ckpt, "metadata.json")}
    common, new_common = None, None
    if fmt == "dp_reshardable":
        common = read_common(ckpt)
        buckets, groups = dp_reshardable_buckets(ckpt, common, _args(ckpt, common))
        rebuilt, windows = model_space_targets(ckpt, buckets)
        views.update(windows)
        replaced = {k for k in ckpt.tensors if is_torch_dist_bucket(k)}
        new_common = _fully_reshardable_common(ckpt, common, groups)
    elif fmt == "fully_sharded_model_space":
        rebuilt, windows, replaced = fragment_targets(ckpt)
        views.update(windows)
        common = read_common(ckpt)
        new_common = _fully_reshardable_common(ckpt, common, None)
    elif store_for(ckpt.path).kind(ckpt.path / COMMON) is EntryKind.FILE:
        extra[COMMON] = common_bytes(ckpt)
    copied = [identity_target(sources[k], properties=ckpt.tensors[k].properties) for k in ckpt.tensors
              if k not in replaced]
    placements = {t.fqn: _like(ckpt, t.fqn) for t in copied}
    placements.update({t.fqn: _like(ckpt, t.fqn.split(".", 3)[3]) for t in rebuilt})  # each state like its param
    targets = copied + rebuilt
    rewritten_item = common is not None and common.where == COMMON_STATE
    kept = [e for f, e in ckpt.bytes_entries.items()
            if not is_torch_dist_bucket(f) and not (rewritten_item and f == COMMON_STATE)]
    out = place_dcp_records(targets, placements, views, kept, None)
    if common is not None and common.where == COMMON:
        extra[COMMON] = new_common
    elif rewritten_item:
        out.append_literal(COMMON_STATE, new_common)
    out.extra_files = extra
    out.masters = {t.fqn: identity_target(views[t.fqn.removeprefix(TORCH_DIST_MASTERS)]) for t in rebuilt
                   if t.fqn.startswith(TORCH_DIST_MASTERS)}
    return out, views


def _like(ckpt: Checkpoint, name: str) -> list[Placed]:
    """The chunks of entry `name`, each in the file of the rank that saved it."""
    placed = []
    for c in ckpt.tensors[name].chunks:
        rank = file_rank(c.file)
        if rank is None:
            raise CheckpointError(ckpt.path / c.file, "not a torch_dist rank file name (__<rank>_<n>.distcp)")
        placed.append(Placed(rank, Box(c.offsets, c.sizes)))
    return placed


def _refusal(ckpt: Checkpoint, where: str, message: str) -> CheckpointError:
    """An error about the common state: at `common.pt`'s path, or naming the `common_state` item."""
    if where == COMMON:
        return CheckpointError(ckpt.path / COMMON, message)
    return CheckpointError(ckpt.path, f"{where}: {message}")


def read_common(ckpt: Checkpoint) -> CommonState:
    """The common state (`common.pt`, or megatron-core 0.19's `common_state` item), read once and
    decoded without torch: its args tell the TP size and spec, and it is written back (here with
    the optimizer's new format, or as fsdp_dtensor items) with enum members in args as they were."""
    where = common_where(ckpt)
    try:
        common = common_state(ckpt)
    except UnsafePickleError as exc:
        raise _refusal(ckpt, where, f"cannot decode it without running code ({exc})") from None
    if common is None:
        raise CheckpointError(ckpt.path, f"no common state ({COMMON} or a {COMMON_STATE} item): the TP size, model "
                                         "spec and optimizer param groups are unknown")
    if not isinstance(common.state, dict):
        raise _refusal(ckpt, where, f"a {type(common.state).__name__}, not the common state dict")
    return common


def _args(ckpt: Checkpoint, common: CommonState) -> argparse.Namespace:
    args = common.state.get("args")
    if not isinstance(args, argparse.Namespace):
        raise _refusal(ckpt, common.where, "no Megatron args in it: the TP size and model spec are unknown")
    return args


def _pipeline(ckpt: Checkpoint, common: CommonState, args: argparse.Namespace) -> tuple[int, Pipeline, bool]:
    """The TP size and pipeline split of args (stage sizes, counted layers or a custom layout),
    and whether the last pipeline stage holds a copy of a tied embedding (a param of its own
    there); args of the wrong kind are refused."""
    tp, pp = getattr(args, "tensor_model_parallel_size", None), getattr(args, "pipeline_model_parallel_size", 1)
    vpp = getattr(args, "virtual_pipeline_model_parallel_size", None)
    vpp = 1 if vpp is None else vpp
    for name, value in (("tensor_model_parallel_size", tp), ("pipeline_model_parallel_size", pp),
                        ("virtual_pipeline_model_parallel_size", vpp)):
        if type(value) is not int or value < 1:
            raise _refusal(ckpt, common.where, f"args.{name} is {value!r:.64}")
    if pp == 1:
        return tp, Pipeline(), False
    first, last = (getattr(args, f"decoder_{end}_pipeline_num_layers", None) for end in ("first", "last"))
    for name, value in (("decoder_first_pipeline_num_layers", first), ("decoder_last_pipeline_num_layers", last)):
        if value is not None and (type(value) is not int or value < 1):
            raise _refusal(ckpt, common.where, f"args.{name} is {value!r:.64}")
    counted = {}
    for part in ("embedding", "loss"):
        name = f"account_for_{part}_in_pipeline_split"
        counted[part] = getattr(args, name, False)
        if type(counted[part]) is not bool:
            raise _refusal(ckpt, common.where, f"args.{name} is {counted[part]!r:.64}")
    text, layout = getattr(args, "pipeline_model_parallel_layout", None), None
    if text is not None:
        if type(text) is not str:
            raise _refusal(ckpt, common.where, f"args.pipeline_model_parallel_layout is {text!r:.64}, not a string")
        try:
            layout = parse_layout(text)
        except ValueError as exc:
            raise _refusal(ckpt, common.where, f"args.pipeline_model_parallel_layout {text!r:.64}: {exc}") from None
    layers = getattr(args, "num_layers", None)
    per_chunk = getattr(args, "num_layers_per_virtual_pipeline_stage", None)
    if per_chunk is not None and not (type(layers) is int and per_chunk * pp * vpp == layers + sum(counted.values())):
        raise _refusal(ckpt, common.where, f"args.num_layers_per_virtual_pipeline_stage is {per_chunk!r:.64}, "
                                           f"but args.num_layers is {layers!r:.64} at PP {pp} × VPP {vpp}")
    stages = getattr(args, "num_virtual_stages_per_pipeline_rank", None)
    if stages not in (None, vpp):
        raise _refusal(ckpt, common.where, f"args.num_virtual_stages_per_pipeline_rank is {stages!r:.64}, but "
                                           f"args.virtual_pipeline_model_parallel_size is {vpp}")
    untied = getattr(args, "untie_embeddings_and_output_weights", None)
    if type(untied) is not bool:
        raise _refusal(ckpt, common.where, f"args.untie_embeddings_and_output_weights is {untied!r:.64}: whether "
                                           "the last pipeline stage holds a copy of the embedding is not known")
    return tp, Pipeline(pp, vpp, first, last, **counted, layout=layout), not untied


def dp_reshardable_buckets(ckpt: Checkpoint, common: CommonState, args: argparse.Namespace
                           ) -> tuple[list[Bucket], dict[int | None, list]]:
    """The dp_reshardable buckets with the params laid out in them, each found by its content
    (`megatron.bucket_order`: any spec whose params the local spec's table names), and each
    optimizer's param groups (by its `chained_<i>.` index; None for the one optimizer of a
    checkpoint without a ChainedOptimizer)."""
    tp, pipeline, tied_copy = _pipeline(ckpt, common, args)
    groups = bucket_param_groups(ckpt)
    optimizers, ep, etp = _optimizers(ckpt, common, args, groups, tp)
    model = {k for k in ckpt.tensors if not is_optimizer_entry(k) and not k.endswith(BUFFERS)}
    mtp = next((k for k in sorted(model) if k.startswith("mtp.")), None)
    copy = "output" if tied_copy else None
    if pipeline.stages > 1 and mtp is not None:  # the last stage's MTP layers read an embedding of its own
        if tied_copy:
            raise CheckpointError(ckpt.path, f"{mtp}: multi-token prediction layers under pipeline parallelism "
                                             "with a tied embedding are not rebuilt (megatron-core cannot save them)")
        copy = "embedding"
    if pipeline.stages > 1 and HYBRID_FINAL_NORM in model:
        raise CheckpointError(ckpt.path, f"{HYBRID_FINAL_NORM}: a hybrid (Mamba) stack under pipeline parallelism "
                                         "is not rebuilt yet (megatron-core splits it by its pattern's '|' "
                                         "segments, not as a GPT decoder)")
    order = registration_order(ckpt, model, copy)
    with ElementReader(ckpt) as elements:
        found = layout_buckets(ckpt, order, tp, optimizers, ep, pipeline, etp, content_order(ckpt, elements.read))
    return found, groups


def _optimizers(ckpt: Checkpoint, common: CommonState, args: argparse.Namespace, groups: dict[int | None, list],
                tp: int) -> tuple[tuple[Optimizer, ...], int, int]:
    """Which params each saved optimizer holds, the EP size and the experts' TP size: one
    optimizer holds them all; a ChainedOptimizer of two (megatron-core's under expert parallelism,
    or an expert TP of its own) holds the experts in the one whose param groups say
    `is_expert_parallel`."""
    if set(groups) == {None}:
        return (Optimizer(None, None),), 1, tp
    if set(groups) != {0, 1}:
        raise CheckpointError(ckpt.path, f"chained optimizers {sorted(groups, key=str)}: a dense and an expert "
                                         "one (0 and 1) are rebuilt")
    roles = {chain: {g.get("is_expert_parallel") for g in found if isinstance(g, dict)}
             for chain, found in groups.items()}
    if sorted(map(sorted, roles.values())) != [[False], [True]]:
        raise CheckpointError(ckpt.path, "chained optimizers whose param groups are not one dense and one "
                              f"expert-parallel optimizer (is_expert_parallel: {roles})")
    ep, etp = getattr(args, "expert_model_parallel_size", None), getattr(args, "expert_tensor_parallel_size", None)
    etp = tp if etp is None else etp  # megatron-core's default
    for name, value in (("expert_model_parallel_size", ep), ("expert_tensor_parallel_size", etp)):
        if type(value) is not int or value < 1:
            raise _refusal(ckpt, common.where, f"args.{name} is {value!r:.64}")
    return tuple(Optimizer(chain, roles[chain] == {True}) for chain in sorted(groups)), ep, etp


def bucket_param_groups(ckpt: Checkpoint) -> dict[int | None, list]:
    """Each optimizer's param groups (by `chained_<i>.` index, None without a ChainedOptimizer):
    its lowest DP group's, as megatron-core's own `fully_reshardable` save keeps rank 0's. Every
    DP group's `dp_group_idx_<g>.optimizer` item holds the same groups, in the order its params
    first meet them (pipeline stages of megatron-core 0.15 differ in that order)."""
    found: dict[int | None, dict[int, list]] = {}
    with ItemReader(ckpt) as reader:
        for fqn in ckpt.bytes_entries:
            match = GROUPS_ITEM.fullmatch(fqn)
            if match is None:
                continue
            try:
                value = decoded_item(ckpt, fqn, reader)
            except UnsafePickleError as exc:
                raise CheckpointError(ckpt.path, f"{fqn}: cannot decode it without running code ({exc})") from None
            if not (isinstance(value, list) and len(value) == 1 and isinstance(value[0], dict)
                    and isinstance(value[0].get("param_groups"), list)):
                raise CheckpointError(ckpt.path, f"{fqn.partition('/')[0]}: no param groups")
            chain = None if match[1] is None else int(match[1])
            found.setdefault(chain, {})[int(match[2])] = value[0]["param_groups"]
    if not found:
        raise CheckpointError(ckpt.path, f"no {TORCH_DIST_BUCKETS}dp_group_idx_<g>.optimizer item: the optimizer's "
                                         "param groups are unknown")
    chosen = {}
    for chain, by_group in found.items():
        first = by_group[min(by_group)]
        for group, groups in sorted(by_group.items()):
            if sorted(map(repr, groups)) != sorted(map(repr, first)):
                prefix = "" if chain is None else f"chained_{chain}."
                raise CheckpointError(ckpt.path, f"{prefix}{TORCH_DIST_BUCKETS}dp_group_idx_{group}.optimizer: the DP "
                                                 "groups of one optimizer saved different param groups")
        chosen[chain] = first
    return dict(sorted(chosen.items(), key=lambda kv: -1 if kv[0] is None else kv[0]))


def _fully_reshardable_common(ckpt: Checkpoint, common: CommonState, param_groups: dict[int | None, list] | None
                              ) -> bytes:
    """The common state as megatron-core's `fully_reshardable` save writes it: each optimizer's
    param groups under `optimizer.optimizer` (`param_groups` by chained index, a dict of them for
    a ChainedOptimizer; else those the common state holds there already), the sharding type in
    each optimizer state and the content metadata; nothing else of the optimizer
    (`fully_sharded_model_space` leaves rank 0's per-param steps in it, which are not a state of
    this format)."""
    state = common.state
    if param_groups is None:
        try:
            param_groups = {None: state["optimizer"]["optimizer"]["param_groups"]}
        except (KeyError, TypeError):
            raise _refusal(ckpt, common.where, "no optimizer param groups in it") from None
    made = {chain: {"optimizer": {"param_groups": groups}, "param_state_sharding_type": "fully_reshardable"}
            for chain, groups in param_groups.items()}
    state = {**state, "optimizer": made[None] if None in made else made}
    if isinstance(state.get("content_metadata"), dict):
        state["content_metadata"] = {**state["content_metadata"], "distrib_optim_sharding_type": "fully_reshardable",
                                     "distrib_optim_fully_reshardable_mem_efficient": False}
    try:
        return common.encoded(state)
    except UnsafePickleError as exc:
        raise _refusal(ckpt, common.where, f"cannot write it back ({exc})") from None


@dataclass(frozen=True)
class TorchDistRewrite:
    """A torch_dist checkpoint rewritten at its own layout: megatron-core re-shards
    `fully_reshardable` state itself when it loads at another TP or DP (`--layout megatron-fsdp`
    converts it: `torch_dist_to_fsdp_dtensor`)."""

    @classmethod
    def from_options(cls, ckpt: Checkpoint, opts: ReshardChoices) -> TorchDistRewrite:
        saved = ckpt.saved_world_size
        if opts.layout == "torch-dist":
            raise UsageError("already a torch_dist checkpoint: pass no --layout (it is rewritten at its own layout "
                             "with its optimizer state in model space)")
        if opts.megatron or opts.include or opts.exclude or opts.dtype is not None \
                or opts.world_size not in (None, saved):
            raise UsageError("a torch_dist checkpoint is rewritten at its own layout with its optimizer state in "
                             "model space (fully_reshardable), which megatron-core loads at any TP and DP: pass no "
                             f"--world-size (or its own, {saved}), layout, TP, filter or dtype options")
        return cls()

    def plan(self, ckpt: Checkpoint) -> PlannedReshard:
        output, views = plan_torch_dist(ckpt)
        return PlannedReshard(output, ckpt.saved_world_size, views)
