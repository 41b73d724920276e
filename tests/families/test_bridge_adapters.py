"""`inspect` names Megatron-Bridge LoRA adapters: their kind, dim and targets.

The checkpoint is what a Megatron-Bridge LoRA run saves (adapters only, the base comes from the
pretrained checkpoint), written by torch's own `dcp.save` under the names Bridge's
`AdapterWrapper.sharded_state_dict` gives them (`<m>.adapter.linear_in.weight`, canonical LoRA's
`<m>.adapter.adapter_q.linear_in.weight`), layer-stacked as a torch_dist save stacks them, with the
shapes `ParallelLinearAdapter` makes on the model of fixtures/data/megatron_torch_dist (hidden 32,
qkv 64 rows, fc1 96, fc2 48 columns, 2 layers).
"""

from __future__ import annotations

import ast
import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
import yaml

from ckptctl.families.bridge_adapters import bridge_adapter_summary, bridge_summary_line, find_bridge_adapters
from ckptctl.util.errors import CheckpointError
from tests.conftest import run_cli

DIM = 4
LAYERS = 2
BASES = {"self_attention.linear_qkv": (64, 32), "self_attention.linear_proj": (32, 32),
         "mlp.linear_fc1": (96, 32), "mlp.linear_fc2": (32, 48)}


def lora_state(canonical: bool = False) -> dict[str, torch.Tensor]:
    """Adapters on every linear of the fixture's model: A [layers, dim, in], B [layers, out, dim]."""
    gen = torch.Generator().manual_seed(0)
    state = {}
    for module, (out, inp) in BASES.items():
        splits = {"linear_qkv": {"adapter_q": 32, "adapter_k": 16, "adapter_v": 16},
                  "linear_fc1": {"adapter_up": 48, "adapter_gate": 48}}.get(module.rsplit(".", 1)[-1])
        for split, rows in (splits.items() if canonical and splits else [("", out)]):
            prefix = f"decoder.layers.{module}.adapter.{split + '.' if split else ''}"
            state[f"{prefix}linear_in.weight"] = torch.randn(LAYERS, DIM, inp, generator=gen)
            state[f"{prefix}linear_out.weight"] = torch.randn(LAYERS, rows, DIM, generator=gen)
    return state


PEFT_CLASSES = {"lora": ("lora.py", "LoRA"), "canonical-lora": ("canonical_lora.py", "CanonicalLoRA"),
                "dora": ("dora.py", "DoRA")}
"""Megatron-Bridge's PEFT dataclasses: file under megatron/bridge/peft, class."""


def _defaults(tree: ast.Module, name: str) -> dict[str, Any]:
    """The dataclass fields of class `name` in `tree` and their defaults, read from its source:
    a literal, `field(default_factory=lambda: [...])`, `field(default_factory=set)`, else None."""
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)
    fields: dict[str, Any] = {}
    for node in cls.body:
        if not isinstance(node, ast.AnnAssign) or not isinstance(node.target, ast.Name):
            continue
        value = node.value
        if isinstance(value, ast.Call) and getattr(value.func, "id", None) == "field":
            kw = {k.arg: k.value for k in value.keywords}
            factory = kw.get("default_factory")
            if isinstance(factory, ast.Lambda):
                value = factory.body
            elif isinstance(factory, ast.Name):
                fields[node.target.id] = {"set": set(), "dict": {}, "list": []}[factory.id]
                continue
            else:
                value = kw.get("default")
        try:
            fields[node.target.id] = ast.literal_eval(value) if value is not None else None
        except ValueError:
            fields[node.target.id] = None
    return fields


def run_config_yaml(kind: str = "lora", lora_dtype: torch.dtype | None = torch.float32, **peft: Any) -> str:
    """A run_config.yaml as Megatron-Bridge's `ConfigContainer.to_yaml` writes it: the PEFT
    dataclass (its fields and defaults read from Bridge's own source, with those of its bases
    `PEFT` and `ModuleMatcher`) as a mapping under `peft` with its class as `_target_`, a torch
    dtype as its representer writes one (`{_target_: torch.float32, _call_: false}`), the set
    `params_to_save` as `yaml.safe_dump` writes a set; beside a few other sections."""
    root = Path(importlib.util.find_spec("megatron.bridge").submodule_search_locations[0]) / "peft"
    file, cls = PEFT_CLASSES[kind]
    fields: dict[str, Any] = {}
    for source, name in (("base.py", "PEFT"), ("module_matcher.py", "ModuleMatcher"), (file, cls)):
        fields.update(_defaults(ast.parse((root / source).read_text()), name))
    fields = {k: v for k, v in fields.items() if not k.startswith("_")}
    if "lora_dtype" in fields:
        fields["lora_dtype"] = None if lora_dtype is None else {"_target_": str(lora_dtype), "_call_": False}
    config = {"_target_": "megatron.bridge.training.config.ConfigContainer",
              "checkpoint": {"_target_": "megatron.bridge.training.config.CheckpointConfig", "ckpt_format": "torch_dist",
                             "save_optim": True},
              "peft": {"_target_": f"megatron.bridge.peft.{file[:-3]}.{cls}", **fields, **peft}}
    return yaml.safe_dump(config, default_flow_style=False)


def shapes(state: dict[str, torch.Tensor], prefix: str = "") -> dict[str, tuple[int, ...]]:
    return {f"{prefix}{name}": tuple(t.shape) for name, t in state.items()}


def test_summary_counts_modules_per_layer_and_names_bridge_targets():
    assert bridge_adapter_summary(shapes(lora_state())) == {
        "kind": "megatron-bridge-lora", "adapters": [], "modules": 8, "ranks": [DIM],
        "targets": {"linear_fc1": 2, "linear_fc2": 2, "linear_proj": 2, "linear_qkv": 2}, "modules_to_save": [],
        "alpha": None, "run_config": None}
    assert bridge_adapter_summary(shapes(lora_state(canonical=True))) == {
        "kind": "megatron-bridge-canonical-lora", "adapters": [], "modules": 14, "ranks": [DIM],
        "targets": {"linear_fc1_gate": 2, "linear_fc1_up": 2, "linear_fc2": 2, "linear_k": 2, "linear_proj": 2,
                    "linear_q": 2, "linear_v": 2}, "modules_to_save": [], "alpha": None, "run_config": None}


def test_summary_of_per_layer_names_with_a_wrapper_prefix():
    """fsdp_dtensor names: `model.module.decoder.layers.<i>.…`, one 2-D tensor per layer."""
    per_layer = {f"model.module.decoder.layers.{i}.self_attention.linear_qkv.adapter.{part}": shape
                 for i in range(3) for part, shape in (("linear_in.weight", (8, 32)), ("linear_out.weight", (64, 8)))}
    per_layer["model.module.decoder.layers.0.self_attention.linear_qkv.weight"] = (64, 32)
    assert bridge_adapter_summary(per_layer) == {"kind": "megatron-bridge-lora", "adapters": [], "modules": 3,
                                                 "ranks": [8], "targets": {"linear_qkv": 3},
                                                 "modules_to_save": [], "alpha": None, "run_config": None}
    assert bridge_adapter_summary({"decoder.layers.self_attention.linear_qkv.weight": (2, 64, 32)}) is None


def test_inspect_names_bridge_adapters(tmp_path):
    dcp.save(lora_state(canonical=True), checkpoint_id=tmp_path / "lora")
    res = run_cli("inspect", tmp_path / "lora", "--json")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["adapters"] == bridge_adapter_summary(shapes(lora_state(canonical=True)))
    shown = " ".join(run_cli("inspect", tmp_path / "lora").stdout.split())
    assert ("Adapters Megatron-Bridge canonical LoRA: 14 modules, dim 4 (linear_fc1_gate ×2, linear_fc1_up ×2, "
            "linear_fc2 ×2, linear_k ×2, linear_proj ×2, linear_q ×2, linear_v ×2); α is not in the tensors (the "
            "run's run_config.yaml has it as peft.alpha)") in shown
    assert bridge_summary_line(bridge_adapter_summary(shapes(lora_state()))) == (
        "Megatron-Bridge LoRA: 8 modules, dim 4 (linear_fc1 ×2, linear_fc2 ×2, linear_proj ×2, linear_qkv ×2); α is "
        "not in the tensors (the run's run_config.yaml has it as peft.alpha)")


def test_inspect_gives_the_alpha_of_the_runs_run_config(tmp_path):
    """A Bridge LoRA save with its run_config.yaml: inspect says the run's α, and why not where
    the file cannot be read (the checkpoint is inspected all the same)."""
    ckpt = tmp_path / "lora"
    dcp.save(lora_state(), checkpoint_id=ckpt)
    (ckpt / "run_config.yaml").write_text(run_config_yaml(alpha=16, dim=DIM))
    doc = json.loads(run_cli("inspect", ckpt, "--json").stdout)["adapters"]
    assert (doc["alpha"], doc["run_config"]) == (16, str(ckpt / "run_config.yaml"))
    shown = " ".join(run_cli("inspect", ckpt).stdout.split())
    assert ("Adapters Megatron-Bridge LoRA: 8 modules, dim 4 (linear_fc1 ×2, linear_fc2 ×2, linear_proj ×2, "
            "linear_qkv ×2); α 16 (peft.alpha of run_config.yaml)") in shown
    (ckpt / "run_config.yaml").write_text("peft: null\n")
    res = run_cli("inspect", ckpt, "--json")
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)["adapters"]
    assert (doc["alpha"], doc["run_config_problem"]) == (None, "peft is null: the run trained no adapters, yet the "
                                                               "checkpoint holds Megatron-Bridge LoRA adapters")


def test_grouped_expert_adapters_as_their_model_holds_them_are_refused():
    """Megatron-FSDP's names of TEGroupedMLP's adapter (Bridge's model state: one adapter on
    `mlp.experts.linear_fc1`, beside `weight0` … `weight<E-1>`): refused by name, not taken for a
    missing base."""
    module = "decoder.layers.0.mlp.experts.linear_fc1"
    shapes = {f"{module}.adapter.linear_in.weight": (4, 32), f"{module}.adapter.linear_out.weight": (48, 4),
              **{f"{module}.weight{e}": (48, 32) for e in range(4)}}
    with pytest.raises(CheckpointError) as err:
        find_bridge_adapters(shapes, "ckpt", "model.module.")
    assert str(err.value) == ("ckpt: model.module.decoder.layers.0.mlp.experts.linear_fc1.adapter.linear_in.weight: a "
                              "Megatron-Bridge adapter on grouped experts (TEGroupedMLP) as its model holds it (one "
                              "shared by an EP rank's experts, or packed [E, …]), which export-hf does not merge yet "
                              "(a torch_dist save's, with its global expert axis, it does)")
