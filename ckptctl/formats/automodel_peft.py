"""A NeMo Automodel PEFT checkpoint, by its names alone (nothing but entry kinds is read here).

Automodel (0.7, `components/checkpoint/checkpointing.py`, `addons.py`) saves a LoRA run's step
folder (`epoch_<e>_step_<s>/`) with its model not as DCP but as a PEFT adapter folder in `model/`:
rank 0 writes `adapter_model.safetensors` (the trainable tensors gathered whole, named
`base_model.model.<m>.lora_A.weight` …, as peft's `save_pretrained` names them), `PeftAddon`
writes `adapter_config.json` (`r`, `lora_alpha`, `use_dora`, the adapted modules' full names as
`target_modules`) and `automodel_peft_config.json` (the rest of Automodel's PeftConfig), which
marks the folder as Automodel's. The optimizer is a DCP checkpoint in `optim/`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ckptctl.storage.store import EntryKind, store_for
from ckptctl.util.errors import UsageError

AUTOMODEL_PEFT_CONFIG = "automodel_peft_config.json"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
MODEL_PART = "model"
OPTIMIZER_PART = "optim"
DCP_METADATA = ".metadata"


@dataclass(frozen=True)
class AutomodelPeft:
    """An Automodel PEFT save: the step folder (None when given its `model/` folder alone) and its adapter folder."""

    step: Path | None
    adapter: Path
    optimizer: Path | None
    """`optim/` when it is there (a DCP checkpoint of the optimizer)."""

    @property
    def path(self) -> Path:
        return self.step if self.step is not None else self.adapter


def _is_adapter_folder(path: Path) -> bool:
    store = store_for(path)
    return all(store.kind(path / name) is EntryKind.FILE for name in (AUTOMODEL_PEFT_CONFIG, ADAPTER_CONFIG))


def automodel_peft(path: Path) -> AutomodelPeft | None:
    """`path` as an Automodel PEFT save (its step folder, or the `model/` folder in it), or None:
    a folder holding `automodel_peft_config.json` and `adapter_config.json` is the adapter folder.
    Refused: such a folder that is a DCP checkpoint too (`.metadata` of its own), which the DCP
    commands take as that checkpoint (which of the two is meant is not known)."""
    store = store_for(path)
    if store.kind(path) is not EntryKind.FOLDER:
        return None
    if _is_adapter_folder(path):
        found = AutomodelPeft(None, path, None)
    elif store.kind(path / MODEL_PART) is EntryKind.FOLDER and _is_adapter_folder(path / MODEL_PART):
        optim = path / OPTIMIZER_PART
        found = AutomodelPeft(path, path / MODEL_PART, optim if store.kind(optim) is EntryKind.FOLDER else None)
    else:
        return None
    if store.kind(path / DCP_METADATA) is EntryKind.FILE:
        raise UsageError(f"{path}: both a DCP checkpoint (its own {DCP_METADATA}) and a NeMo Automodel PEFT save "
                         f"({MODEL_PART + '/ ' if found.step is not None else ''}a PEFT folder): which one is meant "
                         "is not known; move one of them to a folder of its own")
    return found
