"""Red team: diff of a quantized folder.

import-hf never reads FP8 codes as values without their scales ("the codes cast without their
scale would be ~1/scale off"). diff does: an FP8 folder against its own dequantized bf16 twin with
`--compare-as bf16` reports every element of every FP8 weight as differing by up to 448 (the codes
cast, scales ignored) and the scales as tensors of their own; without `--compare-as`, `dtype differs`.
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import run_cli

transformers = pytest.importorskip("transformers")


@pytest.mark.xfail(strict=True, reason="diff reads FP8 codes as values (scales ignored): an FP8 folder and its "
                                       "dequantized twin 'differ' on every element; it should dequantize the folder "
                                       "as import-hf does (then: equal), or refuse, naming the codes")
def test_an_fp8_folder_is_not_compared_as_its_codes(tmp_path):
    from tests.formats.quantized_folders import fp8_folder

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=300, hidden_size=256, intermediate_size=384, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2))
    fp8, twin = fp8_folder(tmp_path, model)
    res = run_cli("diff", fp8, twin, "--compare-as", "bf16")
    assert res.returncode in (0, 2), res.stdout
    assert "differs: first at" not in res.stdout
