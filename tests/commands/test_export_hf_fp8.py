"""`export-hf --quantize`: FP8 block-scaled weights out, as DeepSeek-V3/R1 publish them.

Oracles: Megatron-Bridge's `quantize_fp8_e4m3fn_like_scale` on the same source tensors (codes and
scales bit for bit); transformers' FP8 load on CPU (`FineGrainedFP8Config(dequantize=True)`),
its state and logits equal to the dequantized reference model's; ckptctl's own import-hf of the
FP8 folder, exported again, byte for byte the same folder.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import ckptctl.engine.cpu
from ckptctl.commands.export_hf import ExportOptions, export_hf
from ckptctl.commands.import_hf import ImportOptions, import_hf
from ckptctl.formats.safetensors.quantize_fp8 import parse_quantize
from ckptctl.util.errors import CkptctlError
from tests.conftest import run_cli
from tests.formats.quantized_folders import dequantized_fp8, fp8_folder, megatron_bridge_quantization, write_folder

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

QUANTIZED = ("mlp.down_proj", "mlp.gate_proj", "mlp.up_proj", "self_attn.k_proj", "self_attn.o_proj",
             "self_attn.q_proj", "self_attn.v_proj")
FP8_BLOCK_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                    "weight_block_size": [128, 128]}


def _llama(intermediate: int = 384, seed: int = 0):
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=300, hidden_size=256, intermediate_size=intermediate, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2))


def _hf_folder(root: Path, intermediate: int = 384, seed: int = 0, change=None) -> Path:
    """A tiny Llama in bf16, `change(state)` applied to its tensors first."""
    model = _llama(intermediate, seed).to(torch.bfloat16)
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight" or
             not model.config.tie_word_embeddings}
    if change:
        change(state)
    config = model.config.to_dict()
    return write_folder(root, config, state)


def _dcp(folder: Path, out: Path, dtype: torch.dtype | None = None) -> Path:
    import_hf(folder, out, ImportOptions(world_size=2, dtype=dtype, workers=2, sync=False))
    return out


def _export(src: Path, dst: Path, ref: Path, quantize: str, verify: bool = True, **opts) -> list[str]:
    return export_hf(src, dst, ref, ExportOptions(quantize=parse_quantize(quantize), workers=2, sync=False, **opts),
                     verify=verify).notes


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update(safetensors_torch.load_file(file))
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def _same_bytes(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        assert got[name].dtype == value.dtype and got[name].shape == value.shape, name
        assert torch.equal(_bits(got[name]), _bits(value)), name


@pytest.fixture(scope="module")
def llama_dcp(tmp_path_factory) -> tuple[Path, Path]:
    """(bf16 HF folder, its import as DCP): every quantized dim a multiple of 128."""
    root = tmp_path_factory.mktemp("llama")
    folder = _hf_folder(root / "hf")
    return folder, _dcp(folder, root / "dcp")


# ---------------------------------------------------------------------------------------------
# What is written: DeepSeek's layout, Megatron-Bridge's numbers
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("source_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("intermediate", [384, 200])
def test_fp8_block_equals_megatron_bridge_quantization(tmp_path, source_dtype, intermediate):
    """Every `…proj.weight` as float8_e4m3fn codes and float32 `weight_scale_inv` on the ceil grid,
    bit for bit Megatron-Bridge's quantization of the same (bf16 or fp32) source values, partial
    edge blocks (200 rows: a 72-row block) and all-zero blocks (scale 1) included; everything else
    copied."""
    bridge = megatron_bridge_quantization()
    if bridge is None:
        pytest.skip("Megatron-Bridge is not installed")

    def zero_block(state):
        state["model.layers.0.mlp.up_proj.weight"][:128, 128:] = 0

    folder = _hf_folder(tmp_path / "hf", intermediate, seed=1, change=zero_block)
    src = _dcp(folder, tmp_path / "dcp", source_dtype)
    notes = _export(src, tmp_path / "out", folder, "fp8-block")
    assert notes[-1] == ("7 weights written as FP8 e4m3 with 128×128 blocks, float scales, each with its "
                         "weight_scale_inv; the others as they are")
    source = {k: v.to(source_dtype) if v.is_floating_point() else v
              for k, v in safetensors_torch.load_file(folder / "model.safetensors").items()}
    want = {}
    for name, value in source.items():
        if name.removeprefix("model.layers.0.").removesuffix(".weight") in QUANTIZED:
            rows, cols = value.shape
            like = torch.empty(-(-rows // 128), -(-cols // 128), dtype=torch.float32)
            want[name], want[name + "_scale_inv"] = bridge.quantize_fp8_e4m3fn_like_scale(value, like, name=name)
        else:
            want[name] = value
    got = _tensors(tmp_path / "out")
    _same_bytes(got, want)
    zero = got["model.layers.0.mlp.up_proj.weight_scale_inv"]
    assert zero[0, 1] == 1 and not _bits(got["model.layers.0.mlp.up_proj.weight"][:128, 128:]).any()
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["quantization_config"] == FP8_BLOCK_CONFIG
    assert config["dtype"] == ("bfloat16" if source_dtype == torch.bfloat16 else "float32")


def test_transformers_loads_the_export_with_the_dequantized_models_logits(llama_dcp, tmp_path):
    """transformers' FP8 integration, dequantizing on CPU, loads the folder; its weights and logits
    equal those of the same model holding the dequantized values in bf16."""
    folder, src = llama_dcp
    _export(src, tmp_path / "out", folder, "fp8-block")
    _loads_as_its_dequantized_twin(tmp_path / "out", tmp_path / "twin", 300)


def _loads_as_its_dequantized_twin(folder: Path, twin_folder: Path, vocab: int) -> None:
    """transformers' dequantized load of FP8 `folder` has the state and logits of its twin: the
    same model with every quantized weight stored as its dequantized bf16 values (the producers'
    formula), loaded without quantization."""
    stored = _tensors(folder)
    twin = {name: (dequantized_fp8(value, stored[name + "_scale_inv"], torch.bfloat16)
                   if value.dtype == torch.float8_e4m3fn else value)
            for name, value in stored.items() if not name.endswith("_scale_inv")}
    config = json.loads((folder / "config.json").read_text())
    config.pop("quantization_config")
    write_folder(twin_folder, config, twin)
    fp8 = transformers.AutoModelForCausalLM.from_pretrained(
        folder, quantization_config=transformers.FineGrainedFP8Config(dequantize=True), dtype=torch.bfloat16)
    reference = transformers.AutoModelForCausalLM.from_pretrained(twin_folder, dtype=torch.bfloat16)
    state, want = fp8.state_dict(), reference.state_dict()
    _same_bytes({k: state[k] for k in want}, want)
    ids = torch.randint(0, vocab, (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(fp8(ids).logits, reference(ids).logits)


@pytest.mark.parametrize("dtype", [None, torch.float32])
def test_import_then_export_again_gives_the_same_fp8_bytes(llama_dcp, tmp_path, dtype):
    """import-hf of the export (dequantized to bf16, or fp32) and export-hf --quantize fp8-block
    again: the same FP8 codes and scales, bit for bit (in bf16 the whole file byte for byte; in fp32
    the other tensors come out upcast). Exact because each block's amax, a bf16 value coded as ±448,
    dequantizes back to itself, so its scale is found again."""
    folder, src = llama_dcp
    _export(src, tmp_path / "one", folder, "fp8-block")
    again = _dcp(tmp_path / "one", tmp_path / "dcp", dtype)
    _export(again, tmp_path / "two", tmp_path / "one", "fp8-block")
    one, two = _tensors(tmp_path / "one"), _tensors(tmp_path / "two")
    if dtype is None:
        assert (tmp_path / "one" / "model.safetensors").read_bytes() == \
            (tmp_path / "two" / "model.safetensors").read_bytes()
    else:
        one = {n: v.float() if v.dtype == torch.bfloat16 else v for n, v in one.items()}
    _same_bytes(two, one)
    assert json.loads((tmp_path / "one" / "config.json").read_text())["quantization_config"] == \
        json.loads((tmp_path / "two" / "config.json").read_text())["quantization_config"]


@pytest.mark.parametrize("scale_as", ["float32", "e8m0", "uint8"])
def test_like_orig_reproduces_the_original_folder(tmp_path, scale_as):
    """An FP8 folder ORIG (scales as float32, F8_E8M0 or uint8 E8M0 bytes), imported (to bf16) and
    exported `--quantize like:ORIG` with ORIG as the config: every code, scale (name, dtype, bytes),
    other tensor and the quantization_config come back bit for bit. ORIG's scale of a block is
    kept since it codes the imported values exactly; derived again it would not always be (here
    down_proj is stored with every code halved and its scales doubled, as a producer whose scale
    is not amax / 448 may store it; and a ue8m0 block whose largest code is 224 comes back with
    half its scale)."""
    made, _ = fp8_folder(tmp_path, _llama(seed=2).to(torch.bfloat16), scale_as=scale_as)
    tensors = _tensors(made)
    name = "model.layers.0.mlp.down_proj.weight"
    tensors[name] = (tensors[name].float() / 2).to(torch.float8_e4m3fn)
    scale = tensors[name + "_scale_inv"]
    tensors[name + "_scale_inv"] = scale + 1 if scale.dtype == torch.uint8 else (scale.float() * 2).to(scale.dtype)
    orig = write_folder(tmp_path / "orig", json.loads((made / "config.json").read_text()), tensors)
    src = _dcp(orig, tmp_path / "dcp")
    _export(src, tmp_path / "out", orig, f"like:{orig}")
    _same_bytes(_tensors(tmp_path / "out"), _tensors(orig))
    config, orig_config = (json.loads((p / "config.json").read_text()) for p in (tmp_path / "out", orig))
    assert config["quantization_config"] == orig_config["quantization_config"]


@pytest.mark.parametrize("scale_as", ["float32", "e8m0"])
def test_like_orig_keeps_unchanged_blocks_and_quantizes_changed_ones_as_megatron_bridge(tmp_path, scale_as):
    """A fine-tuned ORIG (one weight's first block row changed): the blocks that did not change are
    ORIG's bytes, the changed ones Megatron-Bridge's quantization with ORIG's scale dtype."""
    bridge = megatron_bridge_quantization()
    if bridge is None:
        pytest.skip("Megatron-Bridge is not installed")
    orig, twin = fp8_folder(tmp_path, _llama(seed=5).to(torch.bfloat16), scale_as=scale_as)
    tuned = _tensors(twin)
    name = "model.layers.0.mlp.up_proj.weight"
    tuned[name][:128] += 0.01
    folder = write_folder(tmp_path / "tuned", json.loads((twin / "config.json").read_text()), tuned)
    _export(_dcp(folder, tmp_path / "dcp"), tmp_path / "out", orig, f"like:{orig}")
    want = _tensors(orig)
    codes, scale = bridge.quantize_fp8_e4m3fn_like_scale(tuned[name], want[name + "_scale_inv"], name=name)
    for key, fresh in ((name, codes), (name + "_scale_inv", scale)):
        rows = 128 if key == name else 1
        merged = torch.cat([fresh.contiguous().view(torch.uint8)[:rows], want[key].view(torch.uint8)[rows:]])
        want[key] = merged.view(want[key].dtype)
    _same_bytes(_tensors(tmp_path / "out"), want)


# ---------------------------------------------------------------------------------------------
# The check every export passes, --dry-run, --json, refusals
# ---------------------------------------------------------------------------------------------


def test_scales_written_wrong_are_refused_by_the_output_check(llama_dcp, tmp_path, monkeypatch):
    """A writer that puts other scales than the codes were made with (here: twice them) never
    exits 0: the output check quantizes the sampled blocks again from the source."""
    folder, src = llama_dcp
    right = ckptctl.engine.cpu.scale_bytes
    monkeypatch.setattr(ckptctl.engine.cpu, "scale_bytes", lambda scale, dtype: right(scale * 2, dtype))
    with pytest.raises(CkptctlError) as caught:
        _export(src, tmp_path / "out", folder, "fp8-block", verify=False)
    assert "weight_scale_inv: element [0, 0] of" in str(caught.value)
    assert not (tmp_path / "out").exists()


def test_verify_compares_every_band_quantized_again(llama_dcp, tmp_path, monkeypatch):
    """--verify re-reads every code and scale and compares them with the source quantized again."""
    import ckptctl.checks.verify as verify

    folder, src = llama_dcp
    _export(src, tmp_path / "ok", folder, "fp8-block", verify=True)
    right = verify.scale_bytes
    monkeypatch.setattr(verify, "scale_bytes", lambda scale, dtype: right(scale * 2, dtype))
    with pytest.raises(CkptctlError) as caught:
        _export(src, tmp_path / "out", folder, "fp8-block", verify=True)
    assert "verification failed (scales of block rows from 0 differ from the source's, quantized again)" in \
        str(caught.value)


def test_dry_run_json_shows_the_quantization(llama_dcp, tmp_path):
    folder, src = llama_dcp
    run = run_cli("export-hf", src, tmp_path / "out", "--hf-config", folder, "--quantize", "fp8-block", "--dry-run",
                  "--json")
    assert run.returncode == 0, run.stderr
    doc = json.loads(run.stdout)
    names = [f"model.layers.0.{m}.weight" for m in QUANTIZED]
    assert doc["quantization"] == {"scheme": "fp8-block", "block": [128, 128], "scale_fmt": "float",
                                   "quantization_config": FP8_BLOCK_CONFIG,
                                   "weights": {n: n + "_scale_inv" for n in names}}
    assert doc["weight_map"]["model.layers.0.mlp.up_proj.weight_scale_inv"] == "model.safetensors"
    scale = "model.layers.0.mlp.up_proj.weight_scale_inv"
    assert doc["mapping"][scale] == ["model.model.layers.0.mlp.up_proj.weight"]  # its weight's source
    assert not (tmp_path / "out").exists()


def test_run_json_reports_the_quantization(llama_dcp, tmp_path):
    folder, src = llama_dcp
    run = run_cli("export-hf", src, tmp_path / "out", "--hf-config", folder, "--quantize", "fp8-block", "--json",
                  "--verify")
    assert run.returncode == 0, run.stderr
    doc = json.loads(run.stdout)
    assert doc["verified"] is True and doc["tensors"] == 19 and doc["quantization"]["scheme"] == "fp8-block"


def _refusal(*args) -> str:
    run = run_cli("export-hf", *map(str, args))
    assert run.returncode == 2 and run.stdout == "", run.stderr
    return run.stderr


def test_refusals_are_one_exact_line(llama_dcp, tmp_path):
    folder, src = llama_dcp
    base = (src, tmp_path / "out", "--hf-config", folder)
    assert _refusal(*base, "--quantize", "int4") == (
        "ckptctl: error: --quantize 'int4': not a scheme ckptctl writes (fp8-block or like:REF (the layout of a "
        "quantized model folder REF))\n")
    assert _refusal(*base, "--quantize", f"like:{folder}") == (
        f"ckptctl: error: --quantize like:{folder}: {folder}/config.json has no quantization_config (not a "
        "quantized folder)\n")
    assert _refusal(*base, "--quantize", "fp8-block", "--layout", "distributed", "-n", "2") == (
        "ckptctl: error: --quantize writes a model folder of FP8 weights, not with --layout distributed\n")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("edit, line", [
    (lambda cfg, t: cfg["quantization_config"].update(weight_block_size=None),
     "FP8 (one scale each, float scales) is not a layout ckptctl writes (FP8 with weight_block_size)"),
    (lambda cfg, t: t.update({"model.layers.0.mlp.up_proj.weight_scale_inv":
                              t["model.layers.0.mlp.up_proj.weight_scale_inv"][:, :1].contiguous()}),
     "model.safetensors: model.layers.0.mlp.up_proj.weight: float8_e4m3fn [384, 256] without a "
     "model.layers.0.mlp.up_proj.weight_scale_inv on the 128×128 ceil grid of a 2-D weight: a layout ckptctl does "
     "not write"),
    (lambda cfg, t: t.update({"model.layers.0.mlp.up_proj.input_scale": torch.ones(())}),
     "model.safetensors: model.layers.0.mlp.up_proj.input_scale: a scale float32 [] of a layout ckptctl does not "
     "write"),
])
def test_a_reference_layout_not_written_here_is_refused_naming_it(llama_dcp, tmp_path, edit, line):
    folder, src = llama_dcp
    orig, _ = fp8_folder(tmp_path, _llama(seed=2).to(torch.bfloat16))
    tensors = _tensors(orig)
    config = json.loads((orig / "config.json").read_text())
    edit(config, tensors)
    ref = write_folder(tmp_path / "ref", config, tensors)
    assert _refusal(src, tmp_path / "out", "--hf-config", folder, "--quantize", f"like:{ref}") == \
        f"ckptctl: error: --quantize like:{ref}: {line}\n"


def test_weights_written_in_many_bands_are_the_bands_of_the_whole(llama_dcp, tmp_path, monkeypatch):
    """A weight written (and verified) one 128-row band at a time, each band's scale rows at their
    place in the scale tensor, is the weight quantized whole."""
    import ckptctl.checks.verify as verify
    import ckptctl.formats.safetensors.quantize_fp8 as quantize_fp8

    folder, src = llama_dcp
    _export(src, tmp_path / "whole", folder, "fp8-block")
    monkeypatch.setattr(quantize_fp8, "BAND_BYTES", 1)
    monkeypatch.setattr(verify, "VERIFY_BLOCK_BYTES", 1)
    _export(src, tmp_path / "bands", folder, "fp8-block", verify=True)
    assert (tmp_path / "bands" / "model.safetensors").read_bytes() == \
        (tmp_path / "whole" / "model.safetensors").read_bytes()


def test_a_block_without_a_finite_scale_is_refused_naming_it(tmp_path):
    """An inf in the source makes its block's scale inf (every code of the block NaN or 0): refused,
    naming the block, nothing written."""
    def poison(state):
        state["model.layers.0.mlp.gate_proj.weight"][200, 130] = float("inf")

    folder = _hf_folder(tmp_path / "hf", change=poison)
    src = _dcp(folder, tmp_path / "dcp")
    with pytest.raises(CkptctlError) as caught:
        _export(src, tmp_path / "out", folder, "fp8-block")
    assert str(caught.value) == (
        "model.layers.0.mlp.gate_proj.weight: its block [1, 1] (128×128) has no FP8 scale (its largest magnitude "
        "gives inf): a value there is not finite, or too small for a float32 scale")
    assert not (tmp_path / "out").exists()


def test_sharded_keeps_each_scale_in_its_weights_file(llama_dcp, tmp_path):
    """Sharded, every scale is in its weight's file and the index (which transformers reads) says
    so; the tensors are those of the one-file export."""
    folder, src = llama_dcp
    _export(src, tmp_path / "one", folder, "fp8-block")
    _export(src, tmp_path / "sharded", folder, "fp8-block", max_shard_size="200kB")
    weight_map = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(weight_map.values())) > 2
    for name in (f"model.layers.0.{m}.weight" for m in QUANTIZED):
        held = safetensors_torch.load_file(tmp_path / "sharded" / weight_map[name])
        assert name + "_scale_inv" in held and weight_map[name + "_scale_inv"] == weight_map[name]
    _same_bytes(_tensors(tmp_path / "sharded"), _tensors(tmp_path / "one"))


def test_dry_run_lines_say_which_tensors_are_codes_and_scales(llama_dcp, tmp_path):
    folder, src = llama_dcp
    run = run_cli("export-hf", src, tmp_path / "out", "--hf-config", folder, "--quantize", "fp8-block", "--dry-run")
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert "model.layers.0.mlp.up_proj.weight ← model.model.layers.0.mlp.up_proj.weight, quantized to FP8" in lines
    assert ("model.layers.0.mlp.up_proj.weight_scale_inv ← the scales of model.layers.0.mlp.up_proj.weight's "
            "blocks") in lines
    assert "model.norm.weight ← model.model.norm.weight" in lines
    assert run.stderr == ("note: 7 weights written as FP8 e4m3 with 128×128 blocks, float scales, each with its "
                          "weight_scale_inv; the others as they are\n")


@pytest.mark.parametrize("family, overrides", [
    pytest.param("llama", dict(hidden_size=256, intermediate_size=384, head_dim=64),  # blocks across TP shards' columns
                 marks=pytest.mark.full),  # a Megatron TP 2 save of its own: the quantization of any export is tested above
    pytest.param("qwen3-moe", {}, marks=pytest.mark.full),  # routers and experts; every block an edge block
])
def test_a_megatron_tp2_export_quantized_is_megatron_bridges_quantization_of_the_plain_export(tmp_path, family,
                                                                                                   overrides):
    """From a Megatron-FSDP checkpoint saved by real ranks at TP 2 (row-parallel weights split on
    their columns, so a 128×128 block takes columns of two TP shards): each quantized weight is
    Megatron-Bridge's quantization of the same weight exported unquantized, every other tensor the
    same bytes, the values quantized being those written unquantized (here cast to bf16 from the
    fp32 checkpoint). The MoE routers (`mlp.gate`, 2-D like an nn.Linear's weight) are kept and
    listed in modules_to_not_convert, with lm_head."""
    from fixtures import hf_models
    from fixtures.gloo import run_ranks

    bridge = megatron_bridge_quantization()
    if bridge is None:
        pytest.skip("Megatron-Bridge is not installed")
    ref = hf_models.reference(family, tmp_path / "ref", **overrides)
    job = hf_models.MegatronJob(str(tmp_path / "ckpt"), hf_models.to_megatron(ref, 2), tp=2, dp=3)
    run_ranks(hf_models.save_jobs, 2, hf_models.write_jobs([job], tmp_path / "jobs.pt"), timeout=600)
    for out, extra in (("plain", ()), ("fp8", ("--quantize", "fp8-block", "--verify"))):
        run = run_cli("export-hf", tmp_path / "ckpt", tmp_path / out, "--hf-config", ref.folder, "--dtype", "bf16",
                      *extra)
        assert run.returncode == 0, run.stderr
    plain, got = _tensors(tmp_path / "plain"), _tensors(tmp_path / "fp8")
    want = {}
    for name, value in plain.items():
        if value.dim() == 2 and "proj" in name:
            rows, cols = value.shape
            like = torch.empty(-(-rows // 128), -(-cols // 128), dtype=torch.float32)
            want[name], want[name + "_scale_inv"] = bridge.quantize_fp8_e4m3fn_like_scale(value.float(), like)
        else:
            want[name] = value
    _same_bytes(got, want)
    config = json.loads((tmp_path / "fp8" / "config.json").read_text())["quantization_config"]
    routers = sorted(n.removesuffix(".weight") for n in got if n.endswith("mlp.gate.weight"))
    if family == "qwen3-moe":
        assert routers and got[routers[0] + ".weight"].dtype == torch.bfloat16
        assert any(".experts.1." in n for n in got if n + "_scale_inv" in got)
        assert config["modules_to_not_convert"] == ["lm_head", *routers]
        _loads_as_its_dequantized_twin(tmp_path / "fp8", tmp_path / "twin", ref.config.vocab_size)
    else:
        assert "modules_to_not_convert" not in config


def test_without_quantize_an_fp8_configs_quantization_config_is_not_written(tmp_path):
    """--hf-config an FP8 folder, no --quantize: the weights written are bf16, so its
    quantization_config (which would make transformers read them as FP8 codes) is left out."""
    orig, _ = fp8_folder(tmp_path, _llama(seed=4).to(torch.bfloat16))
    src = _dcp(orig, tmp_path / "dcp")
    export_hf(src, tmp_path / "out", orig, ExportOptions(workers=2, sync=False), verify=True)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "bfloat16"
    assert {v.dtype for v in _tensors(tmp_path / "out").values()} == {torch.bfloat16}
