"""Megatron-Core's `dp_reshardable` optimizer buckets, laid back out in model space.

DistributedOptimizer keeps each TP rank's params, flat, in DDP buckets; torch_dist's
`dp_reshardable` format saves each bucket's param / exp_avg / exp_avg_sq as a 1-D tensor
(`optimizer.distributed.dp_group_idx_<tp rank>.gbuf_idx_<i>.dtype_(…).bucket_idx_<b>.<state>`)
and not which param lies where. That map is rebuilt here the way megatron-core's
`_ParamAndGradBuffer` builds it: the params in reverse registration order of the model, each
start padded to 64 elements, a bucket closing where its saved length ends. The order is
found by content (`megatron.bucket_order`: any spec, megatron-core's local one, Transformer
Engine's or a custom one) or taken from `LOCAL_SPEC`, megatron-core's local GPT spec, whose
table also names every param the model may have and its TP rule. Each param's range is then its TP-local block, placed
in the global tensor by its TP rule (column, row or replicated; SwiGLU fc1's `[W_t; V_t]` as
two row blocks of torch_dist's `[W_all; V_all]`; a Gated DeltaNet or Mamba `in_proj` or
`conv1d`, saved in parts, as each part's row block of its own key). Under expert parallelism
megatron-core chains two optimizers (`chained_<i>.` entries): the dense one per TP rank, the
experts' per EP × TP rank, each of those holding its EP rank's share of every layer's experts.
Under pipeline parallelism each stage has its own buffers (DP groups PP rank × those): the first
stage the embedding and its share of the layers, the last its share, the final norm and the
output layer; under virtual pipeline parallelism each of a stage's model chunks has a buffer of
its own (`gbuf_idx_<chunk>`), holding the layers of its virtual stage.

Nothing here is taken on trust: every bucket must end exactly at its last param, and every
saved chunk of a bucket (the writer cuts one per param range and per gap) must lie inside
one param or one gap; a checkpoint of another spec, version or layout is refused, naming what
was expected. Pure planning: no I/O (content is read through the `BufferOrder` the caller gives).
"""

from __future__ import annotations

import bisect
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol

from ckptctl.util.errors import CheckpointError
from ckptctl.megatron.rows import LAYERS, WORD_EMBEDDING, TpKind, is_expert
from ckptctl.core.checkpoint import Checkpoint, TensorEntry
from ckptctl.core.plan import ItemWindows, Piece, SourceTensor, TargetTensor

ALIGN = 64
"""megatron-core pads each param's start in a DistributedOptimizer buffer to 64 elements."""

BUCKET = re.compile(r"(?:chained_(\d+)\.)?optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_(\d+)"
                    r"\.dtype_\(([^)]*)\)\.bucket_idx_(\d+)\.(param|exp_avg|exp_avg_sq)")
"""A bucket state: (chained optimizer, DP group, buffer, dtypes, bucket, state); a ChainedOptimizer
(a MoE's dense and expert optimizers under expert parallelism) prefixes each its own `chained_<i>.`."""
GROUPS_ITEM = re.compile(r"(?:chained_(\d+)\.)?optimizer\.distributed\.dp_group_idx_(\d+)\.optimizer/shard_0_1")
"""Each DP group's copy of its optimizer's param groups: (chained optimizer, DP group)."""

COLUMN, ROW, REPLICATED, GATED = TpKind.COLUMN, TpKind.ROW, TpKind.REPLICATED, TpKind.SWIGLU


@dataclass(frozen=True)
class Split:
    """A column-parallel param megatron-core saves in parts, `<key>.<part>` each (its
    `_split_tensor_factory`): a TP rank's block is each part's block in turn (GDN's `in_proj`
    `[q_t; k_t; v_t; z_t; β_t; α_t]`), and part p's rows go to rows t of `<key>.<p>`."""

    parts: tuple[str, ...]


GDN_IN_PROJ = Split(("query", "key", "value", "z", "beta", "alpha"))
GDN_CONV1D = Split(("query", "key", "value"))
MAMBA_IN_PROJ = Split(("z", "x", "B", "C", "dt"))
MAMBA_CONV1D = Split(("x", "B", "C"))

HYBRID_FINAL_NORM = "decoder.final_norm.weight"
"""The final norm of megatron-core's hybrid stack (MambaModel): `decoder.final_layernorm` in a GPT decoder."""

LAYER = (
    ("input_layernorm.weight", REPLICATED),
    ("input_layernorm.bias", REPLICATED),
    ("self_attention.linear_qkv.layer_norm_weight", REPLICATED),
    ("self_attention.linear_qkv.layer_norm_bias", REPLICATED),
    ("self_attention.in_proj.layer_norm_weight", REPLICATED),
    ("self_attention.dt_bias", COLUMN),
    ("self_attention.A_log", COLUMN),
    ("self_attention.in_proj.weight", GDN_IN_PROJ),
    ("self_attention.conv1d.weight", GDN_CONV1D),
    ("self_attention.conv1d.bias", GDN_CONV1D),
    ("self_attention.out_norm.weight", REPLICATED),
    ("self_attention.out_proj.weight", ROW),
    ("mixer.conv1d.weight", MAMBA_CONV1D),
    ("mixer.conv1d.bias", MAMBA_CONV1D),
    ("mixer.dt_bias", COLUMN),
    ("mixer.A_log", COLUMN),
    ("mixer.D", COLUMN),
    ("mixer.in_proj.weight", MAMBA_IN_PROJ),
    ("mixer.norm.weight", COLUMN),
    ("mixer.out_proj.weight", ROW),
    ("norm.weight", REPLICATED),
    ("self_attention.linear_proj.weight", ROW),
    ("self_attention.linear_proj.bias", REPLICATED),
    ("self_attention.linear_qkv.weight", COLUMN),
    ("self_attention.linear_qkv.bias", COLUMN),
    ("self_attention.linear_q_proj.weight", COLUMN),
    ("self_attention.linear_q_down_proj.weight", COLUMN),
    ("self_attention.linear_q_up_proj.layer_norm_weight", REPLICATED),
    ("self_attention.linear_q_up_proj.layer_norm_bias", REPLICATED),
    ("self_attention.linear_q_up_proj.weight", COLUMN),
    ("self_attention.linear_kv_down_proj.weight", COLUMN),
    ("self_attention.linear_kv_up_proj.layer_norm_weight", REPLICATED),
    ("self_attention.linear_kv_up_proj.layer_norm_bias", REPLICATED),
    ("self_attention.linear_kv_up_proj.weight", COLUMN),
    ("self_attention.q_layernorm.weight", REPLICATED),
    ("self_attention.k_layernorm.weight", REPLICATED),
    ("self_attention.kv_layernorm.weight", REPLICATED),
    ("pre_mlp_layernorm.weight", REPLICATED),
    ("pre_mlp_layernorm.bias", REPLICATED),
    ("mlp.linear_fc1.layer_norm_weight", REPLICATED),
    ("mlp.linear_fc1.layer_norm_bias", REPLICATED),
    ("mlp.linear_fc1.weight", GATED),
    ("mlp.linear_fc1.bias", GATED),
    ("mlp.linear_fc2.weight", ROW),
    ("mlp.linear_fc2.bias", REPLICATED),
    ("mlp.router.weight", REPLICATED),
    ("mlp.experts.experts.", (
        ("linear_fc1.weight", GATED),
        ("linear_fc1.bias", GATED),
        ("linear_fc2.weight", ROW),
        ("linear_fc2.bias", REPLICATED),
    )),
    ("mlp.shared_experts.linear_fc1.weight", GATED),
    ("mlp.shared_experts.linear_fc2.weight", ROW),
)
"""A transformer layer of the local spec, its params in registration order (`LOCAL_SPEC`)."""
MTP_LAYER = (
    ("enorm.weight", REPLICATED),
    ("hnorm.weight", REPLICATED),
    ("eh_proj.weight", COLUMN),
    *((f"transformer_layer.{name}", kind) for name, kind in LAYER),
    ("final_layernorm.weight", REPLICATED),
)
"""A multi-token prediction layer: its norms and projection, then its transformer layer (saved
under `transformer_layer.` by megatron-core 0.16 and 0.19.2 alike, though 0.19 names the module
`mtp_model_layer`), then its final norm."""
LOCAL_SPEC = (
    (WORD_EMBEDDING, COLUMN),
    ("embedding.position_embeddings.weight", REPLICATED),
    (LAYERS, LAYER),
    ("decoder.final_layernorm.weight", REPLICATED),
    ("decoder.final_layernorm.bias", REPLICATED),
    (HYBRID_FINAL_NORM, REPLICATED),
    ("mtp.layers.", MTP_LAYER),
    ("output_layer.weight", COLUMN),
)
"""GPTModel with megatron-core's local spec, params in registration order under their torch_dist
keys (`input_layernorm` is saved as `linear_qkv.layer_norm_weight`, a MoE layer's
`pre_mlp_layernorm` as `linear_fc1.layer_norm_weight`; the multi-latent attention spec keeps
both norms' own names, Transformer Engine's fuses them into the up projections as
`linear_q_up_proj` / `linear_kv_up_proj.layer_norm_weight` (and `layer_norm_bias` under LayerNorm),
registered before their weights;
Transformer Engine's spec saves the same keys otherwise, TEGroupedMLP's experts SequentialMLP's
stacks, its params registered in another order, which content finds): the order `named_parameters` gives, which the DDP buffer reverses. A
nested table repeats per index: per layer (`decoder.layers.` stacks [L, …], or per-layer keys
`decoder.layers.<l>.…` where layers differ) and, inside it, per expert (SequentialMLP's
`local_experts.<e>`, saved as stacks [E, …]): expert by expert, each expert's params in its
order, the shared experts after them; then per multi-token prediction layer (`mtp.layers.<i>.`,
on the last pipeline stage). MLA's projections are the local spec's ColumnParallel
linears (Transformer Engine's down projections are duplicated instead: the same at TP 1; at a
larger TP a bucket of that spec does not add up, and is refused). `GATED` is fc1: SwiGLU's `[W; V]` when its rows are twice
fc2's columns, else column-parallel. A Gated DeltaNet layer (the local spec's layer with
megatron-core's GatedDeltaNet as its attention) registers its input norm (saved as
`in_proj.layer_norm_weight`), `dt_bias`, `A_log`, `in_proj` and `conv1d` (`Split`), `out_norm`
and `out_proj`. MambaModel's hybrid stack (`decoder.final_norm`) has a layer per letter of its
pattern, each one of a Mamba layer (its mixer's `conv1d` weight and bias, `dt_bias`, `A_log`, `D`,
`in_proj`, its gated norm, `out_proj`, then the layer's `norm`), an attention layer or an MLP
layer, whose params this table names too."""
_INDEX = re.compile(r"(\d+)\.")


@dataclass(frozen=True)
class LocalParam:
    """One param of a TP rank's buffer: its torch_dist key, its index in the key's stacked dims
    (layer, and expert; none for an unstacked key), TP kind, and the decoder layer it belongs to
    (global; None outside the layers), which tells its pipeline stage."""

    key: str
    lead: tuple[int, ...]
    kind: str
    layer: int | None = None
    copy: bool = False
    """The last pipeline stage's copy of the embedding (a tied embedding's output layer, or the
    embedding multi-token prediction layers read there): laid out in its buckets, but its state
    is the embedding's (megatron-core all-reduces their gradients), whose first-stage copy is the
    one rebuilt."""
    alone: bool = False
    """In a bucket of its own, closing the one before at its aligned start: either copy of an
    embedding held by two pipeline stages (megatron-core's `shared_embedding`)."""

    @property
    def shown(self) -> str:
        """How messages name it: its key, with its layer (and expert) index in a stack."""
        return self.key + (f"[{', '.join(map(str, self.lead))}]" if self.lead else "")


@dataclass(frozen=True)
class Bucket:
    """One saved bucket: its 1-D entries by state, and the params in it with their [start, end)."""

    tp_rank: int
    tp: int
    """The TP size its params are split by (the experts': the expert TP)."""
    number: int
    entries: dict[str, TensorEntry]
    params: tuple[tuple[LocalParam, int, int], ...]
    chain: int | None = None
    """Its optimizer in a ChainedOptimizer (None: one optimizer)."""
    group: int = 0
    """Its optimizer's `dp_group_idx` (`layout_buckets`)."""
    buffer: int = 0
    """Its buffer in the group (`gbuf_idx`: one per model chunk holding the optimizer's params)."""


@dataclass(frozen=True)
class Pipeline:
    """How the layers are split: over `stages` pipeline stages, each holding `chunks` model chunks
    (virtual pipeline parallelism: chunk c of stage s is virtual stage c × stages + s). By default
    evenly; `first` / `last` fix the layers of the first / last stage (Megatron-LM's
    `--decoder-first/last-pipeline-num-layers`), `embedding` / `loss` count the embedding / the
    loss as a layer of the first / last virtual stage (`--account-for-…-in-pipeline-split`); or a
    custom `layout`: each virtual stage's layers (`parse_layout`)."""

    stages: int = 1
    chunks: int = 1
    first: int | None = None
    last: int | None = None
    embedding: bool = False
    loss: bool = False
    layout: tuple[str, ...] | None = None

    def layer_counts(self, layers: int) -> list[int]:
        """The layers of each virtual stage, in layer order, as megatron-core's
        `get_num_layers_to_build` and `get_transformer_layer_offset` split them; ValueError for a
        split megatron-core refuses too."""
        stages, chunks = self.stages, self.chunks
        fixed = [n for n in (self.first, self.last) if n is not None]
        if self.layout is not None:
            return self._layout_counts(layers, bool(fixed) or self.embedding or self.loss)
        if fixed:
            if self.embedding or self.loss:
                raise ValueError("a first or last stage of its own size with the embedding or loss counted as a layer")
            middle, rest = layers - sum(fixed), stages - len(fixed)
            if not rest and chunks > 1:  # megatron-core divides by the middle stages here (and fails)
                raise ValueError("no middle stage under virtual pipeline parallelism")
            if middle < 0 or (middle % rest if rest else middle):
                raise ValueError(f"{middle} layers left over for {rest} middle stages")
            per_stage = [middle // rest if rest else 0] * stages
            per_stage[0] = per_stage[0] if self.first is None else self.first
            per_stage[-1] = per_stage[-1] if self.last is None else self.last
        else:
            counted = layers + self.embedding + self.loss
            if counted % stages:
                raise ValueError(f"{counted} layers do not divide over {stages} pipeline stages")
            per_stage = [counted // stages] * stages
        if any(n % chunks for n in per_stage):
            raise ValueError(f"stages of {per_stage} layers do not divide into {chunks} model chunks")
        counts = [per_stage[stage] // chunks for _ in range(chunks) for stage in range(stages)]
        counts[0] -= self.embedding
        counts[-1] -= self.loss
        if min(counts) < 0:
            raise ValueError("the embedding or loss counted in a virtual stage without a layer")
        return counts

    def _layout_counts(self, layers: int, other_split: bool) -> list[int]:
        """`layer_counts` of a custom layout, which must hold the embedding first and the loss
        last (where `_stages` puts them), and no multi-token prediction layers (megatron-core
        0.19 fails to save them in a layout: nothing to prove their place against)."""
        stages = self.layout
        if other_split:
            raise ValueError("a custom layout with stage sizes or the embedding or loss counted as a layer")
        if len(stages) != self.stages * self.chunks:
            raise ValueError(f"{len(stages)} virtual stages, not PP {self.stages} × VPP {self.chunks}")
        flat = "".join(stages)
        if flat.count("E") != 1 or not stages[0].startswith("E") or flat.count("L") != 1 or not flat.endswith("L"):
            raise ValueError("the embedding (E) must open the first stage and the loss (L) close the last, once each")
        if "m" in flat:
            raise ValueError("multi-token prediction layers (m) in a custom layout are not rebuilt")
        counts = [stage.count("t") for stage in stages]
        if sum(counts) != layers:
            raise ValueError(f"the layout holds {sum(counts)} layers")
        return counts


LAYOUT_CHARS = frozenset("ELtm")
"""Megatron-LM's layout letters: embedding, loss, transformer (decoder) layer, multi-token prediction layer."""
MAX_LAYOUT = 1 << 16
"""Layers and stages a layout may unroll to: a few hundred in any real model."""


def parse_layout(text: str) -> tuple[str, ...]:
    """Each virtual stage's layers in a Megatron-LM `--pipeline-model-parallel-layout` string
    ("Et*3|(tt|)*29,m|L"): commas are cosmetic, `(…)*n` and then `x*n` repeat, `|` ends a stage;
    ValueError for another letter or an unrolling over `MAX_LAYOUT`."""
    text = text.replace(",", "")
    for pattern in (r"\(([^)]+)\)\*(\d{1,6})", r"(.)\*(\d{1,6})"):
        pieces, at, size = [], 0, 0
        for m in re.finditer(pattern, text):
            size += m.start() - at + len(m[1]) * int(m[2])
            if size > MAX_LAYOUT:
                raise ValueError(f"it unrolls to more than {MAX_LAYOUT} layers and stages")
            pieces += [text[at:m.start()], m[1] * int(m[2])]
            at = m.end()
        text = "".join(pieces) + text[at:]
    if len(text) > MAX_LAYOUT:
        raise ValueError(f"it unrolls to more than {MAX_LAYOUT} layers and stages")
    if not set(text) <= LAYOUT_CHARS | {"|"}:
        raise ValueError(f"letters {''.join(sorted(set(text) - LAYOUT_CHARS - {'|'}))!r} are not layers (E, L, t, m)")
    return tuple(text.split("|"))


@dataclass(frozen=True)
class Optimizer:
    """One DistributedOptimizer whose buckets are rebuilt: its `chained_<i>.` index (None when the
    checkpoint has one optimizer), and which params it holds: all (None), the experts (True) or
    the rest (False)."""

    chain: int | None
    experts: bool | None


def bucket_entries(ckpt: Checkpoint) -> dict[tuple[int | None, int, int, int], dict[str, TensorEntry]]:
    """(chained optimizer, DP group, buffer, bucket) → state → the saved 1-D bucket tensor."""
    out: dict[tuple[int | None, int, int, int], dict[str, TensorEntry]] = {}
    for fqn, entry in ckpt.tensors.items():
        m = BUCKET.fullmatch(fqn)
        if m is not None:
            chain = None if m[1] is None else int(m[1])
            out.setdefault((chain, int(m[2]), int(m[3]), int(m[5])), {})[m[6]] = entry
    return out


def registration_order(ckpt: Checkpoint, model_keys: set[str], copy: str | None = None) -> list[LocalParam]:
    """The model's params in megatron-core's registration order (`LOCAL_SPEC`), refusing any
    model key the spec has no place for (another spec: its order is not known). Under pipeline
    parallelism the last stage may hold a `copy` of the embedding: in the output layer's place
    ("output": a tied embedding), or in the embedding's, before its layers ("embedding": the one
    its multi-token prediction layers read)."""
    known: set[str] = set()

    def expand(prefix: str, table: tuple, lead: tuple[int, ...], layer: int | None) -> list[LocalParam]:
        out: list[LocalParam] = []
        for name, kind in table:
            key = prefix + name
            if isinstance(kind, tuple):
                for i, (inner_lead, inner_prefix) in enumerate(_indices(ckpt, key, kind, lead, model_keys)):
                    out += expand(inner_prefix, kind, inner_lead, i if key == LAYERS else layer)
            elif isinstance(kind, Split):
                if all(k in model_keys for k in part_keys(key, kind)):
                    known.update(part_keys(key, kind))
                    out.append(LocalParam(key, lead, kind, layer))
            elif key in model_keys:
                known.add(key)
                gated = kind == GATED and _swiglu(ckpt, key.rpartition("linear_fc1.")[0])
                out.append(LocalParam(key, lead, GATED if gated else COLUMN if kind == GATED else kind, layer))
        return out

    order = expand("", LOCAL_SPEC, (), None)
    if copy is not None:
        order = [replace(p, alone=True) if p.key == WORD_EMBEDDING else p for p in order]
        at = len(order) if copy == "output" else 1 + next(i for i, p in enumerate(order) if p.key == WORD_EMBEDDING)
        order.insert(at, LocalParam(WORD_EMBEDDING, (), COLUMN, copy=True, alone=True))
    unknown = sorted(model_keys - known)
    if unknown:
        raise CheckpointError(ckpt.path, f"{unknown[0]}{f' (and {len(unknown) - 1} more)' if len(unknown) > 1 else ''}"
                                         " has no place in megatron-core's local GPT spec, whose parameter order "
                                         "rebuilds dp_reshardable buckets (other specs are not known yet)")
    return order


def _indices(ckpt: Checkpoint, key: str, table: tuple, lead: tuple[int, ...], model_keys: set[str]
             ) -> list[tuple[tuple[int, ...], str]]:
    """Each repeat of nested `table` under `key` as (lead, key prefix): one per row of its stacks
    (lead grows by the row), or one per index of its per-index keys `<key><i>.…` (lead kept)."""
    present = [k for k in _leaves(table, key) if k in model_keys]
    found = {int(m[1]) for k in model_keys if k.startswith(key) and (m := _INDEX.match(k, len(key)))}
    if present and found:
        raise CheckpointError(ckpt.path, f"{key}: both stacked and per-index keys; dp_reshardable buckets are rebuilt "
                                         "for one or the other")
    if found:
        if sorted(found) != list(range(len(found))):
            raise CheckpointError(ckpt.path, f"{key}<i>: indices {sorted(found)[:8]} are not 0…{len(found) - 1}")
        return [(lead, f"{key}{i}.") for i in range(len(found))]
    lengths = {ckpt.tensors[k].shape[len(lead)] if len(ckpt.tensors[k].shape) > len(lead) else -1 for k in present}
    stack = next(iter(lengths)) if present else 0
    if len(lengths) > 1 or stack < 0:
        raise CheckpointError(ckpt.path, f"stacks under {key} differ in length (or are 0-d): "
                                         "dp_reshardable buckets are rebuilt for homogeneous stacks only")
    return [((*lead, i), key) for i in range(stack)]


def _leaves(table: tuple, prefix: str) -> list[str]:
    """Every key a nested table names under `prefix` (its nested tables' keys and split params' parts included)."""
    return [leaf for name, kind in table
            for leaf in (_leaves(kind, prefix + name) if isinstance(kind, tuple) else
                         part_keys(prefix + name, kind) if isinstance(kind, Split) else [prefix + name])]


def part_keys(key: str, split: Split) -> list[str]:
    """The keys a split param is saved under."""
    return [f"{key}.{part}" for part in split.parts]


def _swiglu(ckpt: Checkpoint, prefix: str) -> bool:
    """SwiGLU fc1 under `prefix`: its rows are twice the columns of fc2 (`[W; V]`)."""
    fc1, fc2 = (ckpt.tensors.get(f"{prefix}linear_fc{i}.weight") for i in (1, 2))
    return fc1 is not None and fc2 is not None and fc1.shape[-2] == 2 * fc2.shape[-1]


def local_shape(ckpt: Checkpoint, param: LocalParam, tp: int) -> tuple[int, ...]:
    """The TP-local shape of `param` (one layer of a stack) at TP size `tp`; a split param's, its
    parts' blocks one after another."""
    if isinstance(param.kind, Split):
        parts = [ckpt.tensors[key] for key in part_keys(param.key, param.kind)]
        shapes = [entry.shape[len(param.lead):] for entry in parts]
        if not shapes[0] or any(shape[1:] != shapes[0][1:] for shape in shapes):
            raise CheckpointError(ckpt.path, f"{param.key}: parts {param.kind.parts} of shapes "
                                             f"{[list(shape) for shape in shapes]} do not stack as rows")
        for entry, shape in zip(parts, shapes):
            if shape[0] % tp:
                raise CheckpointError(entry.fqn, f"dim 0 of {list(shape)} does not divide by TP {tp}")
        return (sum(shape[0] // tp for shape in shapes), *shapes[0][1:])
    entry = ckpt.tensors[param.key]
    shape = entry.shape[len(param.lead):]
    dim = {COLUMN: 0, GATED: 0, ROW: 1}.get(param.kind)
    if dim is None or len(shape) <= dim:
        return tuple(shape)
    if shape[dim] % (2 * tp if param.kind == GATED else tp):
        raise CheckpointError(entry.fqn, f"dim {dim} of {list(shape)} does not divide by TP {tp}")
    return tuple(n // tp if d == dim else n for d, n in enumerate(shape))


class BufferOrder(Protocol):
    """Which of a buffer's params each bucket holds next, from its first bucket on."""

    def next(self, entry: TensorEntry, start: int, length: int, first: bool) -> LocalParam | None:
        """The param at aligned element `start` of bucket state `entry` (the fp32 masters), `length`
        elements long; `first`: none placed in it yet (a param `alone` may only open a bucket).
        None when none is left; CheckpointError when none or several could be there."""

    def packed(self, entry: TensorEntry, cursor: int, length: int) -> LocalParam | None:
        """The param at unaligned element `cursor`, right where the one placed last ends, when both
        are slabs of one single grouped weight (`grouped_next`); None when none is there."""

    def left(self) -> list[LocalParam]:
        """The params not placed yet."""


def grouped_next(before: LocalParam, after: LocalParam) -> bool:
    """Whether `after` is the expert after `before` of the same layer and key: the next slab of
    a single grouped weight (Transformer Engine ≥ 2.14's `GroupedLinear(single_grouped_weight=True)`,
    megatron-core's `moe_single_grouped_weight`: one param [local experts, out, in], which a
    DistributedOptimizer bucket holds as its experts' blocks back to back, in expert order, with
    no padding between them, under the per-expert keys TEGroupedMLP saves)."""
    return (is_expert(after.key) and after.key == before.key and bool(after.lead)
            and after.lead[:-1] == before.lead[:-1] and after.lead[-1] == before.lead[-1] + 1)


OrderFor = Callable[[list[LocalParam], int, int], BufferOrder]
"""(a buffer's params in the local spec's registration order, its TP rank, its TP size) → its
`BufferOrder`."""


@dataclass
class TableOrder:
    """A buffer's params in reverse registration order (`LOCAL_SPEC`), as megatron-core fills it."""

    params: list[LocalParam]
    placed: int = 0

    def next(self, entry: TensorEntry, start: int, length: int, first: bool) -> LocalParam | None:
        if self.placed == len(self.params) or (self.params[self.placed].alone and not first):
            return None
        self.placed += 1
        return self.params[self.placed - 1]

    def packed(self, entry: TensorEntry, cursor: int, length: int) -> LocalParam | None:
        return None  # the local spec registers each expert's weights: none is grouped

    def left(self) -> list[LocalParam]:
        return self.params[self.placed:]


def table_order(order: list[LocalParam], tp_rank: int, tp: int) -> BufferOrder:
    """`OrderFor` of the local spec's table."""
    return TableOrder(list(reversed(order)))


def layout_buckets(ckpt: Checkpoint, order: list[LocalParam], tp: int,
                   optimizers: tuple[Optimizer, ...] = (Optimizer(None, None),), ep: int = 1,
                   pipeline: Pipeline = Pipeline(), etp: int | None = None,
                   order_for: OrderFor = table_order) -> list[Bucket]:
    """Each optimizer's buckets with their params, per DP group and buffer, as megatron-core lays
    them out: in reverse registration order (`order_for` may find each param's place otherwise:
    `megatron.bucket_order`), starts padded to `ALIGN`, a bucket closing where its saved length
    ends. A dense optimizer's groups are the model-parallel ranks, PP rank × TP + TP
    rank; an expert optimizer's are (PP rank × EP + EP rank) × ETP + ETP rank (the expert TP
    `etp`, by default the TP), each holding its EP rank's share of its stage's experts, split by
    the expert TP. Each group has a buffer per model chunk holding params of the optimizer
    (one param and grad dtype); stages and chunks split the layers as `_stages` says."""
    saved = bucket_entries(ckpt)
    chains = {chain for chain, _, _, _ in saved}
    if chains != {o.chain for o in optimizers}:
        raise CheckpointError(ckpt.path, f"dp_reshardable optimizers {sorted(chains, key=str)}, expected "
                                         f"{sorted((o.chain for o in optimizers), key=str)}")
    pp = pipeline.stages
    staged = list(zip(order, _stages(ckpt, order, pipeline)))
    out = []
    for optimizer in optimizers:
        held = [(p, s) for p, s in staged if optimizer.experts is None or is_expert(p.key) == optimizer.experts]
        share = _expert_share(ckpt, [p for p, _ in held], ep) if optimizer.experts else 0
        split = (etp or tp) if optimizer.experts else tp
        per_stage = split * (ep if optimizer.experts else 1)
        count = per_stage * pp
        groups = sorted({group for chain, group, _, _ in saved if chain == optimizer.chain})
        if len(groups) != count or groups != list(range(count)):  # args say tp, ep, pp: never build a list that long
            ranks = f"{'PP × ' if pp > 1 else ''}{'EP × E' if optimizer.experts else ''}TP"
            raise CheckpointError(ckpt.path, f"{_prefix(optimizer)}dp_group_idx_<g>: groups {groups[:8]}, expected one "
                                             f"per {ranks} rank 0…{count - 1}")
        for group in groups:
            pp_rank, rest = divmod(group, per_stage)
            ep_rank, tp_rank = divmod(rest, split)
            ours = [(p, chunk) for p, (rank, chunk) in held if rank == pp_rank
                    and (not optimizer.experts or p.lead[-1] // share == ep_rank)]
            chunks = sorted({chunk for _, chunk in ours})  # a chunk without params of the optimizer has no buffer
            buffers = sorted({b for c, g, b, _ in saved if c == optimizer.chain and g == group})
            if buffers != list(range(len(chunks))):
                raise CheckpointError(ckpt.path, f"{_prefix(optimizer)}dp_group_idx_{group}: buffers {buffers[:8]}, "
                                                 f"expected one per model chunk holding its params ({len(chunks)}; "
                                                 "several param or grad dtypes are not rebuilt yet)")
            for buffer, chunk in enumerate(chunks):
                mine = [p for p, c in ours if c == chunk]
                out += _group_buckets(ckpt, saved, optimizer, group, buffer, tp_rank, mine, split, order_for)
    return out


def _stages(ckpt: Checkpoint, order: list[LocalParam], pipeline: Pipeline) -> list[tuple[int, int]]:
    """The (pipeline stage, model chunk) holding each param of `order`, as megatron-core splits a
    GPT model: the layers in order over the virtual stages (chunk ×
    stages + stage) as `Pipeline.layer_counts` says, the embedding in the first, the final norm,
    the output layer (or the tied embedding's copy) and multi-token prediction layers in the last."""
    layers = 1 + max((p.layer for p in order if p.layer is not None), default=-1)
    try:
        counts = pipeline.layer_counts(layers)
    except ValueError as exc:
        chunks = f" × {pipeline.chunks} model chunks" if pipeline.chunks > 1 else ""
        raise CheckpointError(ckpt.path, f"{layers} layers cannot be split over {pipeline.stages} pipeline stages"
                              f"{chunks} as args say: {exc}") from None
    virtual = [v for v, n in enumerate(counts) for _ in range(n)]  # each layer's virtual stage
    last = (pipeline.stages - 1, pipeline.chunks - 1)
    out = []
    for param in order:
        if param.layer is not None:
            chunk, rank = divmod(virtual[param.layer], pipeline.stages)
            out.append((rank, chunk))
        else:
            out.append((0, 0) if param.key.startswith("embedding.") and not param.copy else last)
    return out


def _prefix(optimizer: Optimizer) -> str:
    """How messages name a chained optimizer (nothing for the one optimizer of a checkpoint)."""
    return "" if optimizer.chain is None else f"chained_{optimizer.chain}.optimizer.distributed."


def _expert_share(ckpt: Checkpoint, experts: list[LocalParam], ep: int) -> int:
    """How many of each layer's experts one EP rank holds."""
    count = 1 + max((p.lead[-1] for p in experts if p.lead), default=-1)
    if count == 0 or count % ep:
        raise CheckpointError(ckpt.path, f"{count} experts per layer do not divide over EP {ep}")
    return count // ep


def _group_buckets(ckpt: Checkpoint, saved: dict, optimizer: Optimizer, group: int, buffer: int, tp_rank: int,
                   order: list[LocalParam], tp: int, order_for: OrderFor) -> list[Bucket]:
    """One buffer's buckets in a DP group, filled with `order`'s params as `order_for` picks them."""
    where = f"{_prefix(optimizer)}dp_group_idx_{group}{f'.gbuf_idx_{buffer}' if buffer else ''}"
    numbers = sorted(b for c, g, f, b in saved if c == optimizer.chain and g == group and f == buffer)
    if numbers != list(range(len(numbers))):
        raise CheckpointError(ckpt.path, f"{where}: buckets {numbers} are not numbered 0…")
    out = []
    picker = order_for(order, tp_rank, tp)
    for b in numbers:
        entries = saved[(optimizer.chain, group, buffer, b)]
        if set(entries) != {"param", "exp_avg", "exp_avg_sq"}:
            raise CheckpointError(ckpt.path, f"{where} bucket {b} holds {sorted(entries)}, "
                                             "expected param, exp_avg and exp_avg_sq (Adam)")
        length = _one_length(ckpt, entries)
        placed: list[tuple[LocalParam, int, int]] = []
        cursor = 0
        while cursor < length:
            param = picker.packed(entries["param"], cursor, length) if placed and cursor % ALIGN else None
            start = cursor if param is not None else -(-cursor // ALIGN) * ALIGN
            if param is None and placed and start >= length:  # it closes at an aligned start: before a param alone
                cursor = start if any(p.alone for p in picker.left()) else cursor
                break
            param = param or picker.next(entries["param"], start, length, not placed)
            if param is None:
                break
            cursor = start + math.prod(local_shape(ckpt, param, tp))
            placed.append((param, start, cursor))
            if param.alone:
                break
        if cursor != length:
            at = f"{placed[-1][0].key} ends at {cursor}" if placed else "no param is left for it"
            raise CheckpointError(ckpt.path, f"{where} bucket {b} is {length} elements but {at} "
                                             "in megatron-core's layout of the model's parameters: another model "
                                             "spec or megatron-core version")
        _check_chunks(ckpt, entries, placed)
        out.append(Bucket(tp_rank, tp, b, entries, tuple(placed), optimizer.chain, group, buffer))
    left = picker.left()
    if left:
        raise CheckpointError(ckpt.path, f"{where}: {len(left)} params ({left[0].shown} first) are in no bucket: "
                                         "another model spec or megatron-core version")
    return out


def _one_length(ckpt: Checkpoint, entries: dict[str, TensorEntry]) -> int:
    shapes = {e.shape for e in entries.values()}
    if len(shapes) != 1 or len(next(iter(shapes))) != 1:
        raise CheckpointError(ckpt.path, f"{next(iter(entries.values())).fqn}: bucket states of shapes "
                                         f"{sorted(list(s) for s in shapes)}, expected one 1-D length")
    return next(iter(shapes))[0]


def _check_chunks(ckpt: Checkpoint, entries: dict[str, TensorEntry], placed: list[tuple[LocalParam, int, int]]) -> None:
    """Every saved chunk lies inside one param's range or one gap: the writer cuts a chunk per
    range (and per DP shard), so a chunk across a param boundary means the layout is not this one.
    Slabs of one single grouped weight (`grouped_next`, back to back) are one param's range."""
    joined = {s for (before, _, end), (after, s, _) in zip(placed, placed[1:])
              if s == end and grouped_next(before, after)}
    bounds = sorted({0, *(s for _, s, _ in placed if s not in joined), *(e for _, _, e in placed if e not in joined)})
    for entry in entries.values():
        for c in entry.chunks:
            lo, hi = c.offsets[0], c.offsets[0] + c.sizes[0]
            after = bisect.bisect_right(bounds, lo)
            if after < len(bounds) and bounds[after] < hi:
                raise CheckpointError(ckpt.path, f"{entry.fqn}: the chunk [{lo}, {hi}) crosses a parameter boundary "
                                                 "of the layout rebuilt: another model spec or megatron-core version")


@dataclass(frozen=True)
class Window:
    """A TP rank's block of one param (one layer and expert of a stack) in a bucket: items
    [start, end) of each of the bucket's states."""

    param: LocalParam
    tp_rank: int
    tp: int
    """The TP size its param is split by."""
    shape: tuple[int, ...]
    """The block's TP-local shape."""
    start: int
    end: int
    entries: dict[str, TensorEntry]


def bucket_windows(ckpt: Checkpoint, buckets: list[Bucket]) -> list[Window]:
    """Every param block the buckets hold, once: a replicated param's copy on TP rank 0 only, a
    tied embedding's on the first pipeline stage only."""
    return [Window(param, bucket.tp_rank, bucket.tp, local_shape(ckpt, param, bucket.tp), start, end,
                   bucket.entries)
            for bucket in buckets for param, start, end in bucket.params
            if not (param.kind == REPLICATED and bucket.tp_rank) and not param.copy]


def window_view(window: Window, state: str, items: dict[str, ItemWindows], units: bool) -> tuple[str, SourceTensor]:
    """The view of `window`'s items of `state` in its block's shape (after a unit dim per stacked
    dim with `units`), and the view's name; `items` keeps each bucket state's runs, sorted once."""
    saved = window.entries[state]
    if saved.fqn not in items:
        items[saved.fqn] = ItemWindows(saved)
    shape = (*(1 for _ in window.param.lead), *window.shape) if units else window.shape
    name = f"{saved.fqn}[{window.start}:{window.end}]{'' if units else '/'}"
    return name, items[saved.fqn].window(window.start, window.end, shape)


def block_places(window: Window, rows: int) -> list[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
    """Where `window`'s block goes in its param's global tensor of `rows` rows (one layer and
    expert): (start in the block, start in the param, sizes) — one place, two for SwiGLU fc1,
    whose block `[W_t; V_t]` goes to rows t of `[W_all; V_all]`'s two halves."""
    shape, rank = window.shape, window.tp_rank
    zero = tuple(0 for _ in shape)
    if window.param.kind == GATED:
        half = shape[0] // 2
        one = (half, *shape[1:])
        return [(zero, (rank * half, *zero[1:]), one),
                ((half, *zero[1:]), (rows // 2 + rank * half, *zero[1:]), one)]
    at = list(zero)
    if window.param.kind == COLUMN and shape:
        at[0] = rank * shape[0]
    elif window.param.kind == ROW and len(shape) > 1:
        at[1] = rank * shape[1]
    return [(zero, tuple(at), shape)]


def keyed_places(ckpt: Checkpoint, window: Window
                 ) -> list[tuple[str, tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
    """`block_places` with the key of the tensor each place is in (one layer and expert of it):
    the param's own, or for a split param each part's, whose rows of the block go to rows t of
    `<key>.<part>`."""
    param, lead = window.param, len(window.param.lead)
    if not isinstance(param.kind, Split):
        entry = ckpt.tensors[param.key]
        rows = entry.shape[lead] if len(entry.shape) > lead else 0
        return [(param.key, *place) for place in block_places(window, rows)]
    out, row, rest = [], 0, window.shape[1:]
    tail = tuple(0 for _ in rest)
    for key in part_keys(param.key, param.kind):
        rows = ckpt.tensors[key].shape[lead] // window.tp
        out.append((key, (row, *tail), (window.tp_rank * rows, *tail), (rows, *rest)))
        row += rows
    return out


def model_space_targets(ckpt: Checkpoint, buckets: list[Bucket]) -> tuple[list[TargetTensor], dict[str, SourceTensor]]:
    """`optimizer.state.<state>.<key>` for every param and Adam state, shaped like the param, with
    the window views of the buckets its pieces read (keyed by view name), in its bucket's dtype."""
    pieces: dict[str, list[Piece]] = {}
    dtypes: dict[str, object] = {}
    views: dict[str, SourceTensor] = {}
    items: dict[str, ItemWindows] = {}
    for window in bucket_windows(ckpt, buckets):
        units, lead = tuple(0 for _ in window.param.lead), window.param.lead
        places = keyed_places(ckpt, window)
        for state, saved in window.entries.items():
            name, views[name] = window_view(window, state, items, units=True)
            for key, src, dst, sizes in places:
                target = f"optimizer.state.{state}.{key}"
                dtypes[target] = saved.dtype
                pieces.setdefault(target, []).append(
                    Piece(name, (*units, *src), (*lead, *dst), (*(1 for _ in lead), *sizes)))
    targets = []
    for fqn, parts in pieces.items():
        entry = ckpt.tensors[fqn.split(".", 3)[3]]
        targets.append(TargetTensor(fqn, entry.shape, dtypes[fqn], tuple(parts)))
    return targets, views
