"""Quantized Hugging Face folders for the tests, written as their producers lay them out.

FP8: each chosen `X.weight` quantized per 128×128 block on the ceil grid, scale = amax/448
(1 for an all-zero block), codes = float8_e4m3fn(w / scale), the scale stored as
`X.weight_scale_inv` (DeepSeek-V3's and Megatron-Bridge's recipe). MXFP4: random E2M1 codes
and E8M0 exponents in gpt-oss's `_blocks`/`_scales` layout. `dequantized_fp8` is the
dequantization formula the producers state (float32 product on the ceil grid, one rounding),
the reference where transformers cannot be one.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors.torch import save_file

BLOCK = 128


def megatron_bridge_quantization() -> Any:
    """Megatron-Bridge's `quantization_utils` (its FP8 and MXFP4 dequantizers), loaded alone: its
    package `__init__`s import its whole training stack. None when Megatron-Bridge is not installed."""
    megatron = importlib.util.find_spec("megatron")
    for root in (megatron.submodule_search_locations or []) if megatron else []:
        path = Path(root) / "bridge" / "models" / "conversion" / "quantization_utils.py"
        if path.is_file():
            spec = importlib.util.spec_from_file_location("megatron_bridge_quantization_utils", path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return module
    return None


def quantized_fp8(weight: torch.Tensor, block: tuple[int, int] = (BLOCK, BLOCK),
                  ue8m0: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn codes, float32 scale per block) of a 2-D weight; ue8m0: scales rounded up to powers of two."""
    (rows, cols), (bm, bn) = weight.shape, block
    gm, gn = -(-rows // bm), -(-cols // bn)
    padded = torch.zeros(gm * bm, gn * bn)
    padded[:rows, :cols] = weight.float()
    tiles = padded.reshape(gm, bm, gn, bn)
    amax = tiles.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / 448, torch.ones_like(amax))
    if ue8m0:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    codes = (tiles / scale[:, None, :, None]).reshape(gm * bm, gn * bn)[:rows, :cols]
    return codes.to(torch.float8_e4m3fn).contiguous(), scale


def dequantized_fp8(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                    block: tuple[int, int] = (BLOCK, BLOCK)) -> torch.Tensor:
    """The producers' formula: codes × their block's scale in float32, rounded once to `dtype`."""
    rows, cols = codes.shape
    full = scale.float().repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return (codes.float() * full).to(dtype)


def write_folder(folder: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    return folder


def fp8_folder(folder: Path, model: Any, quantize: Callable[[str], bool] = lambda name: name.endswith("proj.weight"),
               scale_as: str = "float32", config: dict[str, Any] | None = None,
               state: dict[str, torch.Tensor] | None = None) -> tuple[Path, Path]:
    """`model`'s weights (or `state`, its tensors as saved) with the `quantize`d ones as FP8 codes
    and scales (`scale_as`: float32, e8m0 — F8_E8M0 — or uint8 E8M0 bytes), and its bf16 twin:
    the same config without quantization_config and every quantized weight as its dequantized
    bfloat16 values."""
    ue8m0 = scale_as != "float32"
    quant = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
             **({"scale_fmt": "ue8m0"} if ue8m0 else {}), **(config or {})}
    plain = {**model.config.to_dict()}
    plain.pop("quantization_config", None)
    stored, twin = {}, {}
    for name, value in (model.state_dict() if state is None else state).items():
        value = value.to(torch.bfloat16)
        if not quantize(name):
            stored[name] = twin[name] = value
            continue
        codes, scale = quantized_fp8(value, ue8m0=ue8m0)
        stored[name] = codes
        stored[name + "_scale_inv"] = {"float32": scale, "e8m0": scale.to(torch.float8_e8m0fnu),
                                       "uint8": (torch.log2(scale) + 127).to(torch.uint8)}[scale_as]
        twin[name] = dequantized_fp8(codes, scale, torch.bfloat16)
    quantized = write_folder(folder / "fp8", {**plain, "quantization_config": quant}, stored)
    return quantized, write_folder(folder / "bf16", plain, twin)


def mxfp4_tensors(experts: int, out_rows: int, in_cols: int, generator: torch.Generator,
                  exponents: tuple[int, int] = (120, 131)) -> tuple[torch.Tensor, torch.Tensor]:
    """Random gpt-oss `_blocks` uint8 [E, out, in/32, 16] and `_scales` uint8 [E, out, in/32]."""
    groups = in_cols // 32
    blocks = torch.randint(0, 256, (experts, out_rows, groups, 16), generator=generator, dtype=torch.uint8)
    scales = torch.randint(exponents[0], exponents[1] + 1, (experts, out_rows, groups), generator=generator,
                           dtype=torch.uint8)
    return blocks, scales


def mxfp4_folder(folder: Path, model: Any, seed: int = 0) -> Path:
    """`model` (a GptOssForCausalLM) with its experts' gate_up_proj and down_proj as MXFP4 codes."""
    gen = torch.Generator().manual_seed(seed)
    cfg = model.config
    stored = {}
    for name, value in model.state_dict().items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            experts, in_cols, out_rows = value.shape  # transformers holds [E, in, out]
            stored[name + "_blocks"], stored[name + "_scales"] = mxfp4_tensors(experts, out_rows, in_cols, gen)
        else:
            stored[name] = value.to(torch.bfloat16)
    config = {**cfg.to_dict(), "quantization_config": {
        "quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                            "model.embed_tokens", "lm_head"]}}
    return write_folder(folder, config, stored)
