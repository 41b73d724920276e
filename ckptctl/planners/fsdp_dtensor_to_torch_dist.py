"""Convert a Megatron-FSDP `fsdp_dtensor` checkpoint to Megatron-Core `torch_dist`.

Megatron-LM saves `fsdp_dtensor` with plain DCP: each layer's params by their module names
(`model.module.decoder.layers.<i>.…`), SwiGLU fc1 split into `…weight_w` / `…weight_v` (W_all and
V_all, never TP-blocked), one key per expert with its global index, the fp32 main weights as the
model, Adam's moments as `optimizer.state.<module.>*<name>.{exp_avg,exp_avg_sq,step}`, each
param's group settings as `optimizer.param_to_group_meta.<module.>*<name>.<attr>` items, and
`args`, `iteration`, … as items. torch_dist keeps what megatron-core's `dist_checkpointing`
loads at any TP × DP: one key per param stacked over layers (`decoder.layers.<name>` [L, …], and
over experts: `…mlp.experts.experts.<name>` [L, E, …]) when every layer holds the same params
(per-layer keys otherwise), fc1 as [W_all; V_all], the model in the compute dtype of `args`, a
`fully_reshardable` optimizer (`optimizer.state.{param,exp_avg,exp_avg_sq}.<key>`, the fp32
weights as `param`) whose param groups and Adam step go into the common state (`common.pt`,
written without torch), and `metadata.json`.

Module names differ from torch_dist's keys where the model spec maps them
(`sharded_state_dict_keys_map`): megatron-core's local spec saves `input_layernorm.` as
`self_attention.linear_qkv.layer_norm_` and `pre_mlp_layernorm.` as `mlp.linear_fc1.layer_norm_`
(but in its multi-latent attention layers, whose names are the keys: `fsdp_dtensor_names.layer_names`);
Transformer Engine's spec maps only its fused-op MLPs and MLA's fused norms (refused here), its
other modules carry the key names themselves (megatron-core 0.19.2's spec code: TE itself needs
CUDA, so that spec is read, not run). The spec comes from `args.transformer_impl`. RNG state is
not carried over (resume with `--no-load-rng`), nor `_extra_state`, which Megatron-FSDP does not
save (resume with `--dist-ckpt-strictness log_all`). The router's expert bias is a buffer: a model
tensor kept in its own dtype, with no optimizer state or group.

megatron-core's hybrid stack (MambaModel: `decoder.final_norm`) keys every layer on its own
(`decoder.layers.<i>.…`, never stacked) under its module names (its spec is Transformer Engine's,
the norms inside the modules or named as keys), and its Mamba mixer (0.19.2's
`MambaMixer.sharded_state_dict`) keeps `in_proj.weight` in parts `.z .x .B .C .dt` and the conv
(`conv1d.weight` / `.bias`, 0.19's `conv1d_weight` / `conv1d_bias` params) in parts `.x .B .C`,
each part TP-sharded on its own: its global tensor is every TP rank's rows of it in rank order.
Megatron-FSDP saves them fused, TP-blocked at the run's TP (rank t's block `[z_t; x_t; B_t; C_t;
dt_t]`), so each part is cut out block by block, sized from the layer's own shapes. Gated DeltaNet
layers (`self_attention.in_proj`, `.conv1d`, in a GPT decoder or a hybrid stack) likewise: parts
`.query .key .value .z .beta .alpha` and `.query .key .value` (megatron-core 0.19.2's
`GatedDeltaNet.sharded_state_dict`); under the local spec a GDN layer's input norm is keyed
`self_attention.in_proj.layer_norm_` (Transformer Engine's name, as megatron-core's ModelOpt local
hybrid spec maps it), not `linear_qkv`'s.

Anything else not named here is refused, as are MTP, Transformer Engine's MLA, Mamba mixers outside
a hybrid stack, a layer stack of fused GDN params (a model whose every layer is GDN), fused params
saved in parts, pipeline stages and flat (CPU-offloaded) optimizer states, which are not converted
yet.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import struct
from collections import defaultdict
from dataclasses import dataclass, field, replace
from typing import Any

from ckptctl.core.dtypes import DType, bfloat16, float16
from ckptctl.util.errors import CheckpointError, UsageError
from ckptctl.formats.dcp.items import ItemReader
from ckptctl.formats.dcp.writer import DcpOutput, place_dcp_records
from ckptctl.formats.megatron_args import COMMON, decoded_item
from ckptctl.formats.torch_save.writer import encode_value
from ckptctl.formats.pickle.unpickle import UnsafePickleError
from ckptctl.megatron.fsdp_dtensor_names import (
    COMMON_ITEMS, DROPPED_ROOTS, GROUP_META, GROUPED_EXPERT, LAYER, LOCAL_EXPERT, MODEL_PREFIX, SCHEDULER,
    STATE_PREFIX, SWIGLU_PART, UNSUPPORTED, LayerNames, layer_names,
)
from ckptctl.megatron.buckets import HYBRID_FINAL_NORM
from ckptctl.megatron.rows import BUFFERS, canonical, mixer_part_rows
from ckptctl.megatron.tp import tp_from_geometry
from ckptctl.core.checkpoint import Checkpoint
from ckptctl.core.geometry import Box
from ckptctl.families.placement import Placed, fsdp2
from ckptctl.core.plan import Piece, SourceTensor, TargetTensor, source_view, unsqueezed_view
from ckptctl.planners.request import PlannedReshard, ReshardChoices

TORCH_DIST_MARKER = {"sharded_backend": "torch_dist", "sharded_backend_version": 1}
CONTENT_METADATA = {"distrib_optim_sharding_type": "fully_reshardable",
                    "distrib_optim_fully_reshardable_mem_efficient": False,
                    "singleton_local_shards": False, "chained_optim_avoid_prefix": True}
"""What Megatron-LM passes `dist_checkpointing.save` for a `fully_reshardable` DistributedOptimizer."""
MAMBA_MIXER = re.compile(r"^decoder\.layers\.\d+\.mixer\.")
"""A Mamba layer's mixer in megatron-core's hybrid stack (module names are its torch_dist keys)."""
GDN = re.compile(r"^decoder\.layers\.\d+\.self_attention\.(in_proj|conv1d)\.")
"""A Gated DeltaNet layer's fused projection or conv (`self_attention.in_proj`, `.conv1d`)."""
FUSED_SPLIT = re.compile(r"^(?P<layer>decoder\.layers\.\d+\.)(?P<module>mixer|self_attention)\."
                         r"(?P<param>in_proj\.weight|conv1d\.weight|conv1d\.bias)$")
"""The params megatron-core 0.19.2's `MambaMixer.sharded_state_dict` and GDN's keep in parts
(`_split_tensor_factory`): Mamba `in_proj.weight.{z,x,B,C,dt}`, `conv1d.{weight,bias}.{x,B,C}`; GDN
`in_proj.weight.{query,key,value,z,beta,alpha}`, `conv1d.{weight,bias}.{query,key,value}`."""
FUSED_SAVED_PART = re.compile(r"^decoder\.layers\.\d+\.(mixer|self_attention)\.(in_proj|conv1d)\.(weight|bias)\.")
GDN_NORM = ("input_layernorm.", "self_attention.in_proj.layer_norm_")
"""A GDN layer's input norm in a local spec: keyed as in Transformer Engine's (where `in_proj` holds
it), as megatron-core 0.19.2's ModelOpt local hybrid spec maps it (`gdn_state_dict_keys_map`)."""


@dataclass
class _Key:
    """One torch_dist key: the module-named params it is built from, placed along its stacked dims."""

    key: str
    lead: int = 0
    """How many stacked dims lead (layers, then experts)."""
    layers: bool = False
    """The first stacked dim is the layer axis (a layer stack `<ns>.layers.<name>`)."""
    parts: dict[tuple[int, ...], dict[str | None, str]] = field(default_factory=dict)
    """Index along the stacked dims → SwiGLU part (`w`, `v`, None) → module-named param."""
    split: tuple[tuple[str, int], ...] = ()
    """A Mamba `in_proj` or conv saved fused, TP-blocked at `tp`, that torch_dist keeps in parts
    (`<key>.<part>`): (part, rows per TP rank) in the order each rank holds them."""
    tp: int = 1
    swiglu_blocked: bool = False
    """A Megatron-Bridge adapter's linear_out on a SwiGLU fc1, saved fused TP-blocked at `tp`
    ([W_0; V_0; W_1; V_1 …]), that torch_dist keeps as [W_all; V_all]."""

    @property
    def counts(self) -> tuple[int, ...]:
        """The size of each stacked dim (layers, experts): the largest index saved, plus one."""
        return tuple(1 + max(index[d] for index in self.parts) for d in range(self.lead))


def plan_from_fsdp_dtensor(ckpt: Checkpoint, world_size: int) -> tuple[DcpOutput, dict[str, SourceTensor]]:
    """The torch_dist checkpoint (laid out in FSDP2 rows over `world_size` rank files) and the source
    views its pieces read."""
    with ItemReader(ckpt) as reader:  # every small item and step the plan decodes, each file opened once
        return _planned(ckpt, world_size, reader)


def _planned(ckpt: Checkpoint, world_size: int, reader: ItemReader) -> tuple[DcpOutput, dict[str, SourceTensor]]:
    args = _args(ckpt, reader)
    names = _model_names(ckpt)
    pp = getattr(args, "pipeline_model_parallel_size", 1)
    if pp != 1:  # Megatron-FSDP's names of a stage's layers are not known
        raise CheckpointError(ckpt.path, f"args.pipeline_model_parallel_size is {pp!r}: pipeline stages' layers are "
                                         "not converted to torch_dist yet")
    hybrid = HYBRID_FINAL_NORM in names
    spec = LayerNames((), UNSUPPORTED) if hybrid else layer_names(ckpt, args)
    for part, what in spec.unsupported:
        found = next((n for n in names if part in n and not (hybrid and MAMBA_MIXER.match(n) or GDN.match(n))),
                     None)
        if found is not None:
            raise CheckpointError(ckpt.path, f"{names[found]}: {_unsupported(found, part, what)} are not converted to "
                                             "torch_dist yet")
    keys = _torch_dist_keys(ckpt, names, spec, stack=not hybrid)
    _tp_blocked_fc1(ckpt, args, keys, names)
    _split_fused(ckpt, args, keys, names)
    params = {n: fqn for n, fqn in names.items() if not n.endswith(BUFFERS)}  # a buffer has no optimizer state
    states, steps = _optimizer_states(ckpt, params)
    model_dtype = bfloat16 if getattr(args, "bf16", False) is True else float16 if getattr(args, "fp16", False) is True \
        else None
    views: dict[str, SourceTensor] = {}
    targets: list[TargetTensor] = []
    placements: dict[str, list[Placed]] = {}
    for key in keys.values():
        buffer = key.key.endswith(BUFFERS)  # kept in its own dtype (fp32: the router's expert bias)
        made = _targets(ckpt, key, key.key, names, views, None if buffer else model_dtype)
        if states and not buffer:
            made += _targets(ckpt, key, f"optimizer.state.param.{key.key}", names, views, None)
            for state in ("exp_avg", "exp_avg_sq"):
                made += _targets(ckpt, key, f"optimizer.state.{state}.{key.key}", states[state], views, None)
        for target in made:
            placements[target.fqn] = _per_layer(target.shape, world_size) if key.layers else \
                fsdp2(target.shape, world_size)
        targets += made
    out = place_dcp_records(targets, placements, views, [], None)
    common = _common_state(ckpt, reader, args, _param_groups(ckpt, reader, params, steps) if states else None)
    try:
        out.extra_files = {COMMON: encode_value(common), "metadata.json": json.dumps(TORCH_DIST_MARKER).encode()}
    except UnsafePickleError as exc:
        raise CheckpointError(ckpt.path, f"the common state cannot be written ({exc})") from None
    return out, views


def _unsupported(name: str, part: str, what: str) -> str:
    """What a module name refused for holding `part` is, said precisely."""
    if part not in ("in_proj", "mixer.", "conv1d"):
        return what
    if ".mixer." in name:
        return f"Mamba mixers outside megatron-core's hybrid stack (no {HYBRID_FINAL_NORM})"
    return what


@dataclass(frozen=True)
class ToTorchDist:
    """A Megatron-FSDP fsdp_dtensor checkpoint written as megatron-core's torch_dist, in whole-row
    chunks over `world_size` files: megatron-core reshards it itself when it loads at any TP × DP."""

    world_size: int

    @classmethod
    def from_options(cls, ckpt: Checkpoint, opts: ReshardChoices) -> ToTorchDist:
        if (opts.tp, opts.dp, opts.source_tp, opts.hf_config, opts.dtype) != (None,) * 5 or opts.include \
                or opts.exclude or opts.split_fused or opts.fuse or opts.flat_optimizer:
            raise UsageError("--layout torch-dist writes the whole checkpoint as megatron-core's torch_dist, which "
                             "megatron-core loads at any TP and DP: pass at most --world-size (the number of files)")
        if opts.world_size is not None and opts.world_size < 1:
            raise UsageError(f"--world-size must be at least 1 (got {opts.world_size})")
        return cls(opts.world_size or 1)

    def plan(self, ckpt: Checkpoint) -> PlannedReshard:
        output, views = plan_from_fsdp_dtensor(ckpt, self.world_size)
        return PlannedReshard(output, self.world_size, views)


# --------------------------------------------------------------------------------------
# What the source holds
# --------------------------------------------------------------------------------------


def _args(ckpt: Checkpoint, reader: ItemReader) -> argparse.Namespace:
    if "args" not in ckpt.bytes_entries:
        raise CheckpointError(ckpt.path, "no Megatron args item: not a Megatron-FSDP fsdp_dtensor checkpoint (the "
                                         "model spec and dtype are unknown)")
    try:
        args = decoded_item(ckpt, "args", reader)
    except UnsafePickleError as exc:
        raise CheckpointError(ckpt.path, f"args: cannot decode it without running code ({exc})") from None
    if not isinstance(args, argparse.Namespace):
        raise CheckpointError(ckpt.path, f"args: a {type(args).__name__}, not an argparse.Namespace")
    return args


def _model_names(ckpt: Checkpoint) -> dict[str, str]:
    """Module name → source FQN of every model tensor; every other entry is claimed or refused here."""
    names: dict[str, str] = {}
    unknown = []
    for fqn in ckpt.tensors:
        match = MODEL_PREFIX.match(fqn)
        if match:
            names[fqn[match.end():]] = fqn
        elif not (STATE_PREFIX.match(fqn) or fqn.startswith(DROPPED_ROOTS)):
            unknown.append(fqn)
    for fqn in ckpt.bytes_entries:
        if not (fqn in COMMON_ITEMS or fqn.startswith((SCHEDULER, *DROPPED_ROOTS)) or GROUP_META.match(fqn)
                or "_extra_state" in fqn):
            unknown.append(fqn)
    if unknown:
        raise CheckpointError(ckpt.path, f"{len(unknown)} entries of no known fsdp_dtensor kind, e.g. {unknown[0]!r}: "
                                         "not converted (nothing is dropped unnamed)")
    if not any(n.startswith("decoder.layers.") for n in names):
        raise CheckpointError(ckpt.path, "no model.module.decoder.layers.<i>.… tensors: not a Megatron-FSDP "
                                         "fsdp_dtensor checkpoint")
    return names


def _torch_dist_keys(ckpt: Checkpoint, names: dict[str, str], spec: LayerNames, stack: bool = True) -> dict[str, _Key]:
    """Every torch_dist key and the module-named params it is built from (all of them, each once);
    without `stack` (megatron-core's hybrid stack), keyed per layer whatever the layers hold."""
    per_layer: dict[str, dict[int, set[str]]] = defaultdict(lambda: defaultdict(set))
    parsed = {}
    gdn = {name[:-len("self_attention.in_proj.weight")] for name in names if GDN.match(name)
           and name.endswith(".in_proj.weight")} if spec.renames else set()
    for name in names:
        layer, rest = None, name
        match = LAYER.match(name)
        if match:
            layer, rest = (match["ns"], int(match["index"])), match["rest"]
            if name[:len(name) - len(rest)] in gdn and rest.startswith(GDN_NORM[0]):
                rest = GDN_NORM[1] + rest[len(GDN_NORM[0]):]
            else:
                rest = spec.to_key(rest)
            rest = canonical(rest)  # 0.19's `mixer.conv1d_weight` is keyed `mixer.conv1d.weight`
        part = None
        swiglu = SWIGLU_PART.match(rest)
        if swiglu:
            rest, part = swiglu["base"], swiglu["part"]
        expert = None
        for pattern in (GROUPED_EXPERT, LOCAL_EXPERT):
            found = pattern.match(rest)
            if found:
                rest, expert = f"{found['head']}.experts.{found['param']}", int(found["index"])
                break
        parsed[name] = (layer, rest, expert, part)
        if layer is not None:
            per_layer[layer[0]][layer[1]].add(rest)
    stacked = {ns for ns, layers in per_layer.items()
               if stack and sorted(layers) == list(range(len(layers))) and all(s == layers[0] for s in layers.values())}
    keys: dict[str, _Key] = {}
    for name, (layer, rest, expert, part) in parsed.items():
        index: tuple[int, ...] = ()
        if layer is None:
            key = rest
        elif layer[0] in stacked:
            key, index = f"{layer[0]}.{rest}", (layer[1],)
        else:
            key = f"{layer[0]}.{layer[1]}.{rest}"
        if expert is not None:
            index += (expert,)
        entry = keys.setdefault(key, _Key(key, len(index), layer is not None and layer[0] in stacked))
        if entry.lead != len(index):
            raise CheckpointError(ckpt.path, f"{name}: torch_dist key {key} is built from params of different "
                                             "stacking (per expert and not)")
        slot = entry.parts.setdefault(index, {})
        if part in slot or (part is None and slot) or (part is not None and None in slot):
            raise CheckpointError(ckpt.path, f"{name}: torch_dist key {key} gets it twice, or fused and split")
        slot[part] = name
    for key in keys.values():
        _check_complete(ckpt, key, names)
    return keys


def _tp_blocked_fc1(ckpt: Checkpoint, args: argparse.Namespace, keys: dict[str, _Key], names: dict[str, str]) -> None:
    """A SwiGLU fc1 saved fused is TP-blocked ([W_0; V_0; W_1; V_1; …]), torch_dist's is [W_all; V_all]:
    the same only at TP 1. A Megatron-Bridge adapter's linear_out on it, which Megatron-LM never splits
    (`handle_swiglu_in_state_dict` splits fc1's own weight only), is marked to be unblocked at the
    run's TP (`_Key.swiglu_blocked`); fc1's own weight saved fused is refused."""
    if getattr(args, "swiglu", False) is not True or _blocked_tp(ckpt, args) == 1:
        return
    tp = getattr(args, "tensor_model_parallel_size", None)
    for key in keys.values():
        slot = next(iter(key.parts.values()))
        if None in slot and re.search(r"\blinear_fc1\.adapter\.linear_out\.(weight|bias)$", key.key):
            tp = _tp(ckpt, args)
            shape = ckpt.tensors[names[slot[None]]].shape
            if not shape or shape[0] % (2 * tp):
                raise CheckpointError(ckpt.path, f"{names[slot[None]]}: {shape[0] if shape else 0} rows are no W and "
                                                 f"V halves of {tp} TP blocks")
            key.swiglu_blocked, key.tp = True, tp
        if None in slot and re.search(r"\blinear_fc1\.(weight|bias)$", key.key):
            raise CheckpointError(ckpt.path, f"{names[slot[None]]}: a SwiGLU fc1 saved fused at TP {tp} is "
                                             "TP-blocked; split it first (ckptctl reshard --layout megatron-fsdp "
                                             "--split-fused), then convert")


def _blocked_tp(ckpt: Checkpoint, args: argparse.Namespace) -> Any:
    """args' TP, which fused tensors are blocked at, unless the RowParallel chunks show another (a TP
    split seen on disk is the save's own; one column, as any FSDP2 rows show, proves nothing)."""
    tp = getattr(args, "tensor_model_parallel_size", None)
    seen = tp_from_geometry(ckpt)
    if seen not in (None, 1, tp):
        raise CheckpointError(ckpt.path, f"args say TP {tp!r:.32} but RowParallel chunks show TP {seen}: the TP "
                                         "blocks of its fused tensors are unknown")
    return tp


def _tp(ckpt: Checkpoint, args: argparse.Namespace) -> int:
    """The TP the fused in_proj and conv are blocked at (`_blocked_tp`)."""
    tp = _blocked_tp(ckpt, args)
    if type(tp) is not int or tp < 1:
        raise CheckpointError(ckpt.path, f"args.tensor_model_parallel_size is {tp!r:.32}: the TP blocks of the fused "
                                         "in_proj and conv are unknown")
    return tp


def _split_fused(ckpt: Checkpoint, args: argparse.Namespace, keys: dict[str, _Key], names: dict[str, str]) -> None:
    """Mark each Mamba or GDN `in_proj` and conv param (saved fused, TP-blocked at the run's TP: rank t
    holds `[z_t; x_t; B_t; C_t; dt_t]`, `[x_t; B_t; C_t]`; GDN `[q_t; k_t; v_t; z_t; β_t; α_t]`,
    `[q_t; k_t; v_t]`) with the parts torch_dist keeps, sized from the layer's own shapes (`_sizes`)."""
    sized: dict[str, dict[str, tuple[tuple[str, int], ...]]] = {}
    for key in keys.values():
        if FUSED_SAVED_PART.match(key.key):
            raise CheckpointError(ckpt.path, f"{names[next(iter(key.parts.values()))[None]]}: a Mamba or GDN in_proj "
                                             "or conv saved in parts is not converted to torch_dist yet (only fused, "
                                             "as Megatron-FSDP saves it)")
        match = FUSED_SPLIT.match(key.key)
        if match is None:
            continue
        if key.lead:
            raise CheckpointError(ckpt.path, f"{names[next(iter(key.parts.values()))[None]]}: a layer stack of fused "
                                             "GDN params (every layer GDN) is not converted to torch_dist yet")
        module, tp = match["layer"] + match["module"], _tp(ckpt, args)
        if module not in sized:
            sized[module] = _sizes(ckpt, args, keys, names, module, tp)
        parts = sized[module][match["param"]]
        shape = ckpt.tensors[names[key.parts[()][None]]].shape
        if not shape or shape[0] != sum(r for _, r in parts) * tp:
            raise CheckpointError(ckpt.path, f"{names[key.parts[()][None]]}: {shape[0] if shape else 0} rows, the "
                                             f"layer's conv says {sum(r for _, r in parts) * tp}")
        key.split, key.tp = parts, tp


def _sizes(ckpt: Checkpoint, args: argparse.Namespace, keys: dict[str, _Key], names: dict[str, str], module: str,
           tp: int) -> dict[str, tuple[tuple[str, int], ...]]:
    """Each fused param of Mamba mixer or GDN `module` → (part, rows per TP rank). Mamba's `in_proj`
    has 2·inner + 2·G·N + H rows, its conv inner + 2·G·N, `A_log` H; GDN's `in_proj` 2·qk + 2·v +
    2·nv, its conv 2·qk + v, `A_log` nv. `out_proj` (inner or v columns), Mamba's `norm` (inner)
    and args' `mamba_*` sizes, where given, must agree (`rows.mixer_part_rows`: the one geometry
    the fsdp_dtensor conversion fuses the parts back with)."""

    def dims(name: str) -> tuple[int, ...] | None:
        found = keys.get(f"{module}.{name}")
        return None if found is None or found.lead else ckpt.tensors[names[found.parts[()][None]]].shape

    shapes = [dims(p) for p in ("in_proj.weight", "conv1d.weight", "A_log")]
    if any(not s for s in shapes):
        raise CheckpointError(ckpt.path, f"{module}: needs in_proj.weight, a conv1d weight and A_log to size the parts "
                                         "of its in_proj and conv")
    proj, conv, heads = (s[0] for s in shapes)
    mamba = module.endswith(".mixer")
    checks = [("out_proj.weight", 1), ("norm.weight", 0)] if mamba else [("out_proj.weight", 1)]
    parts = mixer_part_rows(mamba, proj, conv, heads, [None if (s := dims(name)) is None else s[d] if len(s) > d
                                                       else -1 for name, d in checks], args, tp)
    if parts is None:
        what = "Mamba [z, x, B, C, dt]" if mamba else "GDN [q, k, v, z, beta, alpha]"
        raise CheckpointError(ckpt.path, f"{names[keys[module + '.in_proj.weight'].parts[()][None]]}: {proj} rows "
                                         f"beside a conv of {conv} and {heads} heads are no {what} at TP {tp} (nor "
                                         "agree with the out_proj, norm and args)")
    return parts


def _check_complete(ckpt: Checkpoint, key: _Key, names: dict[str, str]) -> None:
    """A stack holds every index from 0 (layers, experts), each with the same params of the same shape."""
    counts = key.counts
    expected = math.prod(counts)
    if len(key.parts) != expected:
        raise CheckpointError(ckpt.path, f"torch_dist key {key.key}: {len(key.parts)} of the {expected} "
                                         f"{' × '.join(map(str, counts))} stacked params are saved")
    shapes = {tuple((p, ckpt.tensors[names[n]].shape) for p, n in sorted(slot.items(), key=lambda kv: str(kv[0])))
              for slot in key.parts.values()}
    if len(shapes) != 1:
        raise CheckpointError(ckpt.path, f"torch_dist key {key.key}: its stacked params differ in shape")
    (parts,) = shapes
    if [p for p, _ in parts] not in ([None], ["v", "w"]) or len({s for _, s in parts}) != 1:
        raise CheckpointError(ckpt.path, f"torch_dist key {key.key}: a SwiGLU fc1 needs both weight_w and weight_v "
                                         "of one shape")


def _optimizer_states(ckpt: Checkpoint, names: dict[str, str]) -> tuple[dict[str, dict[str, str]], dict[str, str]]:
    """Adam's moments by state, then module name → source FQN; and each param's `step` FQN. Either
    every param of `names` (the model's, buffers aside) has both moments or none has (a model-only
    checkpoint)."""
    states: dict[str, dict[str, str]] = {"exp_avg": {}, "exp_avg_sq": {}}
    steps: dict[str, str] = {}
    for fqn in ckpt.tensors:
        match = STATE_PREFIX.match(fqn)
        if not match:
            continue
        name, state = match["name"], match["state"]
        if name not in names:
            raise CheckpointError(ckpt.path, f"{fqn}: optimizer state of {name}, which is not a param of the model")
        entry = ckpt.tensors[fqn]
        if state == "step":
            steps[name] = fqn
        elif entry.shape != ckpt.tensors[names[name]].shape:
            raise CheckpointError(ckpt.path, f"{fqn}: shape {list(entry.shape)}, its param's is "
                                             f"{list(ckpt.tensors[names[name]].shape)} (flat CPU-offloaded optimizer "
                                             "states are not converted to torch_dist yet)")
        else:
            states[state][name] = fqn
    if not any(states.values()):
        return {}, {}
    for state, found in states.items():
        missing = [n for n in names if n not in found]
        if missing:
            raise CheckpointError(ckpt.path, f"{names[missing[0]]} has no {state} ({len(missing)} params lack it): a "
                                             "fully_reshardable optimizer needs the state of every param")
    return states, steps


# --------------------------------------------------------------------------------------
# The output
# --------------------------------------------------------------------------------------


def _target(ckpt: Checkpoint, key: _Key, fqn: str, sources: dict[str, str], views: dict[str, SourceTensor],
            dtype: DType | None) -> TargetTensor:
    """Output `fqn` of `key`'s shape, each stacked slab (and SwiGLU half) read from its source."""
    first_slot = next(iter(key.parts.values()))
    first = ckpt.tensors[sources[next(iter(first_slot.values()))]]
    part = first.shape  # every stacked param (and SwiGLU half) has it: `_check_complete`
    halves = len(first_slot)
    shape = (*key.counts, *((part[0] * halves, *part[1:]) if part else part))
    pieces = []
    for index, slot in sorted(key.parts.items()):
        for half, name in enumerate(slot[p] for p in (("w", "v") if "w" in slot else (None,))):
            src = sources[name]
            view = source_view(ckpt.tensors[src])
            for _ in range(key.lead):
                view = unsqueezed_view(view)
            views[src] = view
            at = (*index, half * part[0], *(0,) * (len(part) - 1)) if part else index
            pieces.append(Piece(src, (0,) * len(view.shape), at, (*(1,) * key.lead, *part)))
    return TargetTensor(fqn, shape, dtype or first.dtype, tuple(pieces), first.properties)


def _targets(ckpt: Checkpoint, key: _Key, fqn: str, sources: dict[str, str], views: dict[str, SourceTensor],
             dtype: DType | None) -> list[TargetTensor]:
    """`_target`, or for a key torch_dist keeps in parts (`_Key.split`) each part `<fqn>.<part>`:
    its rows of every TP rank's block, in rank order (what megatron-core's `_split_tensor_factory`
    saves: each part TP-sharded on its own)."""
    whole = _target(ckpt, key, fqn, sources, views, dtype)
    if key.swiglu_blocked:
        return [_unblocked(whole, key.lead, key.tp)]
    if not key.split:
        return [whole]
    lead, stride, at, out = key.lead, sum(rows for _, rows in key.split), 0, []
    for part, rows in key.split:
        pieces = tuple(Piece(p.src, (*p.src_start[:lead], t * stride + at, *p.src_start[lead + 1:]),
                             (*p.dst_start[:lead], t * rows, *p.dst_start[lead + 1:]),
                             (*p.sizes[:lead], rows, *p.sizes[lead + 1:]))
                       for p in whole.pieces for t in range(key.tp))
        out.append(TargetTensor(f"{fqn}.{part}", (*whole.shape[:lead], rows * key.tp, *whole.shape[lead + 1:]),
                                whole.dtype, pieces, whole.properties))
        at += rows
    return out


def _unblocked(whole: TargetTensor, lead: int, tp: int) -> TargetTensor:
    """`whole` read as TP blocks of W and V halves ([W_0; V_0; W_1; V_1 …]) and written [W_all; V_all]."""
    rows = whole.shape[lead] // (2 * tp)
    pieces = tuple(Piece(p.src, (*p.src_start[:lead], p.src_start[lead] + (2 * t + half) * rows, *p.src_start[lead + 1:]),
                         (*p.dst_start[:lead], p.dst_start[lead] + (half * tp + t) * rows, *p.dst_start[lead + 1:]),
                         (*p.sizes[:lead], rows, *p.sizes[lead + 1:]))
                   for p in whole.pieces for t in range(tp) for half in range(2))
    return replace(whole, pieces=pieces)


def _per_layer(shape: tuple[int, ...], world_size: int) -> list[Placed]:
    """A layer stack chunked as megatron-core saves one: a chunk per layer (here in rank files round
    robin)."""
    return [Placed(layer % world_size, Box((layer, *(0,) * (len(shape) - 1)), (1, *shape[1:])))
            for layer in range(shape[0])]


def _param_groups(ckpt: Checkpoint, reader: ItemReader, names: dict[str, str], steps: dict[str, str]) -> list[dict]:
    """The optimizer's param groups as megatron-core's `fully_reshardable` state keeps them: each
    distinct group setting saved per param (`param_to_group_meta`) once, in first-seen order, with
    Adam's step (saved per param by torch's Adam: one value for all, as megatron-core requires)."""
    meta: dict[str, dict[str, Any]] = defaultdict(dict)
    for fqn in ckpt.bytes_entries:
        match = GROUP_META.match(fqn)
        if match:
            try:
                meta[match["name"]][match["attr"]] = decoded_item(ckpt, fqn, reader)
            except UnsafePickleError as exc:
                raise CheckpointError(ckpt.path, f"{fqn}: cannot decode it without running code ({exc})") from None
    fused = {SWIGLU_PART.sub(r"\g<base>", n) for n in names}  # the group settings keep fc1's fused name
    missing, unknown = sorted(fused - set(meta)), sorted(set(meta) - fused)
    if unknown:
        raise CheckpointError(ckpt.path, f"optimizer.param_to_group_meta has settings for {unknown[0]}, which the "
                                         "model does not have")
    if missing:
        raise CheckpointError(ckpt.path, f"optimizer.param_to_group_meta has no settings for {missing[0]} "
                                         f"({len(missing)} params lack them)")
    groups: list[dict[str, Any]] = []
    for name in sorted(fused):
        if meta[name] not in groups:
            groups.append(meta[name])
    step = _step(ckpt, reader, steps)
    return [{**g, "step": step} if step is not None and "step" not in g else dict(g) for g in groups]


_SCALARS = {"float32": "<f", "float64": "<d", "int64": "<q", "int32": "<i"}


def _step(ckpt: Checkpoint, reader: ItemReader, steps: dict[str, str]) -> float | None:
    """The one Adam step of every param (torch's Adam keeps a 0-d tensor each), read torch-free."""
    values = set()
    for fqn in steps.values():
        entry = ckpt.tensors[fqn]
        fmt = _SCALARS.get(entry.dtype.name)
        if entry.shape != () or fmt is None or len(entry.chunks) != 1:
            raise CheckpointError(ckpt.path, f"{fqn}: a step should be one 0-d number, not {list(entry.shape)} "
                                             f"{entry.dtype.name}")
        record = reader.locate(entry, entry.chunks[0])
        if record is None:
            raise CheckpointError(ckpt.path, f"{fqn}: its item is not a plain torch.save record")
        raw = reader.read_item_bytes(entry.chunks[0].file, record.byte_offset, record.nbytes, ())
        values.add(float(struct.unpack(fmt, raw)[0]))
    if len(values) > 1:
        raise CheckpointError(ckpt.path, f"params saved different Adam steps ({sorted(values)[:4]}): megatron-core "
                                         "keeps one step for the whole optimizer")
    return values.pop() if values else None


def _common_state(ckpt: Checkpoint, reader: ItemReader, args: argparse.Namespace,
                  param_groups: list | None) -> dict[str, Any]:
    """The common state megatron-core's `dist_checkpointing.load` reads (what Megatron-LM saves beside
    a `fully_reshardable` optimizer): the source's args, counters and scheduler, the param groups."""
    common: dict[str, Any] = {"args": args}
    for fqn in ckpt.bytes_entries:
        if fqn in COMMON_ITEMS[1:] or fqn.startswith(SCHEDULER):
            try:
                value = decoded_item(ckpt, fqn, reader)
            except UnsafePickleError as exc:
                raise CheckpointError(ckpt.path, f"{fqn}: cannot decode it without running code ({exc})") from None
            node = common
            *path, last = fqn.split(".")
            for part in path:
                node = node.setdefault(part, {})
            node[last] = value
    common.setdefault("checkpoint_version", 3.0)
    common["content_metadata"] = dict(CONTENT_METADATA)
    if param_groups is not None:
        common["optimizer"] = {"optimizer": {"param_groups": param_groups},
                               "param_state_sharding_type": "fully_reshardable"}
    return common
