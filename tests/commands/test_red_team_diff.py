"""Red team: diff of a quantized folder.

import-hf never reads FP8 codes as values without their scales ("the codes cast without their
scale would be ~1/scale off"). diff did: an FP8 folder against its own dequantized bf16 twin with
`--compare-as bf16` reported every element of every FP8 weight as differing by up to 448 (the codes
cast, scales ignored). `--compare-as` now refuses quantized bytes by name; without it, stored
bytes are compared as stored (two FP8 folders code for code; against bf16, `dtype differs`).
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import run_cli

transformers = pytest.importorskip("transformers")


def test_an_fp8_folder_is_not_compared_as_its_codes(tmp_path):
    from tests.formats.quantized_folders import fp8_folder

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=300, hidden_size=256, intermediate_size=384, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2))
    fp8, twin = fp8_folder(tmp_path, model)
    res = run_cli("diff", fp8, twin, "--compare-as", "bf16")
    assert (res.returncode, res.stdout) == (2, "")
    assert res.stderr == (f"ckptctl: error: {fp8 / 'model.safetensors'}: model.layers.0.mlp.down_proj.weight: "
                          "float8_e4m3fn codes: --compare-as would read quantized bytes as values (import-hf "
                          "dequantizes such a folder; compare that)\n")
