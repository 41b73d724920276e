"""Megatron-aware reshard: split, fuse or re-block fused TP-blocked tensors, and lay out for Megatron-FSDP.

Megatron keeps SwiGLU `linear_fc1` and GDN `in_proj`/`conv1d` fused, and their global
tensor is TP-blocked (`[W_0; V_0; W_1; V_1; …]`): a job at another TP size reads it
scrambled. Every rewrite here — split into components, fuse components, re-block from
one TP to another — is a set of row-block translations (`megatron.tp_blocked_split`,
`tp_reblock`) in *global* row coordinates, applied alike to the param and to each of its
optimizer states with the param's shape (flat 1-D buffers are first seen in the param's
shape), never to a local shard's element count. Other per-param states (Adam `step`)
are copied under every new name, as Megatron does.

The rewritten targets are then placed (FSDP2 rows or Megatron-FSDP TP×DP boxes),
optionally stored flat in item coordinates, and written by the same streaming DCP writer
as a plain reshard. Model dimensions a split needs (GDN heads and dims, whether fc1 is
gated) come from `--hf-config` or the checkpoint's `args`; without them it refuses.
"""

from __future__ import annotations

import argparse
import enum
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Sequence

from ckptctl.core.dtypes import DType, cast_dtype
from ckptctl.util.errors import CheckpointError, UsageError
from ckptctl.formats.dcp.writer import DcpOutput, place_dcp_records
from ckptctl.families.base import is_model_key, load_hf_config
from ckptctl.storage.hub import DEFAULT_HUB_TIMEOUT
from ckptctl.families.nemotron_h import Mamba
from ckptctl.families.qwen3_next import GatedDeltaNet
from ckptctl.core.analysis import analysis, is_optimizer_entry, source_tensors, split_optimizer_fqn
from ckptctl.core.names import MODEL_PREFIXES
from ckptctl.families.registry import family_for_model_type, fused_component, fused_kind, megatron_tp_kind
from ckptctl.megatron.rows import FUSED_PARTS, WRITTEN_SPLIT, RowBlock, TpKind, is_expert, tp_blocked_split, tp_reblock
from ckptctl.megatron.tp import resolve_tp, tp_dp_grid
from ckptctl.formats.megatron_args import checkpoint_args, context_parallel
from ckptctl.formats.torch_save.writer import encode_value
from ckptctl.formats.pickle.unpickle import UnsafePickleError
from ckptctl.core.checkpoint import BytesEntry, Checkpoint
from ckptctl.families.placement import Placed, flat, fsdp2, megatron_fsdp
from ckptctl.core.rank_state import megatron_rng, megatron_rng_selection, plain_reshard_rng_selection
from ckptctl.core.selection import selected
from ckptctl.core.plan import Piece, SourceTensor, TargetTensor, identity_target
from ckptctl.planners.request import PlannedReshard, ReshardChoices

LAYOUTS = ("fsdp2", "megatron-fsdp")
SWIGLU_ACTIVATIONS = frozenset({"silu", "swish", "swiglu"})
"""HF `hidden_act` values of a SwiGLU MLP (Megatron `--swiglu`): Megatron-FSDP saves its fc1
split into `_w`/`_v`; another gated unit (Gemma's GeGLU) stays fused."""
GDN_FIELDS = ("linear_num_key_heads", "linear_key_head_dim", "linear_num_value_heads", "linear_value_head_dim")
MAMBA_FIELDS = {"hf": ("mamba_num_heads", "mamba_head_dim", "n_groups", "ssm_state_size"),
                "args": ("mamba_num_heads", "mamba_head_dim", "mamba_num_groups", "mamba_state_dim")}
"""The Mamba-2 mixer sizes (heads, head dim, groups, state) as an HF config and Megatron's args name them."""
GROUP_META_ROOTS = ("optimizer.param_to_group_meta.", "optim.param_to_group_meta.")


# --------------------------------------------------------------------------------------
# Options: the output layout and the model dimensions
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    """The output layout: `fsdp2` rows at `world_size`, or Megatron-FSDP at `tp` × `dp` ranks."""

    name: str
    world_size: int
    tp: int | None
    dp: int | None = None

    def place(self, shape: tuple[int, ...], param_name: str) -> list[Placed]:
        if self.name == "fsdp2":
            return fsdp2(shape, self.world_size)
        return megatron_fsdp(shape, param_name, self.tp, self.dp)


class FusedAction(enum.Enum):
    """What a Megatron-aware reshard does with fused tensors: keep them fused (re-blocked when the
    TP changes), split them into their saved components, or fuse components."""

    KEEP = "keep"
    SPLIT = "split"
    FUSE = "fuse"


@dataclass(frozen=True)
class MegatronRequest:
    """A Megatron-aware reshard, its options parsed and checked once (`from_options`), before planning:
    the output layout asked for, what to do with fused tensors, flat optimizer states, where
    the model dims come from, and the selection and cast every reshard has."""

    layout: str
    world_size: int | None
    tp: int | None
    """The target TP (fused tensors are re-blocked for it)."""
    dp: int | None
    source_tp: int | None
    fused: FusedAction
    flat_optimizer: bool = False
    hf_config: Path | None = None
    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    dtype: DType | None = None
    hub_timeout: float = DEFAULT_HUB_TIMEOUT
    keep_common_ranks: bool = False

    @classmethod
    def from_options(cls, ckpt: Checkpoint, opts: ReshardChoices) -> MegatronRequest:
        """Refuse option combinations that cannot work (one line each), whatever the checkpoint."""
        layout, world_size, tp, dp, source_tp = opts.layout, opts.world_size, opts.tp, opts.dp, opts.source_tp
        split_fused, fuse = opts.split_fused, opts.fuse
        if layout not in LAYOUTS:
            raise UsageError(f"--layout must be one of {', '.join(LAYOUTS)}, torch-dist (got {layout!r})")
        for flag, value in (("--world-size", world_size), ("--tp", tp), ("--dp", dp), ("--source-tp", source_tp)):
            if value is not None and value < 1:
                raise UsageError(f"{flag} must be at least 1 (got {value})")
        if split_fused and fuse:
            raise UsageError("--split-fused and --fuse are opposites; pass one of them")
        if fuse and tp is None:
            raise UsageError("--fuse needs --tp: the TP size the fused tensors are blocked for")
        if layout == "fsdp2":
            if dp is not None:
                raise UsageError("--dp applies to --layout megatron-fsdp only")
            if world_size is None:
                raise UsageError("--world-size is required with --layout fsdp2")
            if source_tp is not None and tp is None and not split_fused:
                raise UsageError("--source-tp names the TP the source's fused tensors are blocked for; "
                                 "pass --tp (the target TP) or --split-fused with it")
        elif dp is None and world_size is None:
            raise UsageError("--layout megatron-fsdp needs --dp (or --world-size = TP × DP)")
        fused = FusedAction.SPLIT if split_fused else FusedAction.FUSE if fuse else FusedAction.KEEP
        return cls(layout, world_size, tp, dp, source_tp, fused, opts.flat_optimizer, opts.hf_config,
                   tuple(opts.include), tuple(opts.exclude), opts.dtype, opts.hub_timeout, opts.keep_common_ranks)

    def plan(self, ckpt: Checkpoint) -> PlannedReshard:
        return PlannedReshard(plan_megatron(ckpt, self), output_world_size(ckpt, self))


def resolve_layout(ckpt: Checkpoint, req: MegatronRequest) -> Layout:
    """The output's rank grid: for Megatron-FSDP, TP from the request or the checkpoint, DP
    from the request or the world size."""
    if req.layout == "fsdp2":
        return Layout("fsdp2", req.world_size, req.tp)
    tp, dp = tp_dp_grid(ckpt, checkpoint_args(ckpt), req.tp, req.dp, req.world_size, req.source_tp)
    return Layout("megatron-fsdp", tp * dp, tp, dp)


@dataclass(frozen=True)
class ModelDims:
    """What splitting fused tensors needs to know about the model, and where it came from."""

    gated: bool | None
    """fc1 is `[W; V]` per TP rank."""
    swiglu: bool | None
    """…and gated by SiLU, so it may be saved split."""
    gdn: GatedDeltaNet | None
    mamba: Mamba | None
    looked_in: tuple[str, ...]
    """Where they were looked for (`--hf-config PATH`, `the checkpoint's args`)."""

    def not_found(self) -> str:
        """Why a dimension is unknown, for an error message."""
        if not self.looked_in:
            return "no --hf-config was given and the checkpoint has no readable args entry"
        if len(self.looked_in) == 1:
            return f"they are not in {self.looked_in[0]}"
        return f"they are in neither {self.looked_in[0]} nor {self.looked_in[1]}"


def _lookup(data: dict, key: str) -> Any:
    """A config value, also looked for in a multimodal config's `text_config`."""
    if data.get(key) is not None:
        return data[key]
    text = data.get("text_config")
    return text.get(key) if isinstance(text, dict) else None


def _gdn(values: Sequence[Any], where: str) -> GatedDeltaNet | None:
    """The GDN head layout from the values of `GDN_FIELDS`, or None when one is missing."""
    if any(v is None for v in values):
        return None
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in values):
        raise UsageError(f"{where}: GDN fields {', '.join(GDN_FIELDS)} must be positive integers (got {list(values)})")
    key_heads, key_dim, value_heads, value_dim = values
    return GatedDeltaNet(key_heads=key_heads, value_heads=value_heads, key_dim=key_dim, value_dim=value_dim)


def _mamba(values: Sequence[Any], where: str) -> Mamba | None:
    """The Mamba sizes from the values of `MAMBA_FIELDS`, or None when one is missing."""
    if any(v is None for v in values):
        return None
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in values):
        raise UsageError(f"{where}: Mamba fields {', '.join(MAMBA_FIELDS['hf'])} must be positive integers "
                         f"(got {list(values)})")
    return Mamba(*values)


def readable_args(ckpt: Checkpoint) -> argparse.Namespace | None:
    """The checkpoint's `args`, or None when absent or not decodable without unpickling code."""
    try:
        return checkpoint_args(ckpt)
    except CheckpointError:
        return None


def model_dims(ckpt: Checkpoint, hf_config: Path | None, hub_timeout: float = DEFAULT_HUB_TIMEOUT) -> ModelDims:
    """GDN and Mamba sizes and fc1 gating from `--hf-config` (preferred) or the checkpoint's `args`:
    gating from the config's family where ckptctl knows it (its rules say whether fc1 is gated),
    else from `hidden_act`; saved split only when SiLU-gated."""
    gated: bool | None = None
    swiglu: bool | None = None
    gdn: GatedDeltaNet | None = None
    mamba: Mamba | None = None
    origins = []
    if hf_config is not None:
        cfg = load_hf_config(hf_config, hub_timeout)
        act = _lookup(cfg.data, "hidden_act") or _lookup(cfg.data, "hidden_activation")
        family = family_for_model_type(str(_lookup(cfg.data, "model_type")))
        if act is not None:
            swiglu = str(act).lower() in SWIGLU_ACTIVATIONS
        gated = family.gated_mlp() if family is not None else None
        if gated is not None:
            swiglu = bool(swiglu) and gated
        elif act is not None:
            gated = swiglu
        gdn = _gdn([_lookup(cfg.data, k) for k in GDN_FIELDS], str(cfg.path))
        mamba = _mamba([_lookup(cfg.data, k) for k in MAMBA_FIELDS["hf"]], str(cfg.path))
        origins.append(f"--hf-config {cfg.path}")
    args = readable_args(ckpt)
    if args is not None:
        if swiglu is None and (hasattr(args, "swiglu") or hasattr(args, "gated_linear_unit")):
            swiglu = bool(getattr(args, "swiglu", False))
            gated = swiglu or bool(getattr(args, "gated_linear_unit", False))
        if gdn is None:
            gdn = _gdn([getattr(args, k, None) for k in GDN_FIELDS], f"{ckpt.path}: args")
        if mamba is None:
            mamba = _mamba([getattr(args, k, None) for k in MAMBA_FIELDS["args"]], f"{ckpt.path}: args")
        origins.append("the checkpoint's args")
    return ModelDims(gated, swiglu, gdn, mamba, tuple(origins))


# --------------------------------------------------------------------------------------
# Regroups: target params made of row blocks of source params
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Regroup:
    """Target params built from row blocks of source params (model fqns).

    `blocks[j]` lists `(source index, RowBlock src row → target row)` filling `targets[j]`
    (`rows[j]` rows); `tails[j]` is how `targets[j]`'s name differs from `sources[0]`'s:
    (tail dropped, tail added), applied to optimizer state names the same way.
    """

    sources: tuple[str, ...]
    targets: tuple[str, ...]
    rows: tuple[int, ...]
    blocks: tuple[tuple[tuple[int, RowBlock], ...], ...]
    tails: tuple[tuple[str, str], ...]


def split_regroup(fqn: str, parts: Sequence[str], component_rows: Sequence[int], tp: int) -> Regroup:
    """A fused tensor TP-blocked at `tp` → its components `fqn + part`."""
    blocks = tp_blocked_split(component_rows, tp)
    return Regroup((fqn,), tuple(fqn + p for p in parts), tuple(component_rows),
                   tuple(tuple((0, b) for b in bl) for bl in blocks), tuple(("", p) for p in parts))


def fuse_regroup(base: str, parts: Sequence[str], component_rows: Sequence[int], tp: int) -> Regroup:
    """Components `base + part` → one fused tensor TP-blocked at `tp`."""
    blocks = [(i, RowBlock(b.dst_row, b.src_row, b.rows))
              for i, bl in enumerate(tp_blocked_split(component_rows, tp)) for b in bl]
    return Regroup(tuple(base + p for p in parts), (base,), (sum(component_rows),),
                   (tuple(sorted(blocks, key=lambda x: x[1].dst_row)),), ((parts[0], ""),))


def reblock_regroup(fqn: str, component_rows: Sequence[int], source_tp: int, target_tp: int) -> Regroup:
    """A fused tensor TP-blocked at `source_tp` → the same tensor blocked at `target_tp`."""
    blocks = tp_reblock(component_rows, source_tp, target_tp)
    return Regroup((fqn,), (fqn,), (sum(component_rows),), (tuple((0, b) for b in blocks),), (("", ""),))


def row_target(fqn: str, sources: Sequence[str], blocks: Sequence[tuple[int, RowBlock]], rows: int,
               trailing: tuple[int, ...], dtype: DType, properties: Any) -> TargetTensor:
    """A target of `rows` rows assembled from row blocks of `sources` (all with `trailing` dims)."""
    pad = tuple(0 for _ in trailing)
    pieces = tuple(Piece(sources[i], (b.src_row, *pad), (b.dst_row, *pad), (b.rows, *trailing)) for i, b in blocks)
    return TargetTensor(fqn, (rows, *trailing), dtype, pieces, properties)


def renamed_state(state_fqn: str, tail: tuple[str, str]) -> str:
    """`<optimizer prefix><param name>.<state>` with the param name's tail swapped."""
    split = split_optimizer_fqn(state_fqn)
    old, new = tail
    if not split.param.endswith(old):
        raise UsageError(f"{state_fqn}: its param name does not end with {old!r}")
    return f"{split.prefix}{split.param[: len(split.param) - len(old)]}{new}.{split.state}"


# --------------------------------------------------------------------------------------
# The plan
# --------------------------------------------------------------------------------------


@dataclass
class Planned:
    """Targets built so far, with what placing, naming and flattening them needs."""

    targets: dict[str, TargetTensor] = field(default_factory=dict)
    param_of: dict[str, tuple[str, tuple[int, ...] | None]] = field(default_factory=dict)
    """target fqn → (model param name for the TP rule, the param's shape if known)."""
    origin: dict[str, tuple[str, int]] = field(default_factory=dict)
    """target fqn → (source fqn it was renamed from, length of the text after the param name)."""

    def add(self, target: TargetTensor, param: str, param_shape: tuple[int, ...] | None,
            origin: str, after_param: int) -> None:
        if target.fqn in self.targets:
            raise UsageError(f"{target.fqn}: two source tensors would be written under this name")
        self.targets[target.fqn] = target
        self.param_of[target.fqn] = (param, param_shape)
        self.origin[target.fqn] = (origin, after_param)


class MegatronPlanner:
    """Builds the targets of a Megatron-aware reshard from one checkpoint and its options."""

    def __init__(self, ckpt: Checkpoint, req: MegatronRequest, layout: Layout,
                 sources: dict[str, SourceTensor]) -> None:
        self.ckpt, self.req, self.layout, self.sources = ckpt, req, layout, sources
        self._source_tp: int | None = None
        self._dims: ModelDims | None = None
        self.states: dict[str, dict[str, str]] = {}
        self.param_of_state: dict[str, str] = {}
        self.orphans: list[str] = []
        for report in analysis(ckpt).reports:
            fqn = report.fqn
            split = split_optimizer_fqn(fqn)
            if split is None:
                continue
            if report.param:
                self.states.setdefault(report.param, {})[split.state] = fqn
                self.param_of_state[fqn] = report.param
            else:
                self.orphans.append(fqn)
        self.params = [f for f in ckpt.tensors if not is_optimizer_entry(f)]
        self.applied: list[Regroup] = []

    # -- lazily resolved facts -------------------------------------------------------

    def source_tp(self) -> int:
        if self._source_tp is None:
            self._source_tp = resolve_tp(self.ckpt, checkpoint_args(self.ckpt), self.req.source_tp, "--source-tp",
                                         strict=True)
        return self._source_tp

    def dims(self) -> ModelDims:
        if self._dims is None:
            self._dims = model_dims(self.ckpt, self.req.hf_config, self.req.hub_timeout)
        return self._dims

    def component_rows(self, fqn: str, kind: str) -> tuple[int, ...] | None:
        """Global rows of each component of fused `fqn`; None when it is an ungated (unfused) fc1."""
        rows = self.sources[fqn].shape[0] if self.sources[fqn].shape else 0
        dims = self.dims()
        if kind == TpKind.SWIGLU:
            if dims.gated is None:
                raise UsageError(f"{fqn}: cannot tell whether linear_fc1 is gated (fused [W; V], "
                                 f"hidden_act / args.swiglu): {dims.not_found()}; pass --hf-config REF")
            if not dims.gated:
                return None
            if rows % 2:
                raise UsageError(f"{fqn}: SwiGLU fc1 has an odd number of rows ({rows})")
            return (rows // 2, rows // 2)
        if kind.startswith("mamba_"):
            if dims.mamba is None:
                raise UsageError(f"{fqn}: re-blocking Mamba {kind.removeprefix('mamba_')} needs the Mamba sizes "
                                 f"({', '.join(MAMBA_FIELDS['hf'])}), but {dims.not_found()}; pass --hf-config REF")
            wanted = dims.mamba.in_proj_rows if kind == TpKind.MAMBA_IN_PROJ else dims.mamba.conv_rows
            origin = "Mamba"
        elif dims.gdn is None:
            raise UsageError(f"{fqn}: splitting or re-blocking GDN {kind.removeprefix('gdn_')} needs the GDN "
                             f"head counts and dims ({', '.join(GDN_FIELDS)}), but {dims.not_found()}; "
                             "pass --hf-config REF")
        else:
            wanted, origin = (dims.gdn.in_proj_rows if kind == TpKind.GDN_IN_PROJ else dims.gdn.conv_rows), "GDN"
        if sum(wanted) != rows:
            raise UsageError(f"{fqn}: has {rows} rows but the {origin} dims from {' and '.join(dims.looked_in)} give "
                             f"{' + '.join(map(str, wanted))} = {sum(wanted)}")
        return wanted

    def check_expert_tp(self, fqn: str, source_side: bool) -> None:
        """Routed experts are blocked for the expert TP (ETP); they are rewritten only where ETP = TP.

        Source side: the args' ETP must be the TP the source is read with. Target side
        (fusing or re-blocking for --tp): the job must train experts at its dense TP.
        """
        if not is_expert(fqn):
            return
        args = readable_args(self.ckpt)
        etp = getattr(args, "expert_tensor_parallel_size", None) if args is not None else None
        if etp is None:
            return
        tp = self.source_tp() if source_side else getattr(args, "tensor_model_parallel_size", etp)
        if etp != tp:
            raise UsageError(f"{fqn}: experts are blocked for expert TP {etp}, not TP {tp}; "
                             "ckptctl rewrites fused expert tensors only when both are equal")

    # -- regroups --------------------------------------------------------------------

    def regroups(self) -> list[Regroup]:
        """What to split, fuse or re-block, from the options and the fused tensors present."""
        out: list[Regroup] = []
        target_tp = self.layout.tp
        self.refuse_unknown_tp_blocked(target_tp)
        for fqn in self.params:
            kind = fused_kind(fqn)
            if kind is None or not (self.req.fused is FusedAction.SPLIT or target_tp is not None):
                continue
            if self.req.fused is not FusedAction.SPLIT and self.source_tp() == target_tp:
                continue
            rows = self.component_rows(fqn, kind)
            if rows is None:
                continue
            split = self.req.fused is FusedAction.SPLIT and kind in WRITTEN_SPLIT and (kind != TpKind.SWIGLU or bool(self.dims().swiglu))
            if not split and target_tp in (None, self.source_tp()):
                continue
            self.check_expert_tp(fqn, source_side=True)
            if not split:
                self.check_expert_tp(fqn, source_side=False)
            if split:
                out.append(split_regroup(fqn, FUSED_PARTS[kind], rows, self.source_tp()))
            else:
                out.append(reblock_regroup(fqn, rows, self.source_tp(), target_tp))
        if self.req.fused is FusedAction.FUSE:
            out.extend(self.fuse_regroups())
        if out and self.orphans:
            odd = [f for f in self.orphans if fused_kind(split_optimizer_fqn(f).param)
                   or fused_component(split_optimizer_fqn(f).param)]
            if odd:
                raise UsageError(f"{odd[0]}: its model param is not in the checkpoint, so it cannot be "
                                 "split or re-blocked with it")
        return out

    def refuse_unknown_tp_blocked(self, target_tp: int | None) -> None:
        """A TP change re-blocks the fused tensors the family rules know; a tensor no rule knows
        might be fused per TP rank (as GDN's and Mamba's `in_proj` are) and come out scrambled,
        so the change is refused, naming it (`families.registry.megatron_tp_kind`)."""
        if target_tp is None:
            return
        unknown = [f for f in self.params  # model weights: not TE's `_extra_state` blobs, RNG or training state
                   if is_model_key(f) and self.ckpt.tensors[f].shape and megatron_tp_kind(f) is None]
        if unknown and self.source_tp() != target_tp:  # the source TP is asked for only when it matters
            more = f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""
            raise UsageError(f"{unknown[0]}{more}: no rule knows how Megatron splits it over TP (it may be fused "
                             f"per TP rank, as GDN's and Mamba's in_proj are), so changing TP {self.source_tp()} "
                             f"to {target_tp} could scramble it; reshard at --tp {self.source_tp()}")

    def fuse_regroups(self) -> list[Regroup]:
        groups: dict[str, dict[int, str]] = {}
        kinds: dict[str, str] = {}
        for fqn in self.params:
            found = fused_component(fqn)
            if found is not None:
                base, kind, index = found
                groups.setdefault(base, {})[index] = fqn
                kinds[base] = kind
        out = []
        for base, members in groups.items():
            parts = FUSED_PARTS[kinds[base]]
            missing = [base + p for i, p in enumerate(parts) if i not in members]
            if missing:
                raise UsageError(f"{base}: cannot fuse, component {missing[0]} is missing")
            if base in self.ckpt.tensors:
                raise UsageError(f"{base}: cannot fuse, the checkpoint has both it and its components")
            shapes = [self.sources[base + p].shape for p in parts]
            if any(len(s) < 1 or s[1:] != shapes[0][1:] for s in shapes):
                raise UsageError(f"{base}: components have mismatched shapes {[list(s) for s in shapes]}")
            self.check_expert_tp(base, source_side=False)
            out.append(fuse_regroup(base, parts, [s[0] for s in shapes], self.req.tp))
        return out

    # -- targets ---------------------------------------------------------------------

    def cast(self, dtype: DType) -> DType:

        return cast_dtype(dtype, self.req.dtype)

    def properties(self, fqn: str) -> Any:
        return self.ckpt.tensors[fqn].properties

    def build(self) -> Planned:
        planned = Planned()
        consumed: set[str] = set()
        self.applied = self.regroups()
        for group in self.applied:
            consumed.update(self.apply(group, planned))
        for fqn, src in self.sources.items():
            if fqn in consumed:
                continue
            target = identity_target(src, dtype=self.cast(src.dtype))
            target = replace(target, properties=self.properties(fqn))
            split = split_optimizer_fqn(fqn)
            if split is None:
                planned.add(target, fqn, src.shape, fqn, 0)
                continue
            param = self.param_of_state.get(fqn)
            shape = self.ckpt.tensors[param].shape if param else None
            planned.add(target, param or split.param, shape, fqn, len(split.state) + 1)
        return planned

    def apply(self, group: Regroup, planned: Planned) -> set[str]:
        """Add the group's targets (params and optimizer states); returns the source fqns it consumed."""
        first = self.sources[group.sources[0]]
        trailing = first.shape[1:]
        for fqn in group.sources:
            if self.sources[fqn].dtype != first.dtype:
                raise UsageError(f"{fqn}: dtype differs from {group.sources[0]}; cannot fuse them")
        consumed = set(group.sources)
        for j, target in enumerate(group.targets):
            planned.add(row_target(target, group.sources, group.blocks[j], group.rows[j], trailing,
                                   self.cast(first.dtype), self.properties(group.sources[0])),
                        target, (group.rows[j], *trailing), group.sources[0], 0)
        for state in self.states.get(group.sources[0], {}):
            fqns = []
            for param in group.sources:
                fqn = self.states.get(param, {}).get(state)
                if fqn is None:
                    raise UsageError(f"{param}: has no optimizer state {state!r} while "
                                     f"{group.sources[0]} has one; cannot fuse them")
                fqns.append(fqn)
            consumed.update(fqns)
            self.apply_state(group, state, fqns, planned)
        for param in group.sources[1:]:
            extra = set(self.states.get(param, {})) - set(self.states.get(group.sources[0], {}))
            if extra:
                raise UsageError(f"{param}: has optimizer state {sorted(extra)[0]!r} that "
                                 f"{group.sources[0]} lacks; cannot fuse them")
        return consumed

    def apply_state(self, group: Regroup, state: str, fqns: list[str], planned: Planned) -> None:
        shapes = [self.sources[f].shape for f in fqns]
        params = [self.sources[p].shape for p in group.sources]
        after = len(state) + 1
        if shapes == params:
            src = self.sources[fqns[0]]
            for j, target in enumerate(group.targets):
                name = renamed_state(fqns[0], group.tails[j])
                planned.add(row_target(name, fqns, group.blocks[j], group.rows[j], src.shape[1:],
                                       self.cast(src.dtype), self.properties(fqns[0])),
                            target, (group.rows[j], *src.shape[1:]), fqns[0], after)
            return
        bad = next((f for f, s, p in zip(fqns, shapes, params) if s != p and s != ()), None)
        if bad is not None:
            shape = self.sources[bad].shape
            param = group.sources[fqns.index(bad)]
            raise UsageError(
                f"{bad}: saved {list(shape)} but its param {param} is {list(self.sources[param].shape)}: "
                "not in the param's shape (a plain per-rank tensor DCP kept one rank's copy of?); refusing to "
                "split or re-block it (see `ckptctl inspect --check`)")
        src = self.sources[fqns[0]]
        for j, target in enumerate(group.targets):
            copy = identity_target(src, renamed_state(fqns[0], group.tails[j]), self.cast(src.dtype))
            planned.add(replace(copy, properties=self.properties(fqns[0])), target, None, fqns[0], after)


# --------------------------------------------------------------------------------------
# Names: planner_data paths, group meta, args
# --------------------------------------------------------------------------------------


def renamed_path(path: Any, old: str, new: str, after_param: int) -> tuple:
    """`path` (DCP planner_data: nested keys of `old`) rewritten for `new`.

    The name changes only at the end of the param name, which ends `after_param`
    characters before the end of the fqn; the path element ending there is rewritten.
    """
    if not isinstance(path, (tuple, list)) or ".".join(map(str, path)) != old:
        return tuple(new.split("."))
    end_old, end_new = len(old) - after_param, len(new) - after_param
    if old[end_old:] != new[end_new:]:
        return tuple(new.split("."))
    at = -1
    for i, element in enumerate(path):
        at += len(str(element)) + 1
        if at == end_old and isinstance(element, str):
            start = at - len(element)
            return (*path[:i], new[start:end_new], *path[i + 1:])
    return tuple(new.split("."))


def planner_data(ckpt: Checkpoint, planned: Planned, bytes_names: dict[str, str]) -> dict | None:
    """planner_data for every output key: the source's path, renamed where the key was."""
    if not isinstance(ckpt.planner_data, dict):
        return None
    out: dict[str, Any] = {}
    for fqn in planned.targets:
        origin, after = planned.origin[fqn]
        if origin in ckpt.planner_data:
            out[fqn] = ckpt.planner_data[origin] if origin == fqn else \
                renamed_path(ckpt.planner_data[origin], origin, fqn, after)
    for fqn, origin in bytes_names.items():
        if origin in ckpt.planner_data:
            after = len(fqn.rsplit(".", 1)[-1]) + 1 if fqn != origin else 0
            out[fqn] = ckpt.planner_data[origin] if origin == fqn else \
                renamed_path(ckpt.planner_data[origin], origin, fqn, after)
    return out


def group_meta_renames(bytes_names: Sequence[str], groups: Sequence[Regroup]) -> dict[str, str | None]:
    """For `--fuse`: group meta of the first component moves to the fused name, the others are dropped.

    Megatron keys `param_to_group_meta` by the live (fused) param name, so a fused
    checkpoint needs it there; an entry already under the fused name wins.
    """
    components = {param_name(source): (param_name(group.targets[0]), index)
                  for group in groups for index, source in enumerate(group.sources)}
    existing = set(bytes_names)
    out: dict[str, str | None] = {}
    for fqn in bytes_names:
        root = next((r for r in GROUP_META_ROOTS if fqn.startswith(r)), None)
        if root is None:
            continue
        param, _, attr = fqn[len(root):].rpartition(".")
        wrappers = ""
        while param.startswith("module."):
            wrappers, param = wrappers + "module.", param[len("module."):]
        if param in components:
            base, index = components[param]
            new = f"{root}{wrappers}{base}.{attr}"
            out[fqn] = new if index == 0 and new not in existing else None
    return out


def param_name(fqn: str) -> str:
    """A model key without its model prefix and `module.` wrappers (`model.module.decoder.x` → `decoder.x`)."""
    prefix = next(p for p in MODEL_PREFIXES if fqn.startswith(p))
    name = fqn[len(prefix):]
    while name.startswith("module."):
        name = name[len("module."):]
    return name


def rewritten_args(ckpt: Checkpoint, tp: int) -> bytes | None:
    """Megatron's `args` with `tensor_model_parallel_size` set to the output's TP; None when unchanged.

    Later tools (and `--use-checkpoint-args`) read the training TP from here, so leaving the
    old value would make them split the re-blocked tensors with the wrong TP.
    """
    args = readable_args(ckpt)
    if args is None or getattr(args, "tensor_model_parallel_size", None) in (None, tp):
        return None
    old = args.tensor_model_parallel_size
    args = argparse.Namespace(**vars(args))
    args.tensor_model_parallel_size = tp
    if getattr(args, "expert_tensor_parallel_size", None) == old:
        args.expert_tensor_parallel_size = tp
    try:
        return encode_value(args)  # opaque values (enum members) as they were saved
    except UnsafePickleError as exc:
        raise CheckpointError(ckpt.path, f"args cannot be written back ({exc})") from None


# --------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------


def plan_megatron(ckpt: Checkpoint, req: MegatronRequest) -> DcpOutput:
    """The whole output of a Megatron-aware reshard: targets, placement, copy runs. No tensor I/O."""
    layout = resolve_layout(ckpt, req)
    rng, kept = megatron_rng([*ckpt.tensors, *ckpt.bytes_entries]), lambda f: selected(f, req.include, req.exclude)
    keep = megatron_rng_selection(rng, kept, layout.dp, req.keep_common_ranks) if layout.dp is not None else \
        plain_reshard_rng_selection(rng, kept, layout.world_size, req.keep_common_ranks, lambda: context_parallel(ckpt),
                                    layout.tp)
    sources = source_tensors(ckpt)
    planner = MegatronPlanner(ckpt, req, layout, sources)
    planned = planner.build()
    groups = [g for g in planner.applied if len(g.sources) > 1]

    targets: list[TargetTensor] = []
    placements: dict[str, list[Placed]] = {}
    for fqn, target in planned.targets.items():
        if not keep(fqn):
            continue
        param, param_shape = planned.param_of[fqn]
        placed = layout.place(target.shape, param)
        if (req.flat_optimizer and split_optimizer_fqn(fqn) is not None and param_shape is not None
                and len(param_shape) >= 2 and target.shape == param_shape):
            placed = flat(placed, target.shape)
            target = replace(target, shape=(math.prod(target.shape),), logical_shape=target.shape)
        targets.append(target)
        placements[fqn] = placed

    renames = group_meta_renames(list(ckpt.bytes_entries), groups)
    new_args = rewritten_args(ckpt, req.tp) if req.tp is not None and "args" in ckpt.bytes_entries else None
    kept: list[BytesEntry] = []
    bytes_names: dict[str, str] = {}
    for fqn, entry in ckpt.bytes_entries.items():
        name = renames.get(fqn, fqn)
        if name is None or not keep(name):
            continue
        bytes_names[name] = fqn
        if not (fqn == "args" and new_args is not None):
            kept.append(replace(entry, fqn=name))
    out = place_dcp_records(targets, placements, sources, kept, planner_data(ckpt, planned, bytes_names))
    if new_args is not None and "args" in bytes_names:
        out.append_literal("args", new_args)
    return out


def output_world_size(ckpt: Checkpoint, req: MegatronRequest) -> int:
    """How many ranks the output is laid out for."""
    return resolve_layout(ckpt, req).world_size

