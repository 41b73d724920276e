"""`families.peft_folder`: a PEFT folder's names and its config's targets, as a peft model names
them; pure functions over names and shapes (the import itself is proven by peft in
tests/commands/test_import_hf_adapter.py)."""

from __future__ import annotations

import json

import pytest

from ckptctl.families.peft_folder import peft_model_names, read_folder_config
from ckptctl.util.errors import CheckpointError, UsageError

P = "base_model.model."
Q = "model.layers.0.self_attn.q_proj"
BASE = {f"{Q}.weight": (8, 4), f"{Q}.bias": (8,), "model.layers.0.self_attn.k_proj.weight": (4, 4),
        "model.embed_tokens.weight": (16, 4), "lm_head.weight": (16, 4), "model.norm.weight": (4,)}


def config(tmp_path, **data):
    path = tmp_path / "adapter_config.json"
    path.write_text(json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj"], **data}))
    return read_folder_config(path)


def lora(module: str = Q, rank: int = 2, out: int = 8, inp: int = 4) -> dict:
    return {f"{P}{module}.lora_A.weight": (rank, inp), f"{P}{module}.lora_B.weight": (out, rank)}


def test_names_are_the_peft_model_s_with_the_adapter_name(tmp_path):
    folder = {**lora(), f"{P}lm_head.weight": (16, 4)}
    names = peft_model_names(BASE, folder, config(tmp_path, modules_to_save=["lm_head"]), "mine", "W")
    assert names.base == {f"{Q}.weight": f"{P}{Q}.base_layer.weight", f"{Q}.bias": f"{P}{Q}.base_layer.bias",
                          "model.layers.0.self_attn.k_proj.weight": f"{P}model.layers.0.self_attn.k_proj.weight",
                          "model.embed_tokens.weight": f"{P}model.embed_tokens.weight",
                          "lm_head.weight": f"{P}lm_head.original_module.weight",
                          "model.norm.weight": f"{P}model.norm.weight"}
    assert names.folder == {f"{P}{Q}.lora_A.weight": f"{P}{Q}.lora_A.mine.weight",
                            f"{P}{Q}.lora_B.weight": f"{P}{Q}.lora_B.mine.weight",
                            f"{P}lm_head.weight": f"{P}lm_head.modules_to_save.mine.weight"}
    assert (names.adapted, names.saved, names.rank) == ((Q,), ("lm_head",), 2)


def test_an_adapted_embedding_s_saved_weight_is_loaded_over_the_base_s(tmp_path):
    e = "model.embed_tokens"
    folder = {f"{P}{e}.lora_embedding_A": (2, 16), f"{P}{e}.lora_embedding_B": (4, 2), f"{P}{e}.base_layer.weight":
              (16, 4), **lora()}
    names = peft_model_names(BASE, folder, config(tmp_path, target_modules=["q_proj", "embed_tokens"]), "default",
                             "W")
    assert f"{e}.weight" not in names.base
    assert names.folder[f"{P}{e}.base_layer.weight"] == f"{P}{e}.base_layer.weight"
    assert names.folder[f"{P}{e}.lora_embedding_A"] == f"{P}{e}.lora_embedding_A.default"


@pytest.mark.parametrize("targets, folder, line", [
    (["q_proj"], {f"{P}{Q}.lora_A.weight": (2, 4)}, f"W: {P}{Q}.lora_A.weight has no lora_B beside it"),
    (["q_proj"], {**lora(), f"{P}{Q}.lora_A.default.weight": (2, 4)},
     f"W: {P}{Q}.lora_A.default.weight: neither a LoRA tensor nor a parameter of a modules_to_save module of "
     "adapter_config.json: it has no place in the peft model"),
    (["q_proj"], {"model.x": (1,)}, "W: model.x: not under base_model.model., as PEFT's save_pretrained names every "
                                    "tensor"),
    (["norm"], {f"{P}model.norm.lora_A.weight": (2, 4), f"{P}model.norm.lora_B.weight": (4, 2), **lora()},
     f"W: {P}{Q}.lora_A.weight: an adapter on {Q}, which adapter_config.json's target_modules does not name: peft "
     "would not load it"),
    (["q_proj", "norm"], {f"{P}model.norm.lora_A.weight": (2, 4), f"{P}model.norm.lora_B.weight": (4, 2), **lora()},
     f"W: {P}model.norm: lora_A [2, 4] and lora_B [4, 2] do not pair with its base weight [4] (want [r, 4] and "
     "[4, r])"),
    (["q_proj", "k_proj"], lora(), "W: adapter_config.json's target_modules adapt model.layers.0.self_attn.k_proj, "
                                   "which has no adapter here: peft would start it fresh"),
])
def test_folders_that_do_not_fit_are_refused_by_name(tmp_path, targets, folder, line):
    with pytest.raises(CheckpointError) as err:
        peft_model_names(BASE, folder, config(tmp_path, target_modules=targets), "default", "W")
    assert str(err.value) == line


@pytest.mark.parametrize("data, line", [
    ({"target_modules": "all-linear"}, "target_modules is 'all-linear', which import-hf does not expand yet: name the "
                                       "modules"),
    ({"target_modules": "q_proj|(k_proj)+"}, "target_modules is the pattern \"q_proj|(k_proj)+\"; import-hf matches "
                                             "a list of names or |-joined literal names (it runs no pattern from a "
                                             "file)"),
    ({"target_modules": []}, "target_modules is [], not a list of module names"),
    ({"exclude_modules": ["k_proj"]}, "exclude_modules is [\"k_proj\"], which import-hf does not import yet"),
    ({"kasa_config": {}}, "kasa_config is set (KaSA: the base weight truncated by SVD, a learned diagonal between B "
                          "and A), which import-hf does not import yet"),  # {}: peft's KaSA at its defaults
    ({"use_bdlora": {}}, "use_bdlora is {}, which import-hf does not import yet"),
    ({"fan_in_fan_out": True}, "fan_in_fan_out is true (transposed (Conv1D) weights), which import-hf does not "
                               "import yet"),
])
def test_configs_import_hf_does_not_follow_are_refused(tmp_path, data, line):
    with pytest.raises(UsageError) as err:
        config(tmp_path, **data)
    assert str(err.value) == f"{tmp_path / 'adapter_config.json'}: {line}"


def test_refusals_name_the_command_that_reads_the_folder(tmp_path):
    """export-hf of a NeMo Automodel step reads its PEFT folder too: its refusals said
    "which import-hf does not import yet"."""
    path = tmp_path / "adapter_config.json"
    path.write_text(json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj"],
                                "layers_to_transform": [0]}))
    with pytest.raises(UsageError) as err:
        read_folder_config(path, "export-hf does not read")
    assert str(err.value) == f"{path}: layers_to_transform is [0], which export-hf does not read yet"


def test_a_string_of_escaped_names_matches_each_whole_and_nothing_else(tmp_path):
    cfg = config(tmp_path, target_modules=r"model\.layers\.0\.self_attn\.q_proj|lm_head")
    assert cfg.literals == {Q, "lm_head"}
    assert [cfg.adapts(m) for m in (Q, "lm_head", "model.layers.10.self_attn.q_proj", "q_proj")] == [
        True, True, False, False]
    listed = config(tmp_path, target_modules=["q_proj"])
    assert [listed.adapts(m) for m in (Q, "q_proj", "model.layers.0.self_attn.xq_proj")] == [True, True, False]


def test_modules_to_save_matching_a_module_and_one_inside_it_is_refused(tmp_path):
    cfg = config(tmp_path, modules_to_save=["layers.0", "self_attn"])
    with pytest.raises(UsageError) as err:
        peft_model_names(BASE, lora(), cfg, "default", "W")
    assert str(err.value) == (f"{tmp_path / 'adapter_config.json'}: modules_to_save matches "
                              "model.layers.0.self_attn and a module holding it: which one peft trains whole is not "
                              "guessed")


def test_matching_takes_the_name_s_time_not_the_list_s():
    """100,000 target names: each module is looked up tail by tail (peft's `endswith` semantics)."""
    import time

    from ckptctl.families.adapters import LoraScale
    from ckptctl.families.peft_folder import AdapterFolderConfig

    many = tuple(f"x{i}" for i in range(100_000))
    cfg = AdapterFolderConfig(LoraScale(1, False, 2), many + ("q_proj",), None, many + ("lm_head",), None)
    started = time.perf_counter()
    found = [cfg.adapts(f"model.layers.{i}.self_attn.q_proj") and cfg.saves(f"m{i}.lm_head") for i in range(20_000)]
    assert all(found) and not cfg.adapts("model.layers.0.self_attn.xq_proj") and cfg.saves("model.my_lm_head")
    assert time.perf_counter() - started < 5


X = "model.layers.0.mlp.experts"
MOE = {f"{X}.gate_up_proj": (4, 24, 32), f"{X}.down_proj": (4, 32, 12), "model.norm.weight": (32,)}
WRAPPED = {f"{P}{X}.lora_A.weight": (12, 12), f"{P}{X}.lora_B.weight": (32, 12),
           f"{P}{X}.base_layer.lora_A.weight": (12, 32), f"{P}{X}.base_layer.lora_B.weight": (24, 12)}


def moe_config(tmp_path, **data):
    return config(tmp_path, **{"r": 3, "target_modules": [],
                               "target_parameters": ["experts.gate_up_proj", "experts.down_proj"], **data})


def test_parameter_wrappers_are_named_as_peft_nests_them(tmp_path):
    names = peft_model_names(MOE, WRAPPED, moe_config(tmp_path), "default", "W")
    assert names.base == {f"{X}.gate_up_proj": f"{P}{X}.base_layer.base_layer.gate_up_proj",
                          f"{X}.down_proj": f"{P}{X}.base_layer.base_layer.down_proj",
                          "model.norm.weight": f"{P}model.norm.weight"}
    assert names.folder == {name: name.replace(".weight", ".default.weight") for name in WRAPPED}


def expected(order):
    from ckptctl.families.expected import ExpectedNames

    return ExpectedNames("Qwen3MoeForCausalLM", frozenset(), frozenset(), {}, "5", shapes={n: MOE[n] for n in order})


@pytest.mark.parametrize("data, folder, model, line", [
    ({"target_modules": None}, WRAPPED, None,
     "{path}: target_modules is null beside target_parameters: peft then adapts its default modules for the model "
     "type, which import-hf does not guess ([] adapts none)"),
    ({}, {k: v for k, v in WRAPPED.items() if ".base_layer." not in k}, None,
     f"W: {P}{X}.lora_A.weight: adapter_config.json's target_parameters wrap 2 parameters of {X} (down_proj, "
     f"gate_up_proj), but the folder has no LoRA at {P}{X}.base_layer.lora_A.weight"),
    ({"target_parameters": ["experts.gate_up_proj"]}, {k: v for k, v in WRAPPED.items() if ".base_layer." in k},
     None, f"W: {P}{X}.base_layer.lora_A.weight: adapter_config.json's target_parameters wrap 1 parameter of {X} "
     f"(gate_up_proj), but the folder has no LoRA at {P}{X}.lora_A.weight"),
    ({}, WRAPPED, expected([f"{X}.down_proj", f"{X}.gate_up_proj"]),
     f"W: {P}{X}.base_layer.lora_A.weight: the folder nests the LoRA of {X} as down_proj in gate_up_proj, but peft "
     "nests them as the model registers them: gate_up_proj in down_proj"),
    ({"r": 2}, WRAPPED, None, f"W: {P}{X}.lora_A.weight has rank 3 (its rows over 4 experts), but {{path}} says r 2"),
    ({}, {**WRAPPED, f"{P}{X}.base_layer.lora_A.weight": (12, 24), f"{P}{X}.base_layer.lora_B.weight": (32, 12)},
     expected([f"{X}.gate_up_proj", f"{X}.down_proj"]),
     f"W: {P}{X}.base_layer.lora_A.weight: lora_A [12, 24] and lora_B [32, 12] are shaped for {X}.gate_up_proj held "
     "as [E, in, out], but a Qwen3MoeForCausalLM holds it as [E, out, in] (a LoRA of peft before 0.19.1, "
     "huggingface/peft#3165?)"),
])
def test_parameter_wrappers_peft_would_not_load_as_written_are_refused(tmp_path, data, folder, model, line):
    with pytest.raises((CheckpointError, UsageError)) as err:
        peft_model_names(MOE, folder, moe_config(tmp_path, **data), "default", "W", model)
    assert str(err.value) == line.format(path=tmp_path / "adapter_config.json")


@pytest.mark.parametrize("data, line", [
    ({"lora_dropout": 0.1}, "lora_dropout is 0.1 beside target_parameters: peft's ParamWrapper has no dropout"),
    ({"use_dora": True}, "use_dora is true beside target_parameters: peft's ParamWrapper has no DoRA"),
])
def test_what_peft_refuses_beside_target_parameters_is_refused(tmp_path, data, line):
    with pytest.raises(UsageError) as err:
        moe_config(tmp_path, **data)
    assert str(err.value) == f"{tmp_path / 'adapter_config.json'}: {line}, and get_peft_model refuses it"
