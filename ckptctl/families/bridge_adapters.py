"""Megatron-Bridge LoRA adapters in a Megatron checkpoint (torch_dist or fsdp_dtensor): what `inspect` names.

Megatron-Bridge wraps an adapted linear in an `AdapterWrapper` whose state dict keeps the base
weight under the linear's own name (`<m>.weight`) and puts the adapter under `<m>.adapter.`:
`<m>.adapter.linear_in.weight` [dim, in] (A) and `<m>.adapter.linear_out.weight` [out, dim] (B),
merged as W + (α / dim) · B @ A (`LoRAMerge.merge`). Canonical LoRA keeps one adapter per HF
projection on a fused linear: `<m>.adapter.adapter_q|k|v.…` on `linear_qkv`,
`<m>.adapter.adapter_up|gate.…` on `linear_fc1`. A torch_dist save stacks layers, so an
adapter's tensors lead with the layer axis ([layers, dim, in]). α (and dim) are in the run's
`run_config.yaml` (`peft.alpha`, `peft.dim`), never in the tensors.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from typing import Any, Mapping

from ckptctl.util.wording import counted

_PART = re.compile(r"^(?P<module>.+)\.adapter\.(?:(?P<split>adapter_(?:q|k|v|up|gate))\.)?"
                   r"(?P<part>linear_in|linear_out)\.(?P<param>weight|bias)$")
_CANONICAL_TARGETS = {"adapter_q": "linear_q", "adapter_k": "linear_k", "adapter_v": "linear_v",
                      "adapter_up": "linear_fc1_up", "adapter_gate": "linear_fc1_gate"}
"""Canonical LoRA's adapter on a fused linear → the target name its `target_modules` gives it."""


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
            "modules": sum(targets.values()), "ranks": sorted(set(dims.values())), "targets": dict(sorted(targets.items())),
            "modules_to_save": []}


def bridge_summary_line(summary: Mapping[str, Any]) -> str:
    """`Megatron-Bridge LoRA: 4 modules, dim 4 (linear_fc1 ×2, linear_qkv ×2); α is in the run's run_config.yaml …`."""
    kind = "Megatron-Bridge canonical LoRA" if summary["kind"] == "megatron-bridge-canonical-lora" \
        else "Megatron-Bridge LoRA"
    targets = ", ".join(f"{target} ×{count}" for target, count in summary["targets"].items())
    return (f"{kind}: {counted(summary['modules'], 'module')}, dim {', '.join(map(str, summary['ranks']))} "
            f"({targets}); α is not in the tensors (the run's run_config.yaml has it as peft.alpha)")
