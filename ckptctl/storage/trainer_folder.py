"""The HF Trainer / accelerate checkpoint folder: `checkpoint-N/` of an FSDP model saved with
`SHARDED_STATE_DICT`, by its names alone (nothing is read here).

accelerate's `save_fsdp_model` writes the model as a DCP checkpoint in `pytorch_model_fsdp_<i>/`
(entries `model.<fqn>`) and `save_fsdp_optimizer` the optimizer in `optimizer_<i>/` (entries
`optimizer.state.<fqn>.<state>`, `optimizer.param_groups.…`), `<i>` the model's or optimizer's
index. Beside them the Trainer writes `scheduler.pt`, `trainer_state.json`, `scaler.pt` and one
`rng_state_<process>.pth` per process, accelerate's `save_state` `scheduler.bin`, `sampler.bin`
and one `random_states_<process>.pkl` per process (`core.rank_state.rank_files`), and with a
stateful dataloader `dl_state_dict.bin` (`dl_state_dict_<i>.bin` for dataloader i), one file
every process loads, of the world size its per-rank files say, else its model part's data files. With
`use_dcp=False` both write per-rank `torch.save` shards instead (`…_rank<process>.bin`), which no
DCP reader takes.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from ckptctl.core.rank_state import RankFiles, rank_files
from ckptctl.util.errors import UsageError

MODEL_PART = re.compile(r"^pytorch_model_fsdp_(0|[1-9][0-9]{0,3})$")
FIRST_MODEL_PART = "pytorch_model_fsdp_0"
OPTIMIZER_PART = re.compile(r"^optimizer_(0|[1-9][0-9]{0,3})$")
RANK_SHARD = re.compile(r"^(?:pytorch_model_fsdp|optimizer)(?:_[0-9]+)?_rank[0-9]+\.bin$")
"""A model's or optimizer's shard saved with `use_dcp=False`: one process's share, as its `torch.save` wrote it."""
_LISTED = 10_000
"""Entries of a folder looked at: a Trainer folder holds a dozen, plus one file per process."""


def _is_dcp(folder: Path) -> bool:
    return (folder / ".metadata").exists() or (folder / "__0.metadata").exists()


def _is_file(entry: os.DirEntry) -> bool:
    """Whether `entry` is a regular file or a link to one; a link that cannot be followed (a loop,
    too long a chain) is not (it is then no file the folder's rules carry)."""
    try:
        return entry.is_file()
    except OSError:
        return False


@dataclass(frozen=True)
class TrainerFolder:
    """A checkpoint folder's DCP parts, its per-rank files and the files that hold no rank's share."""

    path: Path
    models: tuple[str, ...]
    optimizers: tuple[str, ...]
    rank_files: tuple[RankFiles, ...]
    files: tuple[str, ...]
    """Regular files of no rank (`scheduler.pt`, `trainer_state.json`, …), in name order."""
    rank_shards: tuple[str, ...]
    """`use_dcp=False` shards: a process's share of the model or optimizer, never resharded."""
    others: tuple[str, ...]
    """Entries that are neither a part nor a regular file (another folder, a FIFO …)."""

    @property
    def parts(self) -> tuple[str, ...]:
        return self.models + self.optimizers


def _index(name: str) -> int:
    return int(name.rsplit("_", 1)[1])


def trainer_folder(path: Path) -> TrainerFolder | None:
    """`path` as a Trainer / accelerate checkpoint folder, or None when it holds no model part
    (a `pytorch_model_fsdp_<i>/` DCP checkpoint) or is a DCP checkpoint itself. Refused: a DCP
    checkpoint holding a first model part (which of the two a command is to take is not known;
    taken as the DCP checkpoint, the Trainer parts were left out of a reshard unsaid)."""
    path = Path(path)
    try:
        if not path.is_dir():
            return None
        if _is_dcp(path):
            if (path / FIRST_MODEL_PART).is_dir() and _is_dcp(path / FIRST_MODEL_PART):
                raise UsageError(f"{path}: both a DCP checkpoint (its own .metadata) and an HF Trainer / accelerate "
                                 f"checkpoint folder ({FIRST_MODEL_PART}/): which one is meant is not known; move "
                                 "one of them to a folder of its own")
            return None
        with os.scandir(path) as scan:
            entries = [entry for _, entry in zip(range(_LISTED), scan)]
    except OSError:
        return None
    models, optimizers, files, others = [], [], [], []
    for entry in entries:
        is_dir = entry.is_dir(follow_symlinks=False)
        if is_dir and MODEL_PART.match(entry.name) and _is_dcp(Path(entry.path)):
            models.append(entry.name)
        elif is_dir and OPTIMIZER_PART.match(entry.name) and _is_dcp(Path(entry.path)):
            optimizers.append(entry.name)
        elif _is_file(entry):
            files.append(entry.name)
        else:
            others.append(entry.name)
    if not models:
        return None
    per_rank = rank_files(files, lambda: _part_world(path / sorted(models, key=_index)[0]))
    ranked = {n for state in per_rank for n in state.names}
    shards = sorted(n for n in files if RANK_SHARD.match(n))
    return TrainerFolder(path, tuple(sorted(models, key=_index)), tuple(sorted(optimizers, key=_index)),
                         tuple(per_rank), tuple(sorted(n for n in files if n not in ranked and n not in shards)),
                         tuple(shards), tuple(sorted(others)))


_DATA_FILE = re.compile(r"^__(0|[1-9][0-9]{0,5})_[0-9]+\.distcp$")


def _part_world(part: Path) -> int | None:
    """The world size that saved DCP part `part`, by its data files' names (`__<rank>_<i>.distcp`,
    one rank's each, as torch's FileSystemWriter names them); None when it has none."""
    try:
        with os.scandir(part) as scan:
            ranks = [int(m[1]) for _, e in zip(range(_LISTED), scan) if (m := _DATA_FILE.match(e.name))]
    except OSError:
        return None
    return max(ranks) + 1 if ranks else None


def model_part(path: Path) -> Path:
    """The DCP checkpoint of the model a command reads from `path`: a Trainer folder's model part
    (`pytorch_model_fsdp_0/`), else `path` itself."""
    folder = trainer_folder(path)
    if folder is None:
        return Path(path)
    if len(folder.models) > 1:
        raise UsageError(f"{path}: a Trainer checkpoint folder of {len(folder.models)} models "
                         f"({', '.join(folder.models)}); pass the one to read ({path}/{folder.models[0]} …)")
    return folder.path / folder.models[0]
