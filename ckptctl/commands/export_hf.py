"""`export-hf`: a Megatron-FSDP (or FSDP2 / torchtitan) DCP checkpoint → a Hugging Face model folder.

The steps, each a pure function of metadata until the last: open the checkpoint and the
target config; pick the family (`--arch`, else config `model_type` and key names; naming
schemes not converted yet, such as torchtitan's, are refused); resolve the training TP when
a fused TP-blocked tensor needs it; let the family express every HF tensor as rows of source
tensors; check the names against those transformers' model class for the config expects
(closed world: a name with no place, or a missing weight, is refused — `families.expected`); keep
the tensors `--include`/`--exclude` select; shard
them with huggingface_hub's planner; compute each safetensors header and the copy runs of
every record. `--dry-run` stops there and reports the plan (`preview_export`). Otherwise
the records are streamed into an atomic output directory, the index, config, generation
config and tokenizer files are written as `save_pretrained` writes them, and with
`--verify` every tensor is re-read, and the written names checked against the model's,
before the directory is put in place.
"""

from __future__ import annotations

import functools
import json
import math
import re
import threading
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from fnmatch import fnmatchcase
from fractions import Fraction
from pathlib import Path
from typing import Any, Container, Iterable, Iterator, Mapping, Sequence

from ckptctl.storage.atomic import check_destination, overlapped_input, recorded_reads
from ckptctl.engine import resolve_device
from ckptctl.engine.cpu import ChunkSource, assemble_bytes, equal_tensors
from ckptctl.engine.dist import LOCAL, Comm
from ckptctl.engine.output import write_output
from ckptctl.core.dtypes import DType, cast_dtype, float32
from ckptctl.util.errors import CheckpointError, IncompleteCheckpointError, UsageError
from ckptctl.formats.dcp.items import ItemReader
from ckptctl.formats.dcp.metadata import TORCH_DIST, open_checkpoint
from ckptctl.formats.safetensors.distributed import ShardFile, placed_shards, record_count, shard_records
from ckptctl.formats.safetensors.writer import (ITEM_BYTES, SafetensorsFile, file_records, item_boxes, placed_file,
                                                write_index)
from ckptctl.formats.safetensors.quantize_fp8 import (Fp8Codes, Fp8Scheme, Fp8Scales, band_rows, placed,
                                                      quantization_config, quantized_count, quantized_targets)
from ckptctl.core.geometry import Box, full_box, region_blocks, union_volume
from ckptctl.families.adapters import (PEFT_CONFIG, PEFT_PREFIX, Adapter, LoraScale, PeftAdapters,
                                      check_against_config, find_adapters, peft_config, read_adapter_config,
                                      resolve_scale)
from ckptctl.commands.automodel_peft import peft_source
from ckptctl.formats.automodel_peft import automodel_peft
from ckptctl.commands.bridge_merge import (BridgeAlpha, adapters_alone, bridge_adapter_tensors, bridge_lora,
                                           merge_bridge_adapters, refuse_unplaced_adapters, shaped_base, with_base)
from ckptctl.commands.hf_base import is_hf_folder, with_hf_base
from ckptctl.families.bridge_adapters import BridgeAdapter
from ckptctl.families.expert_lora import fuse_expert_adapters, is_per_expert, per_expert_stack
from ckptctl.families.experts import stacked_parts
from ckptctl.families.automodel import AUTOMODEL, native_expert_names
from ckptctl.families.base import (
    ARCHITECTURES, ExportContext, HFConfig, MegatronModel, TiedHead, generation_config, generative, is_model_key,
    load_hf_config, megatron_prefix,
)
from ckptctl.families.expected import (ExpectedNames, Preparing, asking_transformers, expected_names, shape_problem,
                                       shown, transformers_available)
from ckptctl.families.config_bounds import refuse_unbacked_counts
from ckptctl.storage.hf_files import MAX_COPIED_BYTES, copy_regular
from ckptctl.families.foreign import foreign_reason
from ckptctl.storage.hub import DEFAULT_HUB_TIMEOUT
from ckptctl.families.protocol import ModelFamily, Naming
from ckptctl.families.raw import RAW, raw_prefix
from ckptctl.families.torchtitan import EXPERT_BIASES, TORCHTITAN_FAMILIES, torchtitan_prefix
from ckptctl.formats.megatron_args import checkpoint_args
from ckptctl.families.registry import ARCHES, FAMILIES, family_for_model_type, fused_kind
from ckptctl.core.names import MODEL_PREFIXES
from ckptctl.megatron.tp import resolve_tp, tp_from_geometry
from ckptctl.core.checkpoint import Checkpoint, dtype_name
from ckptctl.util.wording import counted
from ckptctl.checks.distributed_output import check_distributed_safetensors
from ckptctl.checks.output_check import check_safetensors
from ckptctl.checks.verify import ReadBack, check_decoded_source, tensor_read_back, verify_safetensors_file
from ckptctl.util.progress import Phases, ProgressObserver, RunTiming, timed_check
from ckptctl.core.output_plan import OutputPlan
from ckptctl.core.plan import (CopyItem, LowRank, SourceTensor, StreamItem, TargetTensor, identity_target,
                               missing_elements, plan_box, whole_item)
from ckptctl.core.selection import refuse_empty_selection, selected
from ckptctl.commands.options import RunOptions
from ckptctl.storage.store import store_for

FILENAME_PATTERN = "model{suffix}.safetensors"
INDEX_NAME = "model.safetensors.index.json"
CONFIG_NAME = "config.json"
GENERATION_CONFIG_NAME = "generation_config.json"
PEFT_WEIGHTS = "adapter_model.safetensors"
LAYOUTS = ("hf", "distributed")
"""`--layout`: a model folder, or each rank's files as torch's `HuggingFaceStorageWriter(save_distributed=True)`
writes them from FSDP2 (`formats.safetensors.distributed`)."""
SKIPPED_PREFIXES = ("mtp.",)
"""Megatron model tensors with no place in the HF model classes (multi-token prediction heads)."""


@dataclass(kw_only=True)
class ExportOptions(RunOptions):
    """What export-hf writes, beyond the shared selection, cast and engine options (`include` and
    `exclude` are glob patterns over the HF tensor names). Keyword-only: `dtype`, third before it
    was shared, would otherwise take another field's place silently."""

    arch: str = "auto"
    tp: int | None = None
    max_shard_size: int | str = "5GB"
    """Bytes, or a size as transformers writes it (`5GB`, `500MiB`; see `parse_size`)."""
    name_check: bool = True
    """Check the output names against transformers' model for the config (`--no-name-check`: don't)."""
    drop_expert_bias: bool = False
    """Leave out torchtitan's load-balancing expert bias even when it is not zero (the HF model
    routes without one)."""
    drop_tied_head: bool = False
    """Leave out a trained output head the config ties to the embeddings even when it differs
    from them (the HF model's head is then the embeddings)."""
    hub_timeout: float = DEFAULT_HUB_TIMEOUT
    """Seconds a Hub id's config may take to download, connecting and reading (`--hub-timeout`)."""
    merge_adapters: bool = False
    """Write each LoRA-adapted weight merged: cast(W + (B @ A) · s), computed in float32."""
    adapter_only: bool = False
    """Write the LoRA adapters alone, as a PEFT folder (`adapter_config.json`, `adapter_model.safetensors`)."""
    lora_alpha: float | None = None
    rslora: bool = False
    """s = α / √r (rsLoRA) instead of α / r; with `lora_alpha`."""
    adapter_config: Path | None = None
    """The run's peft `adapter_config.json`: α, rsLoRA and r from it."""
    adapter_name: str | None = None
    """The peft adapter to export of a checkpoint holding several (None: its only one)."""
    base: Path | None = None
    """`--base`: the pretrained Megatron checkpoint a Megatron-Bridge LoRA save (adapters alone) was trained on."""
    layout: str = "hf"
    """`LAYOUTS`: `distributed` writes `world_size` ranks' shard files of each model file instead."""
    world_size: int | None = None
    quantize: Fp8Scheme | None = None
    """`--quantize`: the weights written as FP8 block-scaled codes and scales (`quantize_fp8`)."""


@dataclass
class ExportPlan:
    """Everything the export writes, decided before any data moves."""

    family: str
    prefix: str
    tp: int | None
    expert_tp: int | None
    targets: dict[str, TargetTensor]
    sources: dict[str, SourceTensor]
    files: list[SafetensorsFile]
    file_targets: dict[str, list[str]]
    weight_map: dict[str, str] | None
    config: dict[str, Any]
    ref_files: list[Path]
    notes: list[str] = field(default_factory=list)
    generation: dict[str, Any] | None = None
    """`generation_config.json` derived from the config; None when REF has one (copied) or the model cannot generate."""
    expected: ExpectedNames | None = None
    """The names transformers' model expects; None when not checked."""
    selected: bool = False
    """Whether `--include`/`--exclude` left tensors out (then the output is not the whole model)."""
    adapter_config: dict[str, Any] | None = None
    """`--adapter-only`: the PEFT folder's adapter_config.json, written instead of config.json."""
    shards: list[ShardFile] | None = None
    """`--layout distributed`: the ranks' files (`files` are theirs), each holding pieces of its targets."""
    quantize: Fp8Scheme | None = None

    @property
    def data_bytes(self) -> int:
        return sum(f.data_bytes for f in self.files)

    @property
    def total_size(self) -> int:
        return sum(t.nbytes for t in self.targets.values())

    @property
    def parameters(self) -> int:
        """Elements of the written tensors (the index's `total_parameters`)."""
        return sum(math.prod(t.shape) for t in self.targets.values())

    @property
    def file_of(self) -> dict[str, str]:
        """Each target's safetensors file name (with `shards`: the first that holds a piece of it)."""
        out: dict[str, str] = {}
        for f in self.files:
            for name in f.offsets:
                out.setdefault(name, f.name)
        return out

    def side_files(self) -> list[str]:
        """Names of everything written besides the safetensors files, sorted."""
        names = {PEFT_CONFIG if self.adapter_config is not None else CONFIG_NAME, *(p.name for p in self.ref_files)}
        if self.weight_map is not None:
            names.add(INDEX_NAME)
        if self.generation is not None:
            names.add(GENERATION_CONFIG_NAME)
        return sorted(names)

    def output_plan(self) -> OutputPlan:
        """The export as the engine writes it: each file's header, its tensors' row blocks (each
        checked whole as its runs are planned; in rank files, each piece's), then the index, config
        and side files."""
        if self.shards is not None:
            return OutputPlan({s.file.name: s.file.size for s in self.shards},
                              lambda names: (r for s in self.shards if s.file.name in names
                                             for r in shard_records(s, self.targets)),
                              record_count(self.shards, self.targets), self.sources,
                              [CopyItem("", 0, len(s.file.header), s.file.name, 0, s.file.header) for s in self.shards],
                              finish=functools.partial(write_side_files, self), whole_records=True)

        def records(names: Container[str]) -> Iterator[StreamItem]:
            for f in self.files:
                if f.name in names:
                    for target in (self.targets[n] for n in self.file_targets[f.name]):
                        if isinstance(target.properties, Fp8Codes):  # bands of whole block rows; scales with them
                            yield from file_records(f, [target], fp8_band_bytes(target))
                        elif isinstance(target.properties, Fp8Scales):
                            continue
                        elif target.delta is None:
                            yield from file_records(f, [target])
                        else:  # computed whole: one record
                            yield StreamItem(f.name, f.offsets[target.fqn], b"", target, full_box(target.shape), ())

        count = sum(1 if t.delta is not None else 0 if isinstance(t.properties, Fp8Scales) else
                    len(item_boxes(t.shape, t.dtype.itemsize, fp8_band_bytes(t))) for t in self.targets.values())
        headers = [CopyItem("", 0, len(f.header), f.name, 0, f.header) for f in self.files]
        return OutputPlan({f.name: f.size for f in self.files}, records, count, self.sources, headers,
                          finish=functools.partial(write_side_files, self), whole_records=True)


@dataclass
class ExportReport(RunTiming):
    """What a run did, for `--json` and the summary line."""

    src: str
    dst: str
    arch: str
    tp: int | None
    dtype: str
    tensors: int
    files: int
    bytes_written: int
    parameters: int = 0
    notes: list[str] = field(default_factory=list)
    quantization: dict[str, Any] | None = None
    """`--quantize`: the scheme, block, scale format, quantization_config and weights quantized."""


def choose_family(ckpt: Checkpoint, cfg: HFConfig, arch: str) -> tuple[ModelFamily, str]:
    """The family and model-key prefix for `--arch` (auto: config model_type, then key names)."""
    if arch not in ARCHES:
        raise UsageError(f"--arch must be one of {', '.join(ARCHES)} (got {arch!r})")
    titan = torchtitan_prefix(ckpt)
    if titan is not None and (arch == "auto" or FAMILIES[arch].naming is Naming.TORCHTITAN):
        family = FAMILIES[arch] if arch != "auto" else family_for_model_type(cfg.model_type, Naming.TORCHTITAN)
        if family is None:
            known = ", ".join(f"{t} ({f.name})" for f in TORCHTITAN_FAMILIES for t in f.model_types)
            raise UsageError(f"{cfg.path}: model_type {cfg.model_type!r} of a torchtitan checkpoint is not one "
                             f"export-hf converts yet (it converts torchtitan's {known})")
        return family, titan
    prefix = megatron_prefix(ckpt)
    if arch in ("raw", "automodel") or (arch == "auto" and prefix is None):
        stripped = raw_prefix(ckpt)
        names = [fqn[len(stripped):] for fqn in ckpt.tensors if is_model_key(fqn)]
        native = arch != "raw" and native_expert_names(names)
        reason = foreign_reason(names, native_converted=bool(native))
        if reason is not None:
            raise CheckpointError(ckpt.path, reason)
        return (AUTOMODEL if native or arch == "automodel" else RAW), stripped
    if prefix is None:
        shown = ", ".join(repr(p) for p in MODEL_PREFIXES)
        raise CheckpointError(ckpt.path, f"no Megatron model tensors (decoder.layers.*, embedding.word_embeddings.*) "
                                         f"under any prefix of {shown}; for HF-named checkpoints use --arch raw")
    if arch != "auto":
        return FAMILIES[arch], prefix
    family = family_for_model_type(cfg.model_type)
    if family is None and not cfg.model_type:
        names = [f[len(prefix):] for f in ckpt.tensors if f.startswith(prefix)]
        if any(".self_attention.in_proj." in n for n in names):
            family = FAMILIES["qwen3-next"]
        elif any(n.endswith(".mlp.router.weight") for n in names):
            family = FAMILIES["qwen3-moe"]
    if family is None:
        known = ", ".join(t for f in FAMILIES.values() if f.naming is Naming.MEGATRON for t in f.model_types)
        raise UsageError(f"{cfg.path}: model_type {cfg.model_type!r} is not one export-hf knows ({known}); "
                         f"pass --arch")
    return family, prefix


def resolve_tps(ckpt: Checkpoint, model: MegatronModel, given: int | None) -> tuple[int | None, int | None]:
    """The training TP (and expert TP) when some tensor is stored fused TP-blocked; (given, None) otherwise.

    Strict: RowParallel chunks not split on dim 1 say nothing (a checkpoint resharded to an
    FSDP2 layout shows them whatever TP it was trained at), so a wrong split is never guessed.
    """
    if given is not None and given < 1:
        raise UsageError(f"--tp must be at least 1 (got {given})")
    if not any(fused_kind(name) for name in model.entries):
        return given, None
    args = checkpoint_args(ckpt)
    tp = resolve_tp(ckpt, args, given, strict=True)
    if given is not None:
        evidence = {}
        if args is not None and getattr(args, "tensor_model_parallel_size", None) is not None:
            evidence["args"] = int(args.tensor_model_parallel_size)
        geometry = tp_from_geometry(ckpt)
        if geometry is not None and geometry > 1:  # unsplit RowParallel chunks say nothing (see above)
            evidence["RowParallel chunks"] = geometry
        if len(set(evidence.values())) == 1 and given not in evidence.values():
            raise UsageError(f"{ckpt.path}: --tp {given} but the checkpoint says TP {next(iter(evidence.values()))} "
                             f"({' and '.join(evidence)}); fused tensors would be split wrongly")
    etp = getattr(args, "expert_tensor_parallel_size", None) if args is not None else None
    return tp, int(etp) if etp else None


def output_config(cfg: HFConfig, dtype: DType | None) -> dict[str, Any]:
    """The REF config with its dtype fields set to the dtype the weights are written in, and
    `architectures` as save_pretrained writes it: REF's, else the transformers class of its
    model_type (left out for a model_type export-hf has no class for)."""
    data = dict(cfg.data)
    data.pop("quantization_config", None)  # the weights written are not REF's quantized ones (`--quantize` sets it)
    if dtype is not None:
        data["dtype"] = dtype_name(dtype)
        if "torch_dtype" in data:
            data["torch_dtype"] = dtype_name(dtype)
    if not data.get("architectures") and cfg.model_type in ARCHITECTURES:
        data["architectures"] = [ARCHITECTURES[cfg.model_type]]
    return data


def select(names: Iterable[str], include: Sequence[str], exclude: Sequence[str]) -> tuple[list[str], list[str]]:
    """The names `--include`/`--exclude` keep (all unless an include matches; minus any exclude
    match), and a note for each pattern that matches no name at all (a typo, most likely)."""
    names = list(names)
    kept = [n for n in names if selected(n, include, exclude)]
    notes = [f"{flag} {pattern!r} matches no tensor" for flag, patterns in (("--include", include),
                                                                           ("--exclude", exclude))
             for pattern in patterns if not any(fnmatchcase(n, pattern) for n in names)]
    refuse_empty_selection(len(kept), len(names), include, exclude, "tensors")
    return kept, notes




def plan_export(ckpt: Checkpoint, cfg: HFConfig, opts: ExportOptions, ref: str | Path | None = None,
                preparing: Preparing | None = None) -> ExportPlan:
    """Targets, shards, headers and the output config. Reads metadata (and `args`), and the data
    only of tensors left out on a condition: expert biases proven zero, tied heads proven equal
    to the embeddings. `ref` (the `--hf-config` given) is a PEFT folder's base model; the names
    are checked against transformers' model under `preparing` (`asking_transformers`)."""
    ranks = distributed_ranks(opts)
    family, prefix = choose_family(ckpt, cfg, opts.arch)
    model = MegatronModel(ckpt, prefix)
    if not model.entries and not model.layer_views:
        raise CheckpointError(ckpt.path, f"no model tensors under prefix {prefix!r}")
    raw = family.naming is Naming.HF
    shaped = None  # transformers' names, when a Bridge LoRA save is laid out by the config's shapes
    if not raw and opts.adapter_only and opts.base is None and adapters_alone(model):
        shaped = expected_for(cfg, raw, [], preparing) if opts.name_check else None
        if shaped is None:
            raise UsageError(f"{ckpt.path}: holds Megatron-Bridge LoRA adapters alone: --adapter-only lays them out "
                             "by the base model's shapes, known from transformers' model for the config; pass --base "
                             "(the pretrained checkpoint) where transformers or the name check is off")
        ckpt = shaped_base(ckpt, cfg, family, prefix, shaped.required | shaped.optional)
        model = MegatronModel(ckpt, prefix)
    if raw:
        tp, etp = opts.tp, None
    elif ckpt.megatron_backend == TORCH_DIST:
        tp, etp = 1, 1  # torch_dist saves fused tensors as the whole parts one after another: TP-blocked at 1
    else:
        tp, etp = resolve_tps(ckpt, model, opts.tp)
    lora = peft_adapters(ckpt, model, raw, opts) if raw else None
    if raw and opts.base is not None:
        raise UsageError(f"--base applies to Megatron-Bridge LoRA checkpoints, and {ckpt.path} is not one")
    bridge = None if raw else bridge_lora(ckpt, model, adapter_flags(opts), opts.lora_alpha, peft_flags(opts),
                                          str(opts.base) if opts.base is not None else None, opts.tp)
    if lora is not None and opts.adapter_only:
        return plan_adapter_folder(ckpt, cfg, opts, model, *lora, ref, preparing)
    if opts.name_check or not raw:  # a model or family rules are built of the config
        refuse_unbacked_counts(cfg.data, cfg.path, {n: e.shape for n, e in ckpt.tensors.items()}, ckpt.path,
                               "wrong --hf-config?")
    ctx = ExportContext(cfg, model, tp, etp)
    if opts.base is not None:
        how = f", a Hugging Face folder read through the {family.name} rules" if ckpt.dense_files else ""
        ctx.notes.append(f"base weights from {opts.base} (--base{how})")
    tensors = family.to_hf(ctx)
    if not raw:
        unused = [n for n in model.unused() if not n.startswith(SKIPPED_PREFIXES)]
        if bridge is not None:
            refuse_unplaced_adapters(model, bridge[0], unused, family.name)
        if unused:
            more = f" (+{len(unused) - 3} more)" if len(unused) > 3 else ""
            shown = ", ".join(prefix + n for n in unused[:3]) + more
            raise CheckpointError(ckpt.path, f"{len(unused)} model tensors have no place in a {family.name} model "
                                             f"of {cfg.path.name}: {shown} (wrong --hf-config or --arch?)")
        skipped = [n for n in model.unused() if n.startswith(SKIPPED_PREFIXES)]
        if skipped:
            ctx.notes.append(f"{counted(len(skipped), 'tensor')} under {prefix}mtp.* (multi-token prediction) "
                             "not exported")
    if ctx.tied_heads:
        ctx.notes.extend(left_out_tied_heads(ckpt, model, cfg, tensors, ctx.tied_heads, opts.drop_tied_head, None))
    if ctx.zero_only:
        ctx.notes.append(left_out_expert_bias(ckpt, model, ctx.zero_only, cfg, opts.drop_expert_bias))
    if not tensors:
        raise CheckpointError(ckpt.path, "nothing to export")
    expected = shaped
    if opts.name_check and shaped is None:
        expected = expected_for(cfg, raw, ctx.notes, preparing)
    else:
        ctx.notes.append("tensor names not checked (--no-name-check): the output may not load")
    mtp = family.mtp_prefixes(cfg)
    written = [n for n in tensors if mtp and n.startswith(mtp)]
    if written:
        ctx.notes.append(f"{counted(len(written), 'tensor')} of multi-token prediction written as "
                         f"{', '.join(p + '*' for p in mtp)} (transformers skips them on load; inference engines "
                         "read them)")
    if expected is not None and lora is not None:
        refuse_unknown_modules(ckpt, lora[0], expected.for_output(tensors))
    if expected is not None:
        expected = expected.allowing(mtp)
        ties = model_ties(tensors, expected)
        if ties:
            ctx.notes.extend(left_out_tied_heads(ckpt, model, cfg, tensors, ties, opts.drop_tied_head, expected))
        tensors = check_names(ckpt, tensors, expected, megatron_prefix(ckpt) is not None)
    if lora is not None:
        refuse_dropped_adapters(ckpt, prefix, lora[0], tensors)
    selected = False
    if opts.include or opts.exclude:
        kept, notes = select(sorted(tensors), opts.include, opts.exclude)
        ctx.notes.extend(notes)
        if len(kept) < len(tensors):
            ctx.notes.append(f"{len(kept)} of {len(tensors)} tensors selected by --include/--exclude")
            selected = True
        tensors = {name: tensors[name] for name in kept}
    used_fqns = {fqn for t in tensors.values() for fqn in t.sources}
    sources = {fqn: model.source_view(fqn) for fqn in used_fqns}
    targets = {name: t.target(cast_dtype(ckpt.tensors[t.sources[0]].dtype, opts.dtype)) for name, t in tensors.items()}
    if expected is not None:
        check_shapes(ckpt, cfg, expected.for_output(targets), targets, tensors, prefix)
    if bridge is not None and opts.adapter_only:  # the base is not written (nor read: `shaped_base`)
        return plan_bridge_adapter_folder(ckpt, cfg, opts, model, targets, *bridge, ref,
                                          shaped is not None, expected.in_memory if expected is not None else None)
    check_coverage(ckpt, targets.values(), sources)
    if lora is not None:
        ctx.notes.append(merge_adapters(ckpt, model, targets, sources, *lora, expected))
    if bridge is not None:
        ctx.notes.append(merge_bridge_adapters(model, targets, *bridge, selected))
    floating = Counter()
    for t in targets.values():
        if t.dtype.is_floating_point:
            floating[t.dtype] += t.nbytes
    out_dtype = opts.dtype or (floating.most_common(1)[0][0] if floating else None)
    if opts.quantize is not None:
        targets = quantized_targets(targets, opts.quantize, ckpt.path, selected)
        ctx.notes.append(f"{counted(quantized_count(targets), 'weight')} written as {opts.quantize.describe()}, "
                         "each with its weight_scale_inv; the others as they are")
        from_te = te_float8_weights(ckpt, targets) if opts.quantize.quantized is None else 0
        if from_te:
            ctx.notes.append(f"{counted(from_te, 'weight')} from Transformer Engine Float8Tensor items: a block whose "
                             "rows share one scale_inv that codes TE's values exactly keeps that scale and those "
                             "values (e4m3: TE's codes, bit for bit); any other is quantized from the values")
    split = shard(targets, parse_size(opts.max_shard_size))
    file_names = {name: with_scales(names, targets) for name, names in split.filename_to_tensors.items()}
    files = [placed_file(name, [targets[n] for n in names]) for name, names in file_names.items()]
    for f in files:
        placed(targets, f.offsets)
    shards = None
    if ranks is not None:  # each rank's pieces of each model file
        shards = placed_shards([[targets[n] for n in names] for names in split.filename_to_tensors.values()], ranks)
        files = [s.file for s in shards]
    config = output_config(cfg, out_dtype)
    if opts.quantize is not None:
        config["quantization_config"] = quantization_config(opts.quantize, targets)
    ref_files = cfg.ref_files()
    for path in ref_files:  # a FIFO, device or giant file is refused now, not after the weights are written
        store_for(path).open_read(path, MAX_COPIED_BYTES).close()
    copied = {p.name for p in ref_files}
    derive = generative(config.get("architectures") or ()) and GENERATION_CONFIG_NAME not in copied
    return ExportPlan(
        family=family.name, prefix=prefix, tp=tp, expert_tp=etp, targets=targets, sources=sources, files=files,
        file_targets={f.name: list(f.offsets) for f in files},
        weight_map={n: name for name, names in file_names.items() for n in names}
        if split.is_sharded and shards is None else None,
        config=config, ref_files=ref_files, notes=ctx.notes,
        generation=generation_config(config) if derive else None, expected=expected, selected=selected, shards=shards,
        quantize=opts.quantize,
    )


def distributed_ranks(opts: ExportOptions) -> int | None:
    """The ranks of `--layout distributed` (None for a model folder); `--layout` and `--world-size`
    values, and options, that cannot go together are refused."""
    if opts.layout not in LAYOUTS:
        raise UsageError(f"--layout must be one of {', '.join(LAYOUTS)} (got {opts.layout!r})")
    if opts.quantize is not None:
        other = next((flag for flag, on in (("--layout distributed", opts.layout == "distributed"),
                                            ("--adapter-only", opts.adapter_only),
                                            ("--merge-adapters", opts.merge_adapters)) if on), None)
        if other is not None:
            raise UsageError(f"--quantize writes a model folder of FP8 weights, not with {other}")
    if opts.layout != "distributed":
        if opts.world_size is not None:
            raise UsageError("--world-size applies to --layout distributed only (a model folder is not split by rank)")
        return None
    if opts.world_size is None:
        raise UsageError("--layout distributed needs --world-size (the number of ranks whose shard files are written)")
    if opts.world_size < 1:
        raise UsageError(f"--world-size must be at least 1 (got {opts.world_size})")
    if opts.adapter_only:
        raise UsageError("--adapter-only writes a PEFT adapter folder, which has no --layout distributed")
    if opts.merge_adapters:
        raise UsageError("--merge-adapters computes each merged weight whole, not a rank's rows of it: "
                         "export merged with --layout hf")
    return opts.world_size


def adapter_flags(opts: ExportOptions) -> list[str]:
    """The adapter flags given, as the user spelled them; both at once refused."""
    flags = [flag for flag, on in (("--merge-adapters", opts.merge_adapters), ("--adapter-only", opts.adapter_only))
             if on]
    if len(flags) == 2:
        raise UsageError("--merge-adapters and --adapter-only exclude each other: pass one")
    return flags


def peft_flags(opts: ExportOptions) -> list[str]:
    """The flags given that only a peft checkpoint's adapters take."""
    return [flag for flag, on in (("--rslora", opts.rslora), ("--adapter-config", opts.adapter_config is not None),
                                  ("--adapter-name", opts.adapter_name is not None)) if on]


def peft_adapters(ckpt: Checkpoint, model: MegatronModel, raw: bool, opts: ExportOptions
                  ) -> tuple[PeftAdapters, LoraScale] | None:
    """The checkpoint's peft LoRA adapters and their scale, or None without adapters. The model
    is left seeing the HF names (`<m>.base_layer.weight` as `<m>.weight`) and no adapter tensor.
    Adapters without `--merge-adapters` or `--adapter-only` are refused (the closed world: the
    model alone is not what was trained), as are those flags without adapters."""
    flags = adapter_flags(opts)
    peft = raw and model.prefix.endswith(PEFT_PREFIX)  # a PeftModel's state dict: other names are not peft's
    found = find_adapters({n: e.shape for n, e in model.entries.items()}, ckpt.path, model.prefix,
                          opts.adapter_name) if peft else None
    if found is None:
        if flags:
            raise UsageError(f"{ckpt.path}: {flags[0]}, but the checkpoint holds no peft LoRA adapter")
        given = [flag for flag, on in (("--lora-alpha", opts.lora_alpha is not None), ("--rslora", opts.rslora),
                                       ("--adapter-config", opts.adapter_config is not None),
                                       ("--adapter-name", opts.adapter_name is not None)) if on]
        if given:
            raise UsageError(f"{given[0]} applies to LoRA adapters only, and {ckpt.path} holds none")
        return None
    if not flags:
        raise CheckpointError(ckpt.path, f"holds {counted(len(found.adapters), 'peft LoRA adapter')} (rank "
                                         f"{', '.join(map(str, found.ranks))} on "
                                         f"{', '.join(found.targets + found.parameters)}): pass "
                                         "--merge-adapters to export the model with them merged, or --adapter-only "
                                         "to export them as a PEFT adapter folder")
    unfit = sorted(n for n in found.tensors if not model.entries[n].dtype.is_floating_point)
    if unfit:
        raise CheckpointError(ckpt.path, f"{model.prefix}{unfit[0]}: {model.entries[unfit[0]].dtype.name} is no "
                                         "LoRA factor's dtype (peft's factors are floating point)")
    config = read_adapter_config(opts.adapter_config) if opts.adapter_config is not None else None
    scale = resolve_scale(opts.lora_alpha, opts.rslora, config, ckpt.path)
    check_against_config(found, scale, ckpt.path, model.prefix)
    for old, new in found.renamed.items():
        if new in model.entries:
            raise CheckpointError(ckpt.path, f"holds both {model.prefix}{old} and {model.prefix}{new}: which one is "
                                             f"the weight of {new} is not guessed")
        model.entries[new] = model.entries.pop(old)
    for name in (*found.tensors, *found.originals, *found.others):  # operands or PEFT tensors, never HF ones
        del model.entries[name]
    return found, scale


def refuse_unknown_modules(ckpt: Checkpoint, adapters: PeftAdapters, expected: ExpectedNames) -> None:
    """Refuse an adapter on a module whose weight transformers' model has no place for."""
    unknown = expected.unclaimed(a.weight for a in adapters.adapters  # a stack over a base of per-expert tensors
                                 if not (a.experts and a.weight in expected.in_memory))
    if unknown:
        more = f" (+{len(unknown) - 1} more)" if len(unknown) > 1 else ""
        raise CheckpointError(ckpt.path, f"a LoRA adapter on {unknown[0].removesuffix('.weight')}{more}, which a "
                                         f"{expected.model_class} has no weight for (wrong --hf-config?)")


def refuse_dropped_adapters(ckpt: Checkpoint, prefix: str, adapters: PeftAdapters, tensors: Container[str]) -> None:
    """Refuse an adapter on a weight the export leaves out (a head the config ties to the
    embeddings, proven equal to them without its adapter): it would be lost without a word."""
    dropped = [a for a in adapters.adapters if a.weight not in tensors
               and not (a.experts and stacked_parts(a.weight, set(tensors)))]
    if dropped:
        raise CheckpointError(ckpt.path, f"{prefix}{dropped[0].a}: a LoRA adapter on {dropped[0].module}, whose weight "
                                         "the export leaves out (the config ties it to another tensor): merged, "
                                         "the two would differ")


def adapter_operand(model: MegatronModel, name: str) -> tuple[TargetTensor, SourceTensor]:
    """An adapter tensor, whole, as a float32 operand, and the source view it reads."""
    view = model.source_view(model.prefix + name)
    return identity_target(view, dtype=float32), view


def merge_adapters(ckpt: Checkpoint, model: MegatronModel, targets: dict[str, TargetTensor],
                   sources: Mapping[str, SourceTensor], adapters: PeftAdapters, scale: LoraScale,
                   expected: ExpectedNames | None = None) -> str:
    """Give each adapted weight the `delta` that merges its adapter (its W, A and B planned whole;
    a weight `--include`/`--exclude` left out needs none); the note that says so. An expert
    stack's orientation is its adapter's shapes', checked against transformers' model
    (`expected`), which alone tells it for square matrices."""
    merged = 0
    per_expert = {n: (e.fqn, e.shape) for n, e in model.entries.items() if is_per_expert(n)}
    for adapter in adapters.adapters:
        target = targets.get(adapter.weight)
        stack = None if target is not None or not adapter.experts else \
            per_expert_stack(adapter.weight, per_expert, targets)
        if target is None and stack is None:
            continue
        names = (adapter.a, adapter.b) + ((adapter.magnitude,) if adapter.magnitude is not None else ())
        operands = [adapter_operand(model, n) for n in names]
        views = {view.fqn: view for _, view in operands}
        check_coverage(ckpt, [t for t, _ in operands], views)
        a, b, *magnitude = (whole_item(t, views) for t, _ in operands)
        transposed = adapter.embedding or expert_orientation(ckpt, model.prefix, adapter, expected)
        s = scale.scale(adapter.rank)
        if stack is not None:  # the base's experts one by one: peft's merge of the stack, each expert's block of it
            if transposed:
                raise CheckpointError(ckpt.path, f"{model.prefix}{adapter.a}: a LoRA on {adapter.weight}, held as "
                                                 "[E, in, out], whose base holds its experts one by one: export-hf "
                                                 "does not merge such a stack expert by expert yet")
            shape, pieces, blocks = stack
            views.update((p.src, model.source_view(p.src)) for p in pieces)
            w = whole_item(TargetTensor(adapter.weight, shape, float32, pieces), views)
            for name, taken in blocks.items():
                targets[name] = replace(targets[name], delta=LowRank(w, a, b, s, experts=adapter.experts,
                                                                     blocks=taken))
            merged += len(blocks)
            continue
        base = TargetTensor(target.fqn, target.shape, float32, target.pieces)
        delta = LowRank(whole_item(base, sources), a, b, s, *magnitude, transposed=transposed,
                        experts=adapter.experts)
        targets[adapter.weight] = replace(target, delta=delta)
        merged += 1
    how = "α / √r" if scale.rslora else "α / r"
    formula = "m / ‖W + (B @ A) · s‖ per row × (W + (B @ A) · s)" if adapters.dora else "W + (B @ A) · s"
    if any(a.experts for a in adapters.adapters):
        formula += " (expert by expert in a stack, as peft's ParamWrapper)"
    return (f"{counted(merged, 'weight')} merged with {adapters.adapter_name!r} {'DoRA' if adapters.dora else 'LoRA'} "
            f"adapters (s = {how}, α {scale.alpha:g} from {scale.source}): {formula} in float32, cast once; in bf16 "
            f"this equals peft's float32 merge_and_unload() cast to bf16{left_out_adapters(adapters)}")


def expert_orientation(ckpt: Checkpoint, prefix: str, adapter: Adapter, expected: ExpectedNames | None) -> bool:
    """Whether an expert stack holds each expert as [in, out] (transformers' `is_transposed`), which
    the LoRA merges by, as peft since 0.19.1 does: its adapter's shapes say it unless its
    matrices are square, transformers' model always; the two must agree (peft before 0.19.1
    shaped a LoRA on a stack of [E, out, in] as on [E, in, out], huggingface/peft#3165: this peft
    does not load such a LoRA), and a square stack without transformers' answer is refused."""
    said = expected is not None and adapter.weight in expected.transposed
    if not adapter.experts:
        return False
    if adapter.transposed is None and expected is None:
        raise CheckpointError(ckpt.path, f"{prefix}{adapter.a}: a LoRA on {adapter.weight}, whose experts' matrices "
                                         "are square: whether it holds them as [out, in] or [in, out] is transformers' "
                                         "experts class's (is_transposed), which --no-name-check does not ask")
    if adapter.transposed is not None and expected is not None and said != adapter.transposed:
        held = "in, out" if adapter.transposed else "out, in"
        raise CheckpointError(ckpt.path, f"{prefix}{adapter.a}: shaped for {adapter.weight} held as [E, {held}], but "
                                         f"a {expected.model_class} holds it the other way (a LoRA of peft before "
                                         "0.19.1, huggingface/peft#3165, or a wrong --hf-config?)")
    return said if adapter.transposed is None else adapter.transposed


def left_out_adapters(adapters: PeftAdapters) -> str:
    """`; adapter 'b' left out` when the checkpoint holds adapters other than the one exported."""
    if not adapters.left_out:
        return ""
    return f"; {'adapter' if len(adapters.left_out) == 1 else 'adapters'} {', '.join(map(repr, adapters.left_out))} " \
           "left out"


def plan_adapter_folder(ckpt: Checkpoint, cfg: HFConfig, opts: ExportOptions, model: MegatronModel,
                        adapters: PeftAdapters, scale: LoraScale, ref: str | Path | None,
                        preparing: Preparing | None = None) -> ExportPlan:
    """`--adapter-only`: A and B (and DoRA's magnitude) of every adapter, and the trained copies of
    `modules_to_save` modules, under PEFT's names, copied (cast with `--dtype`), in one
    `adapter_model.safetensors`, and the adapter_config.json PEFT loads them with; each adapted
    module is first checked to be one transformers' model has."""
    if opts.include or opts.exclude:
        raise UsageError("--include/--exclude do not apply to --adapter-only (a PEFT folder holds every adapter)")
    notes: list[str] = []
    if opts.name_check:
        expected = expected_for(cfg, True, notes, preparing)
        if expected is not None:
            refuse_unknown_modules(ckpt, adapters, expected.for_output(model.entries))
            for adapter in adapters.adapters:  # shaped as this peft shapes them, or it would not load them
                expert_orientation(ckpt, model.prefix, adapter, expected)
    else:
        notes.append("adapted modules not checked (--no-name-check): the folder may not load")
    targets: dict[str, TargetTensor] = {}
    sources: dict[str, SourceTensor] = {}
    for adapter in adapters.adapters:
        a, b = ("lora_embedding_A", "lora_embedding_B") if adapter.embedding else ("lora_A.weight", "lora_B.weight")
        for name, part in ((adapter.a, a), (adapter.b, b), (adapter.magnitude, "lora_magnitude_vector")):
            if name is None:
                continue
            view = model.source_view(model.prefix + name)
            sources[view.fqn] = view
            out = f"{PEFT_PREFIX}{adapter.wrapped}.{part}"
            targets[out] = identity_target(view, out, cast_dtype(view.dtype, opts.dtype))
    for name, copy in adapters.trained_copies.items():  # modules_to_save: under the module's own names
        view = model.source_view(model.prefix + copy)
        sources[view.fqn] = view
        targets[PEFT_PREFIX + name] = identity_target(view, PEFT_PREFIX + name, cast_dtype(view.dtype, opts.dtype))
    check_coverage(ckpt, targets.values(), sources)
    modules = [name.removesuffix(".weight") for name in model.entries if name.endswith(".weight")]
    config = peft_config(adapters, scale, modules, str(ref) if ref is not None else None, _peft_task_type(cfg),
                         model.entries)
    notes.append(f"{counted(len(adapters.adapters), 'LoRA adapter')} ({adapters.adapter_name!r}) written as a PEFT "
                 f"folder: load it with PeftModel.from_pretrained(base model, folder){left_out_adapters(adapters)}")
    return _peft_folder_plan(model.prefix, targets, sources, notes, config)


def _peft_task_type(cfg: HFConfig) -> str | None:
    """adapter_config.json's `task_type`: CAUSAL_LM for a generative model, else none."""
    return "CAUSAL_LM" if generative(output_config(cfg, None).get("architectures") or ()) else None


def _peft_folder_plan(prefix: str, targets: dict[str, TargetTensor], sources: dict[str, SourceTensor],
                      notes: list[str], config: dict[str, Any]) -> ExportPlan:
    """The plan of a PEFT folder: every tensor in `adapter_model.safetensors`, `config` as its
    adapter_config.json."""
    files = [placed_file(PEFT_WEIGHTS, list(targets.values()))]
    return ExportPlan(
        family="peft-lora", prefix=prefix, tp=None, expert_tp=None, targets=targets, sources=sources,
        files=files, file_targets={f.name: list(f.offsets) for f in files}, weight_map=None, config={},
        ref_files=[], notes=notes, adapter_config=config,
    )


def plan_bridge_adapter_folder(ckpt: Checkpoint, cfg: HFConfig, opts: ExportOptions, model: MegatronModel,
                               targets: Mapping[str, TargetTensor], adapters: Sequence[BridgeAdapter],
                               alpha: BridgeAlpha, tp: int | None, ref: str | Path | None,
                               shaped: bool = False, in_memory: frozenset[str] | None = None) -> ExportPlan:
    """`--adapter-only` of Megatron-Bridge adapters: a PEFT folder whose modules are the HF
    tensors the adapted Megatron weights make (`targets`, the family rule's, names checked),
    each with the shared A and its rows of B, copied; α / r is Bridge's α / dim. Experts' as
    `target_parameters` where transformers holds them fused (`in_memory`: its in-memory names,
    `ExpectedNames.in_memory`; None where the names are not checked)."""
    if opts.include or opts.exclude:
        raise UsageError("--include/--exclude do not apply to --adapter-only (a PEFT folder holds every adapter)")
    sources: dict[str, SourceTensor] = {}
    tensors, peft = bridge_adapter_tensors(model, targets, adapters, tp, opts.dtype, sources)
    tensors, written = fuse_expert_adapters(tensors, peft, targets, in_memory, str(ckpt.path))
    check_coverage(ckpt, tensors.values(), sources)
    found = PeftAdapters(tuple(written), "default", {})
    config = peft_config(found, LoraScale(alpha.value, False),
                         [n.removesuffix(".weight") for n in targets if not is_per_expert(n)],
                         str(ref) if ref is not None else None, _peft_task_type(cfg), in_memory or ())
    on_parameters = sum(a.parameter is not None for a in written)
    modules = counted(len(written) - on_parameters, "PEFT LoRA module")
    if on_parameters:
        modules += f" and {counted(on_parameters, 'expert parameter')}"
    canonical = "; canonical LoRA's with their own" if any(a.split is not None for a in adapters) else ""
    experts = (f"; the experts' as PEFT's target_parameters {', '.join(config['target_parameters'])} of transformers "
               "5's fused experts" if on_parameters else "")
    notes = [f"{counted(len(adapters), 'Megatron-Bridge LoRA adapter')} written as {modules} (each with the shared "
             f"linear_in as lora_A and its rows of linear_out as lora_B{canonical}{experts}; α {alpha.value:g} from "
             f"{alpha.source}): load it with PeftModel.from_pretrained(base model, folder)"]
    if shaped:
        notes.append(f"the adapters alone in {ckpt.path}: laid out by the base model's shapes for {cfg.path} "
                     f"(transformers' {cfg.model_type} model), no base weight read")
    return _peft_folder_plan(model.prefix, tensors, sources, notes, config)


def te_float8_weights(ckpt: Checkpoint, targets: Mapping[str, TargetTensor]) -> int:
    """How many quantized weights read a TE Float8Tensor (their blocks may keep its scale: `engine.cpu.te_scales`)."""
    with ItemReader(ckpt) as reader:
        return sum(any(reader.holds_float8(ckpt.tensors[p.src]) for p in t.pieces if p.src in ckpt.tensors)
                   for t in targets.values() if isinstance(t.properties, Fp8Codes))


def left_out_expert_bias(ckpt: Checkpoint, model: MegatronModel, fqns: Sequence[str], cfg: HFConfig,
                         drop: bool) -> str:
    """The note for the expert biases a family leaves out (`ExportContext.zero_only`), once they
    are proven all zero (read whole: E values per layer), or dropped on purpose."""
    what = f"{len(fqns)} torchtitan expert biases ({model.prefix}{EXPERT_BIASES})"
    if drop:
        return f"{what} dropped (--drop-expert-bias): the export routes without them"
    chunks = ChunkSource(ckpt)
    chunks.reader.dequantize_fp8 = True  # a TE Float8Tensor item: its value, as TE dequantizes it
    try:
        nonzero = [fqn for fqn in fqns if not all_zero(chunks, model.source_view(fqn))]
    finally:
        chunks.close()
    if nonzero:
        more = f" (and {len(nonzero) - 1} more)" if len(nonzero) > 1 else ""
        raise CheckpointError(ckpt.path, f"{nonzero[0]} is not zero{more}: torchtitan's load-balancing expert bias "
                                         f"moves tokens to other experts, and {cfg.model_type} routes without one, so "
                                         "the export would route differently; pass --drop-expert-bias to export "
                                         "without it, as torchtitan's own adapter does")
    return f"{what} not exported: all zero, and {cfg.model_type} routes without one"


def all_zero(chunks: ChunkSource, view: SourceTensor) -> bool:
    """Whether every element of a small source tensor is zero (+0 or -0), read whole; elements no
    chunk holds are refused, never taken for zeros."""
    target = identity_target(view)
    box = full_box(view.shape)
    reads = plan_box(target, box, {view.fqn: view})
    if missing_elements(box, reads):
        raise CheckpointError(view.fqn, "has elements no saved chunk holds: cannot tell whether it is zero")
    data = assemble_bytes(StreamItem("", 0, b"", target, box, reads), chunks)
    if view.dtype.is_floating_point:  # clear each little-endian element's sign bit: -0.0 is zero
        for at in range(view.dtype.itemsize - 1, len(data), view.dtype.itemsize):
            data[at] &= 0x7F
    return not any(data)


COMPARED_BYTES = 16 << 20
"""Bytes of each tensor held at once while two are compared (`equal_tensors`)."""


def model_ties(tensors: dict[str, Any], expected: ExpectedNames) -> list[TiedHead]:
    """The tensors transformers' model class ties to another one the output also holds, taken out
    of `tensors` (`left_out_tied_heads` proves each equal to its source, or refuses)."""
    ties = []
    for name, source in sorted(expected.for_output(tensors).tied.items()):
        if name in tensors and source in tensors:
            ties.append(TiedHead(tensors.pop(name), source, None))
    return ties


def left_out_tied_heads(ckpt: Checkpoint, model: MegatronModel, cfg: HFConfig, tensors: Mapping[str, Any],
                        heads: Sequence[TiedHead], drop: bool, expected: ExpectedNames | None) -> list[str]:
    """The notes for the trained heads a tying config leaves out (`ExportContext.tied_heads`), once
    each is proven equal, bit for bit, to the tensor it is tied to (read block by block), or
    dropped on purpose (`--drop-tied-head`). A head that differs is refused: the HF model's head
    would be the embeddings, not the one trained."""
    def named(hf: Any) -> str:
        return ", ".join(hf.sources)

    if drop:
        return [f"{named(t.head)} not exported (--drop-tied-head): the config ties it to {named(tensors[t.tied_to])}"
                for t in heads if t.tied_to in tensors]
    notes = []
    chunks = ChunkSource(ckpt)
    chunks.reader.dequantize_fp8 = True  # a TE Float8Tensor item: its value, as TE dequantizes it
    try:
        for tie in heads:
            if tie.tied_to not in tensors:  # the family refuses or the name check reports it missing
                continue
            head, source = tie.head, tensors[tie.tied_to]
            a, b = (t.target(ckpt.tensors[t.sources[0]].dtype) for t in (head, source))
            views = {fqn: model.source_view(fqn) for fqn in (*head.sources, *source.sources)}
            how = ("" if a.shape == b.shape and a.dtype == b.dtype else
                   f" (shape {list(a.shape)}, not {list(b.shape)})" if a.shape != b.shape else
                   f" (dtype {dtype_name(a.dtype)}, not {dtype_name(b.dtype)})")
            if how or not equal_tensors(chunks, a, b, views, COMPARED_BYTES):
                if tie.key is None:
                    why = f"a {expected.model_class if expected else 'model'} of {cfg.path} ties them"
                elif tie.key in cfg.data:
                    why = f"{cfg.path} has {tie.key}={json.dumps(cfg.data[tie.key])}"
                else:
                    why = f"{cfg.path} ties them ({tie.key} is true by default)"
                raise CheckpointError(ckpt.path, f"{named(head)} differs from {named(source)}{how}, but {why} (pass "
                                                 "--drop-tied-head to drop the trained head on purpose)")
            notes.append(f"{named(head)} not exported: the config ties it to {named(source)}, which it equals")
    finally:
        chunks.close()
    return notes


def check_shapes(ckpt: Checkpoint, cfg: HFConfig, expected: ExpectedNames, targets: Mapping[str, TargetTensor],
                 tensors: Mapping[str, Any], prefix: str) -> None:
    """Refuse an output tensor whose shape is not the one transformers' model for the config has
    (a checkpoint of 130 vocab rows under `vocab_size` 128: the folder would not load), naming the
    source tensor, its shape and the config keys of the sizes it lacks."""
    wrong = expected.misshapen({name: t.shape for name, t in targets.items()})
    if not wrong:
        return
    name, got, want = wrong[0]
    sources = tensors[name].sources
    what = sources[0] if tuple(sources) == (prefix + name,) else f"{name} (from {', '.join(sources)})"
    more = f"+{counted(len(wrong) - 1, 'more tensor')}; " if len(wrong) > 1 else ""
    raise CheckpointError(ckpt.path, shape_problem(what, got, want, expected.model_class, cfg.path, cfg.data)
                          + f" ({more}wrong --hf-config?)")


def expected_for(cfg: HFConfig, raw: bool, notes: list[str], preparing: Preparing | None = None
                 ) -> ExpectedNames | None:
    """The names transformers' model for the output config expects. Without transformers, None and
    a note for a family (its names come from ckptctl's own tables); `--arch raw` is refused
    (nothing else vouches for its names)."""
    if not transformers_available():
        if raw:
            raise UsageError("--arch raw checks the tensor names against transformers' model for the config, and "
                             "transformers is not installed (pip install transformers; or --no-name-check to write "
                             "them unchecked)")
        notes.append("tensor names not checked against transformers' model (transformers is not installed)")
        return None
    return expected_names(output_config(cfg, None), asking_transformers(preparing, "tensor names"))


def check_names(ckpt: Checkpoint, tensors: dict[str, Any], expected: ExpectedNames, megatron: bool
                ) -> dict[str, Any]:
    """Refuse an output with a name the model has no place for or without a weight it needs (tied
    parameters whose source is written were left out before: `model_ties`)."""
    out = dict(tensors)
    expected = expected.for_output(out)
    cls = expected.model_class
    unclaimed = expected.unclaimed(out)
    if unclaimed:
        hint = ("Megatron names: export with --arch auto or the model's family" if megatron
                else "wrong --hf-config or --arch?")
        verb = "has" if len(unclaimed) == 1 else "have"
        raise CheckpointError(ckpt.path, f"{counted(len(unclaimed), 'tensor')} {verb} no place in a {cls}: "
                                         f"{shown(unclaimed)} ({hint})")
    missing = expected.missing(out)
    if missing:
        verb = "is" if len(missing) == 1 else "are"
        raise CheckpointError(ckpt.path, f"{counted(len(missing), 'weight')} a {cls} expects {verb} missing: "
                                         f"{shown(missing)} (an incomplete checkpoint, or the wrong --hf-config?)")
    return out


def check_written_names(plan: ExportPlan, out: Path, preparing: Preparing | None = None) -> None:
    """`--verify`: the tensor names in the written files, read back from their headers, are the
    planned ones and, against transformers' model for the written config.json, leave nothing
    out and have nothing extra (only what --include/--exclude left out may be missing)."""
    from safetensors import safe_open

    held: list[str] = []
    for f in plan.files:
        with safe_open(str(out / f.name), framework="pt") as handle:
            held.extend(handle.keys())
    if sorted(held) != sorted(n for f in plan.files for n in plan.file_targets[f.name]):
        raise CheckpointError(out, "verification failed: the written tensor names are not the planned ones")
    scales = {n for n, t in plan.targets.items() if isinstance(t.properties, Fp8Scales)}  # no model parameter
    names = sorted(set(held) - scales)  # rank files: each a rank's piece of the tensors it names
    if plan.expected is None:
        return
    asking = asking_transformers(preparing, "the written names")
    with store_for(out).open_read(out / CONFIG_NAME) as written:
        config = json.loads(written.read_at(written.size, 0))
    expected = expected_names(config, asking).allowing(plan.expected.beyond)
    expected = expected.for_output(names)
    unclaimed = expected.unclaimed(names)
    if unclaimed:
        raise CheckpointError(out, f"verification failed: a {expected.model_class} has no place for "
                                   f"{shown(unclaimed)}")
    missing = [] if plan.selected else expected.missing(names)
    if missing:
        raise CheckpointError(out, f"verification failed: a {expected.model_class} expects {shown(missing)}, "
                                   f"not written")


def check_coverage(ckpt: Checkpoint, targets: Iterable[TargetTensor], sources: Mapping[str, SourceTensor]) -> None:
    """Refuse, before anything is written, a target whose source rows are not all in saved chunks,
    or whose source the per-rank metadata files disagree about."""
    problems = []
    for target in targets:
        for piece in target.pieces:
            if piece.src in ckpt.rank_conflicts and ckpt.rank_conflicts[piece.src] not in problems:
                problems.append(ckpt.rank_conflicts[piece.src])
            want, view = piece.source_box, sources[piece.src]
            parts = [part for _, region in view.chunks for block in region_blocks(region, view.shape)
                     if (part := block.intersect(want)) is not None]
            missing = want.numel - union_volume(parts)
            if missing:
                problems.append(f"{target.fqn}: {missing} elements of {piece.src} rows {want.offsets[0]}.."
                                f"{want.ends[0]} are in no saved chunk")
    if problems:
        raise IncompleteCheckpointError(ckpt.path, problems)


def shard(targets: dict[str, TargetTensor], max_shard_size: int):
    """huggingface_hub's own shard planner over the targets' byte sizes; a quantized weight's scale
    is counted with it, and planned nowhere (`with_scales` puts it in the weight's file)."""
    from huggingface_hub import split_state_dict_into_shards_factory

    def size(t: TargetTensor) -> int:
        return t.nbytes + (targets[t.properties.scale].nbytes if isinstance(t.properties, Fp8Codes) else 0)

    return split_state_dict_into_shards_factory(
        {n: t for n, t in targets.items() if not isinstance(t.properties, Fp8Scales)}, get_storage_size=size,
        filename_pattern=FILENAME_PATTERN, max_shard_size=max_shard_size)


def with_scales(names: Iterable[str], targets: Mapping[str, TargetTensor]) -> list[str]:
    """A file's tensor names with each quantized weight's scale added: its records write both."""
    out = []
    for name in names:
        out.append(name)
        if isinstance(targets[name].properties, Fp8Codes):
            out.append(targets[name].properties.scale)
    return out


def fp8_band_bytes(target: TargetTensor) -> int:
    """A record's bytes for `item_boxes`: whole block rows for a quantized weight's codes."""
    if not isinstance(target.properties, Fp8Codes) or len(target.shape) != 2:
        return ITEM_BYTES
    return band_rows(*target.shape, target.properties.block[0]) * target.shape[1]


_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*(?:([kKmMgGtT])(?:([iI][bB])|([bB])))?\s*")
_POWERS = {"k": 1, "m": 2, "g": 3, "t": 4}
SIZE_EXAMPLES = "5GB, 500MB, 5GiB, 500MiB, 1.5GB or bytes; Gb, Mb, Kb are bits"


def parse_size(value: int | str, option: str = "--max-shard-size") -> int:
    """Bytes from a size as transformers' `convert_file_size_to_int` reads it: `5GB` = 5·10^9,
    `5GiB` = 5·2^30 (KiB, MiB, GiB, TiB in any case), a lower-case final `b` counts bits
    (`5Gb` = 5·10^9 / 8), a plain integer is bytes. Fractions (`1.5GB`) are accepted, as
    huggingface_hub does; the result is rounded down."""
    if isinstance(value, int) and not isinstance(value, bool):
        size = Fraction(value)
    else:
        match = _SIZE.fullmatch(str(value))
        if match is None:
            raise UsageError(f"{option} {value!r}: not a size (use {SIZE_EXAMPLES})")
        number, prefix, binary, unit = match.groups()
        size = Fraction(number)
        if prefix is not None:
            size *= (1024 if binary else 1000) ** _POWERS[prefix.lower()]
            if unit == "b":
                size /= 8
    if size < 1:
        raise UsageError(f"{option} {value!r}: must be at least 1 byte (use {SIZE_EXAMPLES})")
    return math.floor(size)


@dataclass(frozen=True)
class PlannedFile:
    """One safetensors file of the plan: its name, size in bytes (header included) and tensor count."""

    name: str
    bytes: int
    tensors: int


@dataclass(frozen=True)
class SourceRows:
    """The rows of one source tensor an HF tensor takes, in order (`[start, stop)` ranges)."""

    fqn: str
    rows: tuple[tuple[int, int], ...]
    source_rows: int
    """Rows of the whole source tensor (0 for a 0-d one)."""

    @property
    def whole(self) -> bool:
        return self.rows in ((), ((0, self.source_rows),))


@dataclass(frozen=True)
class PlannedTensor:
    """One HF tensor of the plan: shape, dtype, file, the source rows it is made of, a constant added."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    file: str
    sources: tuple[SourceRows, ...]
    add: float = 0.0
    merged: tuple[str, str, float, str | None] | None = None
    """The LoRA adapter merged in (`--merge-adapters`): A's and B's FQNs, the scale s, and DoRA's
    magnitude's FQN (None for plain LoRA)."""


@dataclass
class ExportPreview:
    """What `export-hf --dry-run` reports: the whole plan, nothing written."""

    src: str
    dst: str
    arch: str
    tp: int | None
    dtype: str
    parameters: int
    files: list[PlannedFile]
    side_files: list[str]
    tensors: list[PlannedTensor]
    notes: list[str] = field(default_factory=list)
    quantization: dict[str, Any] | None = None

    @property
    def bytes(self) -> int:
        return sum(f.bytes for f in self.files)

    @property
    def weight_map(self) -> dict[str, str]:
        return {t.name: t.file for t in self.tensors}

    @property
    def mapping(self) -> dict[str, list[str]]:
        """Each HF tensor's source FQNs, in the order their rows come."""
        return {t.name: [s.fqn for s in t.sources] for t in self.tensors}


def plan_sources(target: TargetTensor, sources: Mapping[str, SourceTensor]) -> tuple[SourceRows, ...]:
    """The source rows of a target, grouped by source in order of first use; adjacent ranges merged."""
    rows: dict[str, list[tuple[int, int]]] = {}
    for piece in target.pieces:
        read = piece.source_box
        start = read.offsets[0] if read.sizes else 0
        stop = start + (read.sizes[0] if read.sizes else 0)
        ranges = rows.setdefault(piece.src, [])
        if ranges and ranges[-1][1] == start:
            ranges[-1] = (ranges[-1][0], stop)
        elif read.sizes:
            ranges.append((start, stop))
    return tuple(SourceRows(fqn, tuple(r), sources[fqn].shape[0] if sources[fqn].shape else 0)
                 for fqn, r in rows.items())


def merged_sources(delta: LowRank) -> tuple[str, str, float, str | None]:
    """A merged target's A and B FQNs, scale, and DoRA magnitude FQN (or None), as `--dry-run` shows them."""
    magnitude = delta.magnitude.target.fqn if delta.magnitude is not None else None
    return delta.a.target.fqn, delta.b.target.fqn, delta.scale, magnitude


def open_export_source(src: Path, opts: ExportOptions, ref: str | Path) -> tuple[Checkpoint, ExportOptions]:
    """The checkpoint to export, and the options it is exported with: SRC, with `--base`'s weights
    beside its adapters (`with_base`); a NeMo Automodel PEFT save (`automodel_peft.peft_source`)
    as the peft model of its base (`--base`, else the `--hf-config` folder) and its adapter
    folder, α from its adapter_config.json unless `--adapter-config` names another."""
    if (automodel := automodel_peft(src)) is not None:
        ckpt = peft_source(automodel, opts.base, ref)
        if opts.adapter_config is None:
            opts = replace(opts, adapter_config=automodel.adapter / PEFT_CONFIG)
        return ckpt, replace(opts, base=None)
    ckpt = open_checkpoint(src)
    if opts.base is None:
        return ckpt, opts
    if megatron_prefix(ckpt) is None:
        raise UsageError(f"--base applies to Megatron-Bridge LoRA checkpoints, and {ckpt.path} is not one")
    base = Path(opts.base).absolute()  # its chunks are named by their full path, read beside SRC's
    if is_hf_folder(base):
        cfg = load_hf_config(ref, opts.hub_timeout)
        family, prefix = choose_family(ckpt, cfg, opts.arch)
        return with_hf_base(ckpt, base, cfg, family, prefix), opts
    return with_base(ckpt, base), opts


def preview_export(src: Path, dst: Path, ref: str | Path, opts: ExportOptions,
                   preparing: Preparing | None = None) -> ExportPreview:
    """The plan of an export, as `--dry-run` shows it: reads metadata and REF only, writes nothing
    (DST may exist; it is not looked at). `preparing`: as `plan_export`'s."""
    ckpt, opts = open_export_source(src, opts, ref)
    plan = plan_export(ckpt, load_hf_config(ref, opts.hub_timeout), opts, ref, preparing)
    where = plan.file_of
    tensors = [PlannedTensor(name, t.shape, dtype_name(t.dtype), where[name],  # a scale: its weight's sources
                             plan_sources(t.properties.codes if isinstance(t.properties, Fp8Scales) else t,
                                          plan.sources), t.add,
                             None if t.delta is None else merged_sources(t.delta))
               for name, t in sorted(plan.targets.items())]
    return ExportPreview(
        src=str(src), dst=str(dst), arch=plan.family, tp=plan.tp, dtype=str(plan.config.get("dtype", "")),
        parameters=plan.parameters,
        files=[PlannedFile(f.name, f.size, len(plan.file_targets[f.name])) for f in plan.files],
        side_files=plan.side_files(), tensors=tensors, notes=list(plan.notes), quantization=quantization_json(plan),
    )


def quantization_json(plan: ExportPlan) -> dict[str, Any] | None:
    """What `--json` says of `--quantize`: its layout, and each quantized weight with its scale."""
    if plan.quantize is None:
        return None
    weights = {n: t.properties.scale for n, t in sorted(plan.targets.items()) if isinstance(t.properties, Fp8Codes)}
    return {**plan.quantize.as_json(), "quantization_config": plan.config["quantization_config"], "weights": weights}


@recorded_reads()
def export_hf(
    src: Path,
    dst: Path,
    ref: str | Path,
    opts: ExportOptions,
    *,
    force: bool = False,
    verify: bool = False,
    progress: ProgressObserver | None = None,
    comm: Comm = LOCAL,
    preparing: Preparing | None = None,
) -> ExportReport:
    """Run an export end to end and report what happened.

    Under torchrun pass the run's `comm` (collective: every worker calls this with the same
    arguments); each worker then writes its share of the safetensors files and rank 0 the
    index, config and side files. `preparing(what)` is the context a wait on transformers
    happens in (the names checked against its model: `asking_transformers`).
    """
    started = time.perf_counter()
    cfg = load_hf_config(ref, opts.hub_timeout)
    given = opts
    ckpt, opts = open_export_source(src, opts, ref)
    plan = plan_export(ckpt, cfg, opts, ref, preparing)
    check_destination(dst, force, src)
    base = given.base if given.base is not None or ckpt.path != src else None
    if base is None and automodel_peft(src) is not None:
        base = Path(ref)  # the base weights came from --hf-config's folder
    if base is not None and overlapped_input(dst, [base]) is not None:
        raise UsageError(f"{dst}: destination overlaps the base {base}; the source is never modified")
    phases = Phases(progress)
    report = ExportReport(
        src=str(src), dst=str(dst), arch=plan.family, tp=plan.tp, dtype=str(plan.config.get("dtype", "")),
        tensors=len(plan.targets), files=len(plan.files), bytes_written=sum(f.size for f in plan.files),
        parameters=plan.parameters, notes=list(plan.notes), processes=comm.world_size,
        device=resolve_device(opts.device), quantization=quantization_json(plan),
    )
    if report.device != "cpu" and any(t.delta is not None for t in plan.targets.values()):
        report.device = "cpu"  # another device's matmul would give other bits than peft's CPU merge
        report.notes.append("merged weights are computed on the CPU: the run uses the CPU engine")
    if report.device != "cpu" and plan.quantize is not None:
        report.device = "cpu"
        report.notes.append("FP8 weights are quantized on the CPU: the run uses the CPU engine")
    sources = ChunkSource(ckpt)
    sources.reader.dequantize_fp8 = True  # a TE Float8Tensor item: its value, as TE dequantizes it

    def verify_output(tmp: Path) -> None:
        if plan.shards is not None:  # every piece is compared through `check_decoded_source`
            advance = phases.start("verifying", plan.data_bytes)
            read_back = shards_read_back(tmp, plan.shards)
        else:
            advance = phases.start("verifying", 2 * plan.data_bytes)
            for f in plan.files:
                verify_safetensors_file(tmp / f.name, f, plan.targets, plan.sources, sources, max(1, opts.workers),
                                        advance)
            read_back = safetensors_read_back(tmp, plan)
        check_written_names(plan, tmp, preparing)
        copied = {name: t for name, t in plan.targets.items()  # merged and quantized ones: recomputed above
                  if t.delta is None and not isinstance(t.properties, (Fp8Codes, Fp8Scales))}
        check_decoded_source(ckpt, copied, plan.sources, read_back, dst, max(1, opts.workers), advance)
        phases.stop()
        report.verified = True

    try:
        report.write_bytes = write_output(plan.output_plan(), dst, sources, phases, device=report.device,
                                          workers=opts.workers, force=force, sync=opts.sync,
                                          check=timed_check(report, functools.partial(check_export, ckpt, plan)), comm=comm,
                                          verify=verify_output if verify else None)
    finally:
        sources.close()
    report.finish(phases, started)
    return report


def check_export(ckpt: Checkpoint, plan: ExportPlan, folder: Path) -> None:
    """The check every export passes before it takes its name (`output_check.check_safetensors`;
    rank files: `distributed_output.check_distributed_safetensors`)."""
    if plan.shards is not None:
        check_distributed_safetensors(ckpt, folder, plan.shards, plan.targets, plan.sources)
        return
    check_safetensors(ckpt, folder, {f.name: [plan.targets[n] for n in plan.file_targets[f.name]] for f in plan.files},
                      plan.sources, plan.weight_map, INDEX_NAME)


def safetensors_read_back(folder: Path, plan: ExportPlan) -> ReadBack:
    """Boxes of the written tensors, read through safetensors' own reader (one handle per file)."""
    from safetensors import safe_open

    handles: dict[str, Any] = {}
    file_of = plan.file_of
    lock = threading.Lock()

    def tensor(name: str) -> Any:
        with lock:
            if file_of[name] not in handles:
                handles[file_of[name]] = safe_open(folder / file_of[name], "pt")
            return handles[file_of[name]].get_slice(name)

    return tensor_read_back(tensor)


def shards_read_back(folder: Path, shards: Sequence[ShardFile]) -> ReadBack:
    """Boxes of the written tensors, each put together from the rows of the rank files' pieces it
    spans, read through safetensors' own reader (one handle per file)."""
    import torch
    from safetensors import safe_open

    from ckptctl.checks.verify import raw_bytes

    pieces: dict[str, list[tuple[str, Box]]] = {}
    for s in shards:  # rank by rank: a tensor's pieces in row order
        for fqn, box in s.pieces.items():
            if box.numel:
                pieces.setdefault(fqn, []).append((s.file.name, box))
    handles: dict[str, Any] = {}
    lock = threading.Lock()

    def handle(name: str) -> Any:
        with lock:
            if name not in handles:
                handles[name] = safe_open(folder / name, "pt")
            return handles[name]

    def read(target: TargetTensor, box: Box) -> bytes:
        if not box.sizes:  # a 0-d tensor: one piece, whole
            return raw_bytes(handle(pieces[target.fqn][0][0]).get_tensor(target.fqn))
        start, stop = box.offsets[0], box.offsets[0] + box.sizes[0]
        rest = tuple(slice(o, o + n) for o, n in zip(box.offsets[1:], box.sizes[1:]))
        parts = []
        for name, piece in pieces.get(target.fqn, ()):
            a, b = max(start, piece.offsets[0]), min(stop, piece.offsets[0] + piece.sizes[0])
            if a < b:
                rows = slice(a - piece.offsets[0], b - piece.offsets[0])
                parts.append(torch.as_tensor(handle(name).get_slice(target.fqn)[(rows, *rest)]))
        return raw_bytes(torch.cat(parts)) if parts else b""

    return read


def _json_file(doc: Mapping[str, Any]) -> bytes:
    """`doc` as transformers writes a JSON config: indented, keys sorted, ASCII, a final newline."""
    return (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode()


def write_side_files(plan: ExportPlan, out: Path) -> None:
    """Index (when sharded), config.json with the output dtype, the generation config (REF's,
    else derived from the config), tokenizer files of REF; JSON as transformers writes it."""
    store = store_for(out)
    if plan.weight_map is not None:
        write_index(out / INDEX_NAME, plan.parameters, plan.total_size, plan.weight_map)
    if plan.adapter_config is not None:
        store.write_whole(out / PEFT_CONFIG, _json_file(plan.adapter_config))
        return
    store.write_whole(out / CONFIG_NAME, _json_file(plan.config))
    if plan.generation is not None:
        store.write_whole(out / GENERATION_CONFIG_NAME, _json_file(plan.generation))
    for path in plan.ref_files:
        try:
            copy_regular(path, out / path.name)
        except OSError as exc:
            raise UsageError(f"{path}: cannot copy ({exc.strerror or exc})") from exc
