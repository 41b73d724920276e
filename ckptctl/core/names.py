"""The vocabulary of checkpoint entry names: where model params, optimizer state and training
bookkeeping live, declared once for the analysis, the family rules and the planners."""

from __future__ import annotations

import re

MODEL_PREFIXES = ("model.module.module.", "model.module.", "model.", "")
"""Where model params live, most specific first (DDP / Megatron wrappers add `module.`)."""

OPTIMIZER_ROOTS = ("optim.state.", "optimizer.state.")
"""Where per-param optimizer states live (`get_state_dict` / Megatron-FSDP)."""

OPTIMIZER_GROUP_ROOTS = ("optim.", "optimizer.")
"""Everything under these belongs to the optimizer (states, param groups, group meta)."""

CHAINED_OPTIMIZER = re.compile(r"chained_(\d+)\.(?=optimizer\.)")
"""megatron-core's ChainedOptimizer (a MoE's dense and expert optimizers, under expert
parallelism) saves each optimizer's `dp_reshardable` entries under `chained_<i>.optimizer.…`."""

TRAINING_STATE_ROOTS = frozenset({"args", "iteration", "checkpoint_version", "extra", "rng", "rng_state",
                                  "lr_scheduler", "dataloader", "train_state"})
"""Top-level entries that hold training bookkeeping, never model weights (Megatron's `args`,
torchtitan's `lr_scheduler` / `train_state` / `dataloader`, ...): torchtitan saves its model
with no prefix, so these roots cannot be told from model keys by prefix."""


def is_training_state(fqn: str) -> bool:
    """Whether `fqn` lies under a bookkeeping root (`rng_state_<i>` included), never a weight."""
    root = fqn.partition(".")[0]
    return root in TRAINING_STATE_ROOTS or root.startswith("rng_state")
