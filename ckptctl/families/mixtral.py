"""Mixtral: Llama attention, every MLP a sparse MoE whose experts keep Mixtral's own names.

As Megatron-Bridge's `MixtralBridge` maps it (in its repository, PR 1317; not in the 0.6.2
wheel): the router `mlp.router.weight` ↔ `block_sparse_moe.gate.weight`; each expert's fc1
↔ `w1` (gate) and `w3` (up), fused per TP rank or split `_w`/`_v` like any SwiGLU fc1; fc2 ↔
`w2`. Experts are as wide as `intermediate_size` (Mixtral has no separate expert width).
transformers 5 fuses them in memory (`mlp.experts.gate_up_proj`) but saves these names.
"""

from __future__ import annotations

from ckptctl.families.llama import EMBEDDING, FINAL, attention, attention_dims
from ckptctl.families.qwen3_moe import router
from ckptctl.families.rules import Block, Family, Rule, swiglu

ROUTER = router("block_sparse_moe.gate.weight")
EXPERT: tuple[Rule, ...] = swiglu("block_sparse_moe.experts.{e}.", ("mlp.experts.{fc}.{kind}{e}",
                                                                    "mlp.experts.local_experts.{e}.{fc}.{kind}"),
                                  "ffn", expert=True, names=("w1", "w3", "w2"))

MIXTRAL = Family("mixtral", ("mixtral",), attention_dims(None), EMBEDDING,
                 (Block(attention()), Block(ROUTER), Block(EXPERT, per_expert=True)), FINAL)
