"""Source naming schemes `--arch raw` must not write as they are, refused by name.

A torchtitan checkpoint (`tok_embeddings.weight`, `layers.N.attention.qkv_linear.wq.weight`,
`layers.N.feed_forward.w1.weight`, `moe.routed_experts…`) is not an HF-named one: besides
the names, torchtitan's llama keeps q/k rows in another order for RoPE, so writing it as it
is gives a model that loads and computes nonsense (`--arch auto` converts torchtitan's
families). NeMo Automodel's native grouped experts (`mlp.experts.gate_and_up_projs`
[E, H, 2I], `mlp.experts.down_projs` [E, I, H]) are transposed and fused relative to Hugging
Face's per-expert tensors (`--arch auto` converts them: `families.automodel`). Both are refused
before anything else is looked at, with the names that gave them away.
"""

from __future__ import annotations

import re
from typing import Iterable

from ckptctl.families.automodel import native_expert_names
from ckptctl.families.expected import shown

_TORCHTITAN = re.compile(r"^(tok_embeddings\.|layers\.\d+\.(attention\.(qkv_linear\.)?w[qkvo]|attention\.wqkv"
                         r"|feed_forward\.w[123]|moe\.)|moe\.routed_experts)|\.moe\.routed_experts\.")


def torchtitan_names(names: Iterable[str]) -> list[str]:
    """The names, sorted, that only torchtitan's model definitions use."""
    return sorted(n for n in names if _TORCHTITAN.search(n))


def foreign_reason(names: Iterable[str], native_converted: bool = False) -> str | None:
    """Why these model names cannot be exported as they are, or None (`native_converted`: the
    Automodel family converts the native experts)."""
    names = list(names)
    titan = torchtitan_names(names)
    if titan:
        return (f"a torchtitan checkpoint ({len(titan)} tensors named as torchtitan names them: {shown(titan)}); "
                f"its names and llama's RoPE row order differ from Hugging Face's: export it with --arch auto "
                f"(torchtitan's llama3 and qwen3 are converted)")
    native = native_expert_names(names)
    if native and not native_converted:
        return (f"{len(native)} tensors in NeMo Automodel's native expert layout, not Hugging Face's: {shown(native)} "
                f"(grouped, transposed experts): export with --arch auto, which converts them")
    return None
