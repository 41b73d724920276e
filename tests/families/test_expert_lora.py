"""Per-expert LoRA as PEFT's `target_parameters` on transformers 5's fused experts: layout and refusals.

The layout is proven against peft itself in tests/commands/test_export_hf_bridge_moe_lora.py
(the folder loads and gives the merged model's logits); here, the geometry of the pieces and the
cases PEFT's ParamWrapper cannot express, refused by name.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from ckptctl.core.plan import Piece, TargetTensor
from ckptctl.families.adapters import PEFT_PREFIX, Adapter
from ckptctl.families.expert_lora import fuse_expert_adapters
from ckptctl.util.errors import CheckpointError

E, R, H, F = 2, 3, 8, 5
IN_MEMORY = frozenset(f"model.layers.{i}.mlp.experts.{p}" for i in range(2) for p in ("gate_up_proj", "down_proj"))
"""transformers 5's in-memory names of the experts (`ExpectedNames.in_memory`)."""


def _module(layer: int, e: int, leaf: str) -> str:
    return f"model.layers.{layer}.mlp.experts.{e}.{leaf}"


def _case(layers: int = 1, skip: tuple[str, ...] = (), split_a: bool = False, rank: int = R):
    """PEFT tensors as `bridge_adapter_tensors` makes them: per expert, gate and up share fc1's A
    (`A<l>.<e>.fc1`), each its rows of B; down its own A and B."""
    tensors, adapters, targets = {}, [], {}
    for layer in range(layers):
        for e in range(E):
            for leaf, rows, cols in (("gate_proj", F, H), ("up_proj", F, H), ("down_proj", H, F)):
                module = _module(layer, e, leaf)
                targets[f"{module}.weight"] = TargetTensor(f"{module}.weight", (rows, cols), "float32", ())
                if module in skip:
                    continue
                fc = "fc2" if leaf == "down_proj" else "fc1"
                a_src = f"A{layer}.{e}.{leaf if split_a else fc}"
                offset = F if leaf == "up_proj" else 0
                a, b = f"{PEFT_PREFIX}{module}.lora_A.weight", f"{PEFT_PREFIX}{module}.lora_B.weight"
                tensors[a] = TargetTensor(a, (rank, cols), "float32", (Piece(a_src, (0, 0), (0, 0), (rank, cols)),))
                tensors[b] = TargetTensor(b, (rows, rank), "float32",
                                          (Piece(f"B{layer}.{e}.{fc}", (offset, 0), (0, 0), (rows, rank)),))
                adapters.append(Adapter(module, a, b, rank))
    return tensors, adapters, targets


def test_experts_become_one_wrapper_per_fused_parameter():
    tensors, adapters, targets = _case()
    out, written = fuse_expert_adapters(tensors, adapters, targets, IN_MEMORY, "ckpt")
    layer = f"{PEFT_PREFIX}model.layers.0.mlp.experts."
    assert sorted(out) == [f"{layer}{inner}{f}.weight" for inner in ("base_layer.", "") for f in ("lora_A", "lora_B")]
    assert written == [Adapter("model.layers.0.mlp.experts", f"{layer}base_layer.lora_A.weight",
                               f"{layer}base_layer.lora_B.weight", R, parameter="gate_up_proj", experts=E, depth=1),
                       Adapter("model.layers.0.mlp.experts", f"{layer}lora_A.weight", f"{layer}lora_B.weight", R,
                               parameter="down_proj", experts=E)]
    gate_up_a, gate_up_b = out[f"{layer}base_layer.lora_A.weight"], out[f"{layer}base_layer.lora_B.weight"]
    assert gate_up_a.shape == (E * R, H) and gate_up_b.shape == (2 * F, R * E)
    assert gate_up_a.pieces == (Piece("A0.0.fc1", (0, 0), (0, 0), (R, H)), Piece("A0.1.fc1", (0, 0), (R, 0), (R, H)))
    # expert 1's up_proj rows (B rows F.. of its fc1) at rows F.., its rank k at column k·E + 1
    assert Piece("B0.1.fc1", (F, 2), (F, 2 * E + 1), (F, 1)) in gate_up_b.pieces
    assert len(gate_up_b.pieces) == E * 2 * R
    assert out[f"{layer}lora_B.weight"].shape == (H, R * E)


def test_a_layer_with_one_adapted_parameter_has_one_wrapper():
    """Layer 1 adapts gate_up_proj alone: its wrapper is the only one, outermost (no base_layer)."""
    tensors, adapters, targets = _case(layers=2, skip=(_module(1, 0, "down_proj"), _module(1, 1, "down_proj")))
    out, written = fuse_expert_adapters(tensors, adapters, targets, IN_MEMORY, "ckpt")
    assert [(a.module, a.parameter, a.depth) for a in written] == [
        ("model.layers.0.mlp.experts", "gate_up_proj", 1), ("model.layers.0.mlp.experts", "down_proj", 0),
        ("model.layers.1.mlp.experts", "gate_up_proj", 0)]
    assert f"{PEFT_PREFIX}model.layers.1.mlp.experts.lora_A.weight" in out


@pytest.mark.parametrize(("case", "line"), [
    (dict(skip=(_module(0, 1, "up_proj"),)),
     "model.layers.0.mlp.experts.0.gate_proj: LoRA on some of model.layers.0.mlp.experts' experts but not "
     "model.layers.0.mlp.experts.1.up_proj: PEFT's target_parameters adapts every expert of the fused parameter"),
    (dict(split_a=True),
     "model.layers.0.mlp.experts.0.up_proj: its lora_A is not model.layers.0.mlp.experts.0.gate_proj's: the fused "
     "gate_up_proj has one A per expert"),
])
def test_what_target_parameters_cannot_express_is_refused(case, line):
    tensors, adapters, targets = _case(**case)
    with pytest.raises(CheckpointError) as err:
        fuse_expert_adapters(tensors, adapters, targets, IN_MEMORY, "ckpt")
    assert str(err.value) == f"ckpt: {line}"


def test_experts_of_one_stack_at_different_ranks_are_refused():
    tensors, adapters, targets = _case()
    odd = next(a for a in adapters if a.module == _module(0, 1, "down_proj"))
    adapters = [replace(a, rank=R + 1) if a is odd else a for a in adapters]
    with pytest.raises(CheckpointError) as err:
        fuse_expert_adapters(tensors, adapters, targets, IN_MEMORY, "ckpt")
    assert str(err.value) == ("ckpt: model.layers.0.mlp.experts.1.down_proj: LoRA rank 4, "
                              "model.layers.0.mlp.experts.0.down_proj's 3: the fused parameter's ParamWrapper has one "
                              "rank for every expert")


def test_an_expert_linear_transformers_does_not_fuse_is_refused():
    adapter = Adapter("model.layers.0.block_sparse_moe.experts.0.w1", "a", "b", R)
    with pytest.raises(CheckpointError) as err:
        fuse_expert_adapters({}, [adapter], {}, IN_MEMORY, "ckpt")
    assert str(err.value) == ("ckpt: model.layers.0.block_sparse_moe.experts.0.w1: a LoRA adapter on one expert's "
                              "linear, which transformers 5 holds in a fused expert parameter PEFT's target_parameters "
                              "adapts only for mlp.experts.{gate_up,down}_proj")


def test_experts_are_fused_only_where_transformers_holds_them_fused():
    """In-memory names equal to the saved ones (none given): each expert a linear PEFT wraps as it
    is; not known (the name check off) or not fused there: refused by name."""
    tensors, adapters, targets = _case()
    assert fuse_expert_adapters(tensors, adapters, targets, frozenset(), "ckpt") == (tensors, adapters)
    for in_memory, module, why in (
            (None, "down_proj", "transformers' model for the config is not known (the name check is off), nor so how "
                                "it holds the experts"),
            (frozenset({"model.layers.0.mlp.experts.down_proj"}), "gate_proj",
             "transformers' model holds no model.layers.0.mlp.experts.gate_up_proj to adapt")):
        with pytest.raises(CheckpointError) as err:
            fuse_expert_adapters(tensors, adapters, targets, in_memory, "ckpt")
        assert str(err.value) == f"ckpt: model.layers.0.mlp.experts.0.{module}: a LoRA adapter on an expert, but {why}"


def test_experts_at_another_rank_than_the_modules_are_refused():
    tensors, adapters, targets = _case()
    other = Adapter("model.layers.0.self_attn.q_proj", "qa", "qb", R + 1)
    with pytest.raises(CheckpointError) as err:
        fuse_expert_adapters(tensors, [*adapters, other], targets, IN_MEMORY, "ckpt")
    assert str(err.value) == ("ckpt: model.layers.0.mlp.experts.gate_up_proj: LoRA ranks 3, 4 in one folder, the "
                              "experts' among them (normalize_moe_lora?): a rank_pattern entry for a ParamWrapper is "
                              "not written yet")
