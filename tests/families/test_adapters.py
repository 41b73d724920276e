"""`families.adapters`: peft LoRA names paired with their base weights, α read from an adapter
config, the adapter_config.json written for a PEFT folder: pure functions over names and shapes."""

from __future__ import annotations

import json

import pytest

from ckptctl.families.adapters import (LoraScale, adapter_summary, check_against_config, find_adapters, peft_config,
                                       read_adapter_config, resolve_scale)
from ckptctl.util.errors import CheckpointError, UsageError

Q = "model.layers.0.self_attn.q_proj"
V = "model.layers.0.self_attn.v_proj"


def lora_shapes(module: str, out: int = 8, inp: int = 4, rank: int = 2, adapter: str = "default") -> dict:
    return {f"{module}.base_layer.weight": (out, inp), f"{module}.lora_A.{adapter}.weight": (rank, inp),
            f"{module}.lora_B.{adapter}.weight": (out, rank)}


def refusal(shapes: dict) -> str:
    with pytest.raises(CheckpointError) as err:
        find_adapters(shapes, "CKPT", "model.base_model.model.")
    return str(err.value)


def test_adapters_pair_with_their_base_weights_and_base_layer_is_renamed():
    shapes = {**lora_shapes(Q), **lora_shapes(V, rank=3), "model.norm.weight": (4,)}
    found = find_adapters(shapes, "CKPT")
    assert [(a.module, a.rank, a.weight) for a in found.adapters] == [(Q, 2, f"{Q}.weight"), (V, 3, f"{V}.weight")]
    assert found.renamed == {f"{Q}.base_layer.weight": f"{Q}.weight", f"{V}.base_layer.weight": f"{V}.weight"}
    assert (found.adapter_name, found.ranks, found.targets) == ("default", [2, 3], ["q_proj", "v_proj"])
    assert find_adapters({"model.norm.weight": (4,)}, "CKPT") is None


@pytest.mark.parametrize("extra, line", [
    ({f"{Q}.lora_magnitude_vector.default.weight": (8,), **lora_shapes(V)},
     f"CKPT: model.base_model.model.{V}.lora_A.default.weight: a plain LoRA adapter beside DoRA ones (on 1 of 2 "
     "modules): peft's use_dora is one flag for all"),
    ({f"{Q}.lora_magnitude_vector.default.weight": (4,)},
     f"CKPT: model.base_model.model.{Q}.lora_magnitude_vector.default.weight: DoRA magnitude [4], not [8] as its "
     "base weight's rows"),
    ({"model.embed_tokens.lora_embedding_A.default": (2, 16)},
     "CKPT: model.base_model.model.model.embed_tokens.lora_embedding_A.default has no lora_B embedding beside it"),
    ({"model.embed_tokens.lora_embedding_A.default": (2, 16), "model.embed_tokens.lora_embedding_B.default": (8, 2),
      "model.embed_tokens.base_layer.weight": (16, 8),
      "model.embed_tokens.lora_magnitude_vector.default.weight": (16,)},
     "CKPT: model.base_model.model.model.embed_tokens.lora_magnitude_vector.default.weight: DoRA on an embedding, "
     "which export-hf does not merge or export yet"),
    ({f"{Q}.lora_B.default.bias": (8,)},
     f"CKPT: model.base_model.model.{Q}.lora_B.default.bias: a LoRA bias (lora_bias), which export-hf does not "
     "merge or export yet"),
    ({"score.modules_to_save.default.weight": (2, 4)},
     "CKPT: model.base_model.model.score.modules_to_save.default.weight: a modules_to_save tensor without its "
     "original_module beside it"),
    ({"score.modules_to_save.default.weight": (2, 4), "score.original_module.weight": (3, 4)},
     "CKPT: model.base_model.model.score.modules_to_save.default.weight is [2, 4], its original_module [3, 4]"),
    (lora_shapes(V, adapter="other"), "CKPT: 2 peft adapters (default, other): pass --adapter-name to export one"),
])
def test_what_is_not_plain_lora_is_refused_by_name(extra, line):
    assert refusal({**lora_shapes(Q), **extra}) == line


def test_a_chosen_adapter_is_found_and_the_other_s_tensors_are_left_out():
    shapes = {**lora_shapes(Q, adapter="mine"), f"{Q}.lora_A.other.weight": (3, 4), f"{Q}.lora_B.other.weight": (8, 3),
              **lora_shapes(V, adapter="other"), "lm_head.modules_to_save.mine.weight": (6, 4),
              "lm_head.original_module.weight": (6, 4)}
    found = find_adapters(shapes, "CKPT", chosen="mine")
    assert (found.adapter_name, found.left_out) == ("mine", ("other",))
    assert [(a.module, a.a, a.rank) for a in found.adapters] == [(Q, f"{Q}.lora_A.mine.weight", 2)]
    assert found.others == (f"{Q}.lora_A.other.weight", f"{Q}.lora_B.other.weight", f"{V}.lora_A.other.weight",
                            f"{V}.lora_B.other.weight")
    assert found.trained_copies == {"lm_head.weight": "lm_head.modules_to_save.mine.weight"}
    assert found.renamed[f"{V}.base_layer.weight"] == f"{V}.weight"
    with pytest.raises(CheckpointError) as err:
        find_adapters(shapes, "CKPT", chosen="default")
    assert str(err.value) == "CKPT: has no peft adapter 'default' (--adapter-name): its adapters are 'mine', 'other'"


def test_a_modules_to_save_copy_takes_the_module_s_name_and_its_original_is_left_out():
    shapes = {**lora_shapes(Q), "lm_head.modules_to_save.default.weight": (6, 4),
              "lm_head.original_module.weight": (6, 4)}
    found = find_adapters(shapes, "CKPT")
    assert (found.saved, found.originals) == (("lm_head",), ("lm_head.original_module.weight",))
    assert found.trained_copies == {"lm_head.weight": "lm_head.modules_to_save.default.weight"}
    assert peft_config(found, LoraScale(4, False), [Q], None, None)["modules_to_save"] == ["lm_head"]


def test_an_embedding_adapter_pairs_transposed():
    shapes = {"e.base_layer.weight": (16, 8), "e.lora_embedding_A.default": (2, 16),
              "e.lora_embedding_B.default": (8, 2)}
    (adapter,) = find_adapters(shapes, "CKPT").adapters
    assert (adapter.a, adapter.b, adapter.rank, adapter.embedding) == (
        "e.lora_embedding_A.default", "e.lora_embedding_B.default", 2, True)
    shapes["e.lora_embedding_A.default"] = (2, 8)
    assert refusal(shapes) == ("CKPT: model.base_model.model.e: lora_A [2, 8] and lora_B [8, 2] do not pair with its "
                               "base weight [16, 8] (want [r, 16] and [8, r])")


def test_unpaired_or_misshapen_adapters_are_refused():
    shapes = lora_shapes(Q)
    del shapes[f"{Q}.lora_B.default.weight"]
    assert refusal(shapes) == f"CKPT: model.base_model.model.{Q}.lora_A.default.weight has no lora_B beside it"
    shapes = lora_shapes(Q)
    del shapes[f"{Q}.base_layer.weight"]
    assert refusal(shapes) == (f"CKPT: model.base_model.model.{Q}.lora_A.default.weight: an adapter on {Q}, which has "
                               f"no model.base_model.model.{Q}.base_layer.weight")
    shapes = {**lora_shapes(Q), f"{Q}.lora_B.default.weight": (8, 3)}
    assert refusal(shapes) == (f"CKPT: model.base_model.model.{Q}: lora_A [2, 4] and lora_B [8, 3] do not pair with "
                               "its base weight [8, 4] (want [r, 4] and [8, r])")


def test_alpha_comes_from_the_flag_or_the_config_and_they_must_agree(tmp_path):
    config = tmp_path / "adapter_config.json"
    config.write_text(json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 16, "use_rslora": True}))
    read = read_adapter_config(config)
    assert read == LoraScale(16, True, 2, str(config), False)
    assert read.scale(4) == 8.0 and LoraScale(7, False).scale(5) == 7 / 5
    assert resolve_scale(16, True, read, "CKPT") is read
    assert resolve_scale(7.5, False, None, "CKPT") == LoraScale(7.5, False)
    with pytest.raises(UsageError, match=f"^--lora-alpha 8 disagrees with {config}, whose lora_alpha is 16$"):
        resolve_scale(8, False, read, "CKPT")
    with pytest.raises(UsageError, match="^CKPT: LoRA α is not in the checkpoint: pass --lora-alpha"):
        resolve_scale(None, False, None, "CKPT")
    with pytest.raises(CheckpointError, match=r"^CKPT: x\.lora_A\.default\.weight has rank 3 \(its rows\), but "):
        check_against_config(find_adapters(lora_shapes("x", rank=3), "CKPT"), read, "CKPT")
    dora = find_adapters({**lora_shapes("x"), "x.lora_magnitude_vector.default.weight": (8,)}, "CKPT")
    with pytest.raises(CheckpointError, match=f"^CKPT: holds DoRA magnitudes, but {config} says use_dora false$"):
        check_against_config(dora, read, "CKPT")
    assert dora.dora and dora.tensors == {"x.lora_A.default.weight", "x.lora_B.default.weight",
                                          "x.lora_magnitude_vector.default.weight"}


@pytest.mark.parametrize("doc, reason", [
    ({"peft_type": "IA3", "r": 2, "lora_alpha": 4}, "peft_type is 'IA3', not 'LORA'"),
    ({"peft_type": "LORA", "r": 2}, "lora_alpha is null, not a number"),
    ({"peft_type": "LORA", "r": "2", "lora_alpha": 4}, 'r is "2", not a positive integer'),
    ({"peft_type": "LORA", "r": 2, "lora_alpha": 4, "fan_in_fan_out": True},
     "fan_in_fan_out is true (transposed (Conv1D) weights), which export-hf does not merge yet"),
    ({"peft_type": "LORA", "r": 2, "lora_alpha": 4, "rank_pattern": {"q_proj": 8}},
     "has a rank_pattern (per-module ranks), which export-hf does not merge yet"),
])
def test_an_adapter_config_export_hf_cannot_honour_is_refused(tmp_path, doc, reason):
    config = tmp_path / "adapter_config.json"
    config.write_text(json.dumps(doc))
    with pytest.raises(UsageError) as err:
        read_adapter_config(config)
    assert str(err.value) == f"{config}: {reason}"


def test_peft_config_names_exactly_the_adapted_modules():
    k0, q1 = "model.layers.0.self_attn.k_proj", "model.layers.1.self_attn.q_proj"
    every = find_adapters({**lora_shapes(Q), **lora_shapes(q1, rank=4), **lora_shapes(k0, rank=4)}, "CKPT")
    config = peft_config(every, LoraScale(8.0, False), [Q, q1, k0], "org/base", "CAUSAL_LM")
    assert (config["r"], config["lora_alpha"], config["target_modules"], config["rank_pattern"]) == (
        4, 8, ["k_proj", "q_proj"], {Q: 2})
    some = find_adapters(lora_shapes(q1), "CKPT")
    config = peft_config(some, LoraScale(7.5, True), [Q, q1], None, None)
    assert (config["lora_alpha"], config["use_rslora"], config["target_modules"]) == (
        7.5, True, r"model\.layers\.1\.self_attn\.q_proj")


def test_inspect_summary_counts_modules_per_leaf_name_without_judging():
    shapes = {f"model.base_model.model.{k}": v for k, v in {**lora_shapes(Q), **lora_shapes(V, rank=3)}.items()}
    shapes[f"model.base_model.model.{Q}.lora_magnitude_vector.default.weight"] = (8,)
    assert adapter_summary(shapes) == {"kind": "peft-dora", "adapters": ["default"], "modules": 2, "ranks": [2, 3],
                                       "targets": {"q_proj": 1, "v_proj": 1}, "modules_to_save": []}
    assert adapter_summary({"model.norm.weight": (4,)}) is None


X = "model.layers.0.mlp.experts"


def wrapper_shapes(outer: tuple | None = (12, 12, 32), inner: tuple | None = (12, 32, 24), **params) -> dict:
    """peft's two nested ParamWrappers on a Qwen3-MoE's experts (E 4, r 3, H 32, 2F 24, F 12): the
    outer on down_proj [E, H, F] (A [E·r, F], B [H, r·E]), the inner on gate_up_proj [E, 2F, H]."""
    shapes = {f"{X}.base_layer.base_layer.{name}": shape for name, shape in
              {"gate_up_proj": (4, 24, 32), "down_proj": (4, 32, 12), **params}.items()}
    for at, sizes in ((X, outer), (f"{X}.base_layer", inner)):
        if sizes is not None:
            rows, cols, out = sizes
            shapes.update({f"{at}.lora_A.default.weight": (rows, cols), f"{at}.lora_B.default.weight": (out, rows)})
    return shapes


def test_a_parameter_wrapper_s_shapes_tell_its_parameter_and_its_nesting():
    found = find_adapters(wrapper_shapes(), "CKPT")
    assert [(a.weight, a.rank, a.experts, a.transposed, a.depth) for a in found.adapters] == [
        (f"{X}.down_proj", 3, 4, False, 0), (f"{X}.gate_up_proj", 3, 4, False, 1)]
    assert found.renamed == {f"{X}.base_layer.base_layer.gate_up_proj": f"{X}.gate_up_proj",
                             f"{X}.base_layer.base_layer.down_proj": f"{X}.down_proj"}
    assert (found.targets, found.parameters) == ([], ["experts.down_proj", "experts.gate_up_proj"])
    config = peft_config(found, LoraScale(7, False), [], None, None, [f"{X}.gate_up_proj", f"{X}.down_proj"])
    assert (config["target_modules"], config["target_parameters"]) == ([], ["experts.down_proj",
                                                                           "experts.gate_up_proj"])


@pytest.mark.parametrize("shapes, line", [
    (wrapper_shapes(inner=(12, 32, 32)),
     f"{X}.base_layer.lora_A.default.weight: lora_A [12, 32] and lora_B [32, 12] fit no parameter of {X} "
     "(down_proj [4, 32, 12], gate_up_proj [4, 24, 32]) as peft shapes a ParamWrapper's LoRA (A [E·r, in], "
     "B [out, r·E])"),
    (wrapper_shapes(inner=(12, 12, 32), other_proj=(4, 32, 12)),
     f"{X}.lora_A.default.weight: lora_A [12, 12] and lora_B [32, 12] fit down_proj and other_proj of "
     f"{X}: which parameter this ParamWrapper adapts is not told by the shapes"),
    (wrapper_shapes(inner=(12, 12, 32)), f"{X}.base_layer.lora_A.default.weight: a second peft ParamWrapper on "
                                         f"{X}.down_proj"),
    (wrapper_shapes(outer=None), f"{X}: a peft ParamWrapper without LoRA tensors (lora_A, lora_B) between others"),
    ({**wrapper_shapes(inner=None), f"{X}.base_layer.down_proj": (1, 32, 12),
      f"{X}.lora_A.default.weight": (3, 12), f"{X}.lora_B.default.weight": (32, 3)},
     f"{X}.lora_A.default.weight: a LoRA on {X}.down_proj, a stack of one expert [1, 32, 12], which peft merges as "
     "a matrix: export-hf does not merge it yet"),
])
def test_a_parameter_wrapper_the_shapes_do_not_tell_is_refused_by_name(shapes, line):
    if f"{X}.base_layer.down_proj" in shapes:  # one wrapper: the parameters under one .base_layer
        shapes = {k: v for k, v in shapes.items() if ".base_layer.base_layer." not in k}
    assert refusal(shapes) == f"CKPT: model.base_model.model.{line}"


def test_inspect_falls_back_to_the_tensors_when_the_shapes_do_not_tell():
    summary = adapter_summary(wrapper_shapes(inner=(12, 32, 32)))
    assert (summary["modules"], summary["ranks"], "expert_stacks" in summary) == (2, [12], False)
