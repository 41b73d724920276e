"""`inspect` names Megatron-Bridge LoRA adapters: their kind, dim and targets.

The checkpoint is what a Megatron-Bridge LoRA run saves (adapters only, the base comes from the
pretrained checkpoint), written by torch's own `dcp.save` under the names Bridge's
`AdapterWrapper.sharded_state_dict` gives them (`<m>.adapter.linear_in.weight`, canonical LoRA's
`<m>.adapter.adapter_q.linear_in.weight`), layer-stacked as a torch_dist save stacks them, with the
shapes `ParallelLinearAdapter` makes on the model of fixtures/data/megatron_torch_dist (hidden 32,
qkv 64 rows, fc1 96, fc2 48 columns, 2 layers).
"""

from __future__ import annotations

import json

import torch
import torch.distributed.checkpoint as dcp

from ckptctl.families.bridge_adapters import bridge_adapter_summary, bridge_summary_line
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


def shapes(state: dict[str, torch.Tensor], prefix: str = "") -> dict[str, tuple[int, ...]]:
    return {f"{prefix}{name}": tuple(t.shape) for name, t in state.items()}


def test_summary_counts_modules_per_layer_and_names_bridge_targets():
    assert bridge_adapter_summary(shapes(lora_state())) == {
        "kind": "megatron-bridge-lora", "adapters": [], "modules": 8, "ranks": [DIM],
        "targets": {"linear_fc1": 2, "linear_fc2": 2, "linear_proj": 2, "linear_qkv": 2}, "modules_to_save": []}
    assert bridge_adapter_summary(shapes(lora_state(canonical=True))) == {
        "kind": "megatron-bridge-canonical-lora", "adapters": [], "modules": 14, "ranks": [DIM],
        "targets": {"linear_fc1_gate": 2, "linear_fc1_up": 2, "linear_fc2": 2, "linear_k": 2, "linear_proj": 2,
                    "linear_q": 2, "linear_v": 2}, "modules_to_save": []}


def test_summary_of_per_layer_names_with_a_wrapper_prefix():
    """fsdp_dtensor names: `model.module.decoder.layers.<i>.…`, one 2-D tensor per layer."""
    per_layer = {f"model.module.decoder.layers.{i}.self_attention.linear_qkv.adapter.{part}": shape
                 for i in range(3) for part, shape in (("linear_in.weight", (8, 32)), ("linear_out.weight", (64, 8)))}
    per_layer["model.module.decoder.layers.0.self_attention.linear_qkv.weight"] = (64, 32)
    assert bridge_adapter_summary(per_layer) == {"kind": "megatron-bridge-lora", "adapters": [], "modules": 3,
                                                 "ranks": [8], "targets": {"linear_qkv": 3},
                                                 "modules_to_save": []}
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
