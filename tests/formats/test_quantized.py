"""The quantized-folder decoder: each dequantized chunk against its producers' formula and transformers' decode.

A folder is opened as import-hf opens it (`open_safetensors_folder` with its format) and every
chunk of every dequantized tensor decoded as the engine decodes it; the chunks, put together,
must be the formula's tensor bit for bit, across chunk boundaries (a small chunk budget), shapes
off the block grid, leading (expert) dims, every scale spelling and dtype, and every E8M0 byte.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ckptctl.core.dtypes import bfloat16, float32
from ckptctl.formats.safetensors import quantized
from ckptctl.formats.safetensors.quantized import DEQUANT, dequantized_chunk, quant_format
from ckptctl.formats.safetensors.reader import open_safetensors_folder
from ckptctl.formats.dcp.items import ItemReader
from tests.formats.quantized_folders import (dequantized_fp8, megatron_bridge_quantization, mxfp4_tensors,
                                             quantized_fp8, write_folder)

FP8 = {"quant_method": "fp8", "weight_block_size": [128, 128]}


def _decoded(folder: Path, fp8_dtype=bfloat16) -> dict[str, torch.Tensor]:
    """Every dequantized tensor of the folder, put together from its chunks decoded one by one."""
    config = json.loads((folder / "config.json").read_text())
    ckpt = open_safetensors_folder(folder, quant_format(config, folder / "config.json"), fp8_dtype)
    out = {}
    with ItemReader(ckpt) as reader:
        for name, entry in ckpt.tensors.items():
            if not entry.chunks[0].transforms:
                continue
            whole = torch.full(entry.shape, float("nan"), dtype=entry.dtype.torch)
            for chunk in entry.chunks:
                assert chunk.transforms == (DEQUANT,)
                box = tuple(slice(o, o + n) for o, n in zip(chunk.offsets, chunk.sizes))
                whole[box] = dequantized_chunk(entry, chunk, reader.handle)
            out[name] = whole
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


@pytest.mark.parametrize("shape", [(200, 300), (320, 256), (576, 256), (1, 129), (130, 1)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp8_chunks_across_block_rows_and_partial_blocks_are_the_formula(tmp_path, monkeypatch, shape, dtype):
    """A chunk budget of one block row's bytes: every 128 rows a chunk, the last one partial."""
    monkeypatch.setattr(quantized, "DEQUANT_CHUNK_BYTES", 128 * shape[1] * 4)
    torch.manual_seed(0)
    weight = torch.randn(shape) * torch.logspace(-3, 2, shape[1])
    codes, scale = quantized_fp8(weight)
    folder = write_folder(tmp_path, {"quantization_config": FP8}, {"w.weight": codes, "w.weight_scale_inv": scale})
    got = _decoded(folder, bfloat16 if dtype == torch.bfloat16 else float32)["w.weight"]
    assert torch.equal(_bits(got), _bits(dequantized_fp8(codes, scale, dtype)))


def test_fp8_experts_stacked_in_leading_dims_take_their_own_scales(tmp_path, monkeypatch):
    monkeypatch.setattr(quantized, "DEQUANT_CHUNK_BYTES", 1)
    torch.manual_seed(1)
    pairs = [quantized_fp8(torch.randn(200, 160) * (e + 1)) for e in range(3)]
    codes, scales = torch.stack([c for c, _ in pairs]), torch.stack([s for _, s in pairs])
    folder = write_folder(tmp_path, {"quantization_config": FP8}, {"e.weight": codes, "e.weight_scale_inv": scales})
    got = _decoded(folder)["e.weight"]
    for e, (c, s) in enumerate(pairs):
        assert torch.equal(_bits(got[e]), _bits(dequantized_fp8(c, s, torch.bfloat16)))


@pytest.mark.parametrize("spelling", ["X.weight_scale_inv", "X.scale", "X.qscale_weight"])
def test_every_scale_spelling_and_a_single_scale_per_weight(tmp_path, spelling):
    torch.manual_seed(2)
    codes = (torch.randn(64, 48) * 40).to(torch.float8_e4m3fn)
    scale = torch.tensor([0.00123], dtype=torch.float32)
    folder = write_folder(tmp_path, {"quantization_config": {"quant_method": "fp8", "weight_block_size": None}},
                          {"X.weight": codes, spelling: scale})
    got = _decoded(folder)["X.weight"]
    assert torch.equal(_bits(got), _bits((codes.float() * scale).to(torch.bfloat16)))


@pytest.mark.parametrize("stored_as", ["e8m0", "uint8", "bfloat16"])
def test_fp8_scales_of_every_dtype_are_read_as_their_values(tmp_path, stored_as):
    torch.manual_seed(3)
    codes, scale = quantized_fp8(torch.randn(256, 256), ue8m0=stored_as != "bfloat16")
    scale = scale.to(torch.bfloat16).float() if stored_as == "bfloat16" else scale
    stored = {"e8m0": scale.to(torch.float8_e8m0fnu), "uint8": (torch.log2(scale) + 127).to(torch.uint8),
              "bfloat16": scale.to(torch.bfloat16)}[stored_as]
    config = {"quantization_config": {**FP8, **({"scale_fmt": "ue8m0"} if stored_as == "uint8" else {})}}
    folder = write_folder(tmp_path, config, {"w.weight": codes, "w.weight_scale_inv": stored})
    assert torch.equal(_bits(_decoded(folder)["w.weight"]), _bits(dequantized_fp8(codes, scale, torch.bfloat16)))


def test_uint8_e8m0_bytes_are_the_powers_transformers_reads_for_every_byte():
    """transformers reads a uint8 ue8m0 scale byte b as exp2(b - 127) in float32 (255: inf)."""
    raw = bytearray(range(256))
    got = quantized._scale_values(raw, quantized.uint8)
    want = (torch.arange(256, dtype=torch.float32) - 127).exp2()
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


def _every_byte_blocks(block_rows: int, block_cols: int) -> torch.Tensor:
    """Codes of [128 × block_rows, 128 × block_cols] blocks, each holding all 256 bytes 64 times, shuffled."""
    gen = torch.Generator().manual_seed(7)
    blocks = [torch.arange(256, dtype=torch.uint8).repeat(64)[torch.randperm(128 * 128, generator=gen)].reshape(128, 128)
              for _ in range(block_rows * block_cols)]
    rows = [torch.cat(blocks[r * block_cols:(r + 1) * block_cols], dim=1) for r in range(block_rows)]
    return torch.cat(rows, dim=0).view(torch.float8_e4m3fn)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_every_fp8_byte_at_scales_across_float32s_range_is_the_formula(tmp_path, monkeypatch, dtype):
    """Every e4m3 byte, in block rows decoded alone, at scales whose products are float32
    subnormals, near 1, or overflow to inf: block row 0 the widening by shifted bits, row 1 its
    NaN bytes' and row 2 its too-large scales' (≥ 2^8) lookup. Bit for bit the producers'
    formula; a NaN byte decodes as NaN."""
    monkeypatch.setattr(quantized, "DEQUANT_CHUNK_BYTES", 128 * 512 * 2)
    assert quantized._shift_is_exact()  # this CPU widens by shifted bits (none that flushes subnormals)
    lookups = []
    monkeypatch.setattr(quantized, "_fp8_values", lambda real=quantized._fp8_values: lookups.append(1) or real())
    codes = _every_byte_blocks(3, 4).view(torch.uint8)
    for rows in (slice(0, 128), slice(256, 384)):  # NaN bytes in row 1 only
        codes[rows] = torch.where(codes[rows] & 0x7F == 0x7F, 0, codes[rows])
    codes = codes.view(torch.float8_e4m3fn)
    scale = torch.tensor([[2.0 ** -140, 1.3 * 2.0 ** -130, 0.00123, 1.9 * 2.0 ** 7],
                          [1.0, 3.7e-5, 2.0 ** -149, 0.5],
                          [2.0 ** 8, 2.0 ** 120, 3e38, 1.7]], dtype=torch.float32)
    folder = write_folder(tmp_path, {"quantization_config": FP8}, {"w.weight": codes, "w.weight_scale_inv": scale})
    got = _decoded(folder, bfloat16 if dtype == torch.bfloat16 else float32)["w.weight"]
    assert len(lookups) == 2  # rows 1 and 2
    want = dequantized_fp8(codes, scale, dtype)
    nan = torch.isnan(want)
    assert nan[128:256].sum() == 2 * 64 * 4 and not nan[:128].any() and torch.isinf(want[256:]).any()
    assert torch.equal(torch.isnan(got), nan)
    assert torch.equal(_bits(got)[~nan], _bits(want)[~nan])


def test_a_range_of_a_chunk_is_the_chunk_s_bytes_there(tmp_path):
    """What the engine reads of an FP8 chunk (`dequantized_into`): whole rows decoded into place,
    ranges cut across rows through a row buffer, each the chunk's bytes at those elements."""
    codes, scale = quantized_fp8(torch.randn(300, 200, generator=torch.Generator().manual_seed(8)))
    folder = write_folder(tmp_path, {"quantization_config": FP8}, {"w.weight": codes, "w.weight_scale_inv": scale})
    ckpt = open_safetensors_folder(folder, quant_format({"quantization_config": FP8}, folder), bfloat16)
    entry = ckpt.tensors["w.weight"]
    with ItemReader(ckpt) as reader:
        for chunk in entry.chunks:
            whole = bytes(dequantized_chunk(entry, chunk, reader.handle).reshape(-1).view(torch.uint8).numpy())
            for first, count in ((0, 200), (200, 400), (130 * 200, 5 * 200), (1, 1), (199, 2), (57, 1000), (0, 0)):
                out = bytearray(2 * count)
                assert quantized.dequantized_into(entry, chunk, 2 * first, memoryview(out), reader.handle)
                assert out == whole[2 * first:2 * (first + count)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_mxfp4_every_code_at_every_scale_byte_is_transformers_decode(tmp_path, monkeypatch, dtype):
    """All 256 code pairs × all 256 E8M0 bytes (0: 2^-127; 255: 2^128, inf but for a zero code),
    an expert a chunk, against transformers' own `convert_moe_packed_tensors`."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    monkeypatch.setattr(quantized, "DEQUANT_CHUNK_BYTES", 256 * 512 * 2)
    blocks = torch.arange(256, dtype=torch.uint8).repeat(2, 256, 1, 1).reshape(2, 256, 16, 16)
    scales = torch.arange(256, dtype=torch.uint8).repeat(2, 16, 1).transpose(1, 2).contiguous()
    folder = write_folder(tmp_path, {"quantization_config": {"quant_method": "mxfp4"}},
                          {"e.gate_up_proj_blocks": blocks, "e.gate_up_proj_scales": scales})
    got = _decoded(folder)["e.gate_up_proj"].to(dtype)
    want = convert_moe_packed_tensors(blocks.clone(), scales.clone(), dtype=dtype)
    assert got.shape == want.shape == (2, 512, 256)
    assert torch.equal(_bits(got), _bits(want))


def test_mxfp4_codes_are_transposed_by_format_even_when_square(tmp_path):
    """[E, out, in/32, 16] codes are the model's [E, in, out]: with out == in a shape cannot tell."""
    blocks, scales = mxfp4_tensors(2, 64, 64, torch.Generator().manual_seed(4))
    folder = write_folder(tmp_path, {"quantization_config": {"quant_method": "mxfp4"}},
                          {"e.down_proj_blocks": blocks, "e.down_proj_scales": scales})
    got = _decoded(folder)["e.down_proj"]
    lut = torch.tensor(quantized.E2M1_VALUES, dtype=torch.float64)
    row, group = 5, 1  # out row 5, inputs 32..63: the low nibble of byte k is input 2k
    first = lut[int(blocks[0, row, group, 0]) & 15] * 2.0 ** (int(scales[0, row, group]) - 127)
    assert got[0, group * 32, row].item() == first.item()


def test_a_chunk_holds_at_most_the_budget_of_decoded_bytes(tmp_path, monkeypatch):
    monkeypatch.setattr(quantized, "DEQUANT_CHUNK_BYTES", 3 * 128 * 512 * 2)
    codes, scale = quantized_fp8(torch.randn(1000, 512))
    blocks, scales = mxfp4_tensors(8, 64, 512, torch.Generator().manual_seed(5))
    fp8 = write_folder(tmp_path / "fp8", {"quantization_config": FP8}, {"w.weight": codes, "w.weight_scale_inv": scale})
    mx = write_folder(tmp_path / "mx", {"quantization_config": {"quant_method": "mxfp4"}},
                      {"e.down_proj_blocks": blocks, "e.down_proj_scales": scales})
    entry = open_safetensors_folder(fp8, quant_format({"quantization_config": FP8}, fp8), bfloat16).tensors["w.weight"]
    assert [c.sizes[0] for c in entry.chunks] == [384, 384, 232]
    entry = open_safetensors_folder(mx, quant_format({"quantization_config": {"quant_method": "mxfp4"}}, mx),
                                    bfloat16).tensors["e.down_proj"]
    assert [c.sizes[0] for c in entry.chunks] == [6, 2]


def test_a_chunk_reads_only_its_codes_and_its_scale_rows(tmp_path, monkeypatch):
    """Rows 384..511 of a [1000, 512] weight: those rows' 64 KiB of codes and scale row 3 (4 floats)."""
    import os

    monkeypatch.setattr(quantized, "DEQUANT_CHUNK_BYTES", 128 * 512 * 2)
    codes, scale = quantized_fp8(torch.randn(1000, 512))
    folder = write_folder(tmp_path, {"quantization_config": FP8}, {"w.weight": codes, "w.weight_scale_inv": scale})
    ckpt = open_safetensors_folder(folder, quant_format({"quantization_config": FP8}, folder), bfloat16)
    entry = ckpt.tensors["w.weight"]
    stored = {st.name: st for st in (entry.properties.data, entry.properties.scale)}
    reads = []
    real = os.preadv

    def preadv(fd, bufs, at):
        reads.append((at, sum(map(len, bufs))))
        return real(fd, bufs, at)

    monkeypatch.setattr(os, "preadv", preadv)
    with ItemReader(ckpt) as reader:
        dequantized_chunk(entry, entry.chunks[3], reader.handle)
    assert reads == [(stored["w.weight"].start + 384 * 512, 128 * 512),
                     (stored["w.weight_scale_inv"].start + 3 * 4 * 4, 4 * 4)]


@pytest.mark.parametrize("config, fmt", [
    ({"quant_method": "fp8"}, quantized.Fp8Format((128, 128), False)),
    ({"quant_method": "fp8", "weight_block_size": None}, quantized.Fp8Format(None, False)),
    ({"quant_method": "fp8", "weight_block_size": [1, 128], "scale_fmt": "ue8m0"}, quantized.Fp8Format((1, 128), True)),
    ({"quant_method": "mxfp4", "modules_to_not_convert": ["lm_head"]}, quantized.Mxfp4Format()),
])
def test_the_format_is_what_transformers_reads_from_quantization_config(config, fmt):
    """An absent weight_block_size is transformers' default [128, 128]; null is one scale per weight."""
    assert quant_format({"quantization_config": config}, Path("config.json")) == fmt


@pytest.mark.parametrize("shape", [(200, 300), (320, 256), (576, 256), (7, 1000)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp8_equals_megatron_bridge_dequantization_off_the_block_grid(tmp_path, monkeypatch, shape, dtype):
    """Megatron-Bridge's `dequantize_fp8_e4m3fn_with_scale` (ceil grid, float32 product, one cast)
    is the producer-side oracle where transformers 5.24 is none (shapes off the 128 grid)."""
    bridge = megatron_bridge_quantization()
    if bridge is None:
        pytest.skip("Megatron-Bridge is not installed")
    monkeypatch.setattr(quantized, "DEQUANT_CHUNK_BYTES", 128 * shape[1] * 2)
    torch.manual_seed(6)
    codes, scale = quantized_fp8(torch.randn(shape) * 3)
    folder = write_folder(tmp_path, {"quantization_config": FP8}, {"w.weight": codes, "w.weight_scale_inv": scale})
    got = _decoded(folder, bfloat16 if dtype == torch.bfloat16 else float32)["w.weight"]
    want = bridge.dequantize_fp8_e4m3fn_with_scale(codes, scale, dtype=dtype)
    assert torch.equal(_bits(got), _bits(want))


def test_mxfp4_equals_megatron_bridge_dequantization_transposed(tmp_path):
    """Megatron-Bridge's `dequantize_mxfp4` keeps the codes' [E, out, in]; transformers' model, and
    the import, hold [E, in, out]."""
    bridge = megatron_bridge_quantization()
    if bridge is None:
        pytest.skip("Megatron-Bridge is not installed")
    blocks, scales = mxfp4_tensors(3, 96, 64, torch.Generator().manual_seed(7), exponents=(100, 140))
    folder = write_folder(tmp_path, {"quantization_config": {"quant_method": "mxfp4"}},
                          {"e.gate_up_proj_blocks": blocks, "e.gate_up_proj_scales": scales})
    want = bridge.dequantize_mxfp4(blocks.clone(), scales.clone()).transpose(1, 2)
    assert torch.equal(_bits(_decoded(folder)["e.gate_up_proj"]), _bits(want.contiguous()))


def test_a_scale_in_another_shard_than_its_weight_is_read_there(tmp_path):
    from safetensors.torch import save_file

    codes, scale = quantized_fp8(torch.randn(300, 200))
    save_file({"w.weight": codes}, str(tmp_path / "model-1.safetensors"))
    save_file({"w.weight_scale_inv": scale, "n.weight": torch.ones(4)}, str(tmp_path / "model-2.safetensors"))
    index = {"weight_map": {"w.weight": "model-1.safetensors", "w.weight_scale_inv": "model-2.safetensors",
                            "n.weight": "model-2.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": FP8}))
    got = _decoded(tmp_path)
    assert list(got) == ["w.weight"]
    assert torch.equal(_bits(got["w.weight"]), _bits(dequantized_fp8(codes, scale, torch.bfloat16)))
