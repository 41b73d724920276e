"""`export-hf --base HF_FOLDER`: a Megatron-Bridge LoRA save joined to the Hugging Face model its run started from.

A Bridge LoRA save holds the adapters alone; most users hold the pretrained model as the HF folder
Bridge imported it from, not as a torch_dist checkpoint. The family's rules say which rows of which
HF tensor each Megatron weight's rows are (they map Megatron → HF; each piece read backwards, the
HF tensors' rows are the Megatron weight's, fused ones included: linear_qkv's query groups,
linear_fc1's [gate; up]). So the save is seen with each Megatron weight its rules shape for the
config (`shaped_base`) made of chunks that are rows of the folder's safetensors tensors (dense
bytes: `Checkpoint.dense_files`); the export then merges as with a torch_dist base. Closed world:
every tensor the rules make must be in the folder with the config's shape, and every tensor of the
folder must be one the rules make; a rule that does not copy whole rows (a transpose, an offset) is
refused by name.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

from ckptctl.commands.bridge_merge import adapters_alone, shaped_base
from ckptctl.core.checkpoint import Checkpoint, Chunk, TensorEntry
from ckptctl.core.dtypes import float32
from ckptctl.families.base import ExportContext, HFConfig, MegatronModel
from ckptctl.families.bridge_adapters import refuse_bridge_dora
from ckptctl.families.protocol import ModelFamily
from ckptctl.formats.dcp.metadata import TORCH_DIST
from ckptctl.formats.safetensors.hf_sharded import safetensors_files
from ckptctl.formats.safetensors.reader import open_safetensors_folder
from ckptctl.storage.store import store_for
from ckptctl.util.errors import CheckpointError, UsageError
from ckptctl.util.wording import counted


def is_hf_folder(path: Path) -> bool:
    """Whether `path` is a Hugging Face model folder (config.json and safetensors files), not a DCP checkpoint."""
    store = store_for(path)
    return store.exists(path / "config.json") and not store.exists(path / ".metadata") \
        and bool(safetensors_files(path))


def with_hf_base(ckpt: Checkpoint, hf_path: Path, cfg: HFConfig, family: ModelFamily, prefix: str) -> Checkpoint:
    """`ckpt` (a Bridge LoRA save: adapters alone) with the Megatron weights `family`'s rules make of
    the HF folder `hf_path` for `cfg`, each a TensorEntry whose chunks are rows of the folder's tensors."""
    if ckpt.megatron_backend != TORCH_DIST:
        raise UsageError(f"{ckpt.path}: not a Megatron torch_dist checkpoint: an HF --base is joined to a torch_dist "
                         "Megatron-Bridge LoRA save (a Megatron-FSDP one's fused adapters are TP-blocked at its run's "
                         "TP), not yet to others")
    model = MegatronModel(ckpt, prefix)
    refuse_bridge_dora([*model.entries, *model.layer_views], ckpt.path, prefix)
    if not adapters_alone(model):
        raise UsageError(f"{ckpt.path}: holds model weights beside its Megatron-Bridge LoRA adapters: an HF --base "
                         "is for a Bridge LoRA save, which holds the adapters alone")
    hf = open_safetensors_folder(hf_path)
    shaped = shaped_base(ckpt, cfg, family, prefix, hf.tensors.keys())
    tensors = family.to_hf(ExportContext(cfg, MegatronModel(shaped, prefix), 1, 1))
    rows: dict[str, list[Chunk]] = {}
    dtypes: dict[str, set] = {}
    for name, tensor in sorted(tensors.items()):
        target = tensor.target(float32)
        entry = hf.tensors.get(name)
        if entry is None:
            raise CheckpointError(hf_path, f"has no {name}, which a {family.name} model of {cfg.path} has (is --base "
                                           "the run's pretrained model?)")
        if entry.shape != target.shape or not entry.shape:
            raise CheckpointError(hf_path, f"{name}: shape {list(entry.shape)}, a {family.name} model of {cfg.path} "
                                           f"has {list(target.shape)} (is --hf-config the base's config?)")
        if target.add or target.logical_shape is not None:
            raise CheckpointError(hf_path, f"{name}: {family.name}'s rule computes it from its Megatron weight, "
                                           "which an HF --base is not mapped back through yet")
        for piece in target.pieces:
            whole_rows = piece.axes is None and not any(piece.src_start[1:]) and not any(piece.dst_start[1:]) \
                and piece.sizes[1:] == entry.shape[1:] and shaped.tensors[piece.src].shape[1:] == entry.shape[1:]
            if not whole_rows:
                raise CheckpointError(hf_path, f"{name}: {family.name}'s rule takes it from {piece.src} otherwise "
                                               "than whole rows, which an HF --base is not mapped back through yet")
            rows.setdefault(piece.src, []).extend(
                _rows(hf, entry, piece.dst_start[0], piece.sizes[0], piece.src_start[0]))
            dtypes.setdefault(piece.src, set()).add(entry.dtype)
    stray = sorted(set(hf.tensors) - set(tensors))
    if stray:
        more = f" (+{counted(len(stray) - 1, 'more')})" if len(stray) > 1 else ""
        raise CheckpointError(hf_path, f"{stray[0]}{more}: a tensor a {family.name} model of {cfg.path} has no "
                                       "place for (is --hf-config the base's config?)")
    joined = dict(ckpt.tensors)
    for fqn, chunks in rows.items():
        if len(dtypes[fqn]) > 1:
            raise CheckpointError(hf_path, f"the tensors {fqn} is made of differ in dtype")
        shape = shaped.tensors[fqn].shape
        joined[fqn] = TensorEntry(fqn, shape, dtypes[fqn].pop(), tuple(chunks))
    files = {str(hf.path / name): size for name, size in hf.files.items()}
    return replace(ckpt, tensors=joined, files={**ckpt.files, **files}, dense_files=frozenset(files), derived={})


def _rows(hf: Checkpoint, entry: TensorEntry, first: int, count: int, at: int) -> list[Chunk]:
    """Rows `first`… (`count` of them) of the folder's tensor `entry`, as chunks placed at row `at` on."""
    row_bytes = entry.itemsize * math.prod(entry.shape[1:])
    out = []
    for chunk in entry.chunks:
        lo, hi = max(first, chunk.offsets[0]), min(first + count, chunk.offsets[0] + chunk.sizes[0])
        if lo < hi:
            out.append(Chunk(str(hf.path / chunk.file), chunk.offset + (lo - chunk.offsets[0]) * row_bytes,
                             (hi - lo) * row_bytes, (at + lo - first, *(0 for _ in entry.shape[1:])),
                             (hi - lo, *entry.shape[1:])))
    return out
