"""The training TP size of a Megatron checkpoint: given, from its `args`, or seen in the chunks of
the tensors the rules call RowParallel (`families.registry.parallel_dim`)."""

from __future__ import annotations

import argparse

from ckptctl.util.errors import UsageError
from ckptctl.families.registry import parallel_dim
from ckptctl.core.checkpoint import Checkpoint


def tp_from_geometry(ckpt: Checkpoint) -> int | None:
    """The TP degree seen on dim 1 of RowParallel weights (distinct column offsets), if any."""
    seen = set()
    for fqn, entry in ckpt.tensors.items():
        if len(entry.shape) == 2 and parallel_dim(fqn) == 1 and not fqn.split(".")[0].startswith("optim"):
            cols = {offsets[1] for offsets, sizes in entry.boxes() if 0 not in sizes}
            if cols:
                seen.add(len(cols))
    return max(seen) if seen else None


def resolve_tp(ckpt: Checkpoint, args: argparse.Namespace | None, given: int | None, what: str = "--tp", *,
               strict: bool = False) -> int:
    """The training TP size: `given`, else `args.tensor_model_parallel_size` (the checkpoint's
    `formats.megatron_args.checkpoint_args`), else RowParallel geometry.

    RowParallel chunks that are not split on dim 1 (TP 1 seen) are weak evidence: every layout
    that is not TP-split on disk (FSDP2, a reshard to `fsdp2`) shows them. They never
    contradict `args`, and with `strict` (re-blocking fused tensors) they are not trusted at all.
    """
    if given is not None:
        return given
    from_args = getattr(args, "tensor_model_parallel_size", None) if args is not None else None
    if from_args is not None and (type(from_args) is not int or from_args < 1):
        raise UsageError(f"{ckpt.path}: args.tensor_model_parallel_size is {from_args!r:.64}, not a TP size; "
                         f"pass {what}")
    from_geometry = tp_from_geometry(ckpt)
    if from_geometry == 1 and (strict or from_args is not None):
        from_geometry = None
    if from_args is not None and from_geometry is not None and from_args != from_geometry:
        raise UsageError(
            f"{ckpt.path}: args say TP {from_args} but RowParallel chunks show TP {from_geometry}; pass {what}")
    tp = from_args or from_geometry
    if tp is None:
        raise UsageError(f"{ckpt.path}: cannot tell the training TP size (no args entry, no RowParallel "
                         f"chunks split on dim 1); pass {what}")
    return int(tp)


def tp_dp_grid(ckpt: Checkpoint, args: argparse.Namespace | None, tp: int | None, dp: int | None,
               world_size: int | None, source_tp: int | None = None) -> tuple[int, int]:
    """Megatron-FSDP's rank grid: TP as given, else the training TP (`resolve_tp`, `source_tp`
    first); DP as given, else the world size over TP; a world size given too must be TP × DP;
    a TP that does not divide the heads or query groups args name is refused."""
    if tp is None:
        tp = resolve_tp(ckpt, args, source_tp, "--tp")
    if dp is None:
        if world_size is None:
            raise UsageError("--layout megatron-fsdp needs --dp (or --world-size = TP × DP)")
        if world_size % tp:
            raise UsageError(f"--world-size {world_size} is not a multiple of TP {tp}")
        dp = world_size // tp
    if world_size is not None and world_size != tp * dp:
        raise UsageError(f"--world-size {world_size} must equal TP × DP = {tp} × {dp} = {tp * dp} "
                         "for --layout megatron-fsdp (or be omitted)")
    _check_heads(args, tp)
    return tp, dp


def _check_heads(args: argparse.Namespace | None, tp: int) -> None:
    """Megatron splits attention heads and query groups over TP: at a TP that does not divide them
    the job cannot load what is written."""
    heads = getattr(args, "num_attention_heads", None)
    groups = getattr(args, "num_query_groups", None) if getattr(args, "group_query_attention", False) else heads
    for what, count in (("attention heads", heads), ("query groups", groups)):
        if type(count) is int and count % tp:
            raise UsageError(f"TP {tp} does not divide the {count} {what} of args")
