"""Megatron-Bridge LoRA adapters in a Megatron checkpoint (torch_dist or fsdp_dtensor): their names and pairing.

Megatron-Bridge wraps an adapted linear in an `AdapterWrapper` whose state dict keeps the base
weight under the linear's own name (`<m>.weight`) and puts the adapter under `<m>.adapter.`:
`<m>.adapter.linear_in.weight` [dim, in] (A) and `<m>.adapter.linear_out.weight` [out, dim] (B),
merged as W + (α / dim) · B @ A (`LoRAMerge.merge`). Canonical LoRA keeps one adapter per HF
projection on a fused linear: `<m>.adapter.adapter_q|k|v.…` on `linear_qkv`,
`<m>.adapter.adapter_up|gate.…` on `linear_fc1`, each [dim, in] and [its rows, dim], its
output the HF projection's rows (`LoRALinearSplitQKV` interleaves q, k, v into the fused output
by query group; `LoRALinearSplitFC1UpGate` puts gate before up), merged by Megatron-Bridge into
the HF tensor its `ADAPTER_NAME_MAP` names (`q_proj` …). A torch_dist save stacks layers, so an
adapter's tensors lead with the layer axis ([layers, dim, in]). α (and dim) are in the run's
`run_config.yaml` (`peft.alpha`, `peft.dim`), never in the tensors.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

from ckptctl.util.errors import CheckpointError
from ckptctl.util.wording import counted

_PART = re.compile(r"^(?P<module>.+)\.adapter\.(?:(?P<split>adapter_(?:q|k|v|up|gate))\.)?"
                   r"(?P<part>linear_in|linear_out)\.(?P<param>weight|bias)$")
_CANONICAL_TARGETS = {"adapter_q": "linear_q", "adapter_k": "linear_k", "adapter_v": "linear_v",
                      "adapter_up": "linear_fc1_up", "adapter_gate": "linear_fc1_gate"}
"""Canonical LoRA's adapter on a fused linear → the target name its `target_modules` gives it."""
CANONICAL_HF_MODULES = {"adapter_q": "q_proj", "adapter_k": "k_proj", "adapter_v": "v_proj",
                        "adapter_gate": "gate_proj", "adapter_up": "up_proj"}
"""Canonical LoRA's adapter → the HF module whose weight Megatron-Bridge merges it into
(`peft_bridge.ADAPTER_NAME_MAP`, read the other way)."""


_GROUPED_EXPERTS = re.compile(r"\.experts\.linear_fc[12]$")
"""TEGroupedMLP's grouped linears as its model names them (a torch_dist save's stack is seen per expert,
`…experts.local_experts.<e>.linear_fc1`)."""
_DORA_MAGNITUDE = re.compile(r"^(?P<module>.+)\.adapter\.weight_magnitude$")
"""Megatron-Bridge DoRA's `ParallelLinearDoRAAdapter.weight_magnitude` [out] (`dora_layers.py`)."""


def refuse_bridge_dora(names: Iterable[str], where: str | Path, prefix: str = "") -> None:
    """Refuse a Megatron-Bridge DoRA save by its first magnitude: Bridge 0.6.2 has no DoRA merge (its
    `DoRALinear` forward scales by m / ‖W + s·B@A‖ per row; its HF export code never reads
    `weight_magnitude`), so there is no merge of Bridge's to be equal to."""
    found = sorted(n for n in names if _DORA_MAGNITUDE.match(n))
    if found:
        raise CheckpointError(where, f"{prefix}{found[0]}: a Megatron-Bridge DoRA magnitude, which export-hf does "
                                     "not merge (Megatron-Bridge has no DoRA merge of its own to be equal to)")


def is_bridge_adapter(name: str) -> bool:
    """Whether model tensor `name` is a Megatron-Bridge LoRA adapter's (`<m>.adapter.linear_in.weight` …)."""
    return _PART.match(name) is not None


@dataclass(frozen=True)
class BridgeAdapter:
    """One Megatron-Bridge LoRA adapter on one Megatron linear (names without the model's prefix)."""

    module: str
    """The Megatron module (`decoder.layers.0.self_attention.linear_qkv`)."""
    a: str
    """`linear_in.weight` [dim, in]."""
    b: str
    """`linear_out.weight` [out, dim] ([the projection's rows, dim] for a canonical one)."""
    dim: int
    split: str | None = None
    """Canonical LoRA's adapter of one projection of a fused linear (`adapter_q` …), None for one
    on the whole linear."""
    halves: bool = False
    """The base is a SwiGLU fc1 saved split, `weight_w` and `weight_v` (fsdp_dtensor), not `weight`."""

    @property
    def bases(self) -> tuple[str, ...]:
        """The names its base weight is saved under."""
        return (f"{self.module}.weight_w", f"{self.module}.weight_v") if self.halves else (self.weight,)

    @property
    def hf_module(self) -> str | None:
        """The HF module a canonical adapter is merged into (`q_proj` …); None for a whole-linear one."""
        return CANONICAL_HF_MODULES[self.split] if self.split is not None else None

    @property
    def weight(self) -> str:
        """The base weight the adapter is merged into (Bridge's wrapper keeps the linear's own name)."""
        return f"{self.module}.weight"


def find_bridge_adapters(shapes: Mapping[str, tuple[int, ...]], where: str | Path,
                         prefix: str = "", base: str | Path | None = None) -> tuple[BridgeAdapter, ...]:
    """The Megatron-Bridge LoRA adapters among a Megatron model's per-layer tensors (names without
    `prefix`, which messages put back), sorted by module. Refused, by name: adapter biases (not
    merged yet), a linear_in without its linear_out (or the reverse), whole-linear and canonical
    adapters on one linear, an adapter without its base weight (a Bridge LoRA save holds the
    adapters alone: `base`, the checkpoint `--base` gave, when it is not in that either), and
    shapes that do not pair ([dim, in] and [out, dim] with a base [out, in]; a canonical
    adapter's [rows, dim] with rows at most the base's)."""
    refuse_bridge_dora(shapes, where, prefix)
    parts: dict[tuple[str, str | None], dict[str, str]] = {}
    for name in sorted(shapes):
        match = _PART.match(name)
        if match is None:
            continue
        if match["param"] != "weight":
            raise CheckpointError(where, f"{prefix}{name}: a Megatron-Bridge LoRA adapter bias, which export-hf does "
                                         "not merge yet")
        if _GROUPED_EXPERTS.search(match["module"]):
            raise CheckpointError(where, f"{prefix}{name}: a Megatron-Bridge adapter on grouped experts (TEGroupedMLP) "
                                         "as its model holds it (one shared by an EP rank's experts, or packed "
                                         "[E, …]), which export-hf does not merge yet (a torch_dist save's, with "
                                         "its global expert axis, it does)")
        parts.setdefault((match["module"], match["split"]), {})[match["part"]] = name
    adapters = []
    saved = set(shapes)
    whole = {module for module, split in parts if split is None}
    for (module, split), found in sorted(parts.items(), key=lambda kv: (kv[0][0], kv[0][1] or "")):
        if split is not None and module in whole:
            raise CheckpointError(where, f"{prefix}{module}: has both a whole-linear adapter and canonical LoRA's "
                                         f"{split}: which one the run trained is not guessed")
        missing = {"linear_in", "linear_out"} - set(found)
        if missing:
            raise CheckpointError(where, f"{prefix}{next(iter(found.values()))} has no {missing.pop()} beside it")
        a, b, weight = found["linear_in"], found["linear_out"], f"{module}.weight"
        halves = [shapes.get(f"{module}.weight_{part}") for part in "wv"]
        split_base = weight not in saved and halves[0] is not None and halves[0] == halves[1] and len(halves[0]) == 2
        if split_base:  # fsdp_dtensor's SwiGLU fc1, saved as its halves
            shapes = {**shapes, weight: (2 * halves[0][0], halves[0][1])}
        if weight not in shapes:
            if base is not None:
                raise CheckpointError(where, f"{prefix}{a}: an adapter on {prefix}{module}, whose weight "
                                             f"{prefix}{weight} is not in {base} either (is it the run's "
                                             "pretrained checkpoint?)")
            raise CheckpointError(where, f"{prefix}{a}: an adapter on {prefix}{module}, which has no {prefix}{weight} "
                                         "(a Megatron-Bridge LoRA save holds the adapters alone: pass --base, the "
                                         "pretrained checkpoint the run started from)")
        w, sa, sb = shapes[weight], shapes[a], shapes[b]
        rows_fit = sb[0] <= w[0] if split is not None else sb[0] == w[0]
        if len(w) != 2 or len(sa) != 2 or len(sb) != 2 or sa[1] != w[1] or not rows_fit or sa[0] != sb[1]:
            cols, rows = (w[1] if len(w) == 2 else "?"), (w[0] if w else "?")
            what = f"{prefix}{module}{f' ({split})' if split else ''}"
            want = f"[dim, {cols}] and [rows ≤ {rows}, dim]" if split else f"[dim, {cols}] and [{rows}, dim]"
            raise CheckpointError(where, f"{what}: linear_in {list(sa)} and linear_out {list(sb)} do not pair with "
                                         f"its base weight {list(w)}{f' of {base}' if base else ''} (want {want})")
        if sa[0] == 0:
            raise CheckpointError(where, f"{prefix}{a}: dim 0 (linear_in {list(sa)}): α / dim has no value")
        adapters.append(BridgeAdapter(module, a, b, sa[0], split, split_base))
    return tuple(adapters)


def bridge_adapter_summary(shapes: Mapping[str, tuple[int, ...]]) -> dict[str, Any] | None:
    """What `inspect` says of the Megatron-Bridge LoRA adapters among a checkpoint's model tensors
    (full names), without judging them: kind (`megatron-bridge-lora`, or `…-canonical-lora` with
    per-projection adapters), adapted modules (a layer-stacked key counts once per layer), dims
    (linear_in's rows) and modules per target name (Bridge's `target_modules` names); None without
    adapters."""
    dims: dict[str, int] = {}
    targets: Counter[str] = Counter()
    canonical = False
    for name, shape in shapes.items():
        match = _PART.match(name)
        if match is None or match["part"] != "linear_in" or match["param"] != "weight" or len(shape) < 2:
            continue
        split = match["split"]
        canonical = canonical or split is not None
        target = _CANONICAL_TARGETS[split] if split else match["module"].rsplit(".", 1)[-1]
        dims[name] = shape[-2]
        targets[target] += math.prod(shape[:-2])
    if not dims:
        return None
    return {"kind": "megatron-bridge-canonical-lora" if canonical else "megatron-bridge-lora", "adapters": [],
            "modules": sum(targets.values()), "ranks": sorted(set(dims.values())),
            "targets": dict(sorted(targets.items())), "modules_to_save": [], "alpha": None, "run_config": None}


def bridge_summary_line(summary: Mapping[str, Any]) -> str:
    """`Megatron-Bridge LoRA: 4 modules, dim 4 (linear_fc1 ×2, linear_qkv ×2); α 8 (run_config.yaml)`,
    or `…; α is not in the tensors …` where the checkpoint has no readable run_config.yaml."""
    kind = "Megatron-Bridge canonical LoRA" if summary["kind"] == "megatron-bridge-canonical-lora" \
        else "Megatron-Bridge LoRA"
    targets = ", ".join(f"{target} ×{count}" for target, count in summary["targets"].items())
    alpha = (f"α {summary['alpha']:g} (peft.alpha of run_config.yaml)" if summary.get("alpha") is not None
             else "α is not in the tensors (the run's run_config.yaml has it as peft.alpha)")
    return f"{kind}: {counted(summary['modules'], 'module')}, dim {', '.join(map(str, summary['ranks']))} ({targets}); {alpha}"
