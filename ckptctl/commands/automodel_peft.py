"""A NeMo Automodel PEFT save (`storage.automodel_peft`): what `inspect` says of it, and why
`export-hf` sends the user through `import-hf --adapter`.

Its `model/` is a PEFT LoRA folder that `PeftModel.from_pretrained` loads as is: Automodel's
`LinearLoRA` keeps the base weight at `<m>.weight` and the adapter at `<m>.lora_A.weight`
[dim, in] / `<m>.lora_B.weight` [out, dim] (DoRA: `<m>.lora_magnitude`, saved as
`<m>.lora_magnitude_vector`), merged as W + (alpha / dim) · B · A (no rsLoRA), which is peft's
merge at r = dim, α = alpha, as `adapter_config.json` says. The folder holds the adapters alone:
the base weights are the pretrained model the run started from.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from typing import Any

from ckptctl.families.adapters import PEFT_PREFIX, read_adapter_config
from ckptctl.formats.safetensors.reader import open_safetensors_folder
from ckptctl.storage.automodel_peft import (ADAPTER_CONFIG, ADAPTER_WEIGHTS, AUTOMODEL_PEFT_CONFIG, AutomodelPeft)
from ckptctl.storage.hf_files import read_json_object
from ckptctl.storage.store import EntryKind, store_for
from ckptctl.util.errors import CheckpointError, UsageError

_PART = re.compile(r"^(?P<module>.+)\.(?:(?P<lora>lora_A|lora_B)\.weight|lora_magnitude_vector)$")
AUTOMODEL_KEYS = ("use_triton", "use_dora", "dropout", "dropout_position", "lora_dtype", "moe_rank_scaling",
                  "expert_weight_format", "target_modules", "exclude_modules", "match_all_linear")
"""The fields of automodel_peft_config.json `inspect` shows (Automodel's PeftConfig but dim and alpha)."""


def merge_hint(found: AutomodelPeft) -> str:
    """The two commands that give the merged model (BASE: the pretrained model's HF folder)."""
    return (f"ckptctl import-hf BASE TMP --adapter {found.path} then ckptctl export-hf TMP DST --hf-config BASE "
            f"--merge-adapters --adapter-config {found.adapter / ADAPTER_CONFIG}")


def refuse_export(found: AutomodelPeft) -> UsageError:
    what = "its model/ is a PEFT adapter folder" if found.step is not None else "a PEFT adapter folder"
    return UsageError(f"{found.path}: a NeMo Automodel PEFT checkpoint: {what} (the adapters alone; "
                      "PeftModel.from_pretrained loads it as is), which export-hf does not read; for merged "
                      f"weights: {merge_hint(found)}")


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
    parts: dict[str, dict[str, tuple[int, ...]]] = {}
    for name in sorted(tensors):
        match = _PART.match(name[len(PEFT_PREFIX):]) if name.startswith(PEFT_PREFIX) else None
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
    if not parts and not config.get("target_parameters"):
        raise CheckpointError(weights, "holds no LoRA adapter (no <m>.lora_A.weight)")
    return {
        "path": str(found.path), "format": "nemo-automodel peft",
        "adapter_folder": str(found.adapter),
        "optimizer": str(found.optimizer) if found.optimizer is not None else None,
        "adapters": {"kind": "dora" if scale.dora else "lora", "modules": len(parts), "rank": scale.rank,
                     "alpha": scale.alpha, "scale": scale.scale(scale.rank or 1), "rslora": scale.rslora,
                     "targets": dict(sorted(Counter(m.rsplit(".", 1)[-1] for m in parts).items())),
                     "target_parameters": config.get("target_parameters") or [],
                     "base_model": config.get("base_model_name_or_path") or None},
        "automodel": {k: automodel[k] for k in AUTOMODEL_KEYS if k in automodel},
        "merge": merge_hint(found),
    }


def summary_lines(doc: dict[str, Any]) -> list[str]:
    """inspect's text: one line per part, then how to get the merged model."""
    ad = doc["adapters"]
    kind = "DoRA" if ad["kind"] == "dora" else "LoRA"
    targets = ", ".join(f"{leaf} ×{count}" for leaf, count in ad["targets"].items())
    experts = (f"; LoRA on {len(ad['target_parameters'])} parameters (target_parameters: MoE experts), which "
               "import-hf does not import yet" if ad["target_parameters"] else "")
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
