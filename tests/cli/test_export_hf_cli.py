"""export-hf's options as a user of transformers and the `hf` CLI expects them, through the real CLI.

A tiny random Llama (transformers, fp32) is converted to the Megatron layout test-side
(`fixtures.hf_models`: fused SwiGLU fc1 TP-blocked at TP 2, query groups, padded vocab)
and saved by a real single-process `dcp.save`; the committed FSDP2 fixture and a
mixed-dtype `dcp.save` cover `--arch raw`. Outputs are loaded back with transformers and
safetensors and compared with what they write themselves: sizes as
`convert_file_size_to_int` reads them, config, generation config and index as
`save_pretrained` writes them, headers as `safetensors.torch.save_file` lays them out.
A Hub model id is resolved from a Hugging Face cache folder laid out as the Hub client
lays it out (refs, snapshots, blobs) in tmp_path.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from fixtures import hf_models
from tests.conftest import ROOT, run_cli
from tests.terminal import assert_no_traceback, run_in_terminal, unfolded
from tests.commands.test_export_hf import assert_same_model, load_hf, read_safetensors

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

PREFIX = "model.module."
TP = 2
SHARD = "10KB"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@dataclass(frozen=True)
class Llama:
    root: Path
    ref: hf_models.Reference
    ckpt: Path


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Llama:
    """A Megatron-FSDP-named checkpoint of a tiny Llama trained at TP 2 (fused fc1), saved by dcp.save."""
    import torch.distributed.checkpoint as dcp

    root = tmp_path_factory.mktemp("export_cli")
    ref = hf_models.reference("llama", root / "ref")
    state = hf_models.to_megatron(ref, TP, "fused")
    dcp.save({PREFIX + name: t for name, (t, _) in state.items()}, checkpoint_id=root / "ckpt", no_dist=True)
    return Llama(root, ref, root / "ckpt")


def export_json(*args: object) -> dict:
    res = run_cli("export-hf", *args, "--json")
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def run_with_env(env: dict[str, str], *args: object) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ckptctl", *map(str, args)], capture_output=True, text=True,
                          cwd=ROOT, env={**os.environ, **env}, timeout=300)


def header(path: Path) -> tuple[int, dict]:
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return n, json.loads(data[8:8 + n])


def expected_llama_mapping(layers: int) -> dict[str, list[str]]:
    """Which Megatron tensor each HF Llama tensor is cut from (Megatron-Bridge naming)."""
    m = PREFIX
    out = {"model.embed_tokens.weight": [m + "embedding.word_embeddings.weight"],
           "lm_head.weight": [m + "output_layer.weight"], "model.norm.weight": [m + "decoder.final_layernorm.weight"]}
    for i in range(layers):
        hf, mg = f"model.layers.{i}.", f"{m}decoder.layers.{i}."
        out[hf + "input_layernorm.weight"] = [mg + "self_attention.linear_qkv.layer_norm_weight"]
        for proj in ("q_proj", "k_proj", "v_proj"):
            out[f"{hf}self_attn.{proj}.weight"] = [mg + "self_attention.linear_qkv.weight"]
        out[hf + "self_attn.o_proj.weight"] = [mg + "self_attention.linear_proj.weight"]
        out[hf + "post_attention_layernorm.weight"] = [mg + "mlp.linear_fc1.layer_norm_weight"]
        out[hf + "mlp.gate_proj.weight"] = out[hf + "mlp.up_proj.weight"] = [mg + "mlp.linear_fc1.weight"]
        out[hf + "mlp.down_proj.weight"] = [mg + "mlp.linear_fc2.weight"]
    return dict(sorted(out.items()))


# --------------------------------------------------------------------------------------
# --max-shard-size
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["5GB", "5GiB", "500MB", "500MiB", "10KB", "10KiB", "7gib", "5Gb", "500Mb",
                                  "10kb", "3mB", "5 GB"])
def test_max_shard_size_reads_a_size_as_transformers_does(text):
    from transformers.utils.hub import convert_file_size_to_int

    from ckptctl.commands.export_hf import parse_size

    assert parse_size(text) == convert_file_size_to_int(text)


@pytest.mark.parametrize("text,size", [("1.5GB", 1_500_000_000), ("0.5GiB", 1 << 29), ("2.5MiB", 2_621_440),
                                       ("123", 123), (150, 150), ("1.5Gb", 187_500_000)])
def test_max_shard_size_takes_fractions_and_plain_bytes(text, size):
    from ckptctl.commands.export_hf import parse_size

    assert parse_size(text) == size


@pytest.mark.parametrize("text,reason", [("5XB", "not a size"), ("GB", "not a size"), ("-5GB", "not a size"),
                                         ("0", "must be at least 1 byte")])
def test_a_bad_max_shard_size_is_one_line_and_exit_2(fixture_ckpt, tmp_path, text, reason):
    ref = tmp_path / "ref"
    ref.mkdir()
    (ref / "config.json").write_text('{"model_type": "raw"}')
    res = run_cli("export-hf", fixture_ckpt("fsdp2_4ranks"), tmp_path / "dst", "--hf-config", ref, "--arch", "raw",
                  "--no-name-check", "--max-shard-size", text)
    assert (res.returncode, res.stdout) == (2, "")
    assert res.stderr == (f"ckptctl: error: --max-shard-size {text!r}: {reason} (use 5GB, 500MB, 5GiB, 500MiB, "
                          f"1.5GB or bytes; Gb, Mb, Kb are bits)\n")
    assert not (tmp_path / "dst").exists()


def test_equal_sizes_in_any_unit_plan_the_same_shards(llama, tmp_path):
    plans = [export_json(llama.ckpt, tmp_path / "dst", "--hf-config", llama.ref.folder, "--tp", TP, "--dry-run",
                         "--max-shard-size", size) for size in ("10000", "10KB", "80Kb")]
    assert plans[0]["files"] == plans[1]["files"] == plans[2]["files"] and len(plans[0]["files"]) > 2


# --------------------------------------------------------------------------------------
# --dry-run
# --------------------------------------------------------------------------------------


def test_dry_run_json_is_exactly_what_the_export_then_writes(llama, tmp_path):
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "keep.txt").write_text("untouched")
    plan = export_json(llama.ckpt, dst, "--hf-config", llama.ref.folder, "--tp", TP, "--max-shard-size", SHARD,
                       "--dry-run")
    assert [p.name for p in dst.iterdir()] == ["keep.txt"]  # DST may exist: nothing is written or checked

    ref = llama.ref
    n_files = len(plan["files"])
    assert {k: plan[k] for k in ("dry_run", "src", "dst", "arch", "tp", "dtype", "tensors", "parameters")} == {
        "dry_run": True, "src": str(llama.ckpt), "dst": str(dst), "arch": "llama", "tp": TP, "dtype": "float32",
        "tensors": len(ref.state), "parameters": sum(t.numel() for t in ref.state.values())}
    assert plan["mapping"] == expected_llama_mapping(ref.config.num_hidden_layers)
    assert plan["side_files"] == ["config.json", "generation_config.json", "model.safetensors.index.json",
                                  "special_tokens_map.json", "tokenizer_config.json"]
    assert n_files > 2 and plan["bytes"] == sum(f["bytes"] for f in plan["files"])

    out = tmp_path / "out"
    done = export_json(llama.ckpt, out, "--hf-config", ref.folder, "--tp", TP, "--max-shard-size", SHARD)
    assert {k: done[k] for k in ("arch", "tp", "dtype", "tensors", "parameters", "bytes")} == \
        {k: plan[k] for k in ("arch", "tp", "dtype", "tensors", "parameters", "bytes")}
    assert done["files"] == n_files
    written = sorted(p.name for p in out.iterdir())
    assert written == sorted([f["name"] for f in plan["files"]] + plan["side_files"])
    on_disk = [{"name": f["name"], "bytes": (out / f["name"]).stat().st_size,
                "tensors": len(header(out / f["name"])[1]) - 1} for f in plan["files"]]
    assert on_disk == plan["files"]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == plan["weight_map"]
    assert index["metadata"] == {"total_parameters": plan["parameters"],
                                 "total_size": sum(t.numel() * t.element_size() for t in ref.state.values())}
    assert (out / "generation_config.json").read_bytes() == (ref.folder / "generation_config.json").read_bytes()
    assert_same_model(out, ref)


def test_index_is_the_one_save_pretrained_writes(llama, tmp_path):
    """Same keys, same order, same metadata as transformers' own sharded save of the same model."""
    ours = tmp_path / "ours"
    export_json(llama.ckpt, ours, "--hf-config", llama.ref.folder, "--tp", TP, "--max-shard-size", SHARD)
    theirs = tmp_path / "theirs"
    llama.ref.model.save_pretrained(theirs, max_shard_size=SHARD)
    ours_text = (ours / "model.safetensors.index.json").read_text()
    theirs_doc = json.loads((theirs / "model.safetensors.index.json").read_text())
    assert json.loads(ours_text)["metadata"] == theirs_doc["metadata"]
    assert ours_text == json.dumps(json.loads(ours_text), indent=2, sort_keys=True) + "\n"
    assert list(json.loads(ours_text)) == list(theirs_doc) == ["metadata", "weight_map"]


def test_dry_run_prints_plain_lines_in_a_pipe(fixture_ckpt, tmp_path):
    ref = tmp_path / "ref"
    ref.mkdir()
    (ref / "config.json").write_text('{"model_type": "raw"}')
    res = run_cli("export-hf", fixture_ckpt("fsdp2_4ranks"), tmp_path / "dst", "--hf-config", ref, "--arch", "raw",
                  "--no-name-check", "--max-shard-size", "200", "--dry-run")
    assert (res.returncode, res.stderr) == (
        0, "note: tensor names not checked (--no-name-check): the output may not load\n")
    assert res.stdout == f"""\
dry run: nothing written to {tmp_path / 'dst'}
raw, float32: 8 tensors (318 parameters), 1984 bytes in 4 safetensors files
model-00001-of-00004.safetensors  432 bytes  1 tensor
model-00002-of-00004.safetensors  496 bytes  1 tensor
model-00003-of-00004.safetensors  496 bytes  1 tensor
model-00004-of-00004.safetensors  560 bytes  5 tensors
also config.json, model.safetensors.index.json
embed.weight ← model.embed.weight
head.bias ← model.head.bias
head.weight ← model.head.weight
mlp.fc1.bias ← model.mlp.fc1.bias
mlp.fc1.weight ← model.mlp.fc1.weight
mlp.fc2.bias ← model.mlp.fc2.bias
mlp.fc2.weight ← model.mlp.fc2.weight
norm.weight ← model.norm.weight
"""
    assert not (tmp_path / "dst").exists()


def test_dry_run_lines_name_the_source_rows_of_each_hf_tensor(llama, tmp_path):
    """q/k/v are cut per query group from linear_qkv; gate/up from the TP-blocked fc1; the vocab padding is dropped."""
    res = run_cli("export-hf", llama.ckpt, tmp_path / "dst", "--hf-config", llama.ref.folder, "--tp", TP,
                  "--dry-run", "--include", "model.layers.0.*", "--include", "model.embed_tokens.weight")
    assert res.returncode == 0, res.stderr
    assert res.stderr == "note: 10 of 21 tensors selected by --include/--exclude\n"
    layer = f"{PREFIX}decoder.layers.0."
    qkv, fc1 = f"{layer}self_attention.linear_qkv.weight", f"{layer}mlp.linear_fc1.weight"
    lines = res.stdout.splitlines()
    assert lines[1] == "llama, TP 2, float32: 10 tensors (10944 parameters), 44816 bytes in 1 safetensors file"
    assert lines[-10:] == [
        f"model.embed_tokens.weight ← {PREFIX}embedding.word_embeddings.weight rows 0:100",
        f"model.layers.0.input_layernorm.weight ← {layer}self_attention.linear_qkv.layer_norm_weight",
        f"model.layers.0.mlp.down_proj.weight ← {layer}mlp.linear_fc2.weight",
        f"model.layers.0.mlp.gate_proj.weight ← {fc1} rows 0:24, 48:72",
        f"model.layers.0.mlp.up_proj.weight ← {fc1} rows 24:48, 72:96",
        f"model.layers.0.post_attention_layernorm.weight ← {layer}mlp.linear_fc1.layer_norm_weight",
        f"model.layers.0.self_attn.k_proj.weight ← {qkv} rows 8:12, 24:28, 40:44 (+1 more)",
        f"model.layers.0.self_attn.o_proj.weight ← {layer}self_attention.linear_proj.weight",
        f"model.layers.0.self_attn.q_proj.weight ← {qkv} rows 0:8, 16:24, 32:40 (+1 more)",
        f"model.layers.0.self_attn.v_proj.weight ← {qkv} rows 12:16, 28:32, 44:48 (+1 more)",
    ]


def test_dry_run_draws_tables_on_a_terminal(llama, tmp_path):
    dst = tmp_path / "dst"
    run = run_in_terminal("export-hf", llama.ckpt, dst, "--hf-config", llama.ref.folder, "--tp", TP, "--dry-run",
                          "--max-shard-size", "40KB", "--include", "model.layers.1.*", "--exclude", "*norm*")
    assert run.returncode == 0, run.screen
    assert_no_traceback(run.raw)
    screen = run.screen.splitlines()
    assert screen[:7] == [
        "note: 7 of 21 tensors selected by --include/--exclude",
        f"Dry run  nothing written to {dst}",
        f"Source   {llama.ckpt}",
        "Arch     llama (TP 2)",
        "Dtype    float32",
        "Tensors  7 (7,680 parameters), 31.5 kB in 1 file",
        "Also     config.json, generation_config.json, special_tokens_map.json, tokenizer_config.json",
    ]
    assert "1 safetensors file" in screen and "7 tensors" in screen
    assert re.search(r"│ 1 │ model\.safetensors │ 31\.5 kB │\s+7 │", run.screen)
    column = next(line.index("← source rows") for line in screen if "← source rows" in line)
    row = next(i for i, line in enumerate(screen) if line.strip().startswith("model.layers.1.mlp.gate_proj.weight"))
    cells = " ".join(line[column:].strip() for line in screen[row:row + 2])  # the source column, folded
    assert re.sub(r"\s", "", cells) == f"{PREFIX}decoder.layers.1.mlp.linear_fc1.weightrows0:24,48:72"
    assert re.match(r"\s+model\.layers\.1\.mlp\.gate_proj\.weight\s+\[48, 32\]\s+1\s", screen[row])
    assert not dst.exists()


@pytest.mark.parametrize("columns, table", [
    (80, ["  HF tensor                       shape      #   ← source rows",
          " " + "─" * 78,
          "  model.layers.0.mlp.up_proj.     [48, 32]   1   model.module.decoder.layers.",
          "  weight                                         0.mlp.linear_fc1.weight rows",
          "                                                 24:48, 72:96",
          "  model.layers.0.self_attn.       [32, 32]   1   model.module.decoder.layers.",
          "  o_proj.weight                                  0.self_attention.linear_proj.",
          "                                                 weight",
          "  model.layers.0.self_attn.       [32, 32]   1   model.module.decoder.layers.",
          "  q_proj.weight                                  0.self_attention.linear_qkv.",
          "                                                 weight rows 0:8, 16:24, 32:40",
          "                                                 (+1 more)"]),
    (120, ["  HF tensor                                shape      #   ← source rows",
           " " + "─" * 118,
           "  model.layers.0.mlp.up_proj.weight        [48, 32]   1   model.module.decoder.layers.0.mlp.linear_fc1.weight "
           "rows",
           "                                                          24:48, 72:96",
           "  model.layers.0.self_attn.o_proj.weight   [32, 32]   1   model.module.decoder.layers.0.self_attention."
           "linear_proj.",
           "                                                          weight",
           "  model.layers.0.self_attn.q_proj.weight   [32, 32]   1   model.module.decoder.layers.0.self_attention."
           "linear_qkv.",
           "                                                          weight rows 0:8, 16:24, 32:40 (+1 more)"]),
])
def test_dry_run_table_breaks_tensor_names_after_dots(llama, columns, table):
    run = run_in_terminal("export-hf", "ckpt", "dst", "--hf-config", "ref", "--tp", TP, "--dry-run",
                          "--include", "model.layers.0.self_attn.[qo]_proj.weight",
                          "--include", "model.layers.0.mlp.up_proj.weight", columns=columns, cwd=llama.root)
    assert run.returncode == 0, run.screen
    screen = run.screen.splitlines()
    assert screen[screen.index("3 tensors") + 1:] == ["", *table]


# --------------------------------------------------------------------------------------
# --include / --exclude
# --------------------------------------------------------------------------------------


def test_include_and_exclude_select_hf_tensors_and_the_index_follows(llama, tmp_path):
    out = tmp_path / "out"
    done = export_json(llama.ckpt, out, "--hf-config", llama.ref.folder, "--tp", TP, "--max-shard-size", SHARD,
                       "--include", "model.layers.*", "--exclude", "*norm*", "--exclude", "model.layers.1.mlp.*")
    want = sorted([f"model.layers.{i}.self_attn.{p}_proj.weight" for i in (0, 1) for p in "qkvo"]
                  + [f"model.layers.0.mlp.{p}_proj.weight" for p in ("gate", "up", "down")])
    assert done["tensors"] == len(want) == 11
    assert done["notes"] == ["11 of 21 tensors selected by --include/--exclude"]
    got = read_safetensors(out)
    assert sorted(got) == want
    for name in want:
        assert torch.equal(got[name], llama.ref.state[name]), name
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == want
    assert sorted(set(index["weight_map"].values())) == sorted(p.name for p in out.glob("*.safetensors"))
    assert index["metadata"] == {"total_parameters": sum(got[n].numel() for n in want),
                                 "total_size": sum(got[n].numel() * 4 for n in want)}


def test_exclude_on_the_raw_path(fixture_ckpt, tmp_path):
    from fixtures.make_fixtures import load_with_torch

    ref = tmp_path / "ref"
    ref.mkdir()
    (ref / "config.json").write_text('{"model_type": "raw"}')
    done = export_json(fixture_ckpt("fsdp2_4ranks"), tmp_path / "out", "--hf-config", ref, "--arch", "raw",
                       "--no-name-check", "--exclude", "head.*", "--exclude", "lm_head.*", "--verify")
    assert done["notes"] == ["tensor names not checked (--no-name-check): the output may not load",
                             "--exclude 'lm_head.*' matches no tensor",
                             "6 of 8 tensors selected by --include/--exclude"]
    got = read_safetensors(tmp_path / "out")
    assert sorted(got) == ["embed.weight", "mlp.fc1.bias", "mlp.fc1.weight", "mlp.fc2.bias", "mlp.fc2.weight",
                           "norm.weight"]
    want = load_with_torch(fixture_ckpt("fsdp2_4ranks"))["model"]
    for name, tensor in got.items():
        assert torch.equal(tensor, want[name]), name


@pytest.mark.parametrize("args,line", [
    (("--include", "foo*", "--exclude", "model.*"),
     "--include 'foo*' --exclude 'model.*' selects none of the 21 tensors"),
    (("--exclude", "*"), "--exclude '*' selects none of the 21 tensors"),
])
def test_selecting_no_tensor_is_one_line_and_exit_2(llama, tmp_path, args, line):
    res = run_cli("export-hf", llama.ckpt, tmp_path / "dst", "--hf-config", llama.ref.folder, "--tp", TP, *args)
    assert (res.returncode, res.stdout, res.stderr) == (2, "", f"ckptctl: error: {line}\n")
    assert not (tmp_path / "dst").exists()


def test_selecting_no_tensor_on_the_raw_path_is_one_line_and_exit_2(fixture_ckpt, tmp_path):
    ref = tmp_path / "ref"
    ref.mkdir()
    (ref / "config.json").write_text('{"model_type": "raw"}')
    res = run_cli("export-hf", fixture_ckpt("fsdp2_4ranks"), tmp_path / "dst", "--hf-config", ref, "--arch", "raw",
                  "--no-name-check", "--include", "lm_head.*", "--dry-run")
    assert (res.returncode, res.stdout, res.stderr) == (
        2, "", "ckptctl: error: --include 'lm_head.*' selects none of the 8 tensors\n")


# --------------------------------------------------------------------------------------
# config.json, generation_config.json as save_pretrained writes them
# --------------------------------------------------------------------------------------


def test_config_and_generation_config_are_what_save_pretrained_writes(llama, tmp_path):
    """REF without architectures or generation_config.json: both are filled in as transformers would."""
    from transformers import AutoConfig, GenerationConfig

    ref = tmp_path / "ref"
    shutil.copytree(llama.ref.folder, ref, ignore=shutil.ignore_patterns("*.safetensors", "generation_config.json"))
    data = json.loads((ref / "config.json").read_text())
    del data["architectures"]
    data.update(pad_token_id=0, eos_token_id=[2, 3], temperature=0.6, max_new_tokens=7)
    (ref / "config.json").write_text(json.dumps(data))
    out = tmp_path / "out"
    export_json(llama.ckpt, out, "--hf-config", ref, "--tp", TP, "--dtype", "bf16")

    assert json.loads((out / "config.json").read_text()) == {**data, "architectures": ["LlamaForCausalLM"],
                                                             "dtype": "bfloat16"}
    want = GenerationConfig.from_model_config(AutoConfig.from_pretrained(ref))
    assert (out / "generation_config.json").read_text() == want.to_json_string()  # REF's transformers_version
    got = GenerationConfig.from_pretrained(out)
    assert got.to_dict() == want.to_dict()
    assert (got.pad_token_id, got.eos_token_id, got.max_new_tokens, got.temperature) == (0, [2, 3], 7, None)
    model = load_hf(out)
    assert model.dtype == torch.bfloat16 and model.generation_config.to_dict() == want.to_dict()


@pytest.mark.parametrize("extra", [
    {}, {"pad_token_id": 5, "eos_token_id": [2, 7], "decoder_start_token_id": 3},
    {"temperature": 0.7, "top_p": 0.8, "do_sample": True, "max_length": 77, "max_new_tokens": 9, "min_p": 0.1},
    {"output_attentions": True}, {"use_cache": False}, {"force_bos_token_to_be_generated": True},
], ids=["plain", "token-ids", "sampling", "output-flag", "no-cache", "legacy-forced-bos"])
def test_derived_generation_config_is_transformers_own(llama, tmp_path, extra):
    from transformers import AutoConfig, GenerationConfig

    from ckptctl.families.base import generation_config

    data = {**json.loads((llama.ref.folder / "config.json").read_text()), **extra}
    (tmp_path / "config.json").write_text(json.dumps(data))
    want = GenerationConfig.from_model_config(AutoConfig.from_pretrained(tmp_path))
    assert json.dumps(generation_config(data), indent=2, sort_keys=True) + "\n" == want.to_json_string()


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3", "qwen3_moe", "qwen3_next", "qwen3_5_text",
                                        "qwen3_5_moe_text", "gemma2", "gemma3_text"])
def test_architectures_name_the_transformers_causal_lm_class(model_type):
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from ckptctl.commands.export_hf import output_config
    from ckptctl.families.base import HFConfig

    cfg = HFConfig(Path("config.json"), {"model_type": model_type})
    assert output_config(cfg, None)["architectures"] == [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]]
    kept = HFConfig(Path("config.json"), {"model_type": model_type, "architectures": ["MyForCausalLM"]})
    assert output_config(kept, None)["architectures"] == ["MyForCausalLM"]


def test_raw_export_keeps_ref_config_and_writes_no_generation_config_for_unknown_models(fixture_ckpt, tmp_path):
    ref = tmp_path / "ref"
    ref.mkdir()
    (ref / "config.json").write_text('{"model_type": "raw", "architectures": ["Sequential"]}')
    export_json(fixture_ckpt("fsdp2_4ranks"), tmp_path / "out", "--hf-config", ref, "--arch", "raw", "--no-name-check")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["config.json", "model.safetensors"]
    assert json.loads((tmp_path / "out" / "config.json").read_text()) == {
        "model_type": "raw", "architectures": ["Sequential"], "dtype": "float32"}


# --------------------------------------------------------------------------------------
# safetensors layout
# --------------------------------------------------------------------------------------


def test_mixed_dtype_export_is_aligned_and_laid_out_as_safetensors_writes_it(tmp_path):
    """An odd-length bf16 tensor never leaves an fp32 (or int64) tensor after it unaligned."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file, save_file

    gen = torch.Generator().manual_seed(3)
    state = {
        "model.a_odd": torch.randn(3, 5, generator=gen).to(torch.bfloat16),  # 30 bytes
        "model.b_fp32": torch.randn(4, 3, generator=gen),
        "model.c_ids": torch.arange(5, dtype=torch.int64),
        "model.d_mask": torch.tensor([True, False, True]),
        "model.e_half": torch.randn(7, generator=gen).to(torch.float16),
        "model.f_fp32": torch.randn(1, generator=gen),
    }
    dcp.save(dict(state), checkpoint_id=tmp_path / "src", no_dist=True)
    ref = tmp_path / "ref"
    ref.mkdir()
    (ref / "config.json").write_text('{"model_type": "raw"}')
    out = tmp_path / "out"
    export_json(tmp_path / "src", out, "--hf-config", ref, "--arch", "raw", "--no-name-check", "--verify")

    path = out / "model.safetensors"
    n, head = header(path)
    names = [k for k in head if k != "__metadata__"]
    assert names == ["c_ids", "b_fp32", "f_fp32", "a_odd", "e_half", "d_mask"]
    itemsize = {"I64": 8, "F32": 4, "BF16": 2, "F16": 2, "BOOL": 1}
    for name in names:
        assert (8 + n + head[name]["data_offsets"][0]) % itemsize[head[name]["dtype"]] == 0, name
    loaded = load_file(path)
    for name, tensor in state.items():
        assert torch.equal(loaded[name[len("model."):]], tensor), name
    save_file(loaded, tmp_path / "theirs.safetensors", metadata={"format": "pt"})
    assert path.read_bytes() == (tmp_path / "theirs.safetensors").read_bytes()


# --------------------------------------------------------------------------------------
# --hf-config ORG/NAME
# --------------------------------------------------------------------------------------


def hub_cache(root: Path, repo_id: str, files: dict[str, bytes]) -> Path:
    """A Hugging Face cache holding `files` of `repo_id` at COMMIT, laid out as huggingface_hub does."""
    repo = root / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for i, (name, data) in enumerate(sorted(files.items())):
        blob = repo / "blobs" / f"{i:040x}"
        blob.write_bytes(data)
        (snapshot / name).symlink_to(Path("..", "..", "blobs", blob.name))
    return root


@pytest.fixture(scope="module")
def cache(llama, tmp_path_factory) -> Path:
    names = ["config.json", "generation_config.json", *hf_models.TOKENIZER_FILES]
    return hub_cache(tmp_path_factory.mktemp("hub"), "acme/tiny-llama",
                     {n: (llama.ref.folder / n).read_bytes() for n in names})


def test_hf_config_takes_a_hub_model_id_from_the_cache(llama, cache, tmp_path):
    local, hub = tmp_path / "local", tmp_path / "hub"
    export_json(llama.ckpt, local, "--hf-config", llama.ref.folder, "--tp", TP)
    res = run_with_env({"HF_HUB_CACHE": str(cache)}, "export-hf", llama.ckpt, hub, "--hf-config", "acme/tiny-llama",
                       "--tp", TP, "--json")
    assert res.returncode == 0, res.stderr
    assert sorted(p.name for p in hub.iterdir()) == sorted(p.name for p in local.iterdir())
    for path in local.iterdir():
        assert (hub / path.name).read_bytes() == path.read_bytes(), path.name
    assert_same_model(hub, llama.ref)


def test_reshard_takes_a_hub_model_id_too(fixture_ckpt, llama, cache, tmp_path):
    """reshard --split-fused reads hidden_act through the same loader."""
    args = ("reshard", fixture_ckpt("megatron_tp2_dp2"))
    local = run_cli(*args, tmp_path / "local", "--world-size", "2", "--split-fused", "--hf-config", llama.ref.folder)
    assert local.returncode == 0, local.stderr
    hub = run_with_env({"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}, *args, tmp_path / "hub", "--world-size",
                       "2", "--split-fused", "--hf-config", "acme/tiny-llama")
    assert hub.returncode == 0, hub.stderr
    for path in (tmp_path / "local").iterdir():
        assert (tmp_path / "hub" / path.name).read_bytes() == path.read_bytes(), path.name


@pytest.mark.parametrize("command", ["export-hf", "reshard"])
def test_a_hub_model_id_that_cannot_be_had_is_one_line_and_exit_2(llama, cache, fixture_ckpt, tmp_path, command):
    if command == "export-hf":
        args = ("export-hf", llama.ckpt, tmp_path / "dst", "--tp", TP)
    else:
        args = ("reshard", fixture_ckpt("megatron_tp2_dp2"), tmp_path / "dst", "--world-size", "2", "--split-fused")
    res = run_with_env({"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}, *args, "--hf-config", "acme/not-here")
    assert (res.returncode, res.stdout) == (2, "")
    assert res.stderr == (f"ckptctl: error: --hf-config acme/not-here: not a local path, and not in the Hugging Face "
                          f"cache ({cache}); HF_HUB_OFFLINE is set, so it cannot be downloaded: unset it, or pass a "
                          f"local folder (or its config.json)\n")
    assert not (tmp_path / "dst").exists()


def test_a_missing_path_that_is_no_hub_id_is_refused_as_a_path(llama, tmp_path):
    missing = tmp_path / "no" / "such"
    res = run_cli("export-hf", llama.ckpt, tmp_path / "dst", "--hf-config", missing)
    assert (res.returncode, res.stderr) == (2, f"ckptctl: error: {missing}: no such file or directory (--hf-config "
                                               f"wants a Hugging Face model folder, its config.json, or a Hub model "
                                               f"id)\n")


# --------------------------------------------------------------------------------------
# On a terminal
# --------------------------------------------------------------------------------------


def test_export_with_verify_on_a_terminal_shows_both_bars_and_the_final_line(llama, tmp_path):
    dst = tmp_path / "out"
    run = run_in_terminal("export-hf", llama.ckpt, dst, "--hf-config", llama.ref.folder, "--tp", TP, "--verify",
                          columns=250)  # the final line names a temporary path: keep it on one line
    assert run.returncode == 0, run.screen
    assert_no_traceback(run.raw)
    lines = run.screen.splitlines()
    size = (dst / "model.safetensors").stat().st_size
    assert re.fullmatch(r"writing    ━+ (\S+)/(\S+) kB .*", lines[0]) and f"{size / 1000:.1f}/{size / 1000:.1f} kB" \
        in lines[0]
    assert lines[1].startswith("verifying  ━") and " kB " in lines[1]
    final, = lines[2:]
    assert final.startswith(f"wrote {dst} (llama, 21 tensors in 1 safetensors file, {size / 1000:.1f} kB) in ")
    assert ", verifying " in final and final.endswith(" verified")
    assert any(f.startswith("writing") for f in run.frames) and any(f.startswith("verifying") for f in run.frames)
    assert_same_model(dst, llama.ref)


NAMES_CHECK = "checking tensor names against transformers' LlamaForCausalLM"
WRITTEN_NAMES_CHECK = "checking the written names against transformers' LlamaForCausalLM"
WAIT_BAR = {80: 15, 120: 40}
"""Width of the bar drawn beside `NAMES_CHECK` (what is left of the line at 80 columns)."""
WRITTEN_WAIT_BAR = {80: 10, 120: 40}


def cold(tmp_path: Path) -> dict[str, str]:
    """An empty names cache: transformers is imported and its model built during the run."""
    return {"CKPTCTL_CACHE_DIR": str(tmp_path / "names-cache")}


@pytest.mark.parametrize("columns", [80, 120])
def test_the_wait_on_transformers_is_a_line_saying_so_then_gone(llama, tmp_path, columns):
    dst = tmp_path / "out"
    run = run_in_terminal("export-hf", llama.ckpt, dst, "--hf-config", llama.ref.folder, "--tp", TP, "--verify",
                          "--dtype", "bf16", env=cold(tmp_path), columns=columns)
    assert run.returncode == 0, run.screen
    assert_no_traceback(run.raw)
    drawn = [frame.rstrip() for frame in run.frames]
    assert f"{NAMES_CHECK} " + "━" * WAIT_BAR[columns] in drawn
    assert f"{WRITTEN_NAMES_CHECK} " + "━" * WRITTEN_WAIT_BAR[columns] in drawn  # a bf16 config.json: asked anew
    bars = [frame for frame in drawn if frame.startswith(("writing", "verifying"))]
    assert bars and all(bar.startswith(("writing    ━", "verifying  ━")) for bar in bars)  # never pushed aside
    lines = run.screen.splitlines()
    assert [line.split()[0] for line in lines[:2]] == ["writing", "verifying"]
    final, = unfolded(lines[2:])
    assert final.startswith(f"wrote {dst} (llama, 21 tensors in 1 safetensors file, ")
    assert "checking" not in run.screen


@pytest.mark.parametrize("columns", [80, 120])
def test_a_dry_run_waiting_on_transformers_ends_on_the_screen_of_one_that_does_not(llama, tmp_path, columns):
    args = ("export-hf", llama.ckpt, "dst", "--hf-config", llama.ref.folder, "--tp", TP, "--dry-run")
    first = run_in_terminal(*args, env=cold(tmp_path), columns=columns, cwd=tmp_path)
    again = run_in_terminal(*args, env=cold(tmp_path), columns=columns, cwd=tmp_path)  # names from the cache now
    assert (first.returncode, again.returncode) == (0, 0)
    assert f"{NAMES_CHECK} " + "━" * WAIT_BAR[columns] in [frame.rstrip() for frame in first.frames]
    assert "checking" not in again.raw
    assert first.screen == again.screen
    assert first.screen.splitlines()[:3] == ["Dry run  nothing written to dst", f"Source   {llama.ckpt}",
                                             "Arch     llama (TP 2)"]


def test_the_wait_on_transformers_is_not_announced_in_a_pipe(llama, tmp_path):
    res = run_with_env(cold(tmp_path), "export-hf", llama.ckpt, tmp_path / "out", "--hf-config", llama.ref.folder,
                       "--tp", TP, "--verify", "--dtype", "bf16")
    assert res.returncode == 0, res.stderr
    assert res.stdout == ""
    final, = res.stderr.splitlines()
    assert final.startswith(f"wrote {tmp_path / 'out'} (llama, 21 tensors in 1 safetensors file, ")


def test_the_wait_on_transformers_is_not_announced_with_json(llama, tmp_path):
    run = run_in_terminal("export-hf", llama.ckpt, tmp_path / "out", "--hf-config", llama.ref.folder, "--tp", TP,
                          "--json", env=cold(tmp_path), columns=80)
    assert run.returncode == 0, run.screen
    assert "checking" not in run.raw
    assert json.loads(run.plain)["tensors"] == 21
