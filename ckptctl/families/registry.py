"""The one registry of model families, and what Megatron-aware commands look Megatron names up in.

Each export-hf / import-hf family is registered here by name. The Megatron families' rules
also declare each Megatron tensor's TP kind (`rules.COLUMN`, `ROW`, `REPLICATED`, or a
fused kind): `megatron_tp_kind` answers from those declarations (and `MEGATRON_ONLY`, names
Megatron-Core saves that no HF family maps), in each spelling a megatron-core release gives a
name (`megatron.rows.SPELLINGS`: 0.19's Mamba `mixer.conv1d_weight` as 0.16's `mixer.conv1d.weight`),
so placement and reshard split a tensor over TP only as a rule says, and a name no rule knows
is None: theirs to refuse.
"""

from __future__ import annotations

import functools
import re

from ckptctl.families.automodel import AUTOMODEL
from ckptctl.families.deepseek_v3 import DEEPSEEK_V3
from ckptctl.families.gemma import GEMMA2, GEMMA3
from ckptctl.families.gpt_oss import GPT_OSS
from ckptctl.families.llama import LLAMA, QWEN2, QWEN3
from ckptctl.families.mixtral import MIXTRAL
from ckptctl.families.nemotron_h import NEMOTRON_H
from ckptctl.families.qwen3_5 import QWEN3_5
from ckptctl.families.qwen3_moe import QWEN3_MOE
from ckptctl.families.qwen3_next import QWEN3_NEXT
from ckptctl.families.raw import RAW
from ckptctl.families.protocol import ModelFamily, Naming
from ckptctl.families.rules import COLUMN, REPLICATED, MG_LAYER, ROW
from ckptctl.families.torchtitan import TORCHTITAN_DEEPSEEK_V3, TORCHTITAN_LLAMA3, TORCHTITAN_QWEN3
from ckptctl.megatron.rows import FUSED_PARTS, spellings

FAMILIES: dict[str, ModelFamily] = {
    f.name: f for f in (LLAMA, QWEN2, QWEN3, QWEN3_MOE, QWEN3_NEXT, QWEN3_5, DEEPSEEK_V3, MIXTRAL, GEMMA2, GEMMA3,
                        NEMOTRON_H, GPT_OSS, TORCHTITAN_LLAMA3, TORCHTITAN_QWEN3, TORCHTITAN_DEEPSEEK_V3,
                        AUTOMODEL, RAW)}
ARCHES = ("auto", *FAMILIES)

MEGATRON_ONLY: tuple[tuple[str, str], ...] = (
    (MG_LAYER + "self_attention.linear_qkv.layer_norm_bias", REPLICATED),
    (MG_LAYER + "mlp.linear_fc1.layer_norm_bias", REPLICATED),
    (MG_LAYER + "self_attention.linear_q_up_proj.layer_norm_bias", REPLICATED),
    (MG_LAYER + "self_attention.linear_kv_up_proj.layer_norm_bias", REPLICATED),
    (MG_LAYER + "input_layernorm.bias", REPLICATED),
    (MG_LAYER + "pre_mlp_layernorm.bias", REPLICATED),
    ("decoder.final_layernorm.bias", REPLICATED),
    ("embedding.position_embeddings.weight", REPLICATED),
)
"""Megatron-Core GPT tensors of LayerNorm models and learned absolute positions (its layer
specs: norms and `nn.Embedding` positions are the same on every TP rank); under multi-latent
attention Transformer Engine's spec fuses the q / kv norms into the up projections, a LayerNorm's
bias as `layer_norm_bias` beside `layer_norm_weight`."""


def family_for_model_type(model_type: str, naming: Naming = Naming.MEGATRON) -> ModelFamily | None:
    """The family serving an HF `model_type` for checkpoints of `naming`, or None."""
    return next((f for f in FAMILIES.values() if f.naming is naming and model_type in f.model_types), None)


def _pattern(name: str) -> str:
    return re.escape(name).replace(re.escape("{L}"), r"\d+").replace(re.escape("{e}"), r"\d+")


@functools.cache
def _megatron_kinds() -> tuple[re.Pattern[str], tuple[str, ...]]:
    """One regex of every known Megatron name (any wrapper prefix before it), a group per kind."""
    declared: dict[str, str] = {}
    for family in FAMILIES.values():
        for name, kind in family.megatron_tensors():
            if declared.setdefault(name, kind) != kind:
                raise AssertionError(f"{name}: TP kinds {declared[name]} and {kind} in the rules")
    for name, kind in MEGATRON_ONLY:
        declared.setdefault(name, kind)
    for name, kind in list(declared.items()):  # every release's spelling of it (`megatron.rows.SPELLINGS`)
        declared.update((other, kind) for other in spellings(name))
    kinds = tuple(dict.fromkeys(declared.values()))
    groups = "|".join(f"(?P<k{i}>{'|'.join(_pattern(n) for n, k in declared.items() if k == kind)})"
                      for i, kind in enumerate(kinds))
    return re.compile(rf"(?:^|\.)(?:{groups})$"), kinds


@functools.lru_cache(maxsize=65536)
def megatron_tp_kind(name: str) -> str | None:
    """The TP kind a rule declares for Megatron tensor `name` (a saved component of a fused
    tensor, `…weight_w` or `…weight.key`, is ColumnParallel); None when no rule knows it."""
    regex, kinds = _megatron_kinds()
    found = regex.search(name)
    if found is not None:
        return kinds[int(found.lastgroup[1:])]
    return COLUMN if fused_component(name) is not None else None


def fused_kind(name: str) -> str | None:
    """`swiglu` (an fc1 that is fused `[W; V]` when gated), `gdn_in_proj`, `gdn_conv1d`,
    `mamba_in_proj`, `mamba_conv1d`, or None."""
    kind = megatron_tp_kind(name)
    return kind if kind in FUSED_PARTS else None


def fused_component(name: str) -> tuple[str, str, int] | None:
    """(fused name, kind, component index) when `name` is a saved component (`…weight_w`, `…weight.key`)."""
    for kind, parts in FUSED_PARTS.items():
        for index, part in enumerate(parts):
            if name.endswith(part) and fused_kind(name[: -len(part)]) == kind:
                return name[: -len(part)], kind, index
    return None


def parallel_dim(name: str) -> int | None:
    """0 for ColumnParallel (and fused), 1 for RowParallel, None for TP-duplicated and unknown names."""
    kind = megatron_tp_kind(name)
    return None if kind in (None, REPLICATED) else 1 if kind == ROW else 0
