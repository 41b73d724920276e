"""`import-hf`: a Hugging Face safetensors model folder → a DCP checkpoint laid out for training.

The reverse of export-hf for the layout a `fully_shard`ed transformers model saves and
loads (`--to fsdp2`): every tensor under its HF name behind `--prefix` (`model.` as
`dcp.save({"model": model.state_dict()})` writes it), cut into FSDP2 `Shard(0)` row
chunks at `--world-size` ranks, one `__{rank}_0.distcp` file per rank. Each chunk is
streamed from the safetensors records with positioned reads (the folder is opened as a
checkpoint of whole-row chunks, `formats.safetensors.reader`) by the same planner and engine
as reshard: bounded memory, atomic output, `--verify` re-reading every tensor and decoding
every source block with the safetensors library.

Closed world, as export-hf: the names are checked against the model transformers builds
for the folder's `config.json`. A name the model has no place for, or a weight it needs
that the folder lacks, is refused; a tied parameter (`lm_head.weight` of a model that
ties it) is written as a second entry of its source's bytes, because `model.state_dict()`
lists it and `dcp.load` wants every key it lists. A model transformers holds in another
form in memory than on disk (fused MoE experts) is refused: a `fully_shard`ed one loads
the in-memory form, which needs a conversion import-hf does not make.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable, Mapping

from ckptctl.core.dtypes import bfloat16, cast_dtype, float32
from ckptctl.engine.cpu import ChunkSource, equal_tensors
from ckptctl.engine.dist import LOCAL, Comm
from ckptctl.storage.atomic import recorded_reads
from ckptctl.util.errors import CheckpointError, UsageError
from ckptctl.formats.dcp.writer import DcpOutput, place_dcp_records
from ckptctl.formats.safetensors.quantized import describe_dequantized, quant_format
from ckptctl.formats.safetensors.reader import open_safetensors_folder
from ckptctl.util.gc_pause import gc_paused
from ckptctl.families.registry import FAMILIES, family_for_model_type
from ckptctl.families.protocol import ModelFamily, Naming
from ckptctl.families.config_bounds import refuse_unbacked_counts
from ckptctl.families.base import (
    ExportContext, HFConfig, MegatronSpec, Shapes, planned_model, read_config, reversed_pieces, uncovered_elements,
)
from ckptctl.families.expected import (ExpectedNames, Preparing, asking_transformers, expected_names,
                                       shape_problem, shown, sizing_keys, transformers_available)
from ckptctl.families.experts import stacked_parts
from ckptctl.families.llama import EMBED, OUTPUT
from ckptctl.families.torchtitan import EMBED as TT_EMBED
from ckptctl.families.torchtitan import OUTPUT as TT_OUTPUT
from ckptctl.families.torchtitan import EXPERT_BIASES, TORCHTITAN_FAMILIES
from ckptctl.megatron.rows import CURRENT_RELEASE, SPELLINGS, parse_release, respelled
from ckptctl.core.checkpoint import Checkpoint, dtype_name
from ckptctl.families.placement import fsdp2, megatron_fsdp
from ckptctl.core.plan import Piece, SourceTensor, TargetTensor, identity_target, source_view, unsqueezed_view
from ckptctl.util.progress import ProgressObserver
from ckptctl.commands.options import RunOptions
from ckptctl.commands.dcp_write import DcpReport, write_dcp_output
from ckptctl.commands.import_adapter import check_adapter_options, peft_targets
from ckptctl.families.adapters import PEFT_PREFIX
from ckptctl.core.selection import refuse_empty_selection, selected
from ckptctl.util.wording import counted
from ckptctl.storage.store import EntryKind, store_for

TARGETS = ("fsdp2", "torchtitan", "megatron-fsdp")
"""Layouts import-hf writes (`--to`)."""
DEFAULT_PREFIX = {"fsdp2": "model.", "torchtitan": "", "megatron-fsdp": "model.module."}
CONFIG_NAME = "config.json"
VOCAB_MULTIPLE = 128
"""Megatron's `--make-vocab-size-divisible-by` default: the vocab is padded to a multiple of it × TP."""


@dataclass
class ImportOptions(RunOptions):
    """What an import writes: the layout (`to`), its world size (or Megatron TP × DP), names, casts."""

    world_size: int | None
    to: str = "fsdp2"
    prefix: str | None = None
    """Put before every output name; None: `DEFAULT_PREFIX` of the target."""
    name_check: bool = True
    arch: str = "auto"
    tp: int | None = None
    dp: int | None = None
    split_fused: bool = False
    vocab_multiple: int = VOCAB_MULTIPLE
    adapter: Path | None = None
    """fsdp2: a PEFT LoRA folder, imported with the model as a peft model's state dict (`import_adapter`)."""
    adapter_name: str = "default"
    """The peft adapter name the folder's tensors are imported under."""
    megatron_core: str | None = None
    """megatron-fsdp: the megatron-core release that loads the output (its module names,
    `megatron.rows.SPELLINGS`); None: the current release (`megatron.rows.CURRENT_RELEASE`)."""

    @property
    def release(self) -> tuple[int, int]:
        return CURRENT_RELEASE if self.megatron_core is None else parse_release(self.megatron_core)

    @property
    def output_prefix(self) -> str:
        return DEFAULT_PREFIX[self.to] if self.prefix is None else self.prefix

    def grid(self) -> tuple[int, int]:
        """The Megatron-FSDP TP × DP grid (from --tp/--dp, or --world-size / --tp)."""
        tp = self.tp or 1
        if tp < 1:
            raise UsageError(f"--tp must be at least 1 (got {tp})")
        dp = self.dp
        if dp is None and self.world_size is not None:
            if self.world_size % tp:
                raise UsageError(f"--world-size {self.world_size} is not a multiple of --tp {tp}")
            dp = self.world_size // tp
        if dp is None or dp < 1:
            raise UsageError("--to megatron-fsdp needs --dp (or --world-size): the data-parallel size")
        if self.world_size is not None and self.world_size != tp * dp:
            raise UsageError(f"--world-size {self.world_size} is not --tp {tp} × --dp {dp}")
        return tp, dp

    @property
    def output_world_size(self) -> int | None:
        if self.to == "megatron-fsdp":
            tp, dp = self.grid()
            return tp * dp
        return self.world_size


@dataclass
class ImportReport(DcpReport):
    """What an import did: the figures of every DCP write, the model class its names were checked
    against, notes."""

    model_class: str | None = None
    notes: list[str] = field(default_factory=list)
    dequantized_to: str | None = None
    """The dtype a quantized folder's weights were dequantized to (None: the folder is not quantized)."""


@dataclass
class ImportPlan:
    output: DcpOutput
    views: dict[str, SourceTensor]
    """The source views the output's pieces address (some experts seen stacked)."""
    model_class: str | None
    notes: list[str]
    dequantized_to: str | None = None


def _config_path(src: Path) -> Path:
    """Where the `config.json` of a model folder, or of the folder of one `.safetensors` file, is."""
    return (src.parent if store_for(src).kind(src) is EntryKind.FILE else src) / CONFIG_NAME


def folder_config(src: Path) -> dict[str, Any] | None:
    """The folder's `config.json` (beside a single `.safetensors` file), or None when there is none."""
    path = _config_path(src)
    if not store_for(path).exists(path):  # whatever else it is, `read_config` names it
        return None
    return read_config(path)


def expected_for(src: Path, config: dict[str, Any] | None, name_check: bool, preparing: Preparing | None = None
                 ) -> ExpectedNames | None:
    """What transformers' model for the folder's config expects, or None with `--no-name-check`;
    transformers is asked under `preparing` (`asking_transformers`)."""
    if not name_check:
        return None
    bypass = "or --no-name-check to import the names unchecked"
    if config is None:
        raise UsageError(f"{src}: no {CONFIG_NAME}; import-hf checks the tensor names against the model it "
                         f"describes ({bypass})")
    if not transformers_available():
        raise UsageError("import-hf checks the tensor names against transformers' model for config.json, and "
                         f"transformers is not installed (pip install transformers; {bypass})")
    return expected_names(config, asking_transformers(preparing, "tensor names"))


def check_names(ckpt: Checkpoint, expected: ExpectedNames, narrowed: bool, in_memory: bool) -> dict[str, str]:
    """Refuse names the model has no place for and (unless `--include`/`--exclude` narrowed the
    import) weights it needs that are missing; and, when the output is loaded by the model
    itself (`in_memory`), a model that holds weights in memory in another form than on disk.
    Return the tied parameters to write as copies of their source (name → source), those the
    folder does not hold itself."""
    names = set(ckpt.tensors)
    cls = expected.model_class
    if in_memory:
        unknown = sorted(n for n in in_memory_only(expected) if stacked_parts(n, names) is None)
        if unknown:
            raise UsageError(f"{ckpt.path}: a {cls} holds some weights in another form in memory than on disk "
                             f"({shown(unknown)}); a fully_shard'ed {cls} loads that form, and import-hf has no rule "
                             "making it from this folder")
    unclaimed = expected.unclaimed(names)
    if unclaimed:
        verb = "has" if len(unclaimed) == 1 else "have"
        raise CheckpointError(ckpt.path, f"{counted(len(unclaimed), 'tensor')} {verb} no place in a {cls}: "
                                         f"{shown(unclaimed)} (is config.json this model's?)")
    missing = [] if narrowed else expected.missing(names)
    if missing:
        verb = "is" if len(missing) == 1 else "are"
        raise CheckpointError(ckpt.path, f"{counted(len(missing), 'weight')} a {cls} expects {verb} missing: "
                                         f"{shown(missing)}")
    return {name: source for name, source in sorted(expected.tied.items()) if name not in names and source in names}


def check_shapes(ckpt: Checkpoint, expected: ExpectedNames, src: Path, config: dict[str, Any]) -> None:
    """Refuse a folder tensor whose shape is not the one transformers' model for its config.json
    has (130 embedding rows under `vocab_size` 128: the model would not load the import), naming
    it, its shape and the config keys of the sizes it lacks."""
    wrong = expected.misshapen({name: entry.shape for name, entry in ckpt.tensors.items()})
    if wrong:
        name, got, want = wrong[0]
        more = f"+{counted(len(wrong) - 1, 'more tensor')}; " if len(wrong) > 1 else ""
        path = _config_path(src)
        raise CheckpointError(ckpt.path, shape_problem(name, got, want, expected.model_class, path, config)
                              + f" ({more}is config.json this model's?)")


def plan_import(src: Path, opts: ImportOptions, preparing: Preparing | None = None
                ) -> tuple[Checkpoint, ImportPlan]:
    """Open the folder, check its names and plan the whole DCP output. Reads headers only."""
    if opts.to not in TARGETS:
        raise UsageError(f"--to must be one of {', '.join(TARGETS)} (got {opts.to!r})")
    if opts.to != "megatron-fsdp":
        if opts.tp is not None or opts.dp is not None or opts.split_fused or opts.megatron_core is not None:
            raise UsageError("--tp, --dp, --split-fused and --megatron-core are for --to megatron-fsdp")
        if opts.world_size is None:
            raise UsageError("--world-size is required (the number of ranks the output is laid out for)")
        if opts.world_size < 1:
            raise UsageError(f"--world-size must be at least 1 (got {opts.world_size})")
    if opts.adapter is not None:
        check_adapter_options(opts.to, opts.include, opts.exclude)
    elif opts.adapter_name != "default":
        raise UsageError("--adapter-name names the adapter of --adapter FOLDER")
    config = folder_config(src)
    quantized = quant_format(config, _config_path(src))
    ckpt = open_safetensors_folder(src, quantized, bfloat16 if opts.dtype in (None, bfloat16) else float32)
    if config is not None and (opts.name_check or opts.to != "fsdp2"):  # a model or family rules are built of it
        refuse_unbacked_counts(config, ckpt.path / CONFIG_NAME, {n: e.shape for n, e in ckpt.tensors.items()},
                               src, "is config.json this model's?")
    expected = expected_for(src, config, opts.name_check, preparing)
    notes: list[str] = []
    if quantized is not None:
        notes.append(describe_dequantized(ckpt.tensors, quantized, opts.dtype or bfloat16))
    if expected is None:
        notes.append("tensor names not checked against transformers' model (--no-name-check)")
    with gc_paused():
        views = {fqn: source_view(entry) for fqn, entry in ckpt.tensors.items()}
        narrowed = bool(opts.include or opts.exclude)
        if expected is not None and opts.to == "megatron-fsdp" and config is not None:
            expected = expected.allowing(mtp_prefixes(ckpt, config, opts))
        tied = check_names(ckpt, expected, narrowed, opts.to == "fsdp2") if expected else {}
        if expected is not None and config is not None:
            check_shapes(ckpt, expected, src, config)
        if expected is not None:
            refuse_differing_ties(ckpt, expected, views, src, config)
        if opts.to == "fsdp2":
            targets = fsdp2_targets(views, tied, expected, opts, notes)
            if opts.adapter is not None:
                targets = peft_targets(ckpt, views, targets, opts.adapter, opts.adapter_name, opts.dtype, notes,
                                       expected)
        elif opts.to == "torchtitan":
            targets = torchtitan_targets(ckpt, views, config, expected, opts, notes)
        else:
            targets = megatron_targets(ckpt, views, config, expected, opts, notes)
        kept = [t for t in targets if selected(t.fqn, opts.include, opts.exclude)]
        refuse_empty_selection(len(kept), len(targets), opts.include, opts.exclude, "tensors")
        prefix = opts.output_prefix
        kept = sorted((replace(t, fqn=prefix + t.fqn) for t in kept), key=lambda t: t.fqn)
        if opts.to != "megatron-fsdp":
            placements = {t.fqn: fsdp2(t.shape, opts.world_size or 1) for t in kept}
        else:
            tp, dp = opts.grid()
            placements = {t.fqn: megatron_fsdp(t.shape, t.fqn[len(prefix):], tp, dp) for t in kept}
        output = place_dcp_records(kept, placements, views, [], saved_paths((t.fqn for t in kept), prefix))
    dequantized_to = dtype_name(opts.dtype or bfloat16) if quantized is not None else None
    return ckpt, ImportPlan(output, views, expected.model_class if expected else None, notes, dequantized_to)


def saved_paths(fqns: Iterable[str], prefix: str) -> dict[str, tuple[str, ...]]:
    """Each output name's path in the nested state dict (`planner_data`), as `dcp.save` records
    it: under `model.` the state dict is `{"model": model.state_dict()}`, each name the path
    ("model", its key); without a prefix each name is a key of its own. torch's
    `dcp_to_torch_save`, and ckptctl's export-torch, nest the state dict by these paths."""
    head = prefix[:prefix.index(".")] if "." in prefix else None
    return {fqn: (head, fqn[len(head) + 1:]) if head else (fqn,) for fqn in fqns}


TIES_COMPARED_BYTES = 16 << 20
"""Bytes of each of two tied tensors held at once while they are compared."""


def refuse_differing_ties(ckpt: Checkpoint, expected: ExpectedNames, views: Mapping[str, SourceTensor], src: Path,
                          config: dict[str, Any] | None) -> None:
    """A folder that holds both tensors its model ties (`lm_head.weight` and the embeddings of a
    tying config) must hold them equal: the model keeps one tensor for both, and a load would take
    either silently. Compared block by block; a difference is refused, naming both and the key."""
    pairs = [(n, s) for n, s in sorted(expected.tied.items()) if n in ckpt.tensors and s in ckpt.tensors]
    if not pairs:
        return
    chunks = ChunkSource(ckpt)
    try:
        for name, source in pairs:
            a, b = identity_target(views[name]), identity_target(views[source])
            if a.shape == b.shape and a.dtype == b.dtype and equal_tensors(chunks, a, b, views, TIES_COMPARED_BYTES):
                continue
            why = (f"{src / CONFIG_NAME} has tie_word_embeddings=true" if (config or {}).get("tie_word_embeddings")
                   else f"a {expected.model_class} of {src / CONFIG_NAME} ties them")
            raise CheckpointError(src, f"{name} differs from {source}, but {why}: the model holds one tensor for "
                                       "both (is config.json this model's?)")
    finally:
        chunks.close()


def in_memory_only(expected: ExpectedNames) -> list[str]:
    """The names a transformers model holds in memory only (its MoE experts, stacked)."""
    return sorted(expected.in_memory - expected.required) if expected.in_memory else []


def fsdp2_targets(views: dict[str, SourceTensor], tied: dict[str, str], expected: ExpectedNames | None,
                  opts: ImportOptions, notes: list[str]) -> list[TargetTensor]:
    """Every tensor as the model holds it in memory: as it is, MoE experts stacked as transformers
    stacks them (`families.experts`), and each tied parameter the folder leaves out as a copy of its
    source."""
    cls = expected.model_class if expected else "the model"
    on_disk = set(views)
    stacked = {name: parts for name in (in_memory_only(expected) if expected else ())
               if (parts := stacked_parts(name, on_disk))}  # `check_names` refused any other in-memory form
    consumed = {n for experts in stacked.values() for parts in experts for n in parts}
    targets = [identity_target(v, dtype=cast_dtype(v.dtype, opts.dtype)) for v in views.values()
               if v.fqn not in consumed]
    targets += [stacked_target(name, experts, views, opts) for name, experts in stacked.items()]
    if stacked:
        notes.append(f"{counted(len(consumed), 'per-expert tensor')} stacked into {counted(len(stacked), 'tensor')} "
                     f"as {cls} holds them in memory")
    prefix = opts.output_prefix + (PEFT_PREFIX if opts.adapter is not None else "")  # the names `peft_targets` gives
    for name, source in tied.items():
        view = views[source]
        targets.append(identity_target(view, name, cast_dtype(view.dtype, opts.dtype)))
        notes.append(f"{prefix}{name} written as a copy of {prefix}{source} ({cls} ties them; model.state_dict() "
                     "lists both)")
    return targets


def stacked_target(name: str, experts: list[tuple[str, ...]], views: dict[str, SourceTensor],
                   opts: ImportOptions) -> TargetTensor:
    """`name` [E, rows, …]: expert e's rows are its parts' rows one after another; each part is
    seen with a leading unit dim (`plan.unsqueezed_view`) so its piece is a box of the target."""
    first = views[experts[0][0]]
    rows = sum(views[p].shape[0] for p in experts[0])
    pieces = []
    for e, parts in enumerate(experts):
        at = 0
        for part in parts:
            view = views[part]
            if view.shape[1:] != first.shape[1:] or view.dtype != first.dtype:
                raise CheckpointError(part, f"shape {list(view.shape)} does not stack with {first.fqn}'s "
                                            f"{list(first.shape)}")
            views[part] = unsqueezed_view(view)
            pieces.append(Piece(part, (0,) * (len(view.shape) + 1), (e, at, *(0 for _ in view.shape[1:])),
                                (1, *view.shape)))
            at += view.shape[0]
        if at != rows:
            raise CheckpointError(parts[0], f"expert {e} has {at} rows, expert 0 {rows}")
    return TargetTensor(name, (len(experts), rows, *first.shape[1:]), cast_dtype(first.dtype, opts.dtype),
                        tuple(pieces))


def folder_hf_config(ckpt: Checkpoint, config: dict[str, Any] | None, target: str) -> HFConfig:
    if config is None:
        raise UsageError(f"{ckpt.path}: no {CONFIG_NAME}; --to {target} needs the model's config")
    return HFConfig(ckpt.path / CONFIG_NAME, config, ckpt.path)


def megatron_family(cfg: HFConfig, opts: ImportOptions) -> ModelFamily | None:
    """The family `--arch` names, or the one serving the config's model_type (None when none does)."""
    return FAMILIES.get(opts.arch) if opts.arch != "auto" else family_for_model_type(cfg.model_type)


def mtp_prefixes(ckpt: Checkpoint, config: dict[str, Any], opts: ImportOptions) -> tuple[str, ...]:
    """The HF layers of the family's multi-token prediction, which a Megatron import takes where
    the folder holds them (DeepSeek-V3's layer N; transformers has no place for them)."""
    cfg = folder_hf_config(ckpt, config, opts.to)
    family = megatron_family(cfg, opts)
    return family.mtp_prefixes(cfg) if family is not None else ()


def megatron_targets(ckpt: Checkpoint, views: dict[str, SourceTensor], config: dict[str, Any] | None,
                     expected: ExpectedNames | None, opts: ImportOptions, notes: list[str]) -> list[TargetTensor]:
    """The Megatron model of the folder's family at --tp, each tensor made of HF rows, the vocab
    padded with zero rows as Megatron pads it (`rule_targets`)."""
    cfg = folder_hf_config(ckpt, config, opts.to)
    family = megatron_family(cfg, opts)
    if family is None or family.naming is not Naming.MEGATRON:
        known = ", ".join(n for n, f in FAMILIES.items() if f.naming is Naming.MEGATRON)
        what = f"--arch {opts.arch}" if opts.arch != "auto" else f"model_type {cfg.model_type!r}"
        raise UsageError(f"{ckpt.path}: no Megatron rules for {what} (import-hf --to megatron-fsdp knows: {known})")
    tp, _ = opts.grid()
    if opts.vocab_multiple < 1:
        raise UsageError(f"--make-vocab-size-divisible-by must be at least 1 (got {opts.vocab_multiple})")
    vocab, multiple = cfg.int("vocab_size"), opts.vocab_multiple * tp
    spec = MegatronSpec(tp, opts.split_fused, -(-vocab // multiple) * multiple, frozenset(ckpt.tensors))
    targets = rule_targets(ckpt, views, cfg, family, family.megatron_shapes(cfg, spec), tp,
                           {EMBED: vocab, OUTPUT: vocab}, expected, opts, notes)
    targets = respelled_targets(targets, opts, notes)
    if spec.padded_vocab > vocab:
        notes.append(f"vocab padded from {vocab} to {spec.padded_vocab} rows with zeros (a multiple of "
                     f"{opts.vocab_multiple} × TP {tp}, as Megatron pads it)")
    return targets


def respelled_targets(targets: list[TargetTensor], opts: ImportOptions, notes: list[str]) -> list[TargetTensor]:
    """The Megatron tensors named as the release `--megatron-core` names its modules (rules spell
    them as the older releases do, `megatron.rows.SPELLINGS`), with a note of the names a release decides."""
    release = opts.release
    at = ".".join(map(str, release))
    for since in sorted({s.since for s in SPELLINGS}):
        used = [s for s in SPELLINGS if s.since == since and any(t.fqn.endswith(s.old) for t in targets)]
        if used:
            chosen, other = ("new", "old") if release >= since else ("old", "new")
            notes.append(f"{', '.join(getattr(s, chosen) for s in used)} written as megatron-core {at} names them "
                         f"({', '.join(getattr(s, other) for s in used)} {'before' if chosen == 'new' else 'from'} "
                         f"{'.'.join(map(str, since))}; --megatron-core RELEASE)")
    return [replace(t, fqn=respelled(t.fqn, release)) for t in targets]


def torchtitan_targets(ckpt: Checkpoint, views: dict[str, SourceTensor], config: dict[str, Any] | None,
                       expected: ExpectedNames | None, opts: ImportOptions, notes: list[str]) -> list[TargetTensor]:
    """The torchtitan model of the folder's family, named as torchtitan saves it (`rule_targets`); a
    tied `lm_head.weight`, which torchtitan's state dict lists, as a copy of the embeddings."""
    cfg = folder_hf_config(ckpt, config, opts.to)
    family = FAMILIES.get(opts.arch) if opts.arch != "auto" else family_for_model_type(cfg.model_type,
                                                                                      Naming.TORCHTITAN)
    if family is None or family.naming is not Naming.TORCHTITAN:
        known = ", ".join(f"{t} ({f.name})" for f in TORCHTITAN_FAMILIES for t in f.model_types)
        what = f"--arch {opts.arch}" if opts.arch != "auto" else f"model_type {cfg.model_type!r}"
        raise UsageError(f"{ckpt.path}: no torchtitan rules for {what} (import-hf --to torchtitan knows: {known})")
    shapes = family.source_shapes(cfg)
    zeros = {name: 0 for name in shapes if family.zero_filled(name)}
    targets = rule_targets(ckpt, views, cfg, family, shapes, None, zeros, expected, opts, notes)
    if zeros:
        notes.append(f"{len(zeros)} torchtitan expert biases ({opts.output_prefix}{EXPERT_BIASES}) written as zeros "
                     f"({cfg.model_type} routes without one)")
    if cfg.flag("tie_word_embeddings"):
        embed = next(t for t in targets if t.fqn == TT_EMBED)
        targets.append(replace(embed, fqn=TT_OUTPUT))
        notes.append(f"{opts.output_prefix}{TT_OUTPUT} written as a copy of {opts.output_prefix}{TT_EMBED} "
                     "(the config ties them; torchtitan's state dict lists both)")
    return targets


def rule_targets(ckpt: Checkpoint, views: dict[str, SourceTensor], cfg: HFConfig, family: ModelFamily,
                 shapes: Shapes, tp: int | None, padded: dict[str, int], expected: ExpectedNames | None,
                 opts: ImportOptions, notes: list[str]) -> list[TargetTensor]:
    """The family's tensors (`shapes`, as the family names them), each made of HF rows.

    The family says, as for an export, which of their rows each HF tensor is (`to_hf` over a
    model of tensors not written yet, which also checks every shape against the config);
    read backwards, that gives each tensor's pieces. Closed world both ways: every HF tensor
    must be one the family produces (a tied one it leaves out is noted), every one it
    produces must be in the folder with its shape, and every row must come from some HF row
    but the rows of `padded` tensors past the count given (zeros: Megatron's vocab padding,
    torchtitan's expert bias). A tensor the family reads in another shape (a stack slab by
    slab, `MegatronModel.stacked`, as [S·R, …]; row pairs, `in_row_groups`) is planned in that
    shape and written in its own (`TargetTensor.logical_shape`); an HF tensor whose pieces are in
    another shape (`logical_shape`) is read in it: its entry in `views` is replaced."""
    model = planned_model(ckpt.path, shapes, next(iter(ckpt.tensors.values())).dtype)
    hf = family.to_hf(ExportContext(cfg, model, tp, tp))
    unread = model.unused()
    if unread:
        raise CheckpointError(ckpt.path, f"the {family.name} rules name tensors no HF tensor is made of: "
                                         f"{shown(unread)}")
    tied = expected.tied if expected else {}
    left_out = sorted(n for n in ckpt.tensors if n not in hf and n in tied)
    unclaimed = sorted(n for n in ckpt.tensors if n not in hf and n not in tied)
    if unclaimed:
        raise CheckpointError(ckpt.path, f"no {family.name} rule claims {counted(len(unclaimed), 'tensor')}: "
                                         f"{shown(unclaimed)} (wrong --arch?)")
    absent = sorted(n for n in hf if n not in ckpt.tensors)
    if absent:
        raise CheckpointError(ckpt.path, f"the {family.name} model needs {counted(len(absent), 'tensor')} the folder "
                                         f"lacks: {shown(absent)}")
    for name, tensor in hf.items():
        if tuple(tensor.shape) != views[name].shape:
            keys = sizing_keys(cfg.data, views[name].shape, tensor.shape)
            raise CheckpointError(ckpt.path, f"{name}: shape {list(views[name].shape)}, the config implies "
                                             f"{list(tensor.shape)}{f' ({keys})' if keys else ''}")
        logical = getattr(tensor, "logical_shape", None)
        if logical is not None:  # read in the shape its pieces are in (GPT-OSS's interleaved experts)
            views[name] = source_view(ckpt.tensors[name], logical)
    notes.extend(f"{name} not imported: the config ties it to {tied[name]}" for name in left_out)
    pieces, adds = reversed_pieces(hf, shapes)
    targets = []
    for name, shape in shapes.items():
        rows = model.source_view(name).shape
        gap = uncovered_elements(pieces[name], rows)
        if gap and not (name in padded and gap == (shape[0] - padded[name]) * math.prod(shape[1:])):
            raise CheckpointError(ckpt.path, f"{name}: {gap // max(1, math.prod(rows[1:]))} of its {rows[0]} rows "
                                             "come from no HF tensor")
        dtype = views[pieces[name][0].src].dtype if pieces[name] else float32
        target = TargetTensor(name, shape, cast_dtype(dtype, opts.dtype), tuple(pieces[name]), add=adds.get(name, 0.0),
                              logical_shape=rows if rows != shape else None)
        targets.append(target)
    return targets


@recorded_reads()
def import_hf(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    opts: ImportOptions,
    *,
    force: bool = False,
    verify: bool = False,
    dry_run: bool = False,
    progress: ProgressObserver | None = None,
    comm: Comm = LOCAL,
    preparing: Preparing | None = None,
) -> ImportReport:
    """Run an import end to end and report what happened (under torchrun, collective as reshard).
    `preparing(what)` is the context a wait on transformers happens in (`asking_transformers`)."""
    started = time.perf_counter()
    src, dst = Path(src), Path(dst)
    ckpt, plan = plan_import(src, opts, preparing)
    report = ImportReport.planned(ckpt, plan.output, src, dst, opts.output_world_size or 1, opts, dry_run, comm,
                                  model_class=plan.model_class, notes=plan.notes, dequantized_to=plan.dequantized_to)
    if not dry_run:
        write_dcp_output(ckpt, plan.output, src, dst, report, opts, started, force=force, verify=verify,
                         progress=progress, comm=comm, views=plan.views)
    return report
