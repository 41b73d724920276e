"""Megatron and torchtitan ↔ Hugging Face conversion rules, one module per model family, registered here.

Each family has `name`, `model_types` (the HF `config.model_type` values it serves; torchtitan
families are chosen by the source's naming scheme instead) and
`to_hf(ctx) -> {hf_name: tensor}` where each tensor says which source rows it is made of
(`base.HFTensor`, or `raw.RawTensor` for names exported as they are). The reverse direction
(import-hf) reads the same rows backwards: a family also names the tensors it reads
(`megatron_shapes` for Megatron families, `source_shapes` for torchtitan's).
"""

from __future__ import annotations

from ckptctl.hf.llama import LLAMA, QWEN2, QWEN3
from ckptctl.hf.qwen3_moe import QWEN3_MOE
from ckptctl.hf.qwen3_next import QWEN3_NEXT
from ckptctl.hf.raw import RAW
from ckptctl.hf.torchtitan import TORCHTITAN_LLAMA3, TORCHTITAN_QWEN3

FAMILIES = {f.name: f for f in (LLAMA, QWEN2, QWEN3, QWEN3_MOE, QWEN3_NEXT, TORCHTITAN_LLAMA3, TORCHTITAN_QWEN3, RAW)}
ARCHES = ("auto", *FAMILIES)


def family_for_model_type(model_type: str):
    """The family serving an HF `model_type`, or None."""
    return next((f for f in FAMILIES.values() if model_type in f.model_types), None)
