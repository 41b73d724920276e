"""What every export-hf family shares: the HF config, Megatron source views, row-concatenated targets.

A family module only says, for each Hugging Face tensor, which rows of which Megatron
tensors make it up, in order. Rows are always addressed in *global* coordinates of the
source tensor, never of a saved shard: a `RowView` maps the rows of a logical tensor (a
whole source tensor, one component of a TP-blocked fused tensor, one head of it) to rows
of one source tensor. `HFTensor.target()` turns the concatenation of views into a
`TargetTensor` of `Piece`s; `plan_box` then finds the chunks, however unevenly saved.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Protocol, Sequence

from ckptctl.core.dtypes import DType
from ckptctl.util.errors import CheckpointError, UsageError
from ckptctl.families.expected import sizing_keys
from ckptctl.storage.hf_files import read_json_object
from ckptctl.storage.hub import DEFAULT_HUB_TIMEOUT, resolve_repo
from ckptctl.storage.source_files import looks_like_repo_id
from ckptctl.storage.store import EntryKind, store_for
from ckptctl.core.names import MODEL_PREFIXES, is_training_state
from ckptctl.megatron.rows import RowBlock, canonical, select_rows, tp_blocked_split
from ckptctl.core.checkpoint import Checkpoint, TensorEntry
from ckptctl.core.analysis import is_layer_stacked, is_optimizer_entry
from ckptctl.core.plan import Piece, SourceTensor, TargetTensor, layer_stacked_view, row_groups_view, source_view

STACK_PREFIX = "decoder.layers."
EXPERT_STACK = "mlp.experts.experts."
"""torch_dist's name (under `decoder.layers.`) for the stacked SequentialMLP experts."""
_ONE_LAYER = r"(?:decoder\.layers\.\d+|mtp\.layers\.\d+\.transformer_layer)"
"""A decoder layer by index, or an MTP layer's transformer layer (saved as `transformer_layer.` by
megatron-core 0.16 and 0.19.2 alike, though 0.19 names the module `mtp_model_layer`)."""
PER_LAYER_EXPERTS = re.compile(rf"^({_ONE_LAYER}\.mlp\.experts\.)experts\.(.+)$")
"""The same stack of one layer, where torch_dist keeps per-layer keys (heterogeneous layers, MTP)."""
PER_EXPERT = re.compile(rf"^({_ONE_LAYER}\.mlp\.experts\.)experts\.(\d+)\.(.+)$")
"""One expert's param, where torch_dist keeps a key per expert (`singleton_local_shards`)."""
Shapes = dict[str, tuple[int, ...]]
"""Megatron tensor name (no prefix) → global shape: the model an import writes."""

COPIED_REF_FILES = ("tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.*", "merges.txt",
                    "spiece.model", "generation_config.json", "chat_template*", "preprocessor_config.json")
"""Files of an HF model folder copied next to the exported weights (tokenizer, generation config)."""

CONFIG_ALIASES = {"num_experts": ("num_local_experts", "n_routed_experts")}
"""Other spellings of a config key (transformers 5 writes Qwen3-MoE's `num_experts` as
`num_local_experts`; DeepSeek-V3 calls it `n_routed_experts`)."""


# --------------------------------------------------------------------------------------
# Hugging Face config
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class HFConfig:
    """The target model's `config.json`: it decides every split of the export."""

    path: Path
    data: dict[str, Any]
    folder: Path | None = None

    @property
    def model_type(self) -> str:
        return str(self.data.get("model_type", ""))

    def get(self, key: str, default: Any = None) -> Any:
        for name in (key, *CONFIG_ALIASES.get(key, ())):
            value = self.data.get(name)
            if value is not None:
                return value
        return default

    def int(self, key: str, default: int | None = None) -> int:
        value = self.get(key, default)
        if value is None:
            raise UsageError(f"{self.path}: config has no {key!r}, needed to lay out the weights")
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise UsageError(f"{self.path}: {key!r} must be a non-negative integer (got {value!r})")
        return value

    def flag(self, key: str, default: bool = False) -> bool:
        return bool(self.get(key, default))

    def divides(self, total_key: str, part_key: str) -> int:
        """`config[total_key] / config[part_key]`, refused unless exact (heads per group etc.)."""
        total, part = self.int(total_key), self.int(part_key)
        if part == 0 or total % part:
            raise UsageError(f"{self.path}: {total_key}={total} is not a multiple of {part_key}={part}")
        return total // part

    def ref_files(self) -> list[Path]:
        """Tokenizer / generation-config files to copy from the REF folder (none for a bare config file);
        folders are not files to copy, anything else is (`export_hf.write_side_files` refuses a
        FIFO, a device or a giant file)."""
        if self.folder is None:
            return []
        found: dict[str, Path] = {}
        store = store_for(self.folder)
        for pattern in COPIED_REF_FILES:
            for path in store.glob(self.folder, pattern):
                if store.kind(path) is not EntryKind.FOLDER and path.name != "config.json":  # a FIFO or device is refused when copied
                    found.setdefault(path.name, path)
        return [found[name] for name in sorted(found)]


def load_hf_config(ref: str | Path, hub_timeout: float = DEFAULT_HUB_TIMEOUT) -> HFConfig:
    """REF is an HF model folder holding `config.json`, the config file itself, or a Hub model id
    (`Qwen/Qwen3-8B`, when no such path exists: taken from the Hugging Face cache, else downloaded
    within `hub_timeout` seconds)."""
    ref = Path(ref)
    hint = "--hf-config wants a Hugging Face model folder, its config.json, or a Hub model id"
    store = store_for(ref)
    if store.kind(ref) is EntryKind.MISSING:
        if not looks_like_repo_id(str(ref)):
            raise UsageError(f"{ref}: no such file or directory ({hint})")
        ref = resolve_repo(str(ref), ("config.json", *COPIED_REF_FILES), hub_timeout)
    folder = None
    path = ref
    if store.kind(ref) is EntryKind.FOLDER:
        folder, path = ref, ref / "config.json"
        if not store.exists(path):  # whatever else it is, `read_config` names it
            raise UsageError(f"{ref}: no config.json in this folder ({hint})")
    return HFConfig(path, read_config(path), folder)


def read_config(path: Path) -> dict[str, Any]:
    """A model's `config.json` (`storage.hf_files.read_json_object`), refused when it has an `auto_map`
    (at its top or in a sub-config): that names Python code in the model folder or on the Hub,
    which transformers would import, and no checkpoint's code is ever run."""
    data = read_json_object(path, "config")
    if "auto_map" in data or any(isinstance(v, dict) and "auto_map" in v for v in data.values()):
        raise CheckpointError(path, "has an auto_map: it names custom model code, and ckptctl never runs code "
                                    "from a model folder")
    return data


# --------------------------------------------------------------------------------------
# What save_pretrained writes next to the weights
# --------------------------------------------------------------------------------------

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "qwen3_moe": "Qwen3MoeForCausalLM", "qwen3_next": "Qwen3NextForCausalLM",
                 "qwen3_5_text": "Qwen3_5ForCausalLM", "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
                 "deepseek_v3": "DeepseekV3ForCausalLM", "mixtral": "MixtralForCausalLM",
                 "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
                 "nemotron_h": "NemotronHForCausalLM", "gpt_oss": "GptOssForCausalLM"}
"""The transformers model class of each `model_type` export-hf writes, for a REF without `architectures`."""

GENERATION_KEYS = (
    "max_length", "max_new_tokens", "min_length", "min_new_tokens", "early_stopping", "max_time", "stop_strings",
    "do_sample", "num_beams", "use_mtp", "use_cache", "cache_implementation", "cache_config", "max_cache_len",
    "temperature", "top_k", "top_p", "min_p", "top_h", "typical_p", "epsilon_cutoff", "eta_cutoff",
    "repetition_penalty", "encoder_repetition_penalty", "length_penalty", "no_repeat_ngram_size", "bad_words_ids",
    "renormalize_logits", "forced_bos_token_id", "forced_eos_token_id", "remove_invalid_values",
    "exponential_decay_length_penalty", "suppress_tokens", "begin_suppress_tokens", "sequence_bias",
    "token_healing", "guidance_scale", "watermarking_config", "num_return_sequences", "output_attentions",
    "output_hidden_states", "output_scores", "output_logits", "return_dict_in_generate", "pad_token_id",
    "bos_token_id", "eos_token_id", "encoder_no_repeat_ngram_size", "decoder_start_token_id", "is_assistant",
    "num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold",
    "prompt_lookup_num_tokens", "max_matching_ngram_size", "assistant_early_exit", "assistant_lookbehind",
    "target_lookbehind", "assistant_ensemble_weight", "speculation_type", "compile_config", "disable_compile",
    "continuous_batching_config", "low_memory", "penalty_alpha", "dola_layers", "diversity_penalty",
    "num_beam_groups", "constraints", "force_words_ids", "prefill_chunk_size",
)
"""The attributes of transformers' `GenerationConfig` (5.x): a model config's values for these
(when not null) become its generation config."""
DROPPED_FROM_MODEL_CONFIG = frozenset({
    "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "temperature", "top_k", "top_p",
    "typical_p", "repetition_penalty", "length_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size",
    "bad_words_ids", "num_return_sequences", "output_scores", "return_dict_in_generate", "forced_bos_token_id",
    "forced_eos_token_id", "remove_invalid_values", "exponential_decay_length_penalty", "suppress_tokens",
    "begin_suppress_tokens", "epsilon_cutoff", "eta_cutoff", "encoder_repetition_penalty", "num_assistant_tokens",
    "num_assistant_tokens_schedule", "assistant_confidence_threshold", "assistant_lookbehind", "target_lookbehind",
    "num_beam_groups", "diversity_penalty",
})
"""Generation parameters transformers 5 ignores in a model config.json (they belong in
generation_config.json); `use_cache`, a field of every family's config, is kept."""
CONFIG_DEFAULTS = {"output_attentions": False, "output_hidden_states": False}
"""Generation attributes every transformers model config has even when config.json omits them
(`PreTrainedConfig` defaults), so `from_model_config` carries them."""
TEXT_CONFIG_KEYS = ("decoder", "generator", "text_config")
"""Where a composite config keeps its text decoder, whose generation attributes fill the unset ones."""
OUTPUT_FLAGS = ("output_attentions", "output_hidden_states", "output_scores", "output_logits")


def generative(architectures: Sequence[str]) -> bool:
    """Whether transformers would save a generation config for a model of these classes."""
    return any(a.endswith(("ForCausalLM", "ForConditionalGeneration")) for a in architectures)


def generation_config(config: dict[str, Any]) -> dict[str, Any]:
    """`generation_config.json` as transformers 5's `save_pretrained` derives it from a model config
    that has none (`GenerationConfig.from_model_config`): the config's non-null generation
    attributes but those a model config may no longer carry (a composite config's text decoder
    filling the unset ones), `return_dict_in_generate` when an output flag is on,
    `_from_model_config`, and the config's `transformers_version`."""
    def taken(values: dict[str, Any]) -> dict[str, Any]:
        return {k: values[k] for k in GENERATION_KEYS
                if k not in DROPPED_FROM_MODEL_CONFIG and values.get(k) is not None}

    data = {**CONFIG_DEFAULTS, **config}
    out = taken(data)
    if data.get("force_bos_token_to_be_generated"):  # a legacy spelling transformers still honours
        out["forced_bos_token_id"] = out.get("bos_token_id")
    text = next((data[k] for k in TEXT_CONFIG_KEYS if isinstance(data.get(k), dict) and data[k]), None)
    if text is not None:
        out.update({k: v for k, v in taken({**CONFIG_DEFAULTS, **text}).items() if out.get(k) is None})
    out = {k: v for k, v in out.items() if v is not None}
    if not out.get("return_dict_in_generate") and any(out.get(k) for k in OUTPUT_FLAGS):
        out["return_dict_in_generate"] = True
    out["_from_model_config"] = True
    if config.get("transformers_version"):
        out["transformers_version"] = config["transformers_version"]
    return dict(sorted(out.items()))


# --------------------------------------------------------------------------------------
# Views of source rows
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RowView:
    """`rows` rows of a logical tensor, each taken from a row of source `fqn` (`RowBlock` src → dst)."""

    fqn: str
    rows: int
    trailing: tuple[int, ...]
    blocks: tuple[RowBlock, ...]

    def take(self, start: int, count: int) -> "RowView":
        if start < 0 or count < 0 or start + count > self.rows:
            raise ValueError(f"{self.fqn}: rows {start}..{start + count} outside a view of {self.rows} rows")
        return RowView(self.fqn, count, self.trailing, tuple(select_rows(self.blocks, start, count)))

    def split(self, sizes: Sequence[int]) -> list["RowView"]:
        """Consecutive parts of `sizes` rows (which must add up to the view)."""
        if sum(sizes) != self.rows:
            raise ValueError(f"{self.fqn}: parts {list(sizes)} do not add up to {self.rows} rows")
        out, at = [], 0
        for size in sizes:
            out.append(self.take(at, size))
            at += size
        return out

    def chunks(self, n: int) -> list["RowView"]:
        """`n` equal consecutive parts (heads, query groups, key heads)."""
        if n <= 0 or self.rows % n:
            raise ValueError(f"{self.fqn}: {self.rows} rows cannot be cut into {n} equal parts")
        return self.split([self.rows // n] * n)


def whole(entry: TensorEntry) -> RowView:
    """A source tensor as a view of itself."""
    if not entry.shape:
        raise CheckpointError(entry.fqn, "a 0-d tensor has no rows to export")
    rows = entry.shape[0]
    return RowView(entry.fqn, rows, tuple(entry.shape[1:]), (RowBlock(0, 0, rows),) if rows else ())


@dataclass(frozen=True)
class DeinterleavedRows:
    """A whole tensor's rows, each block of `block` rows reordered from interleaved pairs to halves:
    out row `j·block/2 + i` of a block is its in row `2i + j` (torchtitan's llama3 q/k rows → HF's,
    for RoPE). Read as row pairs [R/2, 2, …] (`MegatronModel.in_row_groups`): each block's half is
    one transposed piece, two per block, however many rows."""

    fqn: str
    rows: int
    trailing: tuple[int, ...]
    block: int

    def pieces(self, at: int) -> list[Piece]:
        """The pieces, placed from row `at` of the HF tensor."""
        half, zeros = self.block // 2, tuple(0 for _ in self.trailing)
        axes = (0, *range(2, 2 + len(self.trailing)))
        return [Piece(self.fqn, (b * half, j, *zeros), (at + b * self.block + j * half, *zeros), (half, *self.trailing),
                      axes) for b in range(self.rows // self.block) for j in (0, 1)]


@dataclass(frozen=True)
class HFTensor:
    """An HF tensor as the row concatenation of `views`, plus a constant `add` (GDN norm: + 1)."""

    name: str
    views: tuple[RowView | DeinterleavedRows, ...]
    add: float = 0.0

    @property
    def shape(self) -> tuple[int, ...]:
        return (sum(v.rows for v in self.views), *self.views[0].trailing)

    @property
    def sources(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(v.fqn for v in self.views))

    def pieces(self) -> tuple[Piece, ...]:
        """One `Piece` per row block, adjacent blocks that continue each other merged; a
        de-interleaved view's transposed pieces after them."""
        trailing = self.views[0].trailing
        zeros = tuple(0 for _ in trailing)
        merged: list[tuple[str, RowBlock]] = []
        strided: list[Piece] = []
        at = 0
        for view in self.views:
            if isinstance(view, DeinterleavedRows):
                strided.extend(view.pieces(at))
                at += view.rows
                continue
            for b in view.blocks:
                block = RowBlock(b.src_row, at + b.dst_row, b.rows)
                if merged:
                    fqn, last = merged[-1]
                    if fqn == view.fqn and last.src_row + last.rows == block.src_row \
                            and last.dst_row + last.rows == block.dst_row:
                        merged[-1] = (fqn, RowBlock(last.src_row, last.dst_row, last.rows + block.rows))
                        continue
                merged.append((view.fqn, block))
            at += view.rows
        return (*(Piece(fqn, (b.src_row, *zeros), (b.dst_row, *zeros), (b.rows, *trailing)) for fqn, b in merged),
                *strided)

    def target(self, dtype: DType) -> TargetTensor:
        return TargetTensor(self.name, self.shape, dtype, self.pieces(), add=self.add)


# --------------------------------------------------------------------------------------
# The Megatron model inside a checkpoint
# --------------------------------------------------------------------------------------


def is_model_key(fqn: str) -> bool:
    return not is_training_state(fqn) and not is_optimizer_entry(fqn) and "_extra_state" not in fqn


def megatron_prefix(ckpt: Checkpoint) -> str | None:
    """The wrapper prefix of Megatron model keys (`model.module.` …), or None when there are none."""
    for prefix in MODEL_PREFIXES:
        for fqn in ckpt.tensors:
            if not is_model_key(fqn) or not fqn.startswith(prefix):
                continue
            rest = fqn[len(prefix):]
            if rest.startswith(("decoder.layers.", "embedding.word_embeddings.")):
                return prefix
    return None


class MegatronModel:
    """The model tensors of a Megatron checkpoint by name without prefix, spelled as the rules
    spell them (`megatron.rows.canonical`: 0.19's `mixer.conv1d_weight` is `mixer.conv1d.weight`
    here, its entry's fqn the saved name); remembers which were used.

    A torch_dist checkpoint keeps each layer-wise parameter as one layer stack
    (`decoder.layers.<name>` [L, …]): it is seen here as L tensors `decoder.layers.<l>.<name>`,
    each a view of its layer's rows of the stack read as [L·R, …] (`plan.layer_stacked_view`).
    Its SequentialMLP experts are stacks of stacks (`decoder.layers.mlp.experts.experts.<name>`
    [L, E, R, …]), or per layer (`decoder.layers.<l>.mlp.experts.experts.<name>` [E, R, …]) in
    a model whose layers differ, or a key per expert (`decoder.layers.<l>.mlp.experts.experts.<e>.
    <name>`, saved with `singleton_local_shards`): seen as the model names them,
    `…mlp.experts.local_experts.<e>.<name>`.
    """

    def __init__(self, ckpt: Checkpoint, prefix: str) -> None:
        self.ckpt = ckpt
        self.prefix = prefix
        self.entries: dict[str, TensorEntry] = {}
        for fqn, entry in ckpt.tensors.items():
            if fqn.startswith(prefix) and is_model_key(fqn):
                name = canonical(fqn[len(prefix):])
                if name in self.entries:
                    raise CheckpointError(ckpt.path, f"holds both {self.entries[name].fqn} and {fqn}, two "
                                                     "megatron-core releases' names of one parameter: which one is "
                                                     "the model's is not guessed")
                self.entries[name] = entry
        self.layer_views: dict[str, RowView] = {}
        """Per-layer name → its rows of a torch_dist layer stack."""
        self.stacks: dict[str, int] = {}
        """FQNs of the stacks → how many leading dims are stacked (`layer_stacked_view`'s depth)."""
        self.row_groups: dict[str, SourceTensor] = {}
        """FQNs read as row groups [R / g, g, …] (`row_groups_view`) → that view."""
        if ckpt.megatron_backend == "torch_dist":
            for name, entry in list(self.entries.items()):
                expert = PER_EXPERT.match(name)
                if expert is not None:  # named as the model names it
                    del self.entries[name]
                    self.entries[f"{expert[1]}local_experts.{expert[2]}.{expert[3]}"] = entry
                    continue
                layer = PER_LAYER_EXPERTS.match(name)
                if layer is not None and len(entry.shape) >= 2:  # [E, …]: an expert's weight or bias
                    del self.entries[name]
                    self._stack_views(entry, 1, [f"{layer[1]}local_experts.{e}.{layer[2]}"
                                                 for e in range(entry.shape[0])])
                elif name.startswith(STACK_PREFIX) and is_layer_stacked(entry) and len(entry.shape) >= 2:
                    del self.entries[name]
                    rest = name[len(STACK_PREFIX):]
                    if rest.startswith(EXPERT_STACK) and len(entry.shape) >= 3:  # [L, E, …]
                        inner, experts = rest[len(EXPERT_STACK):], entry.shape[1]
                        self._stack_views(entry, 2, [f"{STACK_PREFIX}{slab // experts}.mlp.experts.local_experts."
                                                     f"{slab % experts}.{inner}"
                                                     for slab in range(entry.shape[0] * experts)])
                    else:
                        self._stack_views(entry, 1, [f"{STACK_PREFIX}{layer}.{rest}"
                                                     for layer in range(entry.shape[0])])
        self.used: set[str] = set()
        self.planned = False
        """Whether the tensors are an import's, not written yet (`planned_model`)."""

    def _stack_views(self, entry: TensorEntry, depth: int, names: Sequence[str]) -> None:
        """Name each slab of a torch_dist stack of `depth` stacked dims (`layer_stacked_view`) by
        the per-layer (per-expert) name the model gives it."""
        self.stacks[entry.fqn] = depth
        rows, trailing = entry.shape[depth], tuple(entry.shape[depth + 1:])
        for slab, name in enumerate(names):
            blocks = (RowBlock(slab * rows, 0, rows),) if rows else ()
            self.layer_views[name] = RowView(entry.fqn, rows, trailing, blocks)

    def has(self, name: str) -> bool:
        return name in self.entries or name in self.layer_views

    def has_prefix(self, prefix: str) -> bool:
        return any(n.startswith(prefix) for n in self.entries)

    def first(self, *names: str) -> str | None:
        return next((n for n in names if self.has(n)), None)

    def missing(self, *names: str) -> CheckpointError:
        alts = " or ".join(self.prefix + n for n in names)
        return CheckpointError(self.ckpt.path, f"no tensor {alts} (wrong --hf-config or --arch?)")

    def _whole(self, name: str) -> RowView:
        return self.layer_views[name] if name in self.layer_views else whole(self.entries[name])

    def view(self, *names: str) -> RowView:
        """The first present of `names`, whole."""
        name = self.first(*names)
        if name is None:
            raise self.missing(*names)
        self.used.add(name)
        return self._whole(name)

    def fused(self, name: str, component_rows: Sequence[int], tp: int) -> list[RowView]:
        """The components of a fused tensor TP-blocked at `tp`, each as a view of its global rows."""
        base = self._whole(name)
        if base.rows != sum(component_rows):
            parts = " + ".join(map(str, component_rows))
            raise CheckpointError(self.ckpt.path, f"{base.fqn}: has {base.rows} rows, the config implies "
                                                  f"{sum(component_rows)} ({parts})")
        try:
            maps = tp_blocked_split(component_rows, tp)
        except UsageError as exc:
            raise UsageError(f"{base.fqn}: {exc}") from None
        self.used.add(name)
        first = base.blocks[0].src_row if base.blocks else 0
        return [RowView(base.fqn, rows, base.trailing, tuple(RowBlock(b.src_row + first, b.dst_row, b.rows)
                                                              for b in blocks))
                for rows, blocks in zip(component_rows, maps)]

    def stacked(self, name: str) -> RowView:
        """A stack of matrices [S, R, …] (torchtitan's grouped experts, [E, F, D]) as the view of its
        S·R rows, slab after slab (read as `plan.layer_stacked_view`)."""
        if name not in self.entries:
            raise self.missing(name)
        entry = self.entries[name]
        if len(entry.shape) < 3:
            raise CheckpointError(entry.fqn, f"shape {list(entry.shape)} is not a stack of matrices")
        self.used.add(name)
        self.stacks[entry.fqn] = 1
        rows = entry.shape[0] * entry.shape[1]
        return RowView(entry.fqn, rows, tuple(entry.shape[2:]), (RowBlock(0, 0, rows),) if rows else ())

    def in_row_groups(self, fqn: str, group: int) -> SourceTensor | None:
        """`fqn` as row groups [R / group, group, …] when every saved chunk is whole groups, or the
        tensor is one an import plans (`planned_model`: it is written as a target of that logical
        shape); then its pieces address that view. Else None."""
        entry = self.ckpt.tensors[fqn]
        if fqn in self.stacks:
            return None
        if self.planned and entry.shape and entry.shape[0] % group == 0:
            view = SourceTensor(fqn, (entry.shape[0] // group, group, *entry.shape[1:]), entry.dtype, ())
        else:
            view = row_groups_view(entry, group)
        if view is not None:
            self.row_groups[fqn] = view
        return view

    def source_view(self, fqn: str) -> SourceTensor:
        """The source tensor the views of `fqn` address: a layer stack as [L·R, …], row groups as
        [R / g, g, …], others as saved."""
        if fqn in self.row_groups:
            return self.row_groups[fqn]
        entry = self.ckpt.tensors[fqn]
        return layer_stacked_view(entry, self.stacks[fqn]) if fqn in self.stacks else source_view(entry)

    def components(self, base: str, suffixes: Sequence[str], component_rows: Sequence[int],
                   tp: Callable[[], int]) -> list[RowView]:
        """Components saved split (`base + suffix` each, TP-invariant) or fused at `base` (TP-blocked)."""
        split = [base + s for s in suffixes]
        if all(self.has(n) for n in split):
            views = [self.view(n) for n in split]
            for view, rows in zip(views, component_rows):
                if view.rows != rows:
                    raise CheckpointError(self.ckpt.path,
                                          f"{view.fqn}: has {view.rows} rows, the config implies {rows}")
            return views
        if self.has(base):
            return self.fused(base, component_rows, tp())
        raise self.missing(base, *split)

    def unused(self) -> list[str]:
        return sorted(n for n in (*self.entries, *self.layer_views) if n not in self.used)


class Exported(Protocol):
    """An HF tensor a family makes (`HFTensor`, `raw.RawTensor`, …): its name, the source tensors
    it reads, and its rows as a target of the copy plan."""

    name: str

    @property
    def sources(self) -> tuple[str, ...]: ...

    def target(self, dtype: DType) -> TargetTensor: ...


@dataclass(frozen=True)
class TiedHead:
    """A trained output head of the checkpoint that the config ties to another HF tensor (the
    embeddings), so the HF model has no tensor for it: it may be left out only when it is that
    tensor bit for bit (export-hf compares them, and refuses otherwise), or on purpose
    (`--drop-tied-head`). A head the checkpoint does not hold needs no entry."""

    head: Exported
    """The head as the HF tensor it would be (a Megatron output layer's vocab rows only)."""
    tied_to: str
    """The HF name of the tensor it is tied to."""
    key: str | None
    """The config key that ties them (`tie_word_embeddings`); None: transformers' model class does."""


@dataclass
class ExportContext:
    """What a family's `to_hf` reads: the config, the Megatron model and the training TP sizes."""

    config: HFConfig
    model: MegatronModel
    tp_value: int | None = None
    expert_tp_value: int | None = None
    notes: list[str] = field(default_factory=list)
    zero_only: list[str] = field(default_factory=list)
    """Source tensors the family claims but leaves out of the HF model, which is only right when
    they are all zero (torchtitan's expert bias): the export proves it or refuses."""
    tied_heads: list[TiedHead] = field(default_factory=list)
    """Output heads the family claims but leaves out because the config ties them, which is only
    right when each equals the tensor it is tied to: the export proves it or refuses."""

    def tp(self) -> int:
        if self.tp_value is None:
            raise UsageError(f"{self.model.ckpt.path}: a fused TP-blocked tensor needs the training TP size; pass --tp")
        return self.tp_value

    def expert_tp(self) -> int:
        return self.expert_tp_value if self.expert_tp_value is not None else self.tp()


# --------------------------------------------------------------------------------------
# The reverse direction: a Megatron model made of HF rows
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MegatronSpec:
    """The Megatron model import-hf writes: its TP (fused tensors are TP-blocked for it), fused or
    split (`_w`/`_v`, `.query` …) components, vocab rows padded as Megatron pads them, and the HF
    names present (a Megatron bias exists where the HF model has one)."""

    tp: int
    split: bool
    padded_vocab: int
    hf_names: frozenset[str]

    def has(self, hf_name: str) -> bool:
        return hf_name in self.hf_names


def planned_model(path: Path, shapes: Shapes, dtype: DType) -> MegatronModel:
    """A Megatron model of tensors not written yet, for a family's `to_hf` to say which rows of
    them each HF tensor is: read backwards, that says which HF rows each of them is."""
    tensors = {name: TensorEntry(name, shape, dtype, ()) for name, shape in shapes.items()}
    model = MegatronModel(Checkpoint(path=path, tensors=tensors, bytes_entries={}, files={}), "")
    model.planned = True
    return model


def reversed_piece(p: Piece, name: str) -> Piece:
    """Piece `p` of HF tensor `name` read backwards: the HF block is the source, the block `p`
    reads the destination (a transposed piece's dims mapped back: each source dim of `p` runs
    along the HF dim that ran along it, or is a unit dim)."""
    if p.axes is None:
        return Piece(name, p.dst_start, p.src_start, p.sizes)
    back = tuple(p.axes.index(k) if k in p.axes else None for k in range(len(p.src_start)))
    return Piece(name, p.dst_start, p.src_start, p.source_box.sizes, back)


def reversed_pieces(hf: Mapping[str, HFTensor], shapes: Shapes) -> tuple[dict[str, list[Piece]], dict[str, float]]:
    """Each Megatron tensor's pieces, taken from the HF tensors (sources named by HF name), and the
    constant to add (the inverse of the HF tensor's shift). Every export piece read backwards: a
    row is a row whichever way it goes, so the two directions cannot disagree. A Megatron row
    claimed twice is refused (rows of the same columns: a row-pair view's halves are apart)."""
    pieces: dict[str, list[Piece]] = {name: [] for name in shapes}
    adds: dict[str, float] = {}
    for tensor in hf.values():
        for p in tensor.pieces():
            pieces[p.src].append(reversed_piece(p, tensor.name))
            if adds.setdefault(p.src, -tensor.add) != -tensor.add:
                raise CheckpointError(p.src, "made of HF tensors with different shifts")
    for name, parts in pieces.items():
        columns: dict[tuple[tuple[int, ...], tuple[int, ...]], list[tuple[int, int]]] = {}
        for p in parts:
            columns.setdefault((p.dst_start[1:], p.sizes[1:]), []).append((p.dst_start[0], p.dst_start[0] + p.sizes[0]))
        for rows in columns.values():
            rows.sort()
            for (_, end), (start, _) in zip(rows, rows[1:]):
                if start < end:
                    raise CheckpointError(name, f"row {start} made of two HF tensors")
    return pieces, adds


def uncovered_elements(pieces: Sequence[Piece], shape: Sequence[int]) -> int:
    """How many elements of a `shape` tensor no piece fills (pieces never overlap: `reversed_pieces`)."""
    return math.prod(shape) - sum(math.prod(p.sizes) for p in pieces)


def check_shape(hf: HFTensor, expected: Sequence[int], cfg: HFConfig) -> HFTensor:
    """Refuse a tensor whose assembled shape is not what the config implies."""
    if tuple(hf.shape) != tuple(expected):
        srcs = ", ".join(hf.sources)
        keys = sizing_keys(cfg.data, hf.shape, expected)
        raise CheckpointError(srcs, f"gives {hf.name} shape {list(hf.shape)} but {cfg.path.name} implies "
                                    f"{list(expected)} ({keys + '; ' if keys else ''}wrong --hf-config?)")
    return hf
