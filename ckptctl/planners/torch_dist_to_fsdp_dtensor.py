"""Convert a Megatron-Core `torch_dist` checkpoint to Megatron-FSDP's `fsdp_dtensor`.

torch_dist keeps one key per param stacked over layers (`decoder.layers.<name>` [L, …]) and
experts ([L, E, …]), SwiGLU fc1 as [W_all; V_all], and a `fully_reshardable` optimizer
(`optimizer.state.{param,exp_avg,exp_avg_sq}.<key>`) whose distinct param groups, with Adam's
step, are in the common state (or a `dp_reshardable` one, see below). Megatron-LM saves
fsdp_dtensor by module names (`fsdp_dtensor_names`): each layer's and expert's params apart,
fc1 split into `_w` / `_v`, the fp32 main weights as the model (`model.module.<name>`), Adam's
moments and step per param (`optimizer.state.<wrappers><name>.…`), and each param's whole group
(`optimizer.param_to_group_meta.<wrappers><name>.<setting>`, the step among them: Transformer
Engine's FusedAdam keeps it per group, torch's Adam per param; each loader asks only for its
own, so both are written). The output is laid out as Megatron-FSDP saves at TP × DP
(`placement.megatron_fsdp`); DCP reshards it again on load.

torch_dist does not record which group each param was in. It is derived by megatron-core's
standard rule (`get_standard_config_overrides`: no weight decay for biases and 1-D params — but
q/k layernorms with `apply_wd_to_qk_layernorm`; experts apart only under expert parallelism,
in an optimizer of their own, which is refused) and checked: each param must
match exactly one saved group by `wd_mult` and `is_expert_parallel`, and each saved group must get
a param; a run with other overrides (decoupled LR, per-layer settings) is refused. RNG state is
not carried over (resume with `--no-load-rng`), nor `_extra_state` (Megatron-FSDP saves none).
A `dp_reshardable` optimizer (megatron-core 0.19's default) is read from its buckets in place,
as the torch_dist rewrite reads them (`megatron.buckets`, laid out by content; one buffer); 0.15's
`fully_sharded_model_space` is rewritten first (`ckptctl reshard SRC MID`).
The router's expert bias, a persistent buffer, is written whole (as Megatron-FSDP saves a buffer)
with no optimizer state or group.
megatron-core's hybrid stack (MambaModel: `decoder.final_norm`) keys every layer on its own under
its module names; its Mamba mixer's `in_proj.weight` is saved in parts `.z .x .B .C .dt` and its
conv (`conv1d.weight` / `.bias`) in parts `.x .B .C`, each part's key holding every TP rank's rows
of it in rank order (`MambaMixer.sharded_state_dict`). Megatron-FSDP saves them fused, TP-blocked
at the output TP (rank t's block `[z_t; x_t; B_t; C_t; dt_t]`), named as the module names them
(0.19's `conv1d_weight`): each is built block by block from its parts, sized from the layer's
shapes by the geometry the torch_dist conversion cuts them with (`rows.mixer_part_rows`). Mamba
mixers outside a hybrid stack, GDN layers and a hybrid model's dp_reshardable buckets are refused.
A checkpoint saved with `singleton_local_shards` (a key per layer and per expert, fc1 as
`weight_w` / `weight_v`) converts to the same output as its stacks; one saved by pipeline stages
(its layer indices are global) converts to one stage.
"""

from __future__ import annotations

import argparse
import fnmatch
import math
import re
import struct
from collections import defaultdict
from dataclasses import dataclass, replace
from typing import Any

from ckptctl.core.dtypes import float32
from ckptctl.util.errors import CheckpointError, UsageError
from ckptctl.formats.dcp.writer import DcpOutput, place_dcp_records
from ckptctl.formats.megatron_args import CommonState, megatron_core_versions
from ckptctl.formats.torch_save.writer import encode_value
from ckptctl.formats.pickle.unpickle import UnsafePickleError
from ckptctl.megatron.fsdp_dtensor_names import (
    COMMON_ITEMS, LAYER, SWIGLU_PART, UNSUPPORTED, LayerNames, layer_names, optimizer_prefix,
)
from ckptctl.core.geometry import full_box
from ckptctl.core.analysis import analysis, is_layer_stacked, is_optimizer_entry, is_torch_dist_bucket
from ckptctl.megatron.rows import BUFFERS, LAYERS, WORD_EMBEDDING, mixer_part_rows, respelled
from ckptctl.megatron.buckets import HYBRID_FINAL_NORM, Window, block_places, bucket_windows, window_view
from ckptctl.megatron.tp import tp_dp_grid
from ckptctl.core.checkpoint import Checkpoint
from ckptctl.families.placement import Placed, megatron_fsdp
from ckptctl.core.plan import ItemWindows, Piece, SourceTensor, TargetTensor, layer_stacked_view, source_view
from ckptctl.planners.request import PlannedReshard, ReshardChoices
from ckptctl.planners.torch_dist import dp_reshardable_buckets, read_common

EXPERTS = "mlp.experts.experts."
STATE_KEY = re.compile(r"^optimizer\.state\.(?:param|exp_avg|exp_avg_sq)\.(?P<key>.+)$")
"""A fully_reshardable state of model key `key`."""
SWIGLU_FC1 = re.compile(r"\blinear_fc1\.(?:weight|bias)\d*$")
SWIGLU_ADAPTER_OUT = re.compile(r"\blinear_fc1\.adapter\.linear_out\.(?:weight|bias)$")
"""Megatron-Bridge LoRA's linear_out on a SwiGLU fc1: torch_dist saves it [W_all; V_all] as fc1
(`ParallelLinearAdapter.sharded_state_dict`, `apply_swiglu_sharded_factory`), but Megatron-LM's
fsdp_dtensor save splits only fc1's own weight and bias (`handle_swiglu_in_state_dict` matches
`mlp.linear_fc1.weight`): the adapter's DTensor is saved as its TP shards, each [W_t; V_t]."""
CARRIED = (*COMMON_ITEMS[1:], "opt_param_scheduler")
"""Common-state entries written as fsdp_dtensor items (args too, marked as fsdp_dtensor's)."""
DROPPED = ("content_metadata", "optimizer", "rng_state", "rerun_state_machine_state")
"""Common-state entries not written as they are: torch_dist's own, the optimizer (rebuilt per
param), RNG state (resume with `--no-load-rng`), the rerun state machine (Megatron-LM ignores it
for fsdp_dtensor)."""
_CHAINED = ("experts trained with expert parallelism (or their own TP) have an optimizer of their own, chained "
            "to the dense one: not converted to fsdp_dtensor yet")
MAMBA_PART = re.compile(r"^(?P<mixer>decoder\.layers\.\d+\.mixer)\."
                        r"(?P<param>in_proj\.weight|conv1d\.weight|conv1d\.bias)\.(?P<part>[^.]+)$")
"""A part of a Mamba mixer's fused param, as megatron-core 0.19.2's `MambaMixer.sharded_state_dict`
saves it in megatron-core's hybrid stack (`in_proj.weight.z` …, `conv1d.weight.x` …)."""
MAMBA_OTHER = re.compile(r"^decoder\.layers\.\d+\.mixer\.(?!in_proj\.|conv1d)")
"""The rest of a Mamba mixer in the hybrid stack (A_log, D, dt_bias, norm, out_proj): plain params."""
DROPPED_ITEMS = re.compile(r"(^|\.)_extra_state(/|$)|^rng_state(/|$)|^common_state/")


@dataclass(frozen=True)
class _Param:
    """One param as Megatron-FSDP names it, and where it is in a torch_dist key."""

    name: str
    """Its module name (a SwiGLU half's with `_w` / `_v`)."""
    owner: str
    """The param the optimizer knows (fc1's fused name for its halves): its group is saved under it."""
    key: str
    lead: tuple[int, ...]
    """Its index along the stacked dims of `key` (layer, expert; none for an unstacked key)."""
    row: int
    """Its first row in its slab of `key` (a SwiGLU half's offset)."""
    shape: tuple[int, ...]
    owner_shape: tuple[int, ...]
    tp_blocked: int = 1
    """The TP its rows are blocked for, [W_0; V_0; W_1; V_1 …] (1: as saved, [W_all; V_all])."""
    parts: tuple[tuple[str, int], ...] = ()
    """A Mamba mixer's fused param torch_dist keeps in parts: (the part's key, its rows per TP rank),
    in the order each rank holds them; the output is TP-blocked at `tp_blocked` ([z_0; x_0; … dt_0;
    z_1 …]), each part's key holding every rank's rows of it in rank order."""


def plan_to_fsdp_dtensor(ckpt: Checkpoint, tp: int | None, dp: int | None,
                         world_size: int | None) -> tuple[DcpOutput, dict[str, SourceTensor], int]:
    """The fsdp_dtensor checkpoint at TP × DP (TP from `tp` or args, DP from `dp` or `world_size`),
    the source views its pieces read, and its world size."""
    fmt = analysis(ckpt).optimizer_format
    if fmt == "fully_sharded_model_space":
        raise CheckpointError(ckpt.path, f"its optimizer state is {fmt}: rewrite it as fully_reshardable first "
                                         "(ckptctl reshard SRC MID), then convert MID")
    common = _common(ckpt)
    args = common.state.get("args")
    if not isinstance(args, argparse.Namespace):
        raise CheckpointError(ckpt.path, f"{common.where}: no Megatron args: the model spec is unknown")
    cp = getattr(args, "context_parallel_size", None)
    if cp not in (None, 1):
        raise CheckpointError(ckpt.path, f"args.context_parallel_size is {cp!r:.64}: Megatron-FSDP shards a "
                                         "context-parallel run over DP × CP ranks, not converted to fsdp_dtensor yet")
    hybrid = HYBRID_FINAL_NORM in ckpt.tensors  # megatron-core's hybrid stack: every layer keyed on its own
    spec = LayerNames((), UNSUPPORTED) if hybrid else layer_names(ckpt, args)
    if type(getattr(args, "swiglu", None)) is not bool:
        raise CheckpointError(ckpt.path, f"args.swiglu is {getattr(args, 'swiglu', None)!r:.64}: whether fc1 is gated "
                                         "(saved split into weight_w / weight_v) is not known")
    tp, dp = tp_dp_grid(ckpt, args, tp, dp, world_size)
    _check_tp(ckpt, args, tp)
    states = fmt is not None
    params, buffers = _params(ckpt, args, spec, fmt, hybrid)
    params = _fused_mixers(ckpt, args, params, tp, _saving_release(ckpt))
    if args.swiglu and tp > 1:  # a Bridge adapter's linear_out on a SwiGLU fc1: not split, so TP-blocked
        params = [replace(p, tp_blocked=tp) if SWIGLU_ADAPTER_OUT.search(p.name) else p for p in params]
    if fmt == "dp_reshardable":
        buckets, by_optimizer = dp_reshardable_buckets(ckpt, common, args)
        if set(by_optimizer) != {None}:
            raise CheckpointError(ckpt.path, _CHAINED)
        source: _Stacked | _Buckets = _Buckets(ckpt, bucket_windows(ckpt, buckets))
        saved_groups = by_optimizer[None]
    else:
        source = _Stacked(ckpt, states)
        saved_groups = _common_groups(ckpt, common) if states else []
    prefix = optimizer_prefix(args)
    views: dict[str, SourceTensor] = {}
    targets: list[TargetTensor] = []
    placements: dict[str, list[Placed]] = {}
    model = _Stacked(ckpt, False)
    masters: dict[str, TargetTensor] = {}  # weights rebuilt from buckets, and each as torch_dist saved it
    for p in params:
        made = [(f"model.module.{p.name}", "param")]
        if states:
            made += [(f"optimizer.state.{prefix}{p.name}.{s}", s) for s in ("exp_avg", "exp_avg_sq")]
        placed = megatron_fsdp(p.shape, p.name, tp, dp)  # a param's states are placed like it
        for fqn, state in made:
            targets.append(source.target(fqn, state, p, views))
            placements[fqn] = placed
        if isinstance(source, _Buckets):
            masters[made[0][0]] = model.target(_saved_as(p), "param", p, views)
    for b in buffers:  # whole on every rank, saved once
        fqn = f"model.module.{b.name}"
        targets.append(model.target(fqn, "param", b, views))
        placements[fqn] = [Placed(0, full_box(b.shape))]
    planner: dict[str, Any] = {t.fqn: _path(t.fqn, prefix) for t in targets}
    items = _common_items(ckpt, common, args, tp, dp)
    if states:
        groups, step = _groups(ckpt, saved_groups, args, params)
        for owner, group in groups.items():
            for attr, value in group.items():
                items[f"optimizer.param_to_group_meta.{prefix}{owner}.{attr}"] = value
    out = place_dcp_records(targets, placements, views, [], None)
    for fqn, value in items.items():
        try:
            out.append_literal(fqn, encode_value(value))
        except UnsafePickleError as exc:
            raise CheckpointError(ckpt.path, f"{common.where}: {fqn} cannot be written ({exc})") from None
        planner[fqn] = _path(fqn, prefix)
    if states and step is not None:  # torch Adam's per-param step (a 0-d float32 tensor each)
        for p in params:
            fqn = f"optimizer.state.{prefix}{p.name}.step"
            out.append_literal_tensor(fqn, float32, (), struct.pack("<f", step))
            planner[fqn] = _path(fqn, prefix)
    out.planner_data = planner
    out.masters = masters
    return out, views, tp * dp


def _saved_as(p: _Param) -> str:
    """Where torch_dist saved `p`: its key, index in the key's stacked dims and, for a SwiGLU half, rows."""
    lead = f"[{', '.join(map(str, p.lead))}]" if p.lead else ""
    rows = f" rows {p.row}:{p.row + p.shape[0]}" if p.shape != p.owner_shape else ""
    return f"{p.key}{lead}{rows}"


@dataclass(frozen=True)
class ToFsdpDtensor:
    """A torch_dist checkpoint converted to Megatron-FSDP's fsdp_dtensor at TP × DP: it takes the
    output grid only (TP from `tp` or args, DP from `dp` or `world_size`)."""

    tp: int | None
    dp: int | None
    world_size: int | None

    @classmethod
    def from_options(cls, ckpt: Checkpoint, opts: ReshardChoices) -> ToFsdpDtensor:
        for flag, value in (("--world-size", opts.world_size), ("--tp", opts.tp), ("--dp", opts.dp)):
            if value is not None and value < 1:
                raise UsageError(f"{flag} must be at least 1 (got {value})")
        if opts.source_tp is not None or opts.hf_config is not None or opts.dtype is not None or opts.include \
                or opts.exclude or opts.split_fused or opts.fuse or opts.flat_optimizer:
            raise UsageError("a torch_dist checkpoint converted to Megatron-FSDP's fsdp_dtensor takes --tp, --dp and "
                             "--world-size only (fc1 is split as Megatron-LM saves it)")
        return cls(opts.tp, opts.dp, opts.world_size)

    def plan(self, ckpt: Checkpoint) -> PlannedReshard:
        output, views, world_size = plan_to_fsdp_dtensor(ckpt, self.tp, self.dp, self.world_size)
        return PlannedReshard(output, world_size, views)


# --------------------------------------------------------------------------------------
# What the source holds
# --------------------------------------------------------------------------------------


def _common(ckpt: Checkpoint) -> CommonState:
    """The common state (`planners.torch_dist.read_common`), every entry of it of a known kind."""
    common = read_common(ckpt)
    unknown = sorted(str(k) for k in common.state if k not in ("args", *CARRIED, *DROPPED))
    if unknown:
        raise CheckpointError(ckpt.path, f"{common.where}: {unknown[0]!r} is of no known kind: not converted "
                                         "(nothing is dropped unnamed)")
    return common


def _check_tp(ckpt: Checkpoint, args: argparse.Namespace, tp: int) -> None:
    """Megatron pads the vocab to a multiple of `make_vocab_size_divisible_by` × TP: at a TP whose
    padding is not the saved one the job cannot load what is written (heads and query groups:
    `megatron.tp.tp_dp_grid`)."""
    saved = getattr(args, "tensor_model_parallel_size", None)
    embedding = ckpt.tensors.get(WORD_EMBEDDING)
    if tp == saved or embedding is None or not embedding.shape:
        return
    divisor = getattr(args, "make_vocab_size_divisible_by", None) or 128
    if type(divisor) is not int or divisor < 1:
        raise CheckpointError(ckpt.path, f"args.make_vocab_size_divisible_by is {divisor!r:.64}, not a row count")
    rows, multiple = embedding.shape[0], divisor * tp
    vocab = getattr(args, "vocab_size", None)
    if type(vocab) is int and 0 < vocab <= rows:
        padded = -(-vocab // multiple) * multiple
        if padded != rows:
            raise UsageError(f"at TP {tp} Megatron pads the vocab of {vocab} to {padded} rows, not the saved {rows}: "
                             "re-padding the vocab is not done yet")
    elif rows % multiple or (type(saved) is int and tp < saved):
        raise UsageError(f"at TP {tp} Megatron pads the vocab to a multiple of {multiple}, which may not be the "
                         f"saved {rows} rows (args do not say the tokenizer's vocab_size): re-padding the vocab is "
                         "not done yet")


def _params(ckpt: Checkpoint, args: argparse.Namespace, spec: LayerNames, fmt: str | None,
            hybrid: bool = False) -> tuple[list[_Param], list[_Param]]:
    """Every param of the model, each once, and every persistent buffer (no optimizer state), from
    the torch_dist keys; every other entry is claimed (an optimizer state of a model param, a
    bucket) or dropped by name, or the checkpoint is refused."""
    model = [k for k in ckpt.tensors if not is_optimizer_entry(k)]
    buckets = fmt == "dp_reshardable"
    unknown = [k for k in ckpt.tensors if is_optimizer_entry(k) and not (
        (buckets and is_torch_dist_bucket(k))
        or ((m := STATE_KEY.match(k)) and m["key"] in ckpt.tensors and not m["key"].endswith(BUFFERS)))]
    unknown += [k for k in ckpt.bytes_entries if not (DROPPED_ITEMS.search(k) or (buckets and is_torch_dist_bucket(k)))]
    if unknown:
        raise CheckpointError(ckpt.path, f"{len(unknown)} entries of no known torch_dist kind, e.g. {unknown[0]!r}: "
                              "not converted (nothing is dropped unnamed)")
    params: list[_Param] = []
    buffers: list[_Param] = []
    for key in model:
        entry = ckpt.tensors[key]
        if key.endswith(BUFFERS):
            for lead, name in _names(ckpt, args, spec, key):
                shape = tuple(entry.shape[len(lead):])
                buffers.append(_Param(name, name, key, lead, 0, shape, shape))
            continue
        if fmt == "fully_reshardable":
            for s in ("param", "exp_avg", "exp_avg_sq"):
                state = ckpt.tensors.get(f"optimizer.state.{s}.{key}")
                if state is None or state.shape != entry.shape:
                    raise CheckpointError(ckpt.path, f"optimizer.state.{s}.{key}: missing or not shaped like its "
                                                     f"param {list(entry.shape)}")
        for lead, name in _names(ckpt, args, spec, key):
            params += _halves(ckpt, args, key, lead, name, tuple(entry.shape[len(lead):]))
    for p in params:
        if hybrid and (MAMBA_PART.match(p.name) or MAMBA_OTHER.match(p.name)):
            continue  # a Mamba mixer of the hybrid stack (`_fused_mixers`)
        for part, what in spec.unsupported:
            if part in p.name:
                if ".mixer." in p.name and not hybrid:
                    what = f"Mamba mixers outside megatron-core's hybrid stack (no {HYBRID_FINAL_NORM})"
                raise CheckpointError(ckpt.path, f"{p.key}: {what} are not converted to fsdp_dtensor yet")
    return params, buffers


def _saving_release(ckpt: Checkpoint) -> tuple[int, int] | None:
    """The megatron-core release whose module names the output takes: the one that saved the
    checkpoint, where it tells (`megatron_core_versions`: `MCoreMetadata` ≤ 0.15, the
    `common_state` item ≥ 0.19); None where it does not (`common.pt`: 0.16–0.18, or a checkpoint
    written by other code)."""
    saved = megatron_core_versions(ckpt)
    if saved is None or saved.newest == (0, 18):  # common.pt: 0.16–0.18, or written by other code
        return None
    return saved.oldest or saved.newest


def _fused_mixers(ckpt: Checkpoint, args: argparse.Namespace, params: list[_Param], tp: int,
                  release: tuple[int, int] | None) -> list[_Param]:
    """`params` with each Mamba mixer's `in_proj` and conv parts (`MAMBA_PART`) made one fused param
    as Megatron-FSDP saves it at TP `tp`, named as megatron-core `release` names the module (0.19's
    `conv1d_weight`, ≤ 0.18's `conv1d.weight`: torch_dist keys are the same for both, and a name
    Megatron-FSDP's partial load does not find leaves the job's fresh weights in place, so with no
    release known the mixer is refused), the parts sized from the layer's shapes by the
    geometry the torch_dist conversion cuts them with (`rows.mixer_part_rows`); each saved part must
    be that size."""
    found: dict[tuple[str, str], dict[str, _Param]] = {}
    out: list[_Param | tuple[str, str]] = []
    by_name = {p.name: p for p in params}
    for p in params:
        match = MAMBA_PART.match(p.name)
        if match is None:
            out.append(p)
            continue
        group = (match["mixer"], match["param"])
        if group not in found:
            found[group] = {}
            out.append(group)
        found[group][match["part"]] = p
    if found and release is None:
        mixer = next(iter(found))[0]
        raise CheckpointError(ckpt.path, f"{mixer}: megatron-core names a Mamba mixer's conv conv1d.weight up to "
                                         "0.18 and conv1d_weight from 0.19, and this torch_dist checkpoint (its common "
                                         "state in common.pt) does not say which release saved it: not converted to "
                                         "fsdp_dtensor")
    sized: dict[str, dict[str, tuple[tuple[str, int], ...]]] = {}
    fused: dict[tuple[str, str], _Param] = {}
    for (mixer, param), parts in found.items():
        if mixer not in sized:
            def rows(name: str) -> int | None:
                saved = found.get((mixer, name))
                return sum(p.shape[0] for p in saved.values()) if saved and all(p.shape for p in saved.values()) \
                    else None
            a_log = by_name.get(f"{mixer}.A_log")
            proj, conv, heads = rows("in_proj.weight"), rows("conv1d.weight"), a_log.shape[0] if a_log and \
                a_log.shape else None
            if proj is None or conv is None or heads is None:
                raise CheckpointError(ckpt.path, f"{mixer}: needs in_proj.weight and conv1d.weight in parts and A_log "
                                                 "to size its fused in_proj and conv")
            inner = [None if (q := by_name.get(f"{mixer}.{n}")) is None else q.shape[d] if len(q.shape) > d else -1
                     for n, d in (("out_proj.weight", 1), ("norm.weight", 0))]
            sizes = mixer_part_rows(True, proj, conv, heads, inner, args, tp)
            if sizes is None:
                raise CheckpointError(ckpt.path, f"{mixer}.in_proj.weight: {proj} rows in parts beside a conv of "
                                                 f"{conv} and {heads} heads are no Mamba [z, x, B, C, dt] at TP "
                                                 f"{tp} (nor agree with the out_proj, norm and args)")
            sized[mixer] = sizes
        want = sized[mixer][param]
        if sorted(parts) != sorted(part for part, _ in want):
            raise CheckpointError(ckpt.path, f"{mixer}.{param}: saved in parts {', '.join(sorted(parts))}; "
                                             f"megatron-core's MambaMixer keeps {', '.join(p for p, _ in want)}")
        first = parts[want[0][0]]
        for part, n in want:
            got = parts[part]
            if got.shape[0] != n * tp or got.shape[1:] != first.shape[1:]:
                raise CheckpointError(ckpt.path, f"{got.key}: shape {list(got.shape)}, the layer's sizes say "
                                                 f"[{n * tp}, {', '.join(map(str, first.shape[1:]))}]")
        name = respelled(f"{mixer}.{param}", release)
        shape = (sum(n for _, n in want) * tp, *first.shape[1:])
        fused[(mixer, param)] = _Param(name, name, first.key, (), 0, shape, shape, tp,
                                       tuple((parts[part].key, n) for part, n in want))
    return [fused[p] if isinstance(p, tuple) else p for p in out]


def _names(ckpt: Checkpoint, args: argparse.Namespace, spec: LayerNames, key: str) -> list[tuple[tuple[int, ...], str]]:
    """(index along the stacked dims, module name) of each param torch_dist key `key` holds."""
    entry = ckpt.tensors[key]
    if EXPERTS in key and ".adapter." in key and getattr(args, "moe_grouped_gemm", False) is True:
        raise CheckpointError(ckpt.path, f"{key}: a Megatron-Bridge adapter on grouped experts (args.moe_grouped_gemm: "
                                         "TEGroupedMLP), which Bridge's model holds as one adapter shared by an EP "
                                         "rank's experts or packed [E, …], never per expert: not converted to "
                                         "Megatron-FSDP yet")
    if key.startswith(LAYERS) and not key[len(LAYERS)].isdigit():
        if not is_layer_stacked(entry) or len(entry.shape) < 2:
            raise CheckpointError(ckpt.path, f"{key}: a layer stack [L, …] saved other than a layer per chunk")
        rest = key[len(LAYERS):]
        if rest.startswith(EXPERTS):
            layers, experts = entry.shape[:2]
            return [((layer, e), f"{LAYERS}{layer}.{_expert(args, rest[len(EXPERTS):], e)}")
                    for layer in range(layers) for e in range(experts)]
        return [((layer,), f"{LAYERS}{layer}.{spec.to_module(rest)}") for layer in range(entry.shape[0])]
    match = LAYER.match(key)
    if match and match["ns"] == "decoder.layers":
        rest = match["rest"]
        if rest.startswith(EXPERTS):
            inner, head = rest[len(EXPERTS):], f"{LAYERS}{match['index']}"
            index, _, param = inner.partition(".")
            if index.isdigit():  # a key per expert (singleton local shards)
                return [((), f"{head}.{_expert(args, param, int(index))}")]
            return [((e,), f"{head}.{_expert(args, inner, e)}") for e in range(entry.shape[0])]
        return [((), f"{LAYERS}{match['index']}.{spec.to_module(rest)}")]
    return [((), key)]


def _expert(args: argparse.Namespace, param: str, index: int) -> str:
    """Expert `index`'s module name: TEGroupedMLP's `experts.<param><e>`, SequentialMLP's
    `experts.local_experts.<e>.<param>` (args.moe_grouped_gemm)."""
    if getattr(args, "moe_grouped_gemm", False) is True:
        split = SWIGLU_PART.match(param)  # a SwiGLU half keeps its part last: `linear_fc1.weight<e>_w`
        return f"mlp.experts.{split['base']}{index}_{split['part']}" if split else f"mlp.experts.{param}{index}"
    return f"mlp.experts.local_experts.{index}.{param}"


def _halves(ckpt: Checkpoint, args: argparse.Namespace, key: str, lead: tuple[int, ...], name: str,
            shape: tuple[int, ...]) -> list[_Param]:
    """The param, or its SwiGLU halves `_w` (W_all) and `_v` (V_all): Megatron-LM splits every fc1
    of a SwiGLU model when it saves fsdp_dtensor (`handle_swiglu_in_state_dict`)."""
    saved_split = SWIGLU_PART.match(name)  # singleton local shards keep fc1 as weight_w / weight_v
    if saved_split:
        return [_Param(name, saved_split["base"], key, lead, 0, shape, shape)]
    if not (args.swiglu and SWIGLU_FC1.search(name)):
        return [_Param(name, name, key, lead, 0, shape, shape)]
    rows = shape[0] if shape else 1
    if rows % 2:
        raise CheckpointError(ckpt.path, f"{key}: a SwiGLU fc1 of {rows} rows, which do not halve")
    half = (rows // 2, *shape[1:])
    return [_Param(f"{name}_{part}", name, key, lead, i * half[0], half, shape) for i, part in enumerate("wv")]


# --------------------------------------------------------------------------------------
# The output
# --------------------------------------------------------------------------------------


class _Stacked:
    """Each param's rows of its torch_dist key, or of `optimizer.state.<state>.<key>` (the fp32
    master as `param`); a stack read as [L·R, …] (`plan.layer_stacked_view`)."""

    def __init__(self, ckpt: Checkpoint, states: bool) -> None:
        self.ckpt, self.states = ckpt, states

    def target(self, fqn: str, state: str, p: _Param, views: dict[str, SourceTensor]) -> TargetTensor:
        src = f"optimizer.state.{state}.{p.key}" if self.states else p.key
        entry = self.ckpt.tensors[src]
        if src not in views:
            views[src] = layer_stacked_view(entry, len(p.lead)) if p.lead else source_view(entry)
        if not p.shape:
            return TargetTensor(fqn, (), entry.dtype, (Piece(src, (), (), ()),), entry.properties)
        if p.parts:  # every part's rows of rank t, then rank t + 1's …
            rest, pieces, at = (0,) * (len(p.shape) - 1), [], 0
            for t in range(p.tp_blocked):
                for key, rows in p.parts:
                    part = f"optimizer.state.{state}.{key}" if self.states else key
                    if part not in views:
                        views[part] = source_view(self.ckpt.tensors[part])
                    pieces.append(Piece(part, (t * rows, *rest), (at, *rest), (rows, *p.shape[1:])))
                    at += rows
            return TargetTensor(fqn, p.shape, entry.dtype, tuple(pieces), entry.properties)
        slab = sum(i * math.prod(entry.shape[d + 1:len(p.lead)]) for d, i in enumerate(p.lead))
        start = (slab * (p.owner_shape[0]) + p.row, *(0,) * (len(p.shape) - 1))
        if p.tp_blocked > 1:  # [W_all; V_all] → [W_0; V_0; W_1; V_1 …]
            half, rest = p.shape[0] // 2, (0,) * (len(p.shape) - 1)
            if p.shape[0] % 2 or half % p.tp_blocked:
                raise CheckpointError(self.ckpt.path, f"{p.key}: {p.shape[0]} rows of a SwiGLU fc1's adapter do not "
                                                      f"split into W and V blocks for TP {p.tp_blocked}")
            rows = half // p.tp_blocked
            pieces = tuple(Piece(src, (start[0] + part * half + t * rows, *rest), ((2 * t + part) * rows, *rest),
                                 (rows, *p.shape[1:])) for t in range(p.tp_blocked) for part in (0, 1))
            return TargetTensor(fqn, p.shape, entry.dtype, pieces, entry.properties)
        return TargetTensor(fqn, p.shape, entry.dtype, (Piece(src, start, (0,) * len(p.shape), p.shape),),
                            entry.properties)


class _Buckets:
    """Each param's TP blocks in the `dp_reshardable` buckets (`megatron.buckets`): its master
    weights (`param`) and moments, each block a window of its bucket's items."""

    def __init__(self, ckpt: Checkpoint, windows: list[Window]) -> None:
        self.ckpt = ckpt
        self.windows: dict[tuple[str, tuple[int, ...]], list[Window]] = defaultdict(list)
        for window in windows:
            self.windows[(window.param.key, window.param.lead)].append(window)
        self.items: dict[str, ItemWindows] = {}
        self.named: dict[tuple[int, str], tuple[str, SourceTensor]] = {}
        """(window, state) → its view's name and view, made once."""

    def target(self, fqn: str, state: str, p: _Param, views: dict[str, SourceTensor]) -> TargetTensor:
        if p.parts:
            raise CheckpointError(self.ckpt.path, f"{p.key}: a Mamba mixer's in_proj or conv in dp_reshardable buckets "
                                                  "is not converted to fsdp_dtensor yet (fully_reshardable is)")
        blocks = self.windows[(p.key, p.lead)]
        if not blocks:
            raise CheckpointError(self.ckpt.path, f"{p.key}: no bucket holds it")
        if p.tp_blocked > 1:
            raise CheckpointError(self.ckpt.path, f"{p.key}: a SwiGLU fc1's adapter in dp_reshardable buckets, which "
                                                  f"is not converted to fsdp_dtensor at TP {p.tp_blocked} yet")
        rows = p.owner_shape[0] if p.owner_shape else 0
        stop = p.row + (p.shape[0] if p.shape else 0)
        pieces = []
        for window in blocks:
            made = self.named.get((id(window), state))
            if made is None:  # both SwiGLU halves read the same windows
                made = self.named[(id(window), state)] = window_view(window, state, self.items, units=False)
                views[made[0]] = made[1]
            name = made[0]
            for src, dst, sizes in block_places(window, rows):
                if not p.shape or p.row <= dst[0] < stop:
                    pieces.append(Piece(name, src, (dst[0] - p.row, *dst[1:]) if p.shape else dst, sizes))
        return TargetTensor(fqn, p.shape, blocks[0].entries[state].dtype, tuple(pieces))


def _common_groups(ckpt: Checkpoint, common: CommonState) -> list[dict[str, Any]]:
    """The param groups a `fully_reshardable` common state keeps (one DistributedOptimizer's)."""
    opt = common.state.get("optimizer")
    saved = opt.get("optimizer", {}).get("param_groups") if isinstance(opt, dict) else None
    if not (isinstance(saved, list) and saved and all(isinstance(g, dict) for g in saved)):
        raise CheckpointError(ckpt.path, f"{common.where}: no optimizer param groups of one DistributedOptimizer "
                                         "(chained optimizers, as a MoE's expert optimizer, are not converted yet)")
    return saved


def _groups(ckpt: Checkpoint, saved: list[dict[str, Any]], args: argparse.Namespace,
            params: list[_Param]) -> tuple[dict[str, dict[str, Any]], float | None]:
    """Each param's group settings (by the param the optimizer knows), and Adam's one step."""
    if getattr(args, "decoupled_lr", None) is not None:
        raise CheckpointError(ckpt.path, "args.decoupled_lr is set: which params had it is not recorded in "
                                         "torch_dist, and its rule is not converted yet")
    if _expert_parallel(args) and any(".mlp.experts." in p.owner for p in params):
        raise CheckpointError(ckpt.path, _CHAINED)
    qk_wd = getattr(args, "apply_wd_to_qk_layernorm", False) is True
    owners: dict[str, dict[str, Any]] = {}
    used: set[int] = set()
    for p in params:
        if p.owner in owners:
            continue
        wd = 0.0 if _no_weight_decay(p.owner, p.owner_shape, qk_wd) else 1.0
        found = [i for i, g in enumerate(saved) if g.get("wd_mult") == wd and g.get("is_expert_parallel") is False]
        if len(found) != 1:
            raise CheckpointError(ckpt.path, f"{p.owner}: megatron-core's standard rule puts it in a group of "
                                             f"wd_mult {wd}, is_expert_parallel False; {len(found)} of the "
                                             f"{len(saved)} saved groups are such (trained with other overrides?)")
        used.add(found[0])
        owners[p.owner] = {k: v for k, v in saved[found[0]].items() if k != "params"}
    if len(used) != len(saved):
        first = next(i for i in range(len(saved)) if i not in used)
        raise CheckpointError(ckpt.path, f"saved param group {first} (wd_mult {saved[first].get('wd_mult')!r}) gets "
                                         "no param by megatron-core's standard rule: trained with other overrides, "
                                         "which torch_dist does not record per param")
    steps = {g.get("step") for g in saved}
    if len(steps) != 1 or not isinstance(next(iter(steps)), (int, float, type(None))):
        raise CheckpointError(ckpt.path, "the param groups saved different Adam steps "
                                         f"{sorted(map(repr, steps))}")
    step = next(iter(steps))
    return owners, None if step is None else float(step)


def _expert_parallel(args: argparse.Namespace) -> bool:
    """Whether expert params are marked `allreduce` False, so grouped apart (`is_expert_parallel`):
    with expert parallelism, or an expert TP other than the TP (megatron-core's parallel linears);
    a value that is not a size says so too (the conversion is then refused)."""
    ep, etp = getattr(args, "expert_model_parallel_size", None), getattr(args, "expert_tensor_parallel_size", None)
    return ep not in (None, 1) or etp not in (None, getattr(args, "tensor_model_parallel_size", None))


def _no_weight_decay(name: str, shape: tuple[int, ...], qk_wd: bool) -> bool:
    """megatron-core's standard `wd_mult` 0 rule (`get_standard_config_overrides`)."""
    if qk_wd:
        return (len(shape) == 1 or name.endswith(".bias")) and not ("q_layernorm." in name or "k_layernorm." in name)
    return fnmatch.fnmatch(name, "*.bias") or len(shape) == 1


def _common_items(ckpt: Checkpoint, common: CommonState, args: argparse.Namespace, tp: int,
                  dp: int) -> dict[str, Any]:
    """args (as Megatron-FSDP's at TP × DP, one pipeline stage), the counters and the scheduler, as
    DCP items."""
    marked = argparse.Namespace(**{**vars(args), "ckpt_format": "fsdp_dtensor", "use_megatron_fsdp": True})
    if getattr(marked, "pipeline_model_parallel_size", None) is not None:  # torch_dist's layer indices are global
        marked.pipeline_model_parallel_size = 1
    if getattr(marked, "virtual_pipeline_model_parallel_size", None) is not None:
        marked.virtual_pipeline_model_parallel_size = None
    saved_tp = getattr(marked, "tensor_model_parallel_size", None)
    if saved_tp is not None:
        marked.tensor_model_parallel_size = tp
    if saved_tp is not None and getattr(marked, "expert_tensor_parallel_size", None) == saved_tp:
        marked.expert_tensor_parallel_size = tp  # the experts' TP followed the TP (Megatron-LM's default)
    if getattr(marked, "data_parallel_size", None) is not None:
        marked.data_parallel_size = dp
    if getattr(marked, "world_size", None) is not None:
        marked.world_size = tp * dp
    items: dict[str, Any] = {"args": marked}
    for name in CARRIED:
        if name not in common.state:
            continue
        value = common.state[name]
        if name == "opt_param_scheduler":
            if not isinstance(value, dict):
                raise CheckpointError(ckpt.path, f"{common.where}: opt_param_scheduler is a "
                                                 f"{type(value).__name__}, not a dict")
            items.update({f"{name}.{k}": v for k, v in value.items()})
        else:
            items[name] = value
    return items


def _path(fqn: str, prefix: str) -> tuple[str, ...]:
    """The state-dict path DCP flattened into `fqn` (`planner_data`)."""
    for root in ("model.module.", f"optimizer.state.{prefix}", f"optimizer.param_to_group_meta.{prefix}"):
        if fqn.startswith(root):
            name, _, leaf = fqn[len(root):].rpartition(".")
            head = tuple(root.split(".")[:2])
            if root == "model.module.":
                return (*head, fqn[len(root):])
            return (*head, prefix + name, leaf)
    return tuple(fqn.split(".", 1))
