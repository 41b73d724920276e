"""`import-hf BASE DST --adapter FOLDER`: a PEFT LoRA folder beside its base model, in as the DCP a
peft model's fine-tuning run resumes from.

A tiny LlamaForCausalLM is saved by `save_pretrained`, and peft adapters trained on it (lora_B,
DoRA magnitudes, an embedding's A, a modules_to_save copy made random, so each changes the
model) by peft's `save_pretrained`. Each folder is imported at 3 ranks with `--verify`; the real
consumer is the model `get_peft_model(model, LoraConfig.from_pretrained(FOLDER))` builds with
other random weights, its `state_dict()` filled by `dcp.load`: every key the checkpoint holds
and no other, every tensor bit for bit that of `PeftModel.from_pretrained(base, FOLDER)`, the
same logits. `make test-full` loads the same into the model `fully_shard`ed over 3 gloo ranks.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from fixtures.gloo import run_ranks
from tests.conftest import run_cli

pytest.importorskip("peft")

WORLD = 3
RANK, ALPHA = 5, 7
TOKENS = torch.tensor([[1, 5, 9, 2, 33, 17, 4, 60, 3]])
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
CASES = {
    "lora": ("default", dict(target_modules=ALL)),
    "dora-rslora": ("default", dict(target_modules=["q_proj", "v_proj"], use_dora=True, use_rslora=True)),
    "embedding-saved": ("default", dict(target_modules=["embed_tokens", "q_proj"], modules_to_save=["lm_head"])),
    "named": ("mine", dict(target_modules=["q_proj", "down_proj"])),
}
"""Adapter folders by kind: (peft adapter name, LoraConfig of the run)."""


def llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, tie_word_embeddings=False)


def base_model():
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(llama_config())


def trained(kind: str):
    """The run's peft model: every trainable tensor moved off its initial value."""
    from peft import LoraConfig, get_peft_model

    name, config = CASES[kind]
    model = get_peft_model(base_model(), LoraConfig(r=RANK, lora_alpha=ALPHA, **config), adapter_name=name)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if any(part in param_name for part in ("lora_B", "lora_embedding_A", "modules_to_save")):
                param.normal_(0, 0.5, generator=generator)
            elif "lora_magnitude_vector" in param_name:
                param.mul_(torch.rand(param.shape, generator=generator) + 0.5)
    return model.eval()


@pytest.fixture(scope="session")
def folders(tmp_path_factory) -> Path:
    """`base/` (the HF model) and one adapter folder per kind (peft puts a named adapter in a subfolder)."""
    root = tmp_path_factory.mktemp("peft-import")
    base_model().save_pretrained(root / "base")
    for kind in CASES:
        trained(kind).save_pretrained(root / kind)
    return root


def adapter_dir(folders: Path, kind: str) -> Path:
    name = CASES[kind][0]
    return folders / kind / name if name != "default" else folders / kind


def import_adapter(folders: Path, kind: str, dst: Path, *args, adapter: Path | None = None):
    name = CASES[kind][0]
    named = ("--adapter-name", name) if name != "default" else ()
    return run_cli("import-hf", folders / "base", dst, "--adapter", adapter or adapter_dir(folders, kind),
                   "--world-size", WORLD, *named, *args)


@pytest.fixture(scope="session")
def imported(folders, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("peft-imported")
    for kind in CASES:
        res = import_adapter(folders, kind, root / kind, "--verify")
        assert res.returncode == 0, (kind, res.stderr)
    return {kind: root / kind for kind in CASES}


def reference(folders: Path, kind: str):
    """What peft itself loads: the base model's folder, then the adapter folder over it."""
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    base = LlamaForCausalLM.from_pretrained(folders / "base")
    return PeftModel.from_pretrained(base, adapter_dir(folders, kind), adapter_name=CASES[kind][0]).eval()


def resumed(folders: Path, kind: str, seed: int = 1000):
    """The run resuming: the peft model of the folder's config on a model of other random weights."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    config = LoraConfig.from_pretrained(adapter_dir(folders, kind))
    return get_peft_model(LlamaForCausalLM(llama_config()), config, adapter_name=CASES[kind][0])


@pytest.mark.parametrize("kind", list(CASES))
def test_the_peft_model_loads_every_tensor_bit_exactly_and_computes_peft_s_logits(folders, imported, kind):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    model = resumed(folders, kind)
    state = model.state_dict()
    saved = FileSystemReader(str(imported[kind])).read_metadata().state_dict_metadata
    assert sorted(saved) == sorted("model." + name for name in state)  # dcp.load would pass over extra keys
    dcp.load({"model": state}, checkpoint_id=imported[kind], no_dist=True)
    want = reference(folders, kind).state_dict()
    assert sorted(want) == sorted(state)
    for name, tensor in want.items():
        assert torch.equal(state[name], tensor), name
    run = trained(kind)
    assert sum(not torch.equal(tensor, run.state_dict()[name]) for name, tensor in want.items()) == 0
    with torch.no_grad():
        logits = model.eval()(TOKENS).logits
        assert torch.equal(logits, reference(folders, kind)(TOKENS).logits)
        assert not torch.equal(logits, base_model()(TOKENS).logits)


def test_every_tensor_is_cut_in_rows_as_fully_shard_cuts_it(folders, imported):
    from torch.distributed.checkpoint import FileSystemReader

    saved = FileSystemReader(str(imported["dora-rslora"])).read_metadata().state_dict_metadata
    state = resumed(folders, "dora-rslora").state_dict()
    for name, tensor in state.items():
        rows = [len(c) for c in torch.arange(tensor.shape[0]).chunk(WORLD)]
        starts = [sum(rows[:i]) for i in range(len(rows))]
        assert [(list(c.offsets), list(c.sizes)) for c in saved["model." + name].chunks] == \
            [([s, *[0] * (tensor.dim() - 1)], [r, *tensor.shape[1:]]) for s, r in zip(starts, rows)], name
    a = "model.base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight"
    assert [list(c.sizes) for c in saved[a].chunks] == [[2, 32], [2, 32], [1, 32]]
    assert list(saved["model.base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector.default.weight"]
                .size) == [32]


@pytest.mark.full
def test_a_fully_sharded_peft_model_loads_it_on_gloo_ranks(folders, imported):
    from fixtures.hf_fsdp2 import load_peft_imports

    cases = [(str(imported[k]), str(folders / "base"), str(adapter_dir(folders, k)), CASES[k][0]) for k in CASES]
    loaded = run_ranks(load_peft_imports, WORLD, cases, TOKENS, timeout=300)[0]
    for kind, got in zip(CASES, loaded):
        want = reference(folders, kind)
        assert sorted(got["state"]) == sorted(want.state_dict())
        for name, tensor in want.state_dict().items():
            assert torch.equal(got["state"][name], tensor), (kind, name)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # as in the ranks: matmuls on other thread counts may sum in another order
        try:
            with torch.no_grad():
                assert torch.equal(got["logits"], want(TOKENS).logits), kind
        finally:
            torch.set_num_threads(threads)


def test_the_note_says_what_was_imported_and_how_to_load_it(folders, tmp_path):
    res = import_adapter(folders, "embedding-saved", tmp_path / "dst")
    assert res.returncode == 0, res.stderr
    assert res.stderr.splitlines()[0] == (
        f"note: 3 LoRA adapters (rank 5) of {folders / 'embedding-saved'} written under peft's names; lm_head "
        "trained whole (modules_to_save): load into get_peft_model(model, LoraConfig.from_pretrained(...))")
    res = import_adapter(folders, "named", tmp_path / "named", "--json")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["notes"] == [
        f"4 LoRA adapters (rank 5) of {folders / 'named' / 'mine'} written under peft's names: load into "
        "get_peft_model(model, LoraConfig.from_pretrained(...), adapter_name='mine')"]


def edited(folders: Path, kind: str, tmp_path: Path, config=None, tensors=None) -> Path:
    """A copy of an adapter folder, its config and tensors changed by the functions given."""
    from safetensors.torch import load_file, save_file

    src, dst = adapter_dir(folders, kind), tmp_path / f"{kind}-edited"
    shutil.copytree(src, dst)
    if config is not None:
        data = json.loads((src / "adapter_config.json").read_text())
        config(data)
        (dst / "adapter_config.json").write_text(json.dumps(data))
    if tensors is not None:
        state = load_file(src / "adapter_model.safetensors")
        tensors(state)
        save_file(state, dst / "adapter_model.safetensors", metadata={"format": "pt"})
    return dst


Q1 = "base_model.model.model.layers.1.self_attn.q_proj"


def renamed_q1(state):
    for part in ("lora_A", "lora_B"):
        state[f"{Q1.replace('q_proj', 'x_proj')}.{part}.weight"] = state.pop(f"{Q1}.{part}.weight")


REFUSALS = [
    ("lora", dict(tensors=renamed_q1),
     "{weights}: base_model.model.model.layers.1.self_attn.x_proj.lora_A.weight: an adapter on "
     "model.layers.1.self_attn.x_proj, but the base model has no model.layers.1.self_attn.x_proj.weight (is the "
     "adapter this model's?)"),
    ("lora", dict(config=lambda c: c.update(r=8)),
     "{weights}: base_model.model.model.layers.0.mlp.down_proj.lora_A.weight has rank 5 (its rows), but {config} says "
     "r 8 (+13 more adapters)"),
    ("named", dict(config=lambda c: c.update(target_modules=["q_proj", "down_proj", "k_proj"])),
     "{weights}: adapter_config.json's target_modules adapt model.layers.0.self_attn.k_proj (+1 more module), which "
     "has no adapter here: peft would start it fresh"),
    ("named", dict(config=lambda c: c.update(target_modules=["q_proj"])),
     "{weights}: base_model.model.model.layers.0.mlp.down_proj.lora_A.weight: an adapter on model.layers.0.mlp."
     "down_proj, which adapter_config.json's target_modules does not name: peft would not load it"),
    ("dora-rslora", dict(config=lambda c: c.update(use_dora=False)),
     "{weights}: base_model.model.model.layers.0.self_attn.q_proj holds DoRA magnitudes (base_model.model.model."
     "layers.0.self_attn.q_proj.lora_magnitude_vector), but {config} says use_dora false"),
    ("embedding-saved", dict(tensors=lambda s: s.pop("base_model.model.lm_head.weight")),
     "{weights}: has no base_model.model.lm_head.weight, the trained copy of a modules_to_save module "
     "(adapter_config.json names lm_head)"),
    ("lora", dict(tensors=lambda s: s.update({"base_model.model.model.norm.weight": torch.ones(32)})),
     "{weights}: base_model.model.model.norm.weight: neither a LoRA tensor nor a parameter of a modules_to_save "
     "module of adapter_config.json: it has no place in the peft model"),
    ("lora", dict(tensors=lambda s: s.update({f"{Q1}.lora_B.weight": torch.zeros(32, 4)})),
     f"{{weights}}: {Q1}: lora_A [5, 32] and lora_B [32, 4] do not pair with its base weight [32, 32] (want "
     "[r, 32] and [32, r])"),
    ("lora", dict(config=lambda c: c.update(target_modules=".*_proj")),
     "{config}: target_modules is the pattern \".*_proj\"; import-hf matches a list of names or |-joined literal "
     "names (it runs no pattern from a file)"),
    ("lora", dict(config=lambda c: c.update(layers_to_transform=[0])),
     "{config}: layers_to_transform is [0], which import-hf does not import yet"),
    ("lora", dict(config=lambda c: c.update(rank_pattern={"q_proj": 2})),
     "{config}: has a rank_pattern (per-module ranks), which import-hf does not import yet"),
]


@pytest.mark.parametrize("kind, edit, line", REFUSALS)
def test_an_adapter_folder_that_does_not_fit_is_refused_in_one_exact_line(folders, tmp_path, kind, edit, line):
    folder = edited(folders, kind, tmp_path, **edit)
    res = import_adapter(folders, kind, tmp_path / "dst", adapter=folder)
    assert res.returncode == 2
    assert res.stderr == "ckptctl: error: " + line.format(weights=folder / "adapter_model.safetensors",
                                                          config=folder / "adapter_config.json") + "\n"
    assert not (tmp_path / "dst").exists()


def test_a_literal_alternation_of_module_names_is_matched_whole(folders, tmp_path):
    """export-hf --adapter-only writes `target_modules` as `|`-joined escaped names when not every
    module of a leaf name is adapted: import-hf matches it as peft's full match does."""
    modules = [f"model.layers.{i}.{m}" for i in (0, 1) for m in ("self_attn.q_proj", "mlp.down_proj")]
    names = "|".join(map(re.escape, modules))
    assert names.startswith(r"model\.layers\.0\.self_attn\.q_proj|model\.layers\.0\.mlp\.down_proj|")
    folder = edited(folders, "named", tmp_path, config=lambda c: c.update(target_modules=names))
    assert import_adapter(folders, "named", tmp_path / "dst", adapter=folder).returncode == 0
    fewer = "|".join(map(re.escape, modules[:3]))
    folder = edited(folders, "named", tmp_path / "fewer", config=lambda c: c.update(target_modules=fewer))
    res = import_adapter(folders, "named", tmp_path / "dst2", adapter=folder)
    assert res.returncode == 2
    assert res.stderr.endswith(": base_model.model.model.layers.1.mlp.down_proj.lora_A.weight: an adapter on "
                               "model.layers.1.mlp.down_proj, which adapter_config.json's target_modules does not "
                               "name: peft would not load it\n")


def test_a_missing_base_weight_is_refused_with_or_without_the_name_check(folders, tmp_path):
    from safetensors.torch import load_file, save_file

    base = tmp_path / "base"
    shutil.copytree(folders / "base", base)
    state = load_file(base / "model.safetensors")
    del state["model.layers.1.self_attn.q_proj.weight"]
    save_file(state, base / "model.safetensors", metadata={"format": "pt"})
    adapter = adapter_dir(folders, "lora")
    res = run_cli("import-hf", base, tmp_path / "dst", "--adapter", adapter, "-n", "2")
    assert (res.returncode, res.stderr) == (2, f"ckptctl: error: {base}: 1 weight a LlamaForCausalLM expects is "
                                               "missing: model.layers.1.self_attn.q_proj.weight\n")
    res = run_cli("import-hf", base, tmp_path / "dst", "--adapter", adapter, "-n", "2", "--no-name-check")
    assert (res.returncode, res.stderr) == (2, f"ckptctl: error: {adapter / 'adapter_model.safetensors'}: {Q1}."
                                               "lora_A.weight: an adapter on model.layers.1.self_attn.q_proj, but the "
                                               "base model has no model.layers.1.self_attn.q_proj.weight (is the "
                                               "adapter this model's?)\n")


@pytest.mark.parametrize("args, line", [
    (("--to", "torchtitan"), "--adapter writes a peft model as FSDP2 saves it: it has no --to torchtitan"),
    (("--include", "model.*"), "--include/--exclude do not apply to --adapter (the peft model loads every tensor)"),
    (("--adapter-name", "a.b"), "--adapter-name 'a.b' is no peft adapter name (one word, no dot)"),
])
def test_option_errors_are_one_line(folders, tmp_path, args, line):
    res = run_cli("import-hf", folders / "base", tmp_path / "dst", "--adapter", adapter_dir(folders, "lora"), "-n",
                  "2", *args)
    assert (res.returncode, res.stderr) == (2, f"ckptctl: error: {line}\n")


def test_adapter_name_without_an_adapter_and_a_pickled_adapter_are_refused(folders, tmp_path):
    res = run_cli("import-hf", folders / "base", tmp_path / "dst", "-n", "2", "--adapter-name", "mine")
    assert (res.returncode, res.stderr) == (2, "ckptctl: error: --adapter-name names the adapter of --adapter "
                                               "FOLDER\n")
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "adapter_config.json").write_text("{}")
    (pickled / "adapter_model.bin").write_bytes(b"\x80\x04K\x01.")
    res = run_cli("import-hf", folders / "base", tmp_path / "dst", "-n", "2", "--adapter", pickled)
    assert (res.returncode, res.stderr) == (2, f"ckptctl: error: {pickled}: holds adapter_model.bin, a pickle, which "
                                               "import-hf does not unpickle: save the adapter with safetensors "
                                               "(adapter_model.safetensors)\n")
    assert not (tmp_path / "dst").exists()


def test_export_hf_gives_the_folder_back_and_merges_it_as_peft_does(folders, imported, tmp_path):
    """The round trip a run makes: imported, trained on, exported. `export-hf --adapter-only` of the
    import writes the folder's tensors bit for bit, and `--merge-adapters` equals peft's
    `merge_and_unload()` of the folder on its base."""
    from safetensors.torch import load_file

    adapter = adapter_dir(folders, "dora-rslora")
    config = adapter / "adapter_config.json"
    out = tmp_path / "adapter"
    res = run_cli("export-hf", imported["dora-rslora"], out, "--hf-config", folders / "base", "--adapter-only",
                  "--adapter-config", config)
    assert res.returncode == 0, res.stderr
    want, got = load_file(adapter / "adapter_model.safetensors"), load_file(out / "adapter_model.safetensors")
    assert sorted(got) == sorted(want) and all(torch.equal(got[n], want[n]) for n in want)
    res = run_cli("export-hf", imported["dora-rslora"], tmp_path / "merged", "--hf-config", folders / "base",
                  "--merge-adapters", "--adapter-config", config)
    assert res.returncode == 0, res.stderr
    merged = reference(folders, "dora-rslora").merge_and_unload().state_dict()
    got = load_file(tmp_path / "merged" / "model.safetensors")
    assert sorted(got) == sorted(merged) and all(torch.equal(got[n], merged[n]) for n in merged)


def test_a_base_that_ties_its_head_keeps_the_head_beside_the_adapters(tmp_path):
    """A tying base (lm_head not on disk): the peft model's state dict lists
    `base_model.model.lm_head.weight`, written as a copy of the embeddings, and the model loads."""
    import torch.distributed.checkpoint as dcp
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import LlamaForCausalLM

    config = llama_config()
    config.tie_word_embeddings = True
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "base")
    torch.manual_seed(0)
    run = get_peft_model(LlamaForCausalLM(config), LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=["v_proj"]))
    with torch.no_grad():
        for name, param in run.named_parameters():
            if "lora_B" in name:
                param.normal_()
    run.save_pretrained(tmp_path / "adapter")
    res = run_cli("import-hf", tmp_path / "base", tmp_path / "dst", "--adapter", tmp_path / "adapter", "-n", "2")
    assert res.returncode == 0, res.stderr
    assert res.stderr.splitlines()[0] == ("note: model.base_model.model.lm_head.weight written as a copy of "
                                          "model.base_model.model.model.embed_tokens.weight (LlamaForCausalLM ties "
                                          "them; model.state_dict() lists both)")
    torch.manual_seed(7)
    model = get_peft_model(LlamaForCausalLM(config), LoraConfig.from_pretrained(tmp_path / "adapter"))
    state = model.state_dict()
    saved = dcp.FileSystemReader(str(tmp_path / "dst")).read_metadata().state_dict_metadata
    assert sorted(saved) == sorted("model." + n for n in state)
    dcp.load({"model": state}, checkpoint_id=tmp_path / "dst", no_dist=True)
    want = PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(tmp_path / "base"), tmp_path / "adapter")
    assert all(torch.equal(state[n], t) for n, t in want.state_dict().items())
    with torch.no_grad():
        assert torch.equal(model.eval()(TOKENS).logits, want.eval()(TOKENS).logits)
