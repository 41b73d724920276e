"""The tensor names a Hugging Face model expects, asked of transformers itself.

export-hf is closed-world: an output name the model has no place for, or a weight the
model needs that the output lacks, is refused, because transformers would load such a
folder with randomly initialised weights and no error. The expectation comes from the
model class transformers builds for the output `config.json` (its `architectures`, else
`AutoModelForCausalLM` for its `model_type`) on the meta device, so no memory is
allocated: its `state_dict()` keys (non-persistent buffers are not in it), minus the
tied parameters transformers restores from their source on load, with the keys its
`_keys_to_ignore_on_load_missing` / `_keys_to_ignore_on_save` patterns name allowed but
not required. transformers 5 holds some weights in another form in memory than on disk
(MoE experts fused as `mlp.experts.gate_up_proj`, written per expert); the names are those
`save_pretrained` writes (its own `revert_weight_conversion` on the meta state dict), and
an output wholly in the in-memory form (a `fully_shard`ed transformers model's DCP) is
checked against that form instead: transformers loads both. Each name's shape is kept too
(`ExpectedNames.shapes`): a weight of another shape than the config's model has is refused,
since transformers would not load it (or, worse, a check that only counts names would pass
a 130-row embedding for a 128-token vocab).

transformers is optional and costs seconds to import (torch, then the model code), so it
is imported only here, only when an export asks for the check; the answer is kept in a
small JSON file per (transformers version, config) under the user's cache folder, so a
repeated export or `--dry-run` of the same model pays nothing.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import re
import tempfile
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, ContextManager, Iterable, Iterator, Mapping, Sequence

from ckptctl.util.errors import UsageError

CACHE_ENV = "CKPTCTL_CACHE_DIR"
"""Where the expected names are cached (default `$XDG_CACHE_HOME/ckptctl`, else `~/.cache/ckptctl`);
`off` disables the cache."""
CACHE_FORMAT = 4
SHOWN = 3
"""Names listed in a refusal before `(+N more)`."""


@dataclass(frozen=True)
class ExpectedNames:
    """What one transformers model class wants to find in a model folder."""

    model_class: str
    required: frozenset[str]
    """Every name the model loads and has no other source for."""
    optional: frozenset[str]
    """Names the model accepts but does without (transformers' ignore-on-load/save patterns)."""
    tied: Mapping[str, str]
    """Tied parameter → the parameter it is restored from on load (never written)."""
    version: str
    """The transformers version that answered."""
    in_memory: frozenset[str] = frozenset()
    """`required` as transformers holds the weights in memory, when that differs from what it saves."""
    beyond: tuple[str, ...] = ()
    """Prefixes of names the family defines past the model class (DeepSeek-V3's MTP layers, which
    transformers skips on load and inference engines read): allowed, not required."""
    shapes: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    """Each name's shape, in both forms (saved and in memory), in the model's own order."""
    transposed: frozenset[str] = frozenset()
    """In-memory parameters of fused-experts modules that hold each expert as [in, out]
    (transformers' `is_transposed`, gpt-oss): how a LoRA on such a stack merges."""

    def for_output(self, names: Iterable[str]) -> "ExpectedNames":
        """The form to check `names` against: the in-memory one when some name is only in it."""
        if not self.in_memory or not (set(names) & (self.in_memory - self.required)):
            return self
        return replace(self, required=self.in_memory, in_memory=frozenset())

    def allowing(self, prefixes: tuple[str, ...]) -> "ExpectedNames":
        return replace(self, beyond=prefixes) if prefixes else self

    def unclaimed(self, names: Iterable[str]) -> list[str]:
        """The names, sorted, that this model has no place for."""
        return sorted(n for n in names if n not in self.required and n not in self.optional
                      and n not in self.tied and not (self.beyond and n.startswith(self.beyond)))

    def missing(self, names: Iterable[str]) -> list[str]:
        """The required names, sorted, that are not among `names`."""
        have = set(names)
        return sorted(self.required - have)

    def misshapen(self, shapes: Mapping[str, Sequence[int]]) -> list[tuple[str, tuple[int, ...], tuple[int, ...]]]:
        """(name, shape given, shape the model has) of each of `shapes` the model has in another
        shape, in the model's order; names it has no shape for (`beyond`) are not judged."""
        return [(name, tuple(shapes[name]), want) for name, want in self.shapes.items()
                if name in shapes and tuple(shapes[name]) != want]


def shape_problem(what: str, got: Sequence[int], want: Sequence[int], model_class: str, config_path: Any,
                  config: Mapping[str, Any]) -> str:
    """`what is [130, 32], but CFG has vocab_size=128: a LlamaForCausalLM wants [128, 32]`: the
    config keys named are those whose value is a size the tensor should have and has not."""
    keys = sizing_keys(config, got, want)
    if keys:
        return f"{what} is {list(got)}, but {config_path} has {keys}: a {model_class} wants {list(want)}"
    return f"{what} is {list(got)}, but a {model_class} of {config_path} wants {list(want)}"


SIZE_WORDS = ("size", "dim", "heads", "experts", "rank", "layers", "groups", "kernel")
"""Words in the names of config keys that size weights (`vocab_size`, `head_dim`,
`num_key_value_heads`, `n_routed_experts`, `kv_lora_rank`, `n_groups`, `conv_kernel` …)."""
NOT_SIZES = ("max_", "position", "per_tok")
"""… and in those that do not, though they hold a count (`max_position_embeddings`,
`num_experts_per_tok`, `max_window_layers`)."""


def sizing_keys(config: Mapping[str, Any], got: Sequence[int], want: Sequence[int]) -> str:
    """The config keys that size weights (`SIZE_WORDS`; a sub-config's as `text_config.vocab_size`)
    whose value is a wanted size the tensor lacks, as `key=value, …`; '' when none is (a size the
    config implies as a product, `num_attention_heads × head_dim`, or another number of dims)."""
    if len(got) != len(want):
        return ""
    sizes = {w for g, w in zip(got, want) if g != w}
    found = []
    for key, value in config.items():
        if isinstance(value, dict):
            found += [(f"{key}.{k}", v) for k, v in value.items() if _sizes(k, v, sizes)]
        elif _sizes(key, value, sizes):
            found.append((key, value))
    return ", ".join(f"{key}={value}" for key, value in found)


def _sizes(key: str, value: Any, sizes: set[int]) -> bool:
    """Whether config `key` sizes weights and its value is one of `sizes`."""
    return (isinstance(value, int) and not isinstance(value, bool) and value in sizes
            and any(w in key for w in SIZE_WORDS) and not any(w in key for w in NOT_SIZES))


def shown(names: list[str]) -> str:
    """The first few names and how many more."""
    more = f" (+{len(names) - SHOWN} more)" if len(names) > SHOWN else ""
    return ", ".join(names[:SHOWN]) + more


def transformers_available() -> bool:
    """Whether `import transformers` can work, without importing it."""
    try:
        return importlib.util.find_spec("transformers") is not None
    except (ImportError, ValueError):
        return False


Preparing = Callable[[str], ContextManager[object]]
"""What shows a line saying what a run does while it waits on something other than its bytes
(the CLI's `ProgressDisplay.preparing`)."""


def asking_transformers(preparing: Preparing | None, what: str) -> Preparing | None:
    """`expected_names`' `asking`: while transformers is imported and its model built (seconds,
    once per config), `preparing` shows `checking {what} against transformers' LlamaForCausalLM`."""
    if preparing is None:
        return None
    return lambda model: preparing(f"checking {what} against transformers' {model}")


def expected_names(config: Mapping[str, Any],
                   asking: Preparing | None = None) -> ExpectedNames:
    """The names the model of this `config.json` content expects (transformers must be importable).

    When the cache does not answer, transformers is asked inside `asking(model)`, `model` naming
    the class it builds (`model_named`): seconds the first time (transformers is imported), which
    the CLI shows as a line saying so rather than a silent terminal.

    Raises UsageError, one line, when transformers has no model class for the config or cannot
    build it.
    """
    version = importlib.metadata.version("transformers")
    key = hashlib.sha256(json.dumps({"format": CACHE_FORMAT, "transformers": version, "config": config},
                                    sort_keys=True, default=str).encode()).hexdigest()
    cached = _read_cache(key, version)
    if cached is not None:
        return cached
    with (asking or contextlib.nullcontext)(model_named(config)):
        names = _ask_transformers(dict(config), version)
    _write_cache(key, names)
    return names


def model_named(config: Mapping[str, Any]) -> str:
    """The transformers class `_ask_transformers` builds for `config`, as a person reads it:
    `LlamaForCausalLM`, or `AutoModelForCausalLM for 'llama'` for a config without architectures."""
    architectures = config.get("architectures") or []
    if architectures:
        return str(architectures[0])
    return f"AutoModelForCausalLM for {config.get('model_type')!r}"


def _ask_transformers(config: dict[str, Any], version: str) -> ExpectedNames:
    """Build the model on the meta device and read its names."""
    import torch
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    model_type = config.get("model_type")
    architectures = config.get("architectures") or []
    what = f"model_type {model_type!r}" + (f" ({', '.join(map(str, architectures))})" if architectures else "")
    hint = "cannot check the tensor names (--no-name-check writes them unchecked; the output may not load)"
    if "auto_map" in config:  # `families.base.read_config` refused it already; never reaches transformers
        raise UsageError(f"{what}: the config has an auto_map (custom model code), and ckptctl never runs it")
    if model_type not in CONFIG_MAPPING:
        raise UsageError(f"transformers {version} has no model for {what}: {hint}")
    cls = None
    if architectures:
        cls = getattr(transformers, str(architectures[0]), None)
        if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)):
            raise UsageError(f"transformers {version} has no model class {architectures[0]!r}: {hint}")
    with _quiet():
        try:
            config_class = CONFIG_MAPPING[model_type]
            decode = getattr(config_class, "_decode_special_floats", None)  # what from_pretrained does to
            data = decode(dict(config)) if decode is not None else dict(config)  # {"__float__": "Infinity"}
            hf_config = config_class.from_dict(data)
            with torch.device("meta"):
                if cls is None:
                    model = transformers.AutoModelForCausalLM.from_config(hf_config, trust_remote_code=False)
                else:
                    model = cls(hf_config)
        except Exception as exc:  # transformers raises ValueError, KeyError, TypeError … for configs it rejects
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise UsageError(f"transformers {version} cannot build a model for {what} ({first}): {hint}") from None
    state = model.state_dict()
    names = set(state)
    shapes = {n: tuple(t.shape) for n, t in state.items()}
    tied = _tied(model, names)
    optional = {n for n in names if _matches(n, getattr(model, "_keys_to_ignore_on_load_missing", None))
                or _matches(n, getattr(model, "_keys_to_ignore_on_save", None))}
    in_memory = frozenset(names - set(tied) - optional)
    saved = in_memory
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # transformers 4 saves what it holds
        pass
    else:
        with _quiet():
            reverted = revert_weight_conversion(model, {n: state[n] for n in in_memory})
        saved = frozenset(reverted)
        shapes.update((n, tuple(t.shape)) for n, t in reverted.items() if hasattr(t, "shape"))
    transposed = frozenset(f"{name}.{param}" for name, module in model.named_modules()
                           if getattr(module, "is_transposed", False) is True
                           for param, _ in module.named_parameters(recurse=False))
    return ExpectedNames(type(model).__name__, saved, frozenset(optional - set(tied)), tied, version,
                         in_memory if in_memory != saved else frozenset(), shapes=shapes, transposed=transposed)


def _tied(model: Any, names: set[str]) -> dict[str, str]:
    """Tied parameter → its source, as transformers ties them for this config."""
    if hasattr(model, "get_expanded_tied_weights_keys"):  # transformers 5
        return {k: v for k, v in model.get_expanded_tied_weights_keys(all_submodels=True).items() if k in names}
    keys = getattr(model, "_tied_weights_keys", None) or []  # transformers 4: a list, tied to the input embeddings
    if not getattr(model.config, "tie_word_embeddings", False) or not hasattr(model, "get_input_embeddings"):
        return {}
    source = next((n for n, p in model.named_parameters() if p is model.get_input_embeddings().weight), "")
    return {k: source for k in keys if k in names}


def _matches(name: str, patterns: Any) -> bool:
    return bool(patterns) and any(re.search(p, name) for p in patterns)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """No transformers log lines or Python warnings on the user's terminal while the model is built."""
    from transformers.utils import logging

    level = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.set_verbosity(level)


def cache_dir() -> Path | None:
    where = os.environ.get(CACHE_ENV)
    if where == "off":
        return None
    if where:
        return Path(where) / "hf-names"
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "ckptctl" / "hf-names"


def _read_cache(key: str, version: str) -> ExpectedNames | None:
    folder = cache_dir()
    if folder is None:
        return None
    try:
        data = json.loads((folder / f"{key}.json").read_text())
        names = ExpectedNames(str(data["model_class"]), frozenset(map(str, data["required"])),
                              frozenset(map(str, data["optional"])),
                              {str(k): str(v) for k, v in data["tied"].items()}, version,
                              frozenset(map(str, data["in_memory"])),
                              shapes={str(k): tuple(int(n) for n in v) for k, v in data["shapes"].items()},
                              transposed=frozenset(map(str, data["transposed"])))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return names


def _write_cache(key: str, names: ExpectedNames) -> None:
    """Best effort: a cache that cannot be written is no error."""
    folder = cache_dir()
    if folder is None:
        return
    data = {"model_class": names.model_class, "required": sorted(names.required), "optional": sorted(names.optional),
            "tied": dict(sorted(names.tied.items())), "in_memory": sorted(names.in_memory),
            "shapes": {k: list(v) for k, v in names.shapes.items()}, "transposed": sorted(names.transposed)}
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)
        os.replace(tmp, folder / f"{key}.json")
    except OSError:
        with contextlib.suppress(OSError, UnboundLocalError):
            os.unlink(tmp)
