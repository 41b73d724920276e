"""How Megatron-FSDP's `fsdp_dtensor` names what megatron-core's `torch_dist` names otherwise.

Both conversions (`fsdp_dtensor_to_torch_dist`, `torch_dist_to_fsdp_dtensor`) read these facts,
one each way. Megatron-LM (`megatron/training/checkpointing.py`, `generate_state_dict` and
`preprocess_fsdp_dtensor_state_dict`) saves fsdp_dtensor with plain DCP: each layer's params by
their module names under `model.module.` (the wrappers stop at MegatronFSDP), SwiGLU fc1 split
into `…_w` / `…_v`, experts by their global index, Adam's moments under the optimizer's own
param names (`optimizer.state.<module.>*<name>.…`: three wrappers with a Float16Module, in a
bf16 or fp16 run, two without), and each param's group settings under the same names.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass

from ckptctl.util.errors import CheckpointError
from ckptctl.core.checkpoint import Checkpoint

MODEL_PREFIX = re.compile(r"^model\.(?:module\.)*")
STATE_PREFIX = re.compile(r"^optimizer\.state\.(?:module\.)*(?P<name>.+)\.(?P<state>exp_avg|exp_avg_sq|step)$")
GROUP_META = re.compile(r"^optimizer\.param_to_group_meta\.(?:module\.)*(?P<name>.+)\.(?P<attr>[^.]+)$")
LAYER = re.compile(r"^(?P<ns>.*\blayers)\.(?P<index>\d+)\.(?P<rest>.+)$")
SWIGLU_PART = re.compile(r"^(?P<base>.*\blinear_fc1\.(?:weight|bias)\d*)_(?P<part>[wv])$")
GROUPED_EXPERT = re.compile(r"^(?P<head>.*\bexperts)\.(?P<param>linear_fc[12]\.(?:weight|bias))(?P<index>\d+)$")
LOCAL_EXPERT = re.compile(r"^(?P<head>.*\bexperts)\.local_experts\.(?P<index>\d+)\.(?P<param>.+)$")
LOCAL_SPEC_NAMES = (("input_layernorm.", "self_attention.linear_qkv.layer_norm_"),
                    ("pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_"))
"""megatron-core's local GPT spec: module name prefix → its torch_dist key (`sharded_state_dict_keys_map`);
its multi-latent attention layers have no such map."""
SPECS = ("local", "transformer_engine")
DROPPED_ROOTS = ("rng_state", "rerun_state_machine")
"""Items not carried over: RNG state (resume with `--no-load-rng`), the rerun state machine."""
COMMON_ITEMS = ("args", "iteration", "checkpoint_version", "num_floating_point_operations_so_far")
SCHEDULER = "opt_param_scheduler."
UNSUPPORTED = (("mtp", "MTP layers"), ("in_proj", "GDN or Mamba projections"), ("mixer.", "Mamba mixers"),
               ("conv1d", "GDN or Mamba convolutions"), ("basic_ops", "Transformer Engine's fused-op MLPs"),
               (".mlp.0.", "Transformer Engine's fused-op MLPs"))
"""Module names whose torch_dist keys are not those above (TE's fused-op MLPs map to other keys;
GDN and Mamba split their projections into sub-keys)."""
TE_MLA = ("_down_proj", "Transformer Engine's MLA projections (its spec saves their fused norm as input_layernorm)")


@dataclass(frozen=True)
class LayerNames:
    """How one model spec's layer module names differ from their torch_dist keys."""

    renames: tuple[tuple[str, str], ...]
    """(module name prefix, torch_dist key prefix) within a layer."""
    unsupported: tuple[tuple[str, str], ...]
    """(name part, what it is) of names not converted."""

    def to_key(self, rest: str) -> str:
        """A layer's module name (after `layers.<i>.`) → the rest of its torch_dist key."""
        return next((new + rest[len(old):] for old, new in self.renames if rest.startswith(old)), rest)

    def to_module(self, rest: str) -> str:
        """The rest of a layer's torch_dist key → its module name."""
        return next((old + rest[len(new):] for old, new in self.renames if rest.startswith(new)), rest)


def layer_names(ckpt: Checkpoint, args: argparse.Namespace) -> LayerNames:
    """The spec `args` name (`model_spec`): the local spec renames its GPT layers' norms but not
    its multi-latent attention layers'; Transformer Engine's spec keeps its module names, but
    for MLA (not converted)."""
    spec = model_spec(ckpt, args)
    mla = getattr(args, "multi_latent_attention", False) is True
    if spec == "local":
        return LayerNames(() if mla else LOCAL_SPEC_NAMES, UNSUPPORTED)
    return LayerNames((), (*UNSUPPORTED, TE_MLA))


def model_spec(ckpt: Checkpoint, args: argparse.Namespace) -> str:
    """The model spec `args` name (its norms' torch_dist names depend on it)."""
    impl = getattr(args, "transformer_impl", None)
    if impl not in SPECS:
        raise CheckpointError(ckpt.path, f"args.transformer_impl is {impl!r}: the torch_dist names of the model's "
                                         f"norms are known for {' and '.join(map(repr, SPECS))} only")
    return impl


def optimizer_prefix(args: argparse.Namespace) -> str:
    """The wrappers of the optimizer's param names: DDP-like, MegatronFSDP and, in a bf16 or fp16
    run, Float16Module (Megatron-LM's `get_model` wraps before Megatron-FSDP does)."""
    half = getattr(args, "bf16", False) is True or getattr(args, "fp16", False) is True
    return "module.module.module." if half else "module.module."
