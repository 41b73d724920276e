"""Megatron-Core's `fully_sharded_model_space` optimizer states, laid back out in model space.

megatron-core up to 0.15 saves each DistributedOptimizer state of a param
(`optimizer.state.{fp32_param,exp_avg,exp_avg_sq}.<key>`) as the param's TP fragments: its
global shape is each dim's fragment count, then one fragment's elements (qkv `[L, TP, 1, n]`,
SwiGLU fc1 `[L, 2·TP, 1, n]`, linear_proj `[L, 1, TP, n]`, a norm `[L, 1, n]`), its chunks cut
mid-fragment at DP boundaries. megatron-core 0.16 cannot load it (it refuses the flattened
ranges this format is made of). Fragment i of a dim is the i-th equal block of that dim of the
param (fc1's 2·TP row blocks of `[W_all; V_all]` are W_0 … W_{T-1}, V_0 … V_{T-1}), its elements
row-major: each is one piece of the model-shaped state `fully_reshardable` saves (named
`param` there, `fp32_param` here). The fragment counts must divide the param's shape and the
fragment's elements must be one block's; otherwise the state is refused. Pure planning.
"""

from __future__ import annotations

import itertools
import math

from ckptctl.util.errors import CheckpointError
from ckptctl.core.analysis import split_torch_dist_state
from ckptctl.core.checkpoint import Checkpoint
from ckptctl.core.plan import ItemWindows, Piece, SourceTensor, TargetTensor

FRAGMENT_STATES = {"fp32_param": "param", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}
"""A fragment state's name → its name in `fully_reshardable`."""


def fragment_targets(ckpt: Checkpoint) -> tuple[list[TargetTensor], dict[str, SourceTensor], set[str]]:
    """Every fragment state rebuilt in its param's shape, the views of its fragments its pieces
    read (keyed by view name), and the fragment states it replaces."""
    targets: list[TargetTensor] = []
    views: dict[str, SourceTensor] = {}
    replaced: set[str] = set()
    for fqn, entry in ckpt.tensors.items():
        split = split_torch_dist_state(fqn)
        if split is None or split.state not in FRAGMENT_STATES:
            continue
        param = ckpt.tensors.get(split.param)
        if param is None:
            raise CheckpointError(ckpt.path, f"{fqn}: no model tensor {split.param} for this optimizer state")
        frags, n = entry.shape[:-1], entry.shape[-1] if entry.shape else 0
        block = tuple(p // f if f and not p % f else -1 for p, f in zip(param.shape, frags))
        if len(frags) != len(param.shape) or -1 in block or math.prod(block) != n:
            raise CheckpointError(ckpt.path, f"{fqn}: {list(entry.shape)} is not fragments of its param "
                                             f"{list(param.shape)} (each dim's fragment count, then one fragment's "
                                             "elements)")
        zero = tuple(0 for _ in block)
        items = ItemWindows(entry)
        pieces = []
        for number, index in enumerate(itertools.product(*(range(f) for f in frags))):
            name = f"{fqn}[{number * n}:{(number + 1) * n}]"
            views[name] = items.window(number * n, (number + 1) * n, block)
            pieces.append(Piece(name, zero, tuple(i * b for i, b in zip(index, block)), block))
        targets.append(TargetTensor(f"optimizer.state.{FRAGMENT_STATES[split.state]}.{split.param}", param.shape,
                                    entry.dtype, tuple(pieces)))
        replaced.add(fqn)
    return targets, views, replaced
