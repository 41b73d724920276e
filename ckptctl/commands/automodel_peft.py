"""A NeMo Automodel PEFT save (`storage.automodel_peft`): what `inspect` says of it, and the
peft model `export-hf` exports of it (`peft_source`).

Its `model/` is a PEFT LoRA folder that `PeftModel.from_pretrained` loads as is: Automodel's
`LinearLoRA` keeps the base weight at `<m>.weight` and the adapter at `<m>.lora_A.weight`
[dim, in] / `<m>.lora_B.weight` [out, dim] (DoRA: `<m>.lora_magnitude`, saved as
`<m>.lora_magnitude_vector`), merged as W + (alpha / dim) · B · A (no rsLoRA), which is peft's
merge at r = dim, α = alpha, as `adapter_config.json` says. The folder holds the adapters alone:
the base weights are the pretrained model the run started from (an HF folder). `export-hf` sees
the two as one checkpoint under the peft model's names (`families.peft_folder`, as `import-hf
--adapter` names them: `<m>.base_layer.weight`, `<m>.lora_A.default.weight`), each tensor read
from its own file under its own name (`TensorEntry.record`), so the export's merge, adapter
folder and checks are those of a peft model's FSDP2 checkpoint.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

from ckptctl.commands.import_adapter import adapter_weights
from ckptctl.core.checkpoint import Checkpoint, TensorEntry
from ckptctl.families.adapters import PEFT_PREFIX, read_adapter_config
from ckptctl.families.expert_lora import is_per_expert
from ckptctl.families.experts import stacked_shapes
from ckptctl.families.peft_folder import peft_model_names, read_folder_config
from ckptctl.formats.safetensors.reader import open_safetensors_folder
from ckptctl.formats.automodel_peft import (ADAPTER_CONFIG, ADAPTER_WEIGHTS, AUTOMODEL_PEFT_CONFIG, AutomodelPeft)
from ckptctl.storage.hf_files import read_json_object
from ckptctl.storage.store import EntryKind, store_for
from ckptctl.util.errors import CheckpointError, UsageError

_PART = re.compile(r"^(?P<module>.+)\.(?:(?P<lora>lora_A|lora_B)\.weight|lora_magnitude_vector)$")
AUTOMODEL_KEYS = ("use_triton", "use_dora", "dropout", "dropout_position", "lora_dtype", "moe_rank_scaling",
                  "expert_weight_format", "target_modules", "exclude_modules", "match_all_linear")
"""The fields of automodel_peft_config.json `inspect` shows (Automodel's PeftConfig but dim and alpha)."""


def _parameter_modules(config: dict[str, Any], path: Any) -> tuple[str, ...]:
    """The modules whose parameters `target_parameters` adapts (`mlp.experts` of
    `mlp.experts.gate_up_proj`): peft wraps each parameter, nesting `base_layer`s."""
    names = config.get("target_parameters") or []
    if not (isinstance(names, list) and all(isinstance(n, str) and "." in n for n in names)):
        raise UsageError(f"{path}: target_parameters is {json.dumps(names)}, not a list of parameter names")
    return tuple(sorted({n.rsplit(".", 1)[0] for n in names}))


def _on_parameter(module: str, wrapped: tuple[str, ...]) -> bool:
    """Whether `module` (a LoRA tensor's, up to `.lora_A`) is a ParamWrapper of a `target_parameters` module."""
    while module.endswith(".base_layer"):
        module = module[:-len(".base_layer")]
    return any(module == w or module.endswith("." + w) for w in wrapped)


def peft_source(found: AutomodelPeft, base: Path | None, ref: str | Path) -> Checkpoint:
    """The peft model of the run's base model (`base`, else `ref`, the `--hf-config` folder, which
    must then hold the weights) and its adapter folder, as one checkpoint of safetensors files.
    LoRA on MoE expert stacks (`target_parameters`) over a base holding its experts one by one:
    the per-expert tensors keep their names (under the wrappers' `.base_layer` steps), and the
    adapter is told its stack by the shapes they make (`families.experts.stacked_shapes`), which
    export-hf merges per expert. Refused: a base without safetensors weights, and whatever the
    adapter folder's check refuses (`peft_model_names`: an adapter on a module the base lacks, a
    rank other than `r`, a module the config adapts without adapter …)."""
    if base is None:
        local = Path(ref)
        if store_for(local).kind(local) is not EntryKind.FOLDER or not stored_tensors_here(local):
            raise UsageError(f"{found.path}: a NeMo Automodel PEFT checkpoint holds the adapters alone: pass --base "
                             "(the pretrained model's Hugging Face folder) or an --hf-config folder holding its "
                             "safetensors weights")
        base = local
    config_path, weights = adapter_weights(found.adapter)
    model = open_safetensors_folder(base)
    adapter = open_safetensors_folder(weights)
    config = read_folder_config(config_path, "export-hf does not read")
    shapes = {n: e.shape for n, e in model.tensors.items()}
    if config.parameters:  # a base folder's experts one by one: peft wraps the stacks transformers makes of them
        modules = {n.split(".mlp.experts.", 1)[0] + ".mlp.experts" for n in shapes if is_per_expert(n)}
        stacks = {f"{m}.{p}": shape for m in sorted(modules) for p, shape in stacked_shapes(m, shapes).items()}
        shapes.update(stacks)
    names = peft_model_names(shapes, {n: e.shape for n, e in adapter.tensors.items()}, config, "default", weights)
    tensors: dict[str, TensorEntry] = {}
    files: dict[str, int] = {}
    for source, renamed in ((model, names.base), (adapter, names.folder)):
        paths = {f: str((source.path / f).resolve()) for f in source.files}
        files.update((paths[f], size) for f, size in source.files.items())
        for name, peft_name in renamed.items():
            if name not in source.tensors:
                continue  # a stack of the base's per-expert tensors, which it holds under their own names
            entry = source.tensors[name]
            tensors[peft_name] = replace(entry, fqn=peft_name, record=name,
                                         chunks=tuple(replace(c, file=paths[c.file]) for c in entry.chunks))
    return Checkpoint(path=found.path, tensors=tensors, bytes_entries={}, files=files, safetensors_folder=True)


def stored_tensors_here(folder: Path) -> bool:
    """Whether an HF folder holds safetensors weights (a config-only folder does not)."""
    return bool(store_for(folder).glob(folder, "*.safetensors"))


def merge_hint(found: AutomodelPeft) -> str:
    """The command that gives the merged model (BASE: the pretrained model's HF folder, with its weights)."""
    return f"ckptctl export-hf {found.path} DST --hf-config BASE --merge-adapters"


def describe(found: AutomodelPeft) -> dict[str, Any]:
    """inspect's document: the adapters (kind, modules, rank, α, s, targets by leaf name), the
    run's Automodel PEFT settings, the optimizer part. Refused with one line: a folder whose
    config or tensors do not agree (an A without its B, a rank other than `r`, DoRA magnitudes
    against `use_dora`, a tensor that is no LoRA tensor), or whose weights are missing."""
    weights, config_path = found.adapter / ADAPTER_WEIGHTS, found.adapter / ADAPTER_CONFIG
    if store_for(weights).kind(weights) is EntryKind.MISSING:
        raise CheckpointError(found.adapter, f"has no {ADAPTER_WEIGHTS} (Automodel writes it beside {ADAPTER_CONFIG})")
    scale = read_adapter_config(config_path, "ckptctl does not read")
    config = read_json_object(config_path, "peft adapter config")
    automodel = read_json_object(found.adapter / AUTOMODEL_PEFT_CONFIG, "Automodel PEFT config")
    tensors = open_safetensors_folder(weights).tensors
    wrapped = _parameter_modules(config, config_path)
    parts: dict[str, dict[str, tuple[int, ...]]] = {}
    on_parameters = 0
    for name in sorted(tensors):
        match = _PART.match(name[len(PEFT_PREFIX):]) if name.startswith(PEFT_PREFIX) else None
        if match is not None and _on_parameter(match["module"], wrapped):
            on_parameters += 1  # peft's ParamWrapper (MoE experts): neither checked nor merged here
            continue
        if match is None:
            raise CheckpointError(weights, f"{name}: not a LoRA tensor under {PEFT_PREFIX} (<m>.lora_A.weight, "
                                           "<m>.lora_B.weight, <m>.lora_magnitude_vector)")
        parts.setdefault(match["module"], {})[match["lora"] or "magnitude"] = tensors[name].shape
    for module, found_parts in parts.items():
        for part in ("lora_A", "lora_B"):
            if part not in found_parts:
                raise CheckpointError(weights, f"{PEFT_PREFIX}{module} has no {part}")
        a, b = found_parts["lora_A"], found_parts["lora_B"]
        if len(a) != 2 or len(b) != 2 or a[0] != b[1]:
            raise CheckpointError(weights, f"{PEFT_PREFIX}{module}: lora_A {list(a)} and lora_B {list(b)} do not pair "
                                           "([r, in] and [out, r])")
        if a[0] != scale.rank:
            raise CheckpointError(weights, f"{PEFT_PREFIX}{module}.lora_A.weight has rank {a[0]} (its rows), but "
                                           f"{config_path} says r {scale.rank}")
        if ("magnitude" in found_parts) != bool(scale.dora):
            raise CheckpointError(weights, f"{PEFT_PREFIX}{module} {'holds' if 'magnitude' in found_parts else 'has no'} "
                                           f"DoRA magnitude, but {config_path} says use_dora "
                                           f"{str(bool(scale.dora)).lower()}")
    if not parts and not on_parameters:
        raise CheckpointError(weights, "holds no LoRA adapter (no <m>.lora_A.weight)")
    return {
        "path": str(found.path), "format": "nemo-automodel peft",
        "adapter_folder": str(found.adapter),
        "optimizer": str(found.optimizer) if found.optimizer is not None else None,
        "adapters": {"kind": "dora" if scale.dora else "lora", "modules": len(parts), "rank": scale.rank,
                     "alpha": scale.alpha, "scale": scale.scale(scale.rank or 1), "rslora": scale.rslora,
                     "targets": dict(sorted(Counter(m.rsplit(".", 1)[-1] for m in parts).items())),
                     "target_parameters": config.get("target_parameters") or [],
                     "parameter_tensors": on_parameters,
                     "base_model": config.get("base_model_name_or_path") or None},
        "automodel": {k: automodel[k] for k in AUTOMODEL_KEYS if k in automodel},
        "merge": merge_hint(found),
    }


def summary_lines(doc: dict[str, Any]) -> list[str]:
    """inspect's text: one line per part, then how to get the merged model."""
    ad = doc["adapters"]
    kind = "DoRA" if ad["kind"] == "dora" else "LoRA"
    targets = ", ".join(f"{leaf} ×{count}" for leaf, count in ad["targets"].items())
    experts = (f"; and LoRA on {len(ad['target_parameters'])} MoE expert parameters "
               f"({', '.join(ad['target_parameters'])}: {ad['parameter_tensors']} tensors as peft's ParamWrapper), "
               "which export-hf merges into the base folder's per-expert weights" if ad["target_parameters"]
               else "")
    am = doc["automodel"]
    settings = ", ".join(f"{k} {json.dumps(v)}" for k, v in am.items() if k in ("use_triton", "dropout", "lora_dtype"))
    base = f"; base model {ad['base_model']}" if ad["base_model"] else ""
    lines = [f"{doc['path']}: NeMo Automodel PEFT checkpoint",
             f"  adapters: {doc['adapter_folder']}, a PEFT folder (PeftModel.from_pretrained loads it as is): {kind}, "
             f"{ad['modules']} modules, rank {ad['rank']}, α {ad['alpha']:g} (s = α / r = {ad['scale']:g}) "
             f"({targets}){experts}{base}",
             f"  automodel: {settings}"]
    if doc["optimizer"] is not None:
        lines.append(f"  optimizer: {doc['optimizer']}, a DCP checkpoint (ckptctl inspect {doc['optimizer']})")
    lines.append(f"  merged model: {doc['merge']}")
    return lines
