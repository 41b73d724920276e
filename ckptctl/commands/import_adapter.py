"""`import-hf BASE DST --adapter FOLDER`: a PEFT LoRA folder and its base model as one peft model's DCP.

A fine-tuning run that goes on training an adapter at N ranks loads the state dict of
`get_peft_model(model, LoraConfig.from_pretrained(FOLDER))`, `fully_shard`ed: the base's
tensors and the folder's under peft's names (`families.peft_folder`), each row-sharded as
FSDP2 shards it. The folder's `adapter_model.safetensors` is opened as a second source
beside the base folder, its tensors under their own names (its chunks name the file by its
absolute path, so one engine streams and `--verify` re-reads both); nothing is loaded whole.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from ckptctl.core.checkpoint import Checkpoint
from ckptctl.core.dtypes import DType, cast_dtype
from ckptctl.core.plan import SourceTensor, TargetTensor, identity_target, source_view
from ckptctl.families.adapters import PEFT_CONFIG
from ckptctl.families.expected import ExpectedNames
from ckptctl.families.peft_folder import peft_model_names, read_folder_config
from ckptctl.formats.safetensors.reader import open_safetensors_folder
from ckptctl.util.errors import CheckpointError, UsageError
from ckptctl.util.wording import counted
from ckptctl.formats.automodel_peft import automodel_peft
from ckptctl.storage.store import EntryKind, store_for

PEFT_WEIGHTS = "adapter_model.safetensors"
PICKLED_WEIGHTS = "adapter_model.bin"


def check_adapter_options(to: str, include: tuple[str, ...], exclude: tuple[str, ...]) -> None:
    """`--adapter` writes a whole peft model as FSDP2 saves it: no other layout, no selection."""
    if to != "fsdp2":
        raise UsageError(f"--adapter writes a peft model as FSDP2 saves it: it has no --to {to}")
    if include or exclude:
        raise UsageError("--include/--exclude do not apply to --adapter (the peft model loads every tensor)")


def adapter_folder(folder: Path) -> Path:
    """The PEFT folder `--adapter` names: the folder, or the `model/` folder of a NeMo Automodel
    PEFT step folder (`epoch_<e>_step_<s>/`, whose model Automodel saves as a PEFT folder)."""
    found = automodel_peft(folder)
    return found.adapter if found is not None else folder


def adapter_weights(folder: Path) -> tuple[Path, Path]:
    """The folder's adapter_config.json and adapter_model.safetensors; a pickled one is refused unread."""
    store = store_for(folder)
    if store.kind(folder) is not EntryKind.FOLDER:
        raise CheckpointError(folder, f"not a PEFT adapter folder ({PEFT_CONFIG} and {PEFT_WEIGHTS})")
    weights = folder / PEFT_WEIGHTS
    if store.kind(weights) is EntryKind.MISSING:
        if store.kind(folder / PICKLED_WEIGHTS) is not EntryKind.MISSING:
            raise CheckpointError(folder, f"holds {PICKLED_WEIGHTS}, a pickle, which import-hf does not unpickle: "
                                          f"save the adapter with safetensors ({PEFT_WEIGHTS})")
        raise CheckpointError(folder, f"has no {PEFT_WEIGHTS}")
    config = folder / PEFT_CONFIG
    if store.kind(config) is EntryKind.MISSING:
        raise CheckpointError(folder, f"has no {PEFT_CONFIG} (its r, lora_alpha and target_modules)")
    return config, weights


def peft_targets(ckpt: Checkpoint, views: dict[str, SourceTensor], targets: list[TargetTensor], folder: Path,
                 adapter_name: str, dtype: DType | None, notes: list[str],
                 model: ExpectedNames | None = None) -> list[TargetTensor]:
    """The base model's targets renamed as the peft model holds them, and the folder's tensors as
    targets of their own; the folder's entries join `ckpt` and `views` under their peft names
    (`model`: transformers' model of the base, which peft nests and shapes ParamWrappers by)."""
    folder = adapter_folder(folder)
    config_path, weights = adapter_weights(folder)
    config = read_folder_config(config_path)
    adapter = open_safetensors_folder(weights)
    names = peft_model_names({t.fqn: t.shape for t in targets}, {n: e.shape for n, e in adapter.tensors.items()},
                             config, adapter_name, weights, model)
    files = {file: str((adapter.path / file).resolve()) for file in adapter.files}
    for file, path in files.items():
        ckpt.files[path] = adapter.files[file]
    refuse_overridden_ties(targets, names.base, weights)
    out = [replace(t, fqn=names.base[t.fqn]) for t in targets if t.fqn in names.base]
    for name, peft_name in sorted(names.folder.items()):  # under their own names: checks find them in the file
        if name in ckpt.tensors:
            raise CheckpointError(weights, f"{name}: also a tensor of the base model's folder")
        entry = adapter.tensors[name]
        ckpt.tensors[name] = replace(entry, chunks=tuple(replace(c, file=files[c.file]) for c in entry.chunks))
        views[name] = source_view(ckpt.tensors[name])
        out.append(identity_target(views[name], peft_name, cast_dtype(entry.dtype, dtype)))
    saved = f"; {', '.join(names.saved)} trained whole (modules_to_save)" if names.saved else ""
    named = "" if adapter_name == "default" else f", adapter_name={adapter_name!r}"
    notes.append(f"{counted(len(names.adapted), 'LoRA adapter')} (rank {names.rank}) of {folder} written under "
                 f"peft's names{saved}: load into get_peft_model(model, LoraConfig.from_pretrained(...){named})")
    return out


def refuse_overridden_ties(targets: list[TargetTensor], kept: dict[str, str], where: Path) -> None:
    """A base weight the folder overrides (an adapted embedding's, which peft saves) must not be
    another tensor's source too (a head tied to it): that copy would keep the base's values."""
    overridden = {p.src for t in targets if t.fqn not in kept for p in t.pieces}
    tied = sorted(t.fqn for t in targets if t.fqn in kept and any(p.src in overridden for p in t.pieces))
    if tied:
        raise CheckpointError(where, f"overrides a base weight that {tied[0]} is tied to, which import-hf does not "
                                     "import yet")
