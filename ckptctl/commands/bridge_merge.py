"""`export-hf --merge-adapters` and `--adapter-only` of Megatron-Bridge LoRA adapters in a Megatron checkpoint.

Megatron-Bridge merges an adapter into its Megatron weight whole (`LoRAMerge.merge`:
W + (α / dim) · (linear_out @ linear_in)) and only then splits a fused weight (linear_qkv's
q, k, v; linear_fc1's gate and up) into HF tensors. Each HF target here is computed the same
way: the whole merged Megatron weight of its layer in float32, then the target's blocks of it,
taken where the family rule takes the base's (a row subset of a matmul need not have the bits
of the same rows of the whole one, so B is never split first). A PEFT folder gives each HF
module the shared A and the rows of B the rule gives it of the base: copied, nothing computed.
Canonical LoRA's adapter of one projection (`adapter_q` …) is merged, as Megatron-Bridge merges
it, into the HF tensor it names (`q_proj` …) once that is split from the fused weight: W_q +
(α / dim) · B_q @ A_q, and written as that module's own A and B.

α is the run's: `run_config.yaml` in the checkpoint folder (`peft.alpha`), or `--lora-alpha`
where the folder has none; both given must agree.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Collection, Mapping, Sequence

from ckptctl.core.checkpoint import Checkpoint, ChunkTable, TensorEntry
from ckptctl.core.dtypes import DType, cast_dtype, float32
from ckptctl.core.plan import LowRank, Piece, SourceTensor, StreamItem, TargetTensor, whole_item
from ckptctl.families.adapters import PEFT_PREFIX, Adapter
from ckptctl.families.base import HFConfig, MegatronModel, MegatronSpec, RowView, is_model_key
from ckptctl.families.bridge_adapters import BridgeAdapter, find_bridge_adapters, is_bridge_adapter
from ckptctl.families.protocol import ModelFamily
from ckptctl.formats.bridge_run_config import BridgePeft, read_bridge_peft, run_config_path
from ckptctl.formats.dcp.metadata import TORCH_DIST, open_checkpoint
from ckptctl.formats.megatron_args import checkpoint_args
from ckptctl.util.errors import CheckpointError, UsageError
from ckptctl.util.wording import counted


_GROUPED_EXPERT = re.compile(r"^(.*\.mlp\.experts\.)(linear_fc[12]\.weight)(\d+)$")
"""A grouped-GEMM expert weight as the rules name it (`…experts.linear_fc1.weight3`); SequentialMLP's is
`…experts.local_experts.3.linear_fc1.weight`, as a torch_dist save's expert stack is seen."""


def with_base(ckpt: Checkpoint, base_path: Path) -> Checkpoint:
    """`--base`: the adapter checkpoint `ckpt` (a Megatron-Bridge LoRA save, adapters alone) seen
    with the weights of the pretrained checkpoint the run started from (`pretrained_checkpoint`,
    a Megatron torch_dist save), each chunk read from its own folder (named by its full path).
    Both torch_dist: their tensors are global, so the two may have been saved at different TP.
    A model tensor in both is refused: which one is the model's is not guessed."""
    base = open_checkpoint(base_path)
    for which, path, backend in (("", ckpt.path, ckpt.megatron_backend), ("--base ", base.path, base.megatron_backend)):
        if backend != TORCH_DIST:
            raise UsageError(f"{which}{path}: not a Megatron torch_dist checkpoint (--base joins a Megatron-Bridge "
                             "LoRA save to its pretrained torch_dist checkpoint)")
    tensors = dict(ckpt.tensors)
    files = dict(ckpt.files)
    files.update({str(base.path / name): size for name, size in base.files.items()})
    both = sorted(fqn for fqn in base.tensors.keys() & ckpt.tensors.keys() if is_model_key(fqn))
    if both:
        more = f" (+{len(both) - 1} more)" if len(both) > 1 else ""
        raise CheckpointError(ckpt.path, f"{both[0]}{more} is in {base.path} too: which one is the model's is not "
                                         "guessed (--base is for a Megatron-Bridge LoRA save, which holds the "
                                         "adapters alone)")
    for fqn, entry in base.tensors.items():
        if fqn in tensors:
            continue  # the run's own: its step, its RNG, its optimizer
        chunks = entry.chunks
        if isinstance(chunks, ChunkTable):
            chunks = chunks.renamed([str(base.path / n) for n in chunks.columns()[0]])
        else:
            chunks = tuple(replace(c, file=str(base.path / c.file)) for c in chunks)
        tensors[fqn] = TensorEntry(fqn, entry.shape, entry.dtype, chunks, entry.properties)
    return replace(ckpt, tensors=tensors, files=files, rank_conflicts={**base.rank_conflicts, **ckpt.rank_conflicts},
                   derived={})


def adapters_alone(model: MegatronModel) -> bool:
    """Whether the model's tensors are Megatron-Bridge LoRA adapters and nothing else (a Bridge
    LoRA save: its base is the pretrained checkpoint)."""
    names = [*model.entries, *model.layer_views]
    return bool(names) and all(is_bridge_adapter(n) for n in names)


def shaped_base(ckpt: Checkpoint, cfg: HFConfig, family: ModelFamily, prefix: str, hf_names: Collection[str]
                ) -> Checkpoint:
    """`--adapter-only` of a Bridge LoRA save without `--base`: the checkpoint with the base model's
    tensors as the family's rules shape them for the config (`megatron_shapes`, TP 1: fused
    weights as torch_dist saves them, [W_all; V_all]; `hf_names`: the HF model's, which say where
    biases are) — shapes alone, with no chunk: the adapters are laid out by them, and any read of
    them finds nothing and is refused."""
    shapes = family.megatron_shapes(cfg, MegatronSpec(1, False, cfg.int("vocab_size"), frozenset(hf_names)))
    dtype = next(e.dtype for e in ckpt.tensors.values() if is_model_key(e.fqn))
    tensors = dict(ckpt.tensors)
    if any(".local_experts." in n for n in MegatronModel(ckpt, prefix).layer_views):  # a torch_dist save's
        shapes = {_GROUPED_EXPERT.sub(r"\1local_experts.\3.\2", n): s for n, s in shapes.items()}  # expert names
    for name, shape in shapes.items():
        tensors.setdefault(prefix + name, TensorEntry(prefix + name, tuple(shape), dtype, ()))
    return replace(ckpt, tensors=tensors, derived={})


@dataclass(frozen=True)
class BridgeAlpha:
    """The run's LoRA α and where it came from (`--lora-alpha`, or the run_config.yaml's path)."""

    value: float
    source: str


def bridge_lora(ckpt: Checkpoint, model: MegatronModel, flags: Sequence[str], alpha: float | None,
                peft_only: Sequence[str], base: str | None = None, tp: int | None = None
                ) -> tuple[tuple[BridgeAdapter, ...], BridgeAlpha, int | None] | None:
    """The Megatron model's Megatron-Bridge LoRA adapters and α, or None without adapters.
    `flags`: the adapter flags given (`--merge-adapters`, `--adapter-only`); `peft_only`: the
    given flags that only a peft checkpoint takes; `base`: `--base`, whose weights the model
    holds too. Adapters without either flag are refused (the model alone is not what was
    trained); α is the checkpoint's run_config.yaml's, else `--lora-alpha`, else refused, and
    the two given must agree; the run's TP (`--tp`, else args) where an adapter's base is a SwiGLU fc1
    saved as halves. The adapters are left out of the model's names the family rules see."""
    shapes = {n: e.shape for n, e in model.entries.items()}
    shapes.update({n: (v.rows, *v.trailing) for n, v in model.layer_views.items()})
    found = find_bridge_adapters(shapes, ckpt.path, model.prefix, base)
    if not found:
        if base is not None:
            raise UsageError(f"{ckpt.path}: --base, but the checkpoint holds no Megatron-Bridge LoRA adapter")
        if flags:
            raise UsageError(f"{ckpt.path}: {flags[0]}, but the checkpoint holds no LoRA adapter")
        given = [*(["--lora-alpha"] if alpha is not None else []), *peft_only]
        if given:
            raise UsageError(f"{given[0]} applies to LoRA adapters only, and {ckpt.path} holds none")
        return None
    dims = ", ".join(map(str, sorted({a.dim for a in found})))
    if not flags:
        raise CheckpointError(ckpt.path, f"holds {counted(len(found), 'Megatron-Bridge LoRA adapter')} (dim {dims}): "
                                         "pass --merge-adapters to export the model with them merged, or "
                                         "--adapter-only to export them as a PEFT adapter folder")
    if peft_only:
        raise UsageError(f"{peft_only[0]} applies to peft adapters, not to Megatron-Bridge's")
    if alpha is not None and not math.isfinite(alpha):
        raise UsageError(f"--lora-alpha {alpha:g} is not a finite number")
    config = run_config_path(ckpt.path)
    peft = read_bridge_peft(config) if config is not None else None
    if peft is not None:
        check_run_config(peft, found, model.prefix)
        if alpha is not None and alpha != peft.alpha:
            raise UsageError(f"--lora-alpha {alpha:g} disagrees with {peft.path}, whose peft.alpha is {peft.alpha:g}")
        chosen = BridgeAlpha(peft.alpha, str(peft.path))
    elif alpha is None:
        raise UsageError(f"{ckpt.path}: has no run_config.yaml, where Megatron-Bridge keeps the run's LoRA α "
                         "(peft.alpha): pass --lora-alpha")
    else:
        chosen = BridgeAlpha(alpha, "--lora-alpha")
    for adapter in found:
        for name in (adapter.a, adapter.b):
            entry = model.entries.get(name)
            dtype = entry.dtype if entry is not None else ckpt.tensors[model.layer_views[name].fqn].dtype
            if not dtype.is_floating_point:
                raise CheckpointError(ckpt.path, f"{model.prefix}{name}: {dtype.name} is no LoRA factor's dtype")
            model.used.add(name)
    return found, chosen, _run_tp(ckpt, tp) if any(a.halves and a.split is None for a in found) else tp


def _run_tp(ckpt: Checkpoint, given: int | None) -> int | None:
    """The run's TP: `--tp`, args' (both: they must agree), or None when neither says."""
    args = checkpoint_args(ckpt)
    saved = getattr(args, "tensor_model_parallel_size", None) if args is not None else None
    if isinstance(saved, bool) or not isinstance(saved, int) or saved < 1:
        saved = None
    if given is not None and saved is not None and given != saved:
        raise UsageError(f"{ckpt.path}: --tp {given} but the checkpoint's args say TP {saved}")
    return given if given is not None else saved


def check_run_config(peft: BridgePeft, adapters: Sequence[BridgeAdapter], prefix: str) -> None:
    """Refuse adapters the run's config does not describe: canonical ones from a LoRA run, a dim
    other than peft.dim (an expert's may be smaller with normalize_moe_lora)."""
    split = next((a for a in adapters if a.split is not None), None)
    if split is not None and peft.kind != "canonical-lora":
        raise CheckpointError(peft.path, f"peft._target_ is LoRA, but {prefix}{split.a} is canonical LoRA's "
                                         "(is this the run's run_config.yaml?)")
    for adapter in adapters:
        if adapter.dim != peft.dim and not (peft.normalize_moe_lora and ".experts." in adapter.module):
            raise CheckpointError(peft.path, f"peft.dim is {peft.dim}, but {prefix}{adapter.a} has dim {adapter.dim} "
                                             "(is this the run's run_config.yaml?)")


def refuse_unplaced_adapters(model: MegatronModel, adapters: Sequence[BridgeAdapter], unused: Sequence[str],
                             family: str) -> None:
    """Refuse, by the adapter's name, an adapter on a Megatron weight the family's rules have no
    place for (`unused`: the model's names they did not take)."""
    left = set(unused)
    unplaced = [a for a in adapters if any(name in left for name in a.bases)]
    if unplaced:
        more = f" (+{counted(len(unplaced) - 1, 'more adapter')})" if len(unplaced) > 1 else ""
        raise CheckpointError(model.ckpt.path, f"{model.prefix}{unplaced[0].a}: a Megatron-Bridge LoRA adapter on "
                                               f"{model.prefix}{unplaced[0].module}, which a {family} model has no "
                                               f"place for{more}")


def _operand(model: MegatronModel, name: str, views: dict[str, SourceTensor]) -> tuple[RowView, StreamItem]:
    """A tensor of the model (a layer's slab of a stack), whole, as a float32 operand."""
    view = _view(model, name)
    views.setdefault(view.fqn, model.source_view(view.fqn))
    return view, whole_item(TargetTensor(view.fqn, (view.rows, *view.trailing), float32, _whole_rows(view)), views)


def _view(model: MegatronModel, name: str) -> RowView:
    return model.layer_views[name] if name in model.layer_views else model.view(name)


@dataclass(frozen=True)
class _Segment:
    """Rows of a saved tensor that are rows of an adapter's base weight (the weight B's rows follow)."""

    fqn: str
    src_row: int
    rows: int
    row: int
    """Its first row in the base weight."""


@dataclass(frozen=True)
class _Base:
    """An adapted Megatron weight as B's rows see it: one layer's slab of a stack, or a SwiGLU fc1
    saved as its halves (fsdp_dtensor's `weight_w`, `weight_v`) seen fused TP-blocked at the run's TP,
    [W_0; V_0; W_1; V_1 …], as Bridge's adapter on it is saved."""

    label: str
    rows: int
    trailing: tuple[int, ...]
    segments: tuple[_Segment, ...]

    def operand(self, model: MegatronModel, views: dict[str, SourceTensor]) -> StreamItem:
        """All of it, as a float32 operand."""
        zeros = tuple(0 for _ in self.trailing)
        for seg in self.segments:
            views.setdefault(seg.fqn, model.source_view(seg.fqn))
        pieces = tuple(Piece(g.fqn, (g.src_row, *zeros), (g.row, *zeros), (g.rows, *self.trailing))
                       for g in self.segments)
        return whole_item(TargetTensor(self.label, (self.rows, *self.trailing), float32, pieces), views)

    def _at(self, fqn: str, row: int) -> _Segment | None:
        return next((g for g in self.segments if g.fqn == fqn and g.src_row <= row < g.src_row + g.rows), None)

    def blocks_of(self, target: TargetTensor) -> tuple[Piece, ...] | None:
        """The target's pieces as blocks of this weight (rows in it), or None when it reads none of
        it; refused when it reads it otherwise than whole rows, or reads other tensors too."""
        if not any(self._at(p.src, p.src_start[0]) for p in target.pieces if p.src_start):
            return None
        blocks = []
        for piece in target.pieces:
            whole_rows = (piece.axes is None and piece.src_start and not any(piece.src_start[1:])
                          and piece.sizes[1:] == self.trailing and not target.add and target.logical_shape is None)
            row, left, dst = (piece.src_start[0], piece.sizes[0], piece.dst_start[0]) if whole_rows else (0, 0, 0)
            while whole_rows and left:
                seg = self._at(piece.src, row)
                if seg is None:
                    whole_rows = False
                    break
                count = min(left, seg.src_row + seg.rows - row)
                blocks.append(Piece(self.label, (seg.row + row - seg.src_row, *piece.src_start[1:]),
                                    (dst, *piece.dst_start[1:]), (count, *piece.sizes[1:])))
                row, left, dst = row + count, left - count, dst + count
            if not whole_rows:
                raise CheckpointError(target.fqn, f"takes {self.label} otherwise than whole rows of one layer's "
                                                  "weight, which export-hf does not merge a Megatron-Bridge adapter "
                                                  "into yet")
        return tuple(blocks)


def _base(model: MegatronModel, adapter: BridgeAdapter, tp: int | None) -> _Base:
    """The base weight of `adapter` (`tp`: the run's, for a SwiGLU fc1 saved as halves; a canonical
    adapter's rows are its projection's own, so its halves are only told apart, at TP 1)."""
    if adapter.split is not None:
        tp = 1
    if not adapter.halves:
        view = _view(model, adapter.weight)
        return _Base(view.fqn, view.rows, view.trailing,
                     tuple(_Segment(view.fqn, b.src_row, b.rows, b.dst_row) for b in view.blocks))
    w, v = (_view(model, name) for name in adapter.bases)
    if tp is None or w.rows % tp:
        why = "which the args do not say (pass --tp)" if tp is None else f"{tp}, which does not divide {w.rows} rows"
        raise CheckpointError(model.ckpt.path, f"{model.prefix}{adapter.b}: on a SwiGLU fc1 saved as weight_w / "
                              f"weight_v, its rows are TP-blocked at the run's TP, {why}")
    rows = w.rows // tp
    segments = []
    for t in range(tp):
        for part, view in enumerate((w, v)):
            src, _ = _rows_of(view, t * rows, rows)
            segments.append(_Segment(view.fqn, src, rows, (2 * t + part) * rows))
    return _Base(f"{model.prefix}{adapter.weight}", 2 * w.rows, w.trailing, tuple(segments))


def _canonical_target(model: MegatronModel, adapter: BridgeAdapter, taken: Mapping[str, tuple[Piece, ...]],
                      targets: Mapping[str, TargetTensor]) -> str:
    """The HF target a canonical adapter is merged into: of those made of its linear's weight, the
    one its `ADAPTER_NAME_MAP` module names (`q_proj` …), whose rows its linear_out must have."""
    named = [n for n in taken if n.removesuffix(".weight").rsplit(".", 1)[-1] == adapter.hf_module]
    if len(named) != 1:
        raise CheckpointError(model.ckpt.path, f"{model.prefix}{adapter.a}: canonical LoRA's {adapter.split} on "
                                               f"{model.prefix}{adapter.module}, but {len(named)} of the HF tensors "
                                               f"made of it are a {adapter.hf_module} (want one)")
    name = named[0]
    b = _view(model, adapter.b)
    if b.rows != targets[name].shape[0]:
        raise CheckpointError(model.ckpt.path, f"{model.prefix}{adapter.b}: {b.rows} rows, but {name} has "
                                               f"{targets[name].shape[0]}")
    return name


def merge_bridge_adapters(model: MegatronModel, targets: dict[str, TargetTensor], adapters: Sequence[BridgeAdapter],
                          alpha: BridgeAlpha, tp: int | None, selected: bool) -> str:
    """Give each HF target made of an adapted Megatron weight the `delta` that merges its adapter
    over the whole weight (one layer's), then takes the target's blocks; a canonical adapter's
    target, the delta over the target alone; the note that says so. An adapter no target takes
    is refused unless `--include`/`--exclude` left its weights out."""
    merged = 0
    for adapter in adapters:
        views: dict[str, SourceTensor] = {}
        base = _base(model, adapter, tp)
        w = base.operand(model, views)
        taken = {name: blocks for name, t in targets.items() if (blocks := base.blocks_of(t)) is not None}
        if adapter.split is not None and taken:
            name = _canonical_target(model, adapter, taken, targets)
            taken = {name: taken[name]}
        if not taken:
            if selected:
                continue
            raise CheckpointError(model.ckpt.path, f"{model.prefix}{adapter.a}: a Megatron-Bridge LoRA adapter on "
                                                   f"{model.prefix}{adapter.module}, which no HF tensor is made of")
        (_, a), (_, b) = _operand(model, adapter.a, views), _operand(model, adapter.b, views)
        scale = alpha.value / adapter.dim
        for name, blocks in taken.items():
            if adapter.split is not None:  # Bridge merges W_q + s · B_q @ A_q once q_proj is split out
                target = targets[name]
                whole = whole_item(TargetTensor(target.fqn, target.shape, float32, target.pieces), views)
                targets[name] = replace(target, delta=LowRank(whole, a, b, scale))
            else:
                targets[name] = replace(targets[name], delta=LowRank(w, a, b, scale, blocks=blocks))
            merged += 1
    canonical = sum(a.split is not None for a in adapters)
    how = ("W + (B @ A) · s in float32 over each whole Megatron weight, as Megatron-Bridge's LoRAMerge, then split "
           "as the base and cast once")
    if canonical:
        how += "; canonical LoRA's over the HF tensor it names (q_proj …), as Bridge merges those"
    return (f"{counted(merged, 'weight')} merged with {counted(len(adapters), 'Megatron-Bridge LoRA adapter')} "
            f"(s = α / dim, α {alpha.value:g} from {alpha.source}): {how}")


def _rows_of(view: RowView, row: int, count: int) -> tuple[int, int]:
    """The source row of row `row` of `view`, and that the `count` rows from it lie in one block."""
    block = next((b for b in view.blocks if b.dst_row <= row < b.dst_row + b.rows), None)
    if block is None or row + count > block.dst_row + block.rows:
        raise CheckpointError(view.fqn, f"rows {row}..{row + count} are not in one block of the layer's view")
    return block.src_row + row - block.dst_row, count


def bridge_adapter_tensors(model: MegatronModel, targets: Mapping[str, TargetTensor],
                           adapters: Sequence[BridgeAdapter], tp: int | None, wanted: DType | None,
                           sources: dict[str, SourceTensor]) -> tuple[dict[str, TargetTensor], list[Adapter]]:
    """`--adapter-only`: each HF module made of an adapted Megatron weight gets the shared A
    (`linear_in`) whole and its rows of B (`linear_out`), the rows the family rule gives it of
    the base (q, k, v of linear_qkv; gate, up of linear_fc1), under PEFT's names, copied; a
    canonical adapter's module, its own A and B whole; and the peft `Adapter` each is;
    `wanted`: `--dtype`."""
    out: dict[str, TargetTensor] = {}
    peft: list[Adapter] = []
    for adapter in adapters:
        base = _base(model, adapter, tp)
        taken = {name: blocks for name, t in targets.items() if (blocks := base.blocks_of(t)) is not None}
        if not taken:
            raise CheckpointError(model.ckpt.path, f"{model.prefix}{adapter.a}: a Megatron-Bridge LoRA adapter on "
                                                   f"{model.prefix}{adapter.module}, which no HF tensor is made of")
        if adapter.split is not None:
            name = _canonical_target(model, adapter, taken, targets)
            taken = {name: ()}
        views = [_view(model, n) for n in (adapter.a, adapter.b)]
        a_view, b_view = views
        for view in views:
            sources.setdefault(view.fqn, model.source_view(view.fqn))
        for name, blocks in taken.items():
            module = name.removesuffix(".weight")
            a_name, b_name = f"{PEFT_PREFIX}{module}.lora_A.weight", f"{PEFT_PREFIX}{module}.lora_B.weight"
            rows = targets[name].shape[0]
            if adapter.split is not None:  # its own B, whole
                b_pieces = list(_whole_rows(b_view))
            else:
                b_pieces = []
                for block in blocks:
                    row, count = _rows_of(b_view, block.src_start[0], block.sizes[0])
                    b_pieces.append(Piece(b_view.fqn, (row, 0), (block.dst_start[0], 0), (count, adapter.dim)))
            out[a_name] = TargetTensor(a_name, (a_view.rows, *a_view.trailing), cast_dtype(sources[a_view.fqn].dtype, wanted),
                                       _whole_rows(a_view))
            out[b_name] = TargetTensor(b_name, (rows, adapter.dim), cast_dtype(sources[b_view.fqn].dtype, wanted), tuple(b_pieces))
            peft.append(Adapter(module, a_name, b_name, adapter.dim))
    return out, peft


def _whole_rows(view: RowView) -> tuple[Piece, ...]:
    """The pieces of all of `view` (a layer's slab of a stack, or a tensor)."""
    zeros = tuple(0 for _ in view.trailing)
    return tuple(Piece(view.fqn, (b.src_row, *zeros), (b.dst_row, *zeros), (b.rows, *view.trailing))
                 for b in view.blocks)
