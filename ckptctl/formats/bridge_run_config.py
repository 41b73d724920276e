"""The PEFT settings of a Megatron-Bridge run, from the `run_config.yaml` its checkpoint holds.

Megatron-Bridge writes the whole run's `ConfigContainer` as `run_config.yaml` into each
iteration folder it saves (`iter_0000100/run_config.yaml`, beside torch_dist's `metadata.json`
or fsdp_dtensor's `.metadata`; `save_checkpoint` → `cfg.to_yaml`, `yaml.safe_dump` of
`to_dict()`). Its `peft` key is the PEFT dataclass as a mapping: `_target_` (the class,
`megatron.bridge.peft.lora.LoRA` or `…canonical_lora.CanonicalLoRA`), `dim`, `alpha`,
`target_modules`, `normalize_moe_lora`, …; `null` for a run without PEFT. The file is untrusted:
read bounded in size, parsed by `yaml.safe_load` (no tags that build objects), and only those few
keys are looked at.
"""

from __future__ import annotations

import math
import reprlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from ckptctl.storage.hf_files import read_regular
from ckptctl.storage.store import store_for
from ckptctl.util.errors import CheckpointError

RUN_CONFIG = "run_config.yaml"
MAX_RUN_CONFIG_BYTES = 8 << 20
"""A whole run's configuration: tens of kB in Megatron-Bridge's recipes."""
LORA_CLASSES = {"megatron.bridge.peft.lora.LoRA": "lora",
                "megatron.bridge.peft.canonical_lora.CanonicalLoRA": "canonical-lora"}
"""`peft._target_` → the kind of adapters its run saves (export-hf merges these two)."""


@dataclass(frozen=True)
class BridgePeft:
    """A Megatron-Bridge run's LoRA settings, as its run_config.yaml gives them."""

    path: Path
    kind: str
    """`lora` or `canonical-lora` (`LORA_CLASSES`)."""
    alpha: float
    dim: int
    target_modules: tuple[str, ...]
    normalize_moe_lora: bool
    """Expert adapters then have dim // moe_router_topk (`get_effective_lora_dim`)."""


def run_config_path(ckpt: Path) -> Path | None:
    """The checkpoint folder's run_config.yaml, or None when it has none."""
    path = Path(ckpt) / RUN_CONFIG
    return path if store_for(path).exists(path) else None


def read_bridge_peft(path: Path) -> BridgePeft:
    """The LoRA settings of run_config.yaml `path`; CheckpointError naming it for anything else:
    not YAML, not a mapping, no peft (null: the run trained no adapters), a PEFT class other
    than LoRA or CanonicalLoRA, an α that is not a finite number, a dim that is not a positive
    integer."""
    data = read_regular(path, MAX_RUN_CONFIG_BYTES)
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    try:
        config = yaml.load(data, Loader=loader)  # noqa: S506 — a safe loader: plain data only
    except RecursionError:
        raise CheckpointError(path, "not a readable run config (nested too deeply)") from None
    except ValueError as exc:  # an integer past Python's digit limit: not a YAMLError (yaml.safe_load fails too)
        raise CheckpointError(path, f"not a readable run config ({str(exc).split(':')[0]})") from None
    except yaml.YAMLError as exc:
        problem = getattr(exc, "problem", None) or (str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise CheckpointError(path, f"not a readable run config ({problem}{where})") from None
    if not isinstance(config, dict):
        raise CheckpointError(path, "not a YAML mapping (is this a Megatron-Bridge run_config.yaml?)")
    peft = config.get("peft")
    if peft is None:
        raise CheckpointError(path, "peft is null: the run trained no adapters, yet the checkpoint holds "
                                    "Megatron-Bridge LoRA adapters")
    if not isinstance(peft, dict):
        raise CheckpointError(path, f"peft is {_shown(peft)}, not a mapping")
    target = peft.get("_target_")
    kind = LORA_CLASSES.get(target) if isinstance(target, str) else None
    if kind is None:
        raise CheckpointError(path, f"peft._target_ is {_shown(target)}, which export-hf does not merge (it merges "
                                    f"{' and '.join(LORA_CLASSES)})")
    alpha, dim = peft.get("alpha"), peft.get("dim")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not _finite(alpha):
        raise CheckpointError(path, f"peft.alpha is {_shown(alpha)}, not a finite number")
    if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
        raise CheckpointError(path, f"peft.dim is {_shown(dim)}, not a positive integer")
    modules = peft.get("target_modules") or []
    if not isinstance(modules, list) or not all(isinstance(m, str) for m in modules):
        raise CheckpointError(path, f"peft.target_modules is {_shown(modules)}, not a list of names")
    normalize = peft.get("normalize_moe_lora", False)
    if not isinstance(normalize, bool):
        raise CheckpointError(path, f"peft.normalize_moe_lora is {_shown(normalize)}, not true or false")
    return BridgePeft(path, kind, alpha, dim, tuple(modules), normalize)


def _finite(number: int | float) -> bool:
    """Whether `number` is a finite float (an integer too large for one is not)."""
    try:
        return math.isfinite(number)
    except OverflowError:
        return False


class _Bounded(reprlib.Repr):
    """reprlib's bounded repr: a few levels and items of a container (aliases make a 9-line file's
    value 9⁹ strings long), and an integer too large to print in decimal by its size."""

    def __init__(self) -> None:
        super().__init__()
        self.maxlevel, self.maxlist, self.maxdict, self.maxtuple, self.maxset = 4, 4, 4, 4, 4
        self.maxstring, self.maxother = 200, 200

    def repr_int(self, x: int, level: int) -> str:
        return f"<an integer of {x.bit_length()} bits>" if x.bit_length() > 256 else repr(x)


def _shown(value: Any) -> str:
    """A YAML value as a message shows it: short, one line, in time bounded whatever its size."""
    text = "null" if value is None else _Bounded().repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
