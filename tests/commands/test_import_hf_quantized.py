"""`import-hf` of quantized folders: FP8 block-scaled and MXFP4 weights dequantized while streaming.

Oracles: transformers' own dequantized load on CPU (`FineGrainedFP8Config(dequantize=True)`,
`Mxfp4Config(dequantize=True)`), compared bit for bit with the import read back by torch's
`dcp_to_torch_save`; and the import of each FP8 folder byte for byte equal to the import of its
bf16 twin (the dequantized values written by `save_file`). Quantized tensors that would be
read as values are refused, with or without `--no-name-check`: casting FP8 codes without their
scale writes weights ~1/scale off and exits 0.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import ckptctl.checks.verify
from fixtures.make_fixtures import load_with_torch
from tests.conftest import run_cli
from ckptctl.commands.import_hf import ImportOptions, import_hf
from ckptctl.util.errors import CkptctlError
from tests.formats.quantized_folders import dequantized_fp8, fp8_folder, mxfp4_folder, write_folder

transformers = pytest.importorskip("transformers")

needs_checked_decode = pytest.mark.xfail(
    not hasattr(ckptctl.checks.verify, "safetensors_dequantized"), strict=True,
    reason="the output check and --verify decode a dequantized chunk only once checks/verify.py's "
           "decode_source_item does (patch in issue #37's report)")


def _llama(intermediate: int = 384, seed: int = 0):
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=300, hidden_size=256, intermediate_size=intermediate, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2))


@pytest.fixture(scope="module")
def llama_fp8(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny Llama, every quantized dim a multiple of 128: (FP8 folder, bf16 twin)."""
    return fp8_folder(tmp_path_factory.mktemp("llama"), _llama())


def _import(src: Path, dst: Path, dtype: str | None = None, verify: bool = False) -> list[str]:
    """Import at 2 ranks, in-process; the notes it reports."""
    opts = ImportOptions(world_size=2, dtype=getattr(torch, dtype) if dtype else None, workers=2, sync=False)
    return import_hf(src, dst, opts, verify=verify).notes


def _same_bits(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        assert got[name].dtype == value.dtype and got[name].shape == value.shape, name
        bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[value.element_size()]
        assert torch.equal(got[name].view(bits), value.view(bits)), name


def _transformers_dequantized(folder: Path, dtype: torch.dtype, config: object) -> dict[str, torch.Tensor]:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, quantization_config=config, dtype=dtype)
    return model.state_dict()


# ---------------------------------------------------------------------------------------------
# Refusals: quantized bytes are never read as values
# ---------------------------------------------------------------------------------------------


def _refused(src: Path, tmp_path: Path, *args: str) -> str:
    """The error line of an import of `src` (in-process; the regression test runs the CLI)."""
    with pytest.raises(CkptctlError) as caught:
        import_hf(src, tmp_path / "out", ImportOptions(world_size=1, name_check="--no-name-check" not in args))
    assert not (tmp_path / "out").exists()
    return f"ckptctl: error: {caught.value}\n"


def _edited(folder: Path, dst: Path, change=None, config=None) -> Path:
    from safetensors.torch import load_file

    tensors = load_file(folder / "model.safetensors")
    if change:
        change(tensors)
    cfg = json.loads((folder / "config.json").read_text())
    if config:
        config(cfg)
    return write_folder(dst, cfg, tensors)


def test_an_fp8_folder_without_quantization_config_is_refused_even_with_no_name_check(llama_fp8, tmp_path):
    """The regression: before, `--no-name-check` wrote the codes cast to bf16 without their scales
    (values ~1/scale off) and the scales as tensors of their own, and exited 0."""
    src = _edited(llama_fp8[0], tmp_path / "hf", config=lambda c: c.pop("quantization_config"))
    line = (f"ckptctl: error: {src}/model.safetensors: model.layers.0.mlp.down_proj.weight: float8_e4m3fn codes "
            "(+13 more quantized tensors); config.json has no quantization_config saying how to decode it (fp8 and "
            "mxfp4 ones are decoded): refusing to read quantized bytes as values\n")
    run = run_cli("import-hf", src, tmp_path / "out", "--world-size", 1, "--no-name-check")
    assert (run.returncode, run.stderr, (tmp_path / "out").exists()) == (2, line, False)
    assert _refused(src, tmp_path) == line


def test_mxfp4_blocks_without_quantization_config_are_refused_with_no_name_check(tmp_path):
    from tests.formats.quantized_folders import mxfp4_tensors

    blocks, scales = mxfp4_tensors(2, 64, 32, torch.Generator().manual_seed(0))
    src = write_folder(tmp_path / "hf", {"model_type": "gpt_oss"}, {
        "model.layers.0.mlp.experts.down_proj_blocks": blocks, "model.layers.0.mlp.experts.down_proj_scales": scales})
    assert _refused(src, tmp_path, "--no-name-check") == (
        f"ckptctl: error: {src}/model.safetensors: model.layers.0.mlp.experts.down_proj_blocks: MXFP4 blocks (+1 more "
        "quantized tensors); config.json has no quantization_config saying how to decode it (fp8 and mxfp4 ones are "
        "decoded): refusing to read quantized bytes as values\n")


@pytest.mark.parametrize("change, config, reason", [
    (lambda t: t.pop("model.layers.0.self_attn.q_proj.weight_scale_inv"), None,
     "{src}: model.layers.0.self_attn.q_proj.weight: float8_e4m3fn [256, 256] with no scale (a weight's is "
     "model.layers.0.self_attn.q_proj.weight_scale_inv): refusing FP8 bytes without their scale"),
    (lambda t: t.update({"model.layers.0.self_attn.q_proj.weight": t["model.layers.0.self_attn.q_proj.weight"]
                         .to(torch.bfloat16)}), None,
     "{src}: model.layers.0.self_attn.q_proj.weight_scale_inv: a scale with no float8_e4m3fn weight "
     "model.layers.0.self_attn.q_proj.weight"),
    (lambda t: t.update({f"model.layers.0.self_attn.{m}_proj.weight": t[f"model.layers.0.self_attn.{m}_proj.weight"]
                         .to(torch.bfloat16) for m in "kqv"}), None,
     "{src}: model.layers.0.self_attn.k_proj.weight_scale_inv: a scale with no float8_e4m3fn weight "
     "model.layers.0.self_attn.k_proj.weight (+2 more)"),
    (lambda t: t.update({"model.layers.0.self_attn.q_proj.weight_scale_inv": torch.ones(2, 1)}), None,
     "{src}: model.layers.0.self_attn.q_proj.weight_scale_inv: scale of shape [2, 1] for "
     "model.layers.0.self_attn.q_proj.weight [256, 256], not the 128×128-block grid [2, 2] (other scale layouts "
     "are not decoded)"),
    (lambda t: t.update({"model.layers.0.self_attn.q_proj.weight_scale_inv": torch.ones(256)}), None,
     "{src}: model.layers.0.self_attn.q_proj.weight_scale_inv: scale of shape [256] for "
     "model.layers.0.self_attn.q_proj.weight [256, 256], not the 128×128-block grid [2, 2] (other scale layouts "
     "are not decoded)"),
    (lambda t: t.update({"model.layers.0.self_attn.q_proj.weight_scale_inv": torch.ones(2, 2, dtype=torch.uint8)}),
     None, "{src}: model.layers.0.self_attn.q_proj.weight_scale_inv: uint8 scales (float32/bfloat16/float8_e8m0fnu "
           "decoded; uint8 ones with scale_fmt ue8m0)"),
    (None, lambda c: c["quantization_config"].update(quant_method="gptq"),
     "{src}/config.json: quantization_config quant_method 'gptq' is not one ckptctl dequantizes (fp8 (block-scaled "
     "or per-tensor float8_e4m3fn) and mxfp4)"),
    (None, lambda c: c["quantization_config"].update(weight_block_size=[128]),
     "{src}/config.json: quantization_config weight_block_size [128] is not two positive integers"),
    (None, lambda c: c["quantization_config"].update(quant_method="mxfp4"),
     "{src}/model.safetensors: model.layers.0.mlp.down_proj.weight: float8_e4m3fn codes (+13 more quantized "
     "tensors); MXFP4 (E2M1, one E8M0 scale per 32 values) does not decode it: refusing to read quantized bytes "
     "as values"),
], ids=["no-scale", "orphan-scale", "orphan-scales", "grid", "per-row", "uint8-float-scale", "gptq", "block-size", "wrong-method"])
def test_quantized_tensors_it_cannot_decode_are_refused_naming_them(llama_fp8, tmp_path, change, config, reason):
    src = _edited(llama_fp8[0], tmp_path / "hf", change, config)
    for args in ((), ("--no-name-check",)):
        assert _refused(src, tmp_path, *args) == f"ckptctl: error: {reason.format(src=src)}\n"


def _poisoned(value: float):
    def change(tensors: dict) -> None:
        scale = tensors["model.layers.0.mlp.up_proj.weight_scale_inv"].clone()
        scale[2, 1] = value
        tensors["model.layers.0.mlp.up_proj.weight_scale_inv"] = scale
    return change


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_scale_that_is_not_a_finite_number_is_refused_naming_its_block(llama_fp8, tmp_path, value):
    """Found by the red team: a NaN or infinite scale imported a block of NaN or infinite weights, exit 0."""
    src = _edited(llama_fp8[0], tmp_path / "hf", _poisoned(value))
    line = (f"ckptctl: error: {src}/model.safetensors: model.layers.0.mlp.up_proj.weight: its scale "
            f"model.layers.0.mlp.up_proj.weight_scale_inv holds {value} at [2, 1]: the weights it scales cannot be "
            "decoded\n")
    run = run_cli("import-hf", src, tmp_path / "out", "--world-size", 2)
    assert (run.returncode, run.stderr, (tmp_path / "out").exists()) == (2, line, False)
    assert _refused(src, tmp_path) == line


@pytest.mark.parametrize("dtype, to", [(None, "bfloat16"), (torch.float16, "float16")])
def test_a_dry_run_says_what_the_quantized_weights_are_dequantized_to(llama_fp8, tmp_path, dtype, to):
    report = import_hf(llama_fp8[0], tmp_path / "out", ImportOptions(world_size=2, dtype=dtype), dry_run=True)
    assert (report.dequantized_to, report.notes) == (
        to, [f"7 FP8 weights dequantized from FP8 (128×128 blocks, float scales) to {to}"])
    assert report.tensors == 12 and not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------
# FP8: transformers' dequantized load, and the bf16 twin
# ---------------------------------------------------------------------------------------------


@needs_checked_decode
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_fp8_import_equals_transformers_dequantized_load_bit_for_bit(llama_fp8, tmp_path, dtype):
    notes = _import(llama_fp8[0], tmp_path / "out", dtype if dtype != "bfloat16" else None, verify=True)
    assert notes == [f"7 FP8 weights dequantized from FP8 (128×128 blocks, float scales) to {dtype}"]
    want = _transformers_dequantized(llama_fp8[0], getattr(torch, dtype),
                                     transformers.FineGrainedFP8Config(dequantize=True))
    _same_bits(load_with_torch(tmp_path / "out")["model"], want)


@needs_checked_decode
def test_fp8_import_is_byte_identical_to_the_import_of_its_bf16_twin(llama_fp8, tmp_path):
    _import(llama_fp8[0], tmp_path / "fp8")
    _import(llama_fp8[1], tmp_path / "bf16")
    files = sorted(p.name for p in (tmp_path / "bf16").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "fp8").iterdir())
    for name in files:
        assert (tmp_path / "fp8" / name).read_bytes() == (tmp_path / "bf16" / name).read_bytes(), name


@needs_checked_decode
@pytest.mark.parametrize("scale_as", ["e8m0", "uint8"])
def test_ue8m0_scales_as_e8m0_or_bytes_equal_transformers(tmp_path, scale_as):
    src, _ = fp8_folder(tmp_path, _llama(seed=1), scale_as=scale_as)
    _import(src, tmp_path / "out")
    want = _transformers_dequantized(src, torch.bfloat16, transformers.FineGrainedFP8Config(dequantize=True))
    _same_bits(load_with_torch(tmp_path / "out")["model"], want)


@needs_checked_decode
def test_modules_not_converted_pass_through_as_transformers_loads_them(tmp_path):
    src, _ = fp8_folder(tmp_path, _llama(seed=2), quantize=lambda n: n.endswith("proj.weight") and "down" not in n,
                        config={"modules_to_not_convert": ["model.layers.0.mlp.down_proj"]})
    _import(src, tmp_path / "out")
    want = _transformers_dequantized(src, torch.bfloat16, transformers.FineGrainedFP8Config(dequantize=True))
    _same_bits(load_with_torch(tmp_path / "out")["model"], want)


@needs_checked_decode
@pytest.mark.parametrize("intermediate", [200, 320])
def test_shapes_off_the_block_grid_follow_the_producers_formula(tmp_path, intermediate):
    """Rows 200 and 320 are 2 and 3 blocks on the ceil grid, the last one partial (DeepSeek-V3's
    kv_a_proj_with_mqa, 576 rows, is 5). Transformers 5.24 cannot be the oracle here: its CPU
    dequant derives the block from the grid (rows // grid rows), so 200 rows decode with 100-row
    blocks — wrong values, silently — and 320 rows raise ValueError
    (`test_transformers_derives_the_block_from_the_grid` keeps watching it)."""
    src, _ = fp8_folder(tmp_path, _llama(intermediate, seed=3))
    _import(src, tmp_path / "out", verify=True)
    from safetensors.torch import load_file

    stored = load_file(src / "model.safetensors")
    got = load_with_torch(tmp_path / "out")["model"]
    for name in (n for n in stored if n.endswith("proj.weight")):
        want = dequantized_fp8(stored[name], stored[name + "_scale_inv"], torch.bfloat16)
        assert torch.equal(got[name].view(torch.int16), want.view(torch.int16)), name


@pytest.mark.xfail(strict=True, reason="transformers 5.24 derives the FP8 block from the scale grid")
def test_transformers_derives_the_block_from_the_grid(tmp_path):
    """Fails while transformers decodes a 200-row weight with 100-row blocks; passes (and so
    xfail-strict fails) once it uses the configured 128-row block, as the producers do."""
    src, _ = fp8_folder(tmp_path, _llama(200, seed=3))
    from safetensors.torch import load_file

    stored = load_file(src / "model.safetensors")
    got = _transformers_dequantized(src, torch.bfloat16, transformers.FineGrainedFP8Config(dequantize=True))
    name = "model.layers.0.mlp.up_proj.weight"
    assert torch.equal(got[name], dequantized_fp8(stored[name], stored[name + "_scale_inv"], torch.bfloat16))


# ---------------------------------------------------------------------------------------------
# MXFP4 (gpt-oss)
# ---------------------------------------------------------------------------------------------


def _gpt_oss(hidden: int, intermediate: int):
    torch.manual_seed(0)
    return transformers.GptOssForCausalLM(transformers.GptOssConfig(
        vocab_size=100, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
        layer_types=["full_attention"]))


@needs_checked_decode
@pytest.mark.parametrize("hidden, intermediate, dtype", [(64, 96, "bfloat16"), (64, 64, "bfloat16"),
                                                         (64, 96, "float32")])
def test_mxfp4_import_equals_transformers_dequantized_load_bit_for_bit(tmp_path, hidden, intermediate, dtype):
    """H == F is the orientation trap: the codes are [E, out, in], the model's tensors [E, in, out];
    shapes cannot tell them apart, the format does."""
    src = mxfp4_folder(tmp_path / "hf", _gpt_oss(hidden, intermediate))
    notes = _import(src, tmp_path / "out", dtype if dtype != "bfloat16" else None, verify=True)
    assert notes == [f"2 MXFP4 expert stacks dequantized from MXFP4 (E2M1, one E8M0 scale per 32 values) to {dtype}"]
    want = _transformers_dequantized(src, getattr(torch, dtype), transformers.Mxfp4Config(dequantize=True))
    _same_bits(load_with_torch(tmp_path / "out")["model"], want)


# ---------------------------------------------------------------------------------------------
# Every family and layout: a quantized folder imports exactly as its dequantized twin
# ---------------------------------------------------------------------------------------------


EQUIVALENT = [
    ("qwen3-moe", "fp8", dict(to="fsdp2", world_size=2)),
    ("gpt-oss", "mxfp4", dict(to="megatron-fsdp", tp=2, dp=1)),
    pytest.param("qwen3-moe", "fp8", dict(to="torchtitan", world_size=2), marks=pytest.mark.full),
    pytest.param("qwen3-moe", "fp8", dict(to="megatron-fsdp", tp=2, dp=2), marks=pytest.mark.full),
    pytest.param("deepseek-v3", "fp8", dict(to="fsdp2", world_size=2), marks=pytest.mark.full),
    pytest.param("deepseek-v3", "fp8", dict(to="torchtitan", world_size=2), marks=pytest.mark.full),
    pytest.param("deepseek-v3", "fp8", dict(to="megatron-fsdp", tp=2, dp=1), marks=pytest.mark.full),
    pytest.param("qwen3", "fp8", dict(to="megatron-fsdp", tp=2, dp=1), marks=pytest.mark.full),
    pytest.param("gpt-oss", "mxfp4", dict(to="fsdp2", world_size=2), marks=pytest.mark.full),
    *(pytest.param(family, "fp8", dict(to=to, **sizes), marks=pytest.mark.full)
      for family in ("llama", "qwen2", "qwen3", "qwen3-next", "qwen3.5", "qwen3.5-moe", "gemma2", "gemma3",
                     "nemotron-h", "mixtral", "deepseek-v3", "gpt-oss")
      for to, sizes in (("fsdp2", dict(world_size=2)), ("megatron-fsdp", dict(tp=1, dp=2)))
      if not (to == "fsdp2" and family in ("nemotron-h", "mixtral"))),  # in-memory forms import-hf does not make
]


def _twins(family: str, method: str, root: Path) -> tuple[Path, Path]:
    """A tiny `family` model's quantized folder and its bf16 twin (transformers' own dequantized
    load, for MXFP4, written by `save_file`)."""
    from fixtures import hf_models

    sizes = {"intermediate_size": 64} if method == "mxfp4" else {}  # MXFP4 groups 32 inputs
    ref = hf_models.reference(family, root / "ref", seed=5, **sizes)
    if method == "fp8":
        return fp8_folder(root, ref.model, state=ref.state)
    src = mxfp4_folder(root / "mxfp4", ref.model)
    plain = {**ref.model.config.to_dict()}
    state = _transformers_dequantized(src, torch.bfloat16, transformers.Mxfp4Config(dequantize=True))
    return src, write_folder(root / "bf16", plain, state)


@needs_checked_decode
@pytest.mark.parametrize("family, method, layout", EQUIVALENT)
def test_a_quantized_folder_imports_byte_for_byte_as_its_dequantized_twin(tmp_path, family, method, layout):
    quantized, twin = _twins(family, method, tmp_path)
    outputs = []
    for src in (quantized, twin):
        outputs.append(tmp_path / f"out-{src.name}")
        import_hf(src, outputs[-1], ImportOptions(**{"world_size": None, **layout}, workers=2, sync=False))
    files = sorted(p.name for p in outputs[1].iterdir())
    assert files == sorted(p.name for p in outputs[0].iterdir())
    for name in files:
        assert (outputs[0] / name).read_bytes() == (outputs[1] / name).read_bytes(), name
