"""`ckptctl import-hf`: a Hugging Face folder in, a DCP checkpoint a `fully_shard`ed model loads out.

Tiny random transformers models are saved by `save_pretrained` (one sharded with an
index, one tying lm_head), imported by the CLI at 3 ranks, and loaded by their real
consumer: the same model class `fully_shard`ed over 3 gloo ranks with other random
weights, `dcp.load` into its state dict. Every tensor must equal the folder's, bit for
bit, and the sharded model's logits those of `from_pretrained` on the folder.
"""

from __future__ import annotations

import json
import re
import shutil
import struct
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from fixtures.gloo import run_ranks
from tests.conftest import run_cli
from tests.terminal import assert_no_traceback, run_in_terminal

transformers = pytest.importorskip("transformers")
WORLD = 3
WIDE = 250


def _tiny(kind: str):
    common = dict(vocab_size=64, hidden_size=16, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2)
    if kind == "llama-tied":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common, tie_word_embeddings=True))
    if kind == "qwen3-moe":
        return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            **common, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=12,
            decoder_sparse_step=1, mlp_only_layers=[0], tie_word_embeddings=False))
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common, head_dim=8, tie_word_embeddings=False))


@pytest.fixture(scope="session")
def folders(tmp_path_factory):
    """HF folders by kind: `llama-tied` in 3 shards with an index, `qwen3` and `qwen3-moe` (experts
    per expert on disk, stacked in memory) in one file."""
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for seed, kind in enumerate(("llama-tied", "qwen3", "qwen3-moe")):
        torch.manual_seed(seed)
        model = _tiny(kind)
        out[kind] = root / kind
        model.save_pretrained(out[kind], max_shard_size="8KB" if kind == "llama-tied" else "5GB")
    return out


@pytest.fixture(scope="session")
def imported(folders, tmp_path_factory):
    """Each folder imported at 3 ranks with --verify, and what the fully_shard'ed model loaded from it."""
    from fixtures import hf_fsdp2

    root = tmp_path_factory.mktemp("imported")
    with ThreadPoolExecutor(max_workers=2) as pool:  # each run is a process: two cores, two at a time
        runs = dict(zip(folders, pool.map(lambda item: run_cli("import-hf", item[1], root / item[0], "--world-size",
                                                               WORLD, "--verify"), folders.items())))
    for kind, run in runs.items():
        assert run.returncode == 0, (kind, run.stderr)
    loaded = run_ranks(hf_fsdp2.load_imports, WORLD, [(str(root / k), str(f)) for k, f in folders.items()])[0]
    return {kind: (root / kind, runs[kind], got) for kind, got in zip(folders, loaded)}


def _folder_tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update(load_file(file))
    return out


@pytest.mark.parametrize("kind", ["llama-tied", "qwen3", "qwen3-moe"])
def test_a_fully_sharded_model_loads_every_tensor_bit_exactly_and_computes_the_same_logits(folders, imported, kind):
    from fixtures.hf_fsdp2 import TOKENS

    _, _, got = imported[kind]
    want = _folder_tensors(folders[kind])
    ref = transformers.AutoModelForCausalLM.from_pretrained(folders[kind], dtype=torch.float32)
    expected = ref.state_dict()
    assert sorted(got["state"]) == sorted(expected)
    for name, value in expected.items():
        assert torch.equal(got["state"][name], want.get(name, value)), name
        assert torch.equal(got["state"][name], value), name
    with torch.no_grad():
        assert torch.equal(got["logits"], ref(TOKENS).logits)


def test_the_output_is_fsdp2_shard0_at_the_world_size_with_hf_names_behind_the_prefix(imported, folders):
    from torch.distributed.checkpoint import FileSystemReader

    out, _, _ = imported["qwen3"]
    md = FileSystemReader(str(out)).read_metadata()
    want = _folder_tensors(folders["qwen3"])
    assert sorted(md.state_dict_metadata) == sorted("model." + n for n in want)
    assert sorted(p.name for p in out.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp"]
    for name, tensor in want.items():
        meta = md.state_dict_metadata["model." + name]
        rows = [len(c) for c in torch.arange(tensor.shape[0]).chunk(WORLD)]  # FSDP2's own cut: torch.chunk
        starts = [sum(rows[:i]) for i in range(len(rows))]
        assert list(meta.size) == list(tensor.shape)
        assert [(list(c.offsets), list(c.sizes)) for c in meta.chunks] == \
            [([s, *[0] * (tensor.dim() - 1)], [r, *tensor.shape[1:]]) for s, r in zip(starts, rows)], name
    assert md.state_dict_metadata["model.model.embed_tokens.weight"].chunks[2].sizes == torch.Size([20, 16])


def test_a_tied_lm_head_is_written_as_a_copy_of_the_embeddings_with_a_note(imported):
    out, run, got = imported["llama-tied"]
    assert run.stderr.splitlines()[0] == ("note: model.lm_head.weight written as a copy of "
                                          "model.model.embed_tokens.weight (LlamaForCausalLM ties them; "
                                          "model.state_dict() lists both)")
    assert re.fullmatch(rf"wrote {out} \(21 tensors, [\d.]+ kB in 3 data files \+ \.metadata; names checked against "
                        r"LlamaForCausalLM\) in .*, verified", run.stderr.splitlines()[-1])
    assert torch.equal(got["state"]["lm_head.weight"], got["state"]["model.embed_tokens.weight"])


def test_moe_experts_are_stacked_as_transformers_holds_them_in_memory(imported, folders):
    from torch.distributed.checkpoint import FileSystemReader

    out, run, _ = imported["qwen3-moe"]
    assert run.stderr.splitlines()[0] == ("note: 12 per-expert tensors stacked into 2 tensors as Qwen3MoeForCausalLM "
                                          "holds them in memory")
    md = FileSystemReader(str(out)).read_metadata().state_dict_metadata
    gate_up = md["model.model.layers.1.mlp.experts.gate_up_proj"]
    assert list(gate_up.size) == [4, 24, 16]
    assert [(list(c.offsets), list(c.sizes)) for c in gate_up.chunks] == \
        [([0, 0, 0], [2, 24, 16]), ([2, 0, 0], [2, 24, 16])]  # torch.chunk(4, 3): 2, 2 and none
    assert not any(".experts.0." in name for name in md)


def test_json_reports_the_counts_the_model_class_and_the_notes(folders, tmp_path):
    run = run_cli("import-hf", folders["qwen3"], tmp_path / "o", "-n", "2", "--json", "--prefix", "",
                  "--dtype", "bf16")
    assert run.returncode == 0, run.stderr
    doc = json.loads(run.stdout)
    assert (doc["world_size"], doc["tensors"], doc["files"], doc["model_class"], doc["notes"]) == \
        (2, 25, 3, "Qwen3ForCausalLM", [])
    assert doc["bytes_read"] == sum(t.numel() * 4 for t in _folder_tensors(folders["qwen3"]).values())
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(str(tmp_path / "o")).read_metadata()
    assert "model.embed_tokens.weight" in md.state_dict_metadata  # --prefix '': the names as they are
    assert md.state_dict_metadata["lm_head.weight"].properties.dtype == torch.bfloat16


def test_include_narrows_the_import_without_asking_for_the_rest(folders, tmp_path):
    run = run_cli("import-hf", folders["qwen3"], tmp_path / "o", "-n", "2", "--include", "model.layers.0.*")
    assert run.returncode == 0, run.stderr
    from torch.distributed.checkpoint import FileSystemReader

    names = FileSystemReader(str(tmp_path / "o")).read_metadata().state_dict_metadata
    assert len(names) == 11 and all(n.startswith("model.model.layers.0.") for n in names)


def _copy(folder: Path, dst: Path) -> Path:
    shutil.copytree(folder, dst)
    return dst


def _resave(folder: Path, change) -> None:
    """Rewrite a one-file folder's tensors after `change(dict)`."""
    from safetensors.torch import save_file

    tensors = _folder_tensors(folder)
    change(tensors)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


def test_a_name_the_model_has_no_place_for_is_refused(folders, tmp_path):
    bad = _copy(folders["qwen3"], tmp_path / "hf")
    _resave(bad, lambda t: t.update({"model.layers.0.mlp.extra.weight": torch.zeros(2)}))
    run = run_cli("import-hf", bad, tmp_path / "o", "-n", "2")
    assert (run.returncode, run.stderr) == (2, f"ckptctl: error: {bad}: 1 tensor has no place in a Qwen3ForCausalLM: "
                                               "model.layers.0.mlp.extra.weight (is config.json this model's?)\n")
    assert not (tmp_path / "o").exists()


def test_a_missing_weight_is_refused(folders, tmp_path):
    bad = _copy(folders["qwen3"], tmp_path / "hf")
    _resave(bad, lambda t: t.pop("model.layers.1.self_attn.k_norm.weight"))
    run = run_cli("import-hf", bad, tmp_path / "o", "-n", "2")
    assert (run.returncode, run.stderr) == (2, f"ckptctl: error: {bad}: 1 weight a Qwen3ForCausalLM expects is "
                                               "missing: model.layers.1.self_attn.k_norm.weight\n")


def test_a_folder_without_config_is_refused_unless_names_are_left_unchecked(folders, tmp_path):
    bare = _copy(folders["qwen3"], tmp_path / "hf")
    (bare / "config.json").unlink()
    run = run_cli("import-hf", bare, tmp_path / "o", "-n", "2")
    assert (run.returncode, run.stderr) == (2, f"ckptctl: error: {bare}: no config.json; import-hf checks the tensor "
                                               "names against the model it describes (or --no-name-check to import "
                                               "the names unchecked)\n")
    run = run_cli("import-hf", bare / "model.safetensors", tmp_path / "o", "-n", "2", "--no-name-check", "--verify")
    assert run.returncode == 0, run.stderr
    assert run.stderr.splitlines()[0] == "note: tensor names not checked against transformers' model (--no-name-check)"


@pytest.mark.parametrize("damage, reason", [
    (lambda b: b[:-5], "bytes {} do not hold"),
    (lambda b: struct.pack("<Q", 1 << 40) + b[8:], "not a safetensors file (no header of a plausible length)"),
    (lambda b: b[:8] + b"[" + b[9:], "not a safetensors file (header is not JSON)"),
])
def test_a_damaged_safetensors_file_is_one_line_naming_it(folders, tmp_path, damage, reason):
    bad = _copy(folders["qwen3"], tmp_path / "hf")
    file = bad / "model.safetensors"
    file.write_bytes(damage(file.read_bytes()))
    run = run_cli("import-hf", bad, tmp_path / "o", "-n", "2")
    assert run.returncode == 2
    line = run.stderr.strip()
    assert "\n" not in line and line.startswith(f"ckptctl: error: {file}: ")
    assert reason.split("{}")[0] in line
    assert not (tmp_path / "o").exists()


def test_an_unknown_target_is_refused_naming_those_there_are(folders, tmp_path):
    run = run_cli("import-hf", folders["qwen3"], tmp_path / "o", "-n", "2", "--to", "nemo")
    assert (run.returncode, run.stderr) == (2, "ckptctl: error: --to must be one of fsdp2, torchtitan, megatron-fsdp "
                                               "(got 'nemo')\n")


def test_at_a_terminal_a_bar_then_the_final_line_and_in_a_pipe_only_the_line(folders, tmp_path):
    run = run_in_terminal("import-hf", folders["qwen3"], tmp_path / "t", "-n", "2", "--verify", columns=WIDE)
    assert run.returncode == 0
    assert_no_traceback(run.plain)
    lines = run.screen.splitlines()
    assert len([line for line in lines if line.startswith("writing")]) == 1
    assert len([line for line in lines if line.startswith("verifying")]) == 1
    assert re.fullmatch(rf"wrote {tmp_path / 't'} \(25 tensors, [\d.]+ kB in 2 data files \+ \.metadata; names checked against "
                        r"Qwen3ForCausalLM\) in \d+\.\d\ds \(writing .*\), peak RSS [\d.]+ MB, verified", lines[-1])
    piped = run_cli("import-hf", folders["qwen3"], tmp_path / "p", "-n", "2")
    assert piped.returncode == 0 and piped.stdout == ""
    assert len(piped.stderr.splitlines()) == 1 and piped.stderr.startswith(f"wrote {tmp_path / 'p'} (25 tensors")


def test_dry_run_writes_nothing_and_says_the_plan(folders, tmp_path):
    run = run_cli("import-hf", folders["llama-tied"], tmp_path / "o", "-n", "4", "--dry-run")
    assert run.returncode == 0, run.stderr
    assert re.fullmatch(rf"Dry run      nothing written to {tmp_path / 'o'}\nSource       {folders['llama-tied']}\n"
                        r"As           fsdp2\nWorld size   4\nDtype        kept\n"
                        r"Entries      21 tensors, 0 bytes entries\n"
                        r"Files        4 data files \+ \.metadata, [\d.]+ kB\n(?:             __\d_0\.distcp  [\d.]+ kB\n){4}"
                        r"Read         [\d.]+ kB\n"
                        r"Peak memory  [\d.]+ MB \(predicted\)\nNames        names checked against LlamaForCausalLM\n",
                        run.stdout)
    assert not (tmp_path / "o").exists()


# --------------------------------------------------------------------------------------
# --to megatron-fsdp: against the test-side HF → Megatron mapping, and back through export-hf
# --------------------------------------------------------------------------------------

MEGATRON_CASES = [  # (family, TP, DP, fc1/GDN storage)
    ("llama", 2, 2, "fused"), ("qwen3-moe", 2, 2, "fused"), ("qwen3-next", 1, 3, "split"),
    ("nemotron-h", 2, 2, "split"), ("gpt-oss", 2, 2, "split"),
    *(pytest.param(*case, marks=pytest.mark.full) for case in (
        ("llama", 4, 1, "split"), ("qwen3", 2, 1, "fused"), ("qwen3-next", 2, 2, "fused"),
        ("qwen3.5", 2, 2, "split"), ("qwen3.5-moe", 4, 1, "fused"), ("gemma2", 2, 2, "split"),
        ("gemma3", 2, 1, "fused"))),
]
"""Under `make test-full`: llama split at TP 4, qwen3 (qwen3-moe's rules without experts) and
fused GDN (the other storage of the case kept), and Qwen3.5 and Gemma, whose rules differ from
Qwen3-Next's and Llama's in names and one rule each, which the rules property test and the
Bridge oracle cover too."""
VOCAB_MULTIPLE = 8
"""Passed as --make-vocab-size-divisible-by: the test-side mapping pads the vocab to 8 × TP."""


class References(dict):
    """Each family's tiny HF model, saved the first time a test asks for it."""

    def __init__(self, root) -> None:
        super().__init__()
        self.root = root

    def __missing__(self, family: str):
        from fixtures import hf_models

        self[family] = hf_models.reference(family, self.root / family, seed=3)
        return self[family]


@pytest.fixture(scope="session")
def references(tmp_path_factory):
    return References(tmp_path_factory.mktemp("refs"))


def loaded_flat(path) -> dict:
    """An output as torch's own `dcp_to_torch_save` nests it — `{"model": {"module.…": …}}`, as
    Megatron-FSDP's own saves record their paths — with its names flat again."""
    from fixtures.make_fixtures import load_with_torch

    nested = load_with_torch(path)
    assert list(nested) == ["model"]
    return {"model." + name: value for name, value in nested["model"].items()}


@pytest.mark.parametrize("family, tp, dp, storage", MEGATRON_CASES)
def test_megatron_import_equals_the_independent_mapping_and_exports_back_bit_exactly(references, tmp_path, family,
                                                                                     tp, dp, storage):
    from fixtures import hf_models

    ref = references[family]
    out = tmp_path / "mg"
    args = ["--split-fused"] if storage == "split" else []
    run = run_cli("import-hf", ref.folder, out, "--to", "megatron-fsdp", "--tp", tp, "--dp", dp, "--verify",
                  "--make-vocab-size-divisible-by", VOCAB_MULTIPLE, *args)
    assert run.returncode == 0, run.stderr
    want = hf_models.to_megatron(ref, tp, fc1=storage, gdn=storage, vocab_multiple=VOCAB_MULTIPLE)
    got = loaded_flat(out)
    assert sorted(got) == sorted("model.module." + n for n in want)
    vocab = ref.config.vocab_size
    for name, (tensor, _) in want.items():
        value = got["model.module." + name]
        assert value.shape == tensor.shape, name
        if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
            assert torch.equal(value[:vocab], tensor[:vocab]) and not value[vocab:].any(), name
        else:
            assert torch.equal(value, tensor), name
    back = tmp_path / "hf"
    exported = run_cli("export-hf", out, back, "--hf-config", ref.folder)
    assert exported.returncode == 0, exported.stderr
    assert _folder_tensors(back).keys() == ref.state.keys()
    for name, tensor in _folder_tensors(back).items():
        assert torch.equal(tensor, ref.state[name]), name


def test_mixtral_imports_as_megatron_bridges_mixtral_mapping_lays_it_out_and_exports_back(tmp_path):
    """Mixtral's bridge is not in the Megatron-Bridge wheel; its source (PR 1317) maps the router
    to `block_sparse_moe.gate`, each expert's fc1 to `w1` (gate) and `w3` (up) with the SwiGLU
    mapping (TP-blocked `[w1_0; w3_0; w1_1; w3_1]` at TP 2), fc2 to `w2`: checked here by hand."""
    from fixtures import hf_models

    ref = hf_models.reference("mixtral", tmp_path / "ref", seed=5)
    run = run_cli("import-hf", ref.folder, tmp_path / "mg", "--to", "megatron-fsdp", "--tp", 2, "--dp", 1, "--verify")
    assert run.returncode == 0, run.stderr
    got, hf = loaded_flat(tmp_path / "mg"), ref.state
    layer, expert = "model.module.decoder.layers.1.", "model.layers.1.block_sparse_moe.experts.2."
    w1, w3 = hf[expert + "w1.weight"].chunk(2), hf[expert + "w3.weight"].chunk(2)
    assert torch.equal(got[layer + "mlp.experts.linear_fc1.weight2"], torch.cat([w1[0], w3[0], w1[1], w3[1]]))
    assert torch.equal(got[layer + "mlp.experts.linear_fc2.weight2"], hf[expert + "w2.weight"])
    assert torch.equal(got[layer + "mlp.router.weight"], hf["model.layers.1.block_sparse_moe.gate.weight"])
    back = tmp_path / "hf"
    exported = run_cli("export-hf", tmp_path / "mg", back, "--hf-config", ref.folder, "--tp", 2)
    assert exported.returncode == 0, exported.stderr
    assert _folder_tensors(back).keys() == hf.keys()
    assert all(torch.equal(t, hf[n]) for n, t in _folder_tensors(back).items())


def test_a_gelu_gated_fc1_is_reblocked_on_a_tp_change_and_never_split(references, tmp_path):
    """A llama's fc1 is gated whatever its `hidden_act` (as Gemma's GeGLU is): fused `[W_t; V_t]`
    per TP rank like SwiGLU, but Megatron-FSDP saves only SwiGLU split. A reshard from TP 1 to TP 2
    with `--split-fused` must re-block it (a plain row split would give rank 0 all of W) and keep
    it fused."""
    from fixtures import hf_models

    ref = references["llama"]
    gelu = tmp_path / "gelu"
    shutil.copytree(ref.folder, gelu)
    config = json.loads((gelu / "config.json").read_text())
    (gelu / "config.json").write_text(json.dumps({**config, "hidden_act": "gelu"}))
    run = run_cli("import-hf", gelu, tmp_path / "tp1", "--to", "megatron-fsdp", "--tp", 1, "--dp", 2,
                  "--make-vocab-size-divisible-by", VOCAB_MULTIPLE)
    assert run.returncode == 0, run.stderr
    run = run_cli("reshard", tmp_path / "tp1", tmp_path / "tp2", "--layout", "megatron-fsdp", "--tp", 2, "--dp", 1,
                  "--source-tp", 1, "--split-fused", "--hf-config", gelu)
    assert run.returncode == 0, run.stderr
    want = hf_models.to_megatron(ref, 2, vocab_multiple=VOCAB_MULTIPLE)
    got = loaded_flat(tmp_path / "tp2")
    assert sorted(got) == sorted("model.module." + n for n in want)
    fc1 = "decoder.layers.1.mlp.linear_fc1.weight"
    gate, up = ref.state["model.layers.1.mlp.gate_proj.weight"], ref.state["model.layers.1.mlp.up_proj.weight"]
    assert torch.equal(got["model.module." + fc1], torch.cat([gate[:24], up[:24], gate[24:], up[24:]]))
    for name, (tensor, _) in want.items():
        rows = ref.config.vocab_size if name in ("embedding.word_embeddings.weight", "output_layer.weight") else None
        assert torch.equal(got["model.module." + name][:rows], tensor[:rows]), name  # padding: TP 1's


def test_megatron_import_is_laid_out_tp_outer_dp_inner_with_the_vocab_padded_as_megatron_pads_it(references,
                                                                                                 tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    out = tmp_path / "mg"
    run = run_cli("import-hf", references["llama"].folder, out, "--to", "megatron-fsdp", "--world-size", 4,
                  "--tp", 2)
    assert run.returncode == 0, run.stderr
    assert run.stderr.splitlines()[0] == ("note: vocab padded from 100 to 256 rows with zeros (a multiple of 128 × "
                                          "TP 2, as Megatron pads it)")
    md = FileSystemReader(str(out)).read_metadata().state_dict_metadata
    emb = md["model.module.embedding.word_embeddings.weight"]
    assert list(emb.size) == [256, 32]
    assert [(list(c.offsets), list(c.sizes)) for c in emb.chunks] == \
        [([0, 0], [64, 32]), ([128, 0], [64, 32]), ([64, 0], [64, 32]), ([192, 0], [64, 32])]  # rank = dp·TP + tp
    proj = md["model.module.decoder.layers.0.self_attention.linear_proj.weight"]  # RowParallel: TP cuts dim 1
    assert [(list(c.offsets), list(c.sizes)) for c in proj.chunks] == \
        [([0, 0], [16, 16]), ([0, 16], [16, 16]), ([16, 0], [16, 16]), ([16, 16], [16, 16])]


def test_megatron_import_refuses_a_tensor_no_rule_claims_and_a_missing_one(references, tmp_path):
    bad = _copy(references["llama"].folder, tmp_path / "hf")
    _resave(bad, lambda t: t.update({"model.layers.0.mlp.extra.weight": torch.zeros(2)}))
    run = run_cli("import-hf", bad, tmp_path / "o", "--to", "megatron-fsdp", "--tp", 2, "--dp", 1,
                  "--no-name-check")
    assert (run.returncode, run.stderr) == (2, f"ckptctl: error: {bad}: no llama rule claims 1 tensor: "
                                               "model.layers.0.mlp.extra.weight (wrong --arch?)\n")
    _resave(bad, lambda t: [t.pop("model.layers.0.mlp.extra.weight"), t.pop("model.layers.1.mlp.up_proj.weight")])
    run = run_cli("import-hf", bad, tmp_path / "o", "--to", "megatron-fsdp", "--tp", 2, "--dp", 1,
                  "--no-name-check")
    assert (run.returncode, run.stderr) == (2, f"ckptctl: error: {bad}: the llama model needs 1 tensor the folder "
                                               "lacks: model.layers.1.mlp.up_proj.weight\n")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("args, line", [
    (["--to", "megatron-fsdp", "--tp", "8", "--dp", "1"],
     "ckptctl: error: {ref}/config.json: num_key_value_heads=4 does not divide by TP 8 (Megatron gives each TP rank "
     "whole query groups)"),
    (["--to", "megatron-fsdp", "--tp", "2"],
     "ckptctl: error: --to megatron-fsdp needs --dp (or --world-size): the data-parallel size"),
    (["--to", "megatron-fsdp", "--tp", "2", "--world-size", "3"],
     "ckptctl: error: --world-size 3 is not a multiple of --tp 2"),
    (["--to", "megatron-fsdp", "--dp", "2", "--arch", "raw"],
     "ckptctl: error: {ref}: no Megatron rules for --arch raw (import-hf --to megatron-fsdp knows: llama, qwen2, "
     "qwen3, qwen3-moe, qwen3-next, qwen3.5, deepseek-v3, mixtral, gemma2, gemma3, nemotron-h, gpt-oss)"),
    (["--world-size", "2", "--tp", "2"], "ckptctl: error: --tp, --dp, --split-fused and --megatron-core are for --to megatron-fsdp"),
    (["--to", "torchtitan", "--world-size", "2", "--arch", "qwen3-moe"],
     "ckptctl: error: {ref}: no torchtitan rules for --arch qwen3-moe (import-hf --to torchtitan knows: llama "
     "(torchtitan-llama3), qwen3 (torchtitan-qwen3), qwen3_moe (torchtitan-qwen3), deepseek_v3 "
     "(torchtitan-deepseek-v3))"),
])
def test_megatron_import_option_errors_are_one_line(references, tmp_path, args, line):
    ref = references["llama"].folder
    run = run_cli("import-hf", ref, tmp_path / "o", *args)
    assert (run.returncode, run.stderr) == (2, line.format(ref=ref) + "\n")
