"""What a checkpoint's chunks say about how it was sharded, and whether it is whole.

Pure analysis of a `Checkpoint` (metadata only, no I/O): per tensor, how much of it the
chunks cover and which sharding scheme they follow; across entries, which model param
each optimizer state belongs to and whether the state is as big as its param. `inspect`
shows the result, `inspect --check` fails on its problems, and commands that copy data
call `analyze(ckpt).problems` to refuse a source that would silently lose data.

Layout labels (`TensorReport.layout`):

- `scalar`: a 0-d tensor (Adam `step`).
- `empty`: a tensor with no elements.
- `flat`: a 1-D optimizer state whose model param is N-D with the same element count
  (Megatron-FSDP flat buffers; chunk offsets are item coordinates).
- `single`: one chunk.
- `shard0-even`: whole-row chunks exactly as `torch.chunk` cuts dim 0 for some rank count
  (FSDP2 `Shard(0)`), ceil(rows/N) rows each.
- `rows-uneven`: whole-row chunks that are not `torch.chunk` cuts (Megatron-FSDP).
- `shard1`: every chunk holds all of dim 0 and a column block of dim 1 (`dim1_parts` of
  them): FSDP2 `Shard(1)`, or Megatron RowParallel TP without DP.
- `grid`: chunks cut both dim 0 and dim 1 into column blocks (`dim1_parts`): Megatron-FSDP's
  TP × DP of a RowParallel weight, or expert parallelism on dim 0 with FSDP `Shard(1)`.
  Which one is a question of names, not geometry: `inspect` calls a dim-1 split of a tensor
  the Megatron rules call RowParallel `tp-dp-grid` with its TP degree.
- `layer-stacked`: a Megatron-Core torch_dist key with a leading layer axis
  (`decoder.layers.<name>`), saved one layer deep per chunk (TP cuts inside each layer).
- `bucketed`: a torch_dist `dp_reshardable` optimizer buffer
  (`optimizer.distributed.dp_group_idx_…bucket_idx_….exp_avg`): a DP bucket of a TP rank's
  params, 1-D, cut at DP boundaries; which param lies where is not saved.
- `model-space`: a torch_dist `fully_sharded_model_space` state: the param's TP fragments as
  axes plus each fragment's elements (`[L, TP, 1, n]`), cut mid-fragment at DP boundaries.
- `irregular`: anything else.

Zero-size chunks (FSDP2 ranks that own no rows write them at offset == rows) are ignored.

Problem kinds (`Problem.kind`): `gaps` and `overlaps` (coverage), `data-loss` (a per-param
optimizer state with another element count than its param: a plain per-rank tensor of
which DCP kept one rank's copy), `shape-mismatch` (an N-D state with the param's element
count in another shape), `rank-conflict` (per-rank `__{rank}.metadata` files that
disagree about an entry's shape, dtype or kind: ranks saved different data under one
name, and only one rank's can be read).

A torch_dist checkpoint names its optimizer format by its keys (`torch_dist_optimizer_format`):
`fully_reshardable` states are shaped like their param and checked like any other;
`model-space` ones hold the param's elements in another shape (not a problem), and buckets
belong to no one param.

Groups: `optimizer` for keys under `optim.` / `optimizer.`; `other` for training
bookkeeping roots (`TRAINING_STATE_ROOTS`: `args`, `iteration`, RNG state, torchtitan's
`lr_scheduler`, `train_state`, `dataloader`, ...), whatever the model prefix; `model` for
keys under the checkpoint's model prefix (the most common one of `MODEL_PREFIXES`) or named
as the param of an optimizer state; `other` for the rest.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

from ckptctl.util.gc_pause import gc_paused
from ckptctl.core.geometry import Box, chunk_rows, interval_union, union_volume, whole_rows
from ckptctl.core.checkpoint import Checkpoint, TensorEntry
from ckptctl.core.optimizer_states import expected_shape, is_scalar
from ckptctl.core.names import (CHAINED_OPTIMIZER, MODEL_PREFIXES, OPTIMIZER_GROUP_ROOTS, OPTIMIZER_ROOTS,
                                is_training_state)
from ckptctl.core.plan import SourceTensor, source_view

TORCH_DIST_STATES = ("param", "fp32_param", "exp_avg", "exp_avg_sq")
"""Megatron-Core torch_dist's per-param optimizer states, named before the param:
`optimizer.state.exp_avg.decoder.layers.mlp.linear_fc1.weight`."""

TORCH_DIST_BUCKETS = "optimizer.distributed."
"""Where torch_dist's `dp_reshardable` format keeps its DP bucket buffers (after `chained_<i>.`
for each optimizer of a ChainedOptimizer)."""

TORCH_DIST_MASTERS = "optimizer.state.param."
"""The fully_reshardable format's fp32 master copy of each param (`<this><key>`, shaped like it)."""

TORCH_DIST_FORMATS = (("dp_reshardable", TORCH_DIST_BUCKETS),
                      ("fully_sharded_model_space", "optimizer.state.fp32_param."),
                      ("fully_reshardable", TORCH_DIST_MASTERS))
"""Megatron-Core's DistributedOptimizer formats (`distrib_optim_sharding_type`) and the keys each saves."""

_WRAPPER = "module."


@dataclass(frozen=True)
class Coverage:
    """How the chunks cover the global tensor, in elements.

    `covered` counts elements held by at least one chunk, `gaps` those held by none, and
    `overlaps` the extra copies (sum of chunk sizes minus `covered`).
    """

    status: str
    covered: int
    gaps: int
    overlaps: int

    @property
    def complete(self) -> bool:
        return self.status == "complete"


@dataclass(frozen=True)
class TensorReport:
    """The analysis of one tensor entry."""

    fqn: str
    layout: str
    dim1_parts: int | None
    """For `shard1` and `grid`: how many column blocks dim 1 is cut into."""
    coverage: Coverage
    group: str
    param: str | None


@dataclass(frozen=True)
class Problem:
    """A coverage hole, an overlap or an inconsistency that would lose or corrupt data."""

    fqn: str
    kind: str
    message: str


@dataclass(frozen=True)
class Prefixes:
    """Key prefixes seen: model wrappers (`model.module.`) and optimizer state roots."""

    model: tuple[str, ...]
    optimizer: tuple[str, ...]


@dataclass(frozen=True)
class Analysis:
    """Everything `inspect` reports about a checkpoint beyond its raw metadata."""

    reports: list[TensorReport]
    problems: list[Problem]
    prefixes: Prefixes
    world_size: int
    groups: dict[str, int]
    dtypes: dict[str, int]
    layouts: dict[str, int]
    optimizer_format: str | None = None
    """A torch_dist checkpoint's DistributedOptimizer format (`TORCH_DIST_FORMATS`), if it has optimizer state."""

    _index: dict[str, TensorReport] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_index", {r.fqn: r for r in self.reports})

    def report(self, fqn: str) -> TensorReport:
        """The report of tensor `fqn` (KeyError if the checkpoint has no such tensor)."""
        return self._index[fqn]


@dataclass(frozen=True)
class StateName:
    """An optimizer state key split up: `optimizer.state.module.` + `decoder.x.weight` + `exp_avg`."""

    prefix: str
    param: str
    state: str


def split_optimizer_fqn(fqn: str) -> StateName | None:
    """Split a per-param optimizer state key; None for anything else (param groups, model keys).

    The prefix is the state root plus any `module.` wrappers, the state name is the last
    component: `optim.state.layers.0.weight.exp_avg` → (`optim.state.`, `layers.0.weight`,
    `exp_avg`).
    """
    root = next((r for r in OPTIMIZER_ROOTS if fqn.startswith(r)), None)
    if root is None:
        return None
    prefix = root
    while fqn.startswith(prefix + _WRAPPER):
        prefix += _WRAPPER
    param, dot, state = fqn[len(prefix):].rpartition(".")
    if not dot or not param or not state:
        return None
    return StateName(prefix, param, state)


def split_torch_dist_state(fqn: str) -> StateName | None:
    """Split a torch_dist per-param state key (`optimizer.state.<state>.<param key>`); None otherwise."""
    if not fqn.startswith("optimizer.state."):
        return None
    state, dot, param = fqn[len("optimizer.state."):].partition(".")
    return StateName("optimizer.state.", param, state) if dot and param and state in TORCH_DIST_STATES else None


def is_optimizer_entry(fqn: str) -> bool:
    """Whether `fqn` belongs to an optimizer (`OPTIMIZER_GROUP_ROOTS`, or a chained optimizer's)."""
    return fqn.startswith(OPTIMIZER_GROUP_ROOTS) or CHAINED_OPTIMIZER.match(fqn) is not None


def _unchained(fqn: str) -> str:
    """`fqn` without a chained optimizer's `chained_<i>.` prefix."""
    chained = CHAINED_OPTIMIZER.match(fqn)
    return fqn[chained.end():] if chained else fqn


def is_torch_dist_bucket(fqn: str) -> bool:
    """Whether `fqn` is a `dp_reshardable` entry: a bucket buffer, its sizes or its param groups."""
    return _unchained(fqn).startswith(TORCH_DIST_BUCKETS)


def torch_dist_optimizer_format(names: Collection[str]) -> str | None:
    """Which DistributedOptimizer format a torch_dist checkpoint's keys hold, or None (no optimizer state)."""
    unchained = [_unchained(n) for n in names]
    return next((name for name, root in TORCH_DIST_FORMATS if any(n.startswith(root) for n in unchained)), None)


def find_param(ckpt_or_names: Checkpoint | Collection[str], optimizer_fqn: str) -> str | None:
    """The model tensor an optimizer state belongs to, or None.

    Tries the param path as written after the state root (wrappers included), then with
    the `module.` wrappers stripped, under each model prefix, most specific first; so
    `optimizer.state.module.decoder.x.exp_avg` finds `model.module.decoder.x`.
    """
    names = ckpt_or_names.tensors if isinstance(ckpt_or_names, Checkpoint) else ckpt_or_names
    split = split_optimizer_fqn(optimizer_fqn)
    if split is None:
        return None
    root = next(r for r in OPTIMIZER_ROOTS if optimizer_fqn.startswith(r))
    wrappers = split.prefix[len(root):]
    for name in dict.fromkeys((wrappers + split.param, split.param)):
        for model_prefix in MODEL_PREFIXES:
            candidate = model_prefix + name
            if candidate in names:
                return candidate
    return None


def whole_row_spans(entry: TensorEntry) -> list[tuple[int, int]] | None:
    """The row ranges of the non-empty chunks, sorted, when every chunk is a box of whole rows of
    a tensor with elements (FSDP2's Shard(0), a million times in a large checkpoint); else None.
    Told from the boxes' columns, without a `Box` per chunk."""
    shape = entry.shape
    if not shape or entry.numel == 0:
        return None
    boxes = list(entry.boxes())
    if not whole_rows(shape, [o for o, _ in boxes], [s for _, s in boxes]):
        return None
    return sorted((o[0], o[0] + s[0]) for o, s in boxes if s[0])


def coverage(entry: TensorEntry) -> Coverage:
    """Exact element coverage of `entry` by its chunks (by their row ranges when they are whole rows)."""
    return _coverage(entry, whole_row_spans(entry))


def _coverage(entry: TensorEntry, spans: list[tuple[int, int]] | None) -> Coverage:
    if spans is not None:
        row = math.prod(entry.shape[1:])
        covered = interval_union(spans) * row
        overlaps = sum(hi - lo for lo, hi in spans) * row - covered
    else:
        boxes = [Box(offsets, sizes) for offsets, sizes in entry.boxes() if 0 not in sizes]
        covered = union_volume(boxes)
        overlaps = sum(b.numel for b in boxes) - covered
    gaps = entry.numel - covered
    status = "+".join(s for s, n in (("gaps", gaps), ("overlaps", overlaps)) if n) or "complete"
    return Coverage(status, covered, gaps, overlaps)


def classify_layout(entry: TensorEntry, param: TensorEntry | None = None) -> tuple[str, int | None]:
    """The layout label of `entry` and, for `shard1` and `grid`, how many column blocks cut dim 1.

    `param` is the model param of an optimizer state (needed to recognise `flat`).
    """
    return _classify_layout(entry, param, whole_row_spans(entry))


def _classify_layout(entry: TensorEntry, param: TensorEntry | None,
                     spans: list[tuple[int, int]] | None) -> tuple[str, int | None]:
    """`classify_layout`, given the entry's `whole_row_spans` (worked out once per tensor)."""
    if not entry.shape:
        return "scalar", None
    if entry.numel == 0:
        return "empty", None
    if (param is not None and len(entry.shape) == 1 and len(param.shape) >= 2
            and param.numel == entry.numel):
        return "flat", None
    if spans is not None and len(spans) > 1:
        return ("shard0-even" if _is_torch_chunk(entry.shape[0], spans) else "rows-uneven"), None
    boxes = sorted((box for box in entry.boxes() if 0 not in box[1]), key=lambda box: box[0])
    if len(boxes) == 1:
        return "single", None
    if not boxes:
        return "irregular", None
    shape = entry.shape
    if all(o[1:] == (0,) * (len(shape) - 1) and s[1:] == shape[1:] for o, s in boxes):
        return ("shard0-even" if _is_torch_chunk(shape[0], [(o[0], o[0] + s[0]) for o, s in boxes])
                else "rows-uneven"), None
    if len(shape) >= 2 and all(o[2:] == (0,) * (len(shape) - 2) and s[2:] == shape[2:] for o, s in boxes):
        widths: dict[int, set[int]] = {}
        for o, s in boxes:
            widths.setdefault(o[1], set()).add(s[1])
        if len(widths) > 1 and all(len(w) == 1 for w in widths.values()):
            all_rows = all(o[0] == 0 and s[0] == shape[0] for o, s in boxes)
            return ("shard1" if all_rows else "grid"), len(widths)
    return "irregular", None


_STACKED = re.compile(r"(^|\.)decoder\.layers\.(?!\d)")


def is_layer_stacked(entry: TensorEntry) -> bool:
    """A torch_dist layer stack: `decoder.layers.<name>` (no layer number), each chunk one layer deep
    (as megatron-core saves) or whole layers (as a converter writing whole tensors does): what
    `plan.layer_stacked_view` reads layer by layer."""
    whole = entry.shape[1:2]  # a chunk of whole layers spans every row of them
    return bool(entry.shape) and _STACKED.search(entry.fqn) is not None and all(
        sizes[0] == 1 or (bool(whole) and offsets[1] == 0 and sizes[1:2] == whole)
        for offsets, sizes in entry.boxes() if 0 not in sizes)


def _is_torch_chunk(rows: int, ranges: list[tuple[int, int]]) -> bool:
    """True when the sorted non-empty row ranges are `torch.chunk(rows, N)` for some N."""
    step = ranges[0][1] - ranges[0][0]
    parts = -(-rows // step)
    if -(-rows // parts) != step:
        return False
    return ranges == [r for r in chunk_rows(rows, parts) if r[1] > r[0]]


def _model_prefix(fqn: str) -> str:
    return next(p for p in MODEL_PREFIXES if fqn.startswith(p))


def _group(fqn: str, model_prefix: str | None, params: set[str]) -> str:
    """Optimizer keys by root; model keys under the checkpoint's model prefix or named by a state."""
    if is_optimizer_entry(fqn):
        return "optimizer"
    if is_training_state(fqn):
        return "other"
    if model_prefix is not None and (fqn.startswith(model_prefix) or fqn in params):
        return "model"
    return "other"


def _fmt_shape(shape: tuple[int, ...]) -> str:
    return str(list(shape))


def _state_problem(state: TensorEntry, param: TensorEntry, state_name: str) -> Problem | None:
    """A per-param state must hold as many elements as its param (flat or in the param's shape), or
    be of the smaller shape its optimizer gives it by design (Adafactor's factored moments)."""
    if not state.shape or is_scalar(state_name):
        return None
    factored = expected_shape(state_name, param.shape)
    if factored is not None:
        if state.shape == factored:
            return None
        lost = state.numel < math.prod(factored)
        return Problem(state.fqn, "data-loss" if lost else "shape-mismatch", (
            f"{state.fqn}: saved {_fmt_shape(state.shape)} but {state_name} of param {param.fqn} "
            f"{_fmt_shape(param.shape)} is {_fmt_shape(factored)}" + (
                ": optimizer state was saved as a plain per-rank tensor and DCP kept one rank's copy (data loss)"
                if lost else "")))
    if state.numel != param.numel:
        return Problem(state.fqn, "data-loss", (
            f"{state.fqn}: saved {_fmt_shape(state.shape)} ({state.numel} elements) but param {param.fqn} is "
            f"{_fmt_shape(param.shape)} ({param.numel} elements): optimizer state was saved as a plain per-rank "
            "tensor and DCP kept one rank's copy (data loss)"))
    if len(state.shape) > 1 and state.shape != param.shape:
        return Problem(state.fqn, "shape-mismatch", (
            f"{state.fqn}: saved {_fmt_shape(state.shape)} but param {param.fqn} is {_fmt_shape(param.shape)}"))
    return None


def _coverage_problems(fqn: str, cov: Coverage, numel: int) -> list[Problem]:
    out = []
    if cov.gaps:
        out.append(Problem(fqn, "gaps", f"{fqn}: chunks cover {cov.covered} of {numel} elements ({cov.gaps} missing)"))
    if cov.overlaps:
        out.append(Problem(fqn, "overlaps", f"{fqn}: chunks overlap on {cov.overlaps} elements"))
    return out


def analysis(ckpt: Checkpoint) -> Analysis:
    """Layouts, coverage and problems (`analyze`), computed once per opened checkpoint and kept
    with it: refusal checks, source views, Megatron planning and verification all need them."""
    found = ckpt.derived.get("analysis")
    if found is None:
        with gc_paused():
            found = ckpt.derived["analysis"] = analyze(ckpt)
    return found


@dataclass(frozen=True)
class _Context:
    """What every tensor's analysis reads of the whole checkpoint: which entries are optimizer states of
    which params, and the model's key prefix."""

    stacked: bool
    states: dict[str, StateName]
    param_of: dict[str, str | None]
    params: set[str]
    model_prefix: str | None


def _context(ckpt: Checkpoint) -> _Context:
    names = ckpt.tensors.keys()
    stacked = ckpt.megatron_backend == "torch_dist"
    split = split_torch_dist_state if stacked else split_optimizer_fqn
    states = {fqn: state for fqn in names if (state := split(fqn))}
    param_of = {fqn: (state.param if state.param in names else None) if stacked else find_param(names, fqn)
                for fqn, state in states.items()}
    params = {p for p in param_of.values() if p is not None}
    seen = Counter(_model_prefix(f) for f in names if not is_optimizer_entry(f) and not is_training_state(f))
    model_prefix = max(seen, key=lambda p: (seen[p], len(p))) if seen else None
    return _Context(stacked, states, param_of, params, model_prefix)


Finding = tuple[TensorReport, list[Problem]]
"""One tensor's report and problems."""


def shared_findings(ckpt: Checkpoint, rank: int, world_size: int) -> list[Finding]:
    """Worker `rank`'s share of the tensors' analysis: every `world_size`-th tensor from its rank.
    Each depends on the whole checkpoint only through `_context`, so torchrun workers share the
    tensors out (`engine.dist.shared_analysis`)."""
    context = _context(ckpt)
    return [_finding(ckpt, fqn, context) for fqn in list(ckpt.tensors)[rank::world_size]]


def analyze_shares(ckpt: Checkpoint, shares: Sequence[Sequence[Finding]]) -> Analysis:
    """`analyze(ckpt)` from every worker's `shared_findings`, indexed by rank."""
    k = len(shares)
    return analyze(ckpt, [shares[i % k][i // k] for i in range(len(ckpt.tensors))])


def _finding(ckpt: Checkpoint, fqn: str, context: _Context) -> Finding:
    entry = ckpt.tensors[fqn]
    param_fqn = context.param_of.get(fqn)
    param = ckpt.tensors[param_fqn] if param_fqn else None
    spans = whole_row_spans(entry)
    layout, parts = _torch_dist_layout(entry, param) if context.stacked else _classify_layout(entry, param, spans)
    cov = _coverage(entry, spans)
    problems = _coverage_problems(fqn, cov, entry.numel)
    if param is not None and layout != "model-space" and (
            problem := _state_problem(entry, param, context.states[fqn].state)):
        problems.append(problem)
    group = _group(fqn, context.model_prefix, context.params)
    return TensorReport(fqn, layout, parts, cov, group, param_fqn), problems


def analyze(ckpt: Checkpoint, findings: Sequence[Finding] | None = None) -> Analysis:
    """Coverage, layout, grouping and cross-entry consistency of every tensor of `ckpt` (given
    `findings`, every tensor's in checkpoint order, only what spans them is computed)."""
    context = _context(ckpt)
    if findings is None:
        findings = [_finding(ckpt, fqn, context) for fqn in ckpt.tensors]
    reports = [report for report, _ in findings]
    problems = [problem for _, found in findings for problem in found]
    problems.extend(Problem(fqn, "rank-conflict", message) for fqn, message in ckpt.rank_conflicts.items())
    model_seen = Counter(_model_prefix(r.fqn) for r in reports if r.group == "model")
    optim_seen = Counter(state.prefix for state in context.states.values())
    groups = Counter(r.group for r in reports)
    groups.update(_group(f, context.model_prefix, context.params) for f in ckpt.bytes_entries)
    return Analysis(
        reports=reports,
        problems=problems,
        prefixes=Prefixes(_by_count(model_seen), _by_count(optim_seen)),
        world_size=ckpt.saved_world_size,
        groups={g: groups.get(g, 0) for g in ("model", "optimizer", "other")},
        dtypes=dict(sorted(Counter(e.dtype_name for e in ckpt.tensors.values()).items())),
        layouts=dict(sorted(Counter(r.layout for r in reports).items())),
        optimizer_format=torch_dist_optimizer_format(ckpt.tensors.keys()) if context.stacked else None,
    )


def _torch_dist_layout(entry: TensorEntry, param: TensorEntry | None) -> tuple[str, int | None]:
    """A torch_dist entry's layout: its optimizer buckets and model-space fragments by name, layer
    stacks by their chunks, the rest by geometry."""
    if is_torch_dist_bucket(entry.fqn) and len(entry.shape) == 1:
        return "bucketed", None
    if param is not None and entry.shape != param.shape and entry.numel == param.numel:
        return "model-space", None
    if is_layer_stacked(entry):
        return "layer-stacked", None
    return classify_layout(entry, param)


def _by_count(counts: Mapping[str, int]) -> tuple[str, ...]:
    return tuple(sorted(counts, key=lambda p: (-counts[p], p)))


def source_tensors(ckpt: Checkpoint) -> dict[str, SourceTensor]:
    """Every tensor entry as a source; flat 1-D optimizer buffers take their param's shape."""
    reports = {r.fqn: r for r in analysis(ckpt).reports}
    out = {}
    for fqn, entry in ckpt.tensors.items():
        report = reports.get(fqn)
        if report is not None and report.layout == "flat" and report.param:
            out[fqn] = source_view(entry, ckpt.tensors[report.param].shape)
        else:
            out[fqn] = source_view(entry)
    return out
