"""Megatron's `args`: the training settings saved beside a Megatron checkpoint.

An `argparse.Namespace`, pickled by `torch.save`: in a DCP bytes entry `args` (Megatron-FSDP),
in `common.pt` (torch_dist up to megatron-core 0.16) or in the bytes item
`common_state/shard_0_1` (torch_dist from 0.19). `checkpoint_args` reads the first with torch's
restricted loader (for the TP size and model dims); `training_args` reads any of them without
torch and without running anything: values of classes it does not know (enum members such as
0.19's `AttnBackend`) become inert `Opaque` names.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from ckptctl.errors import CheckpointError
from ckptctl.formats.dcp_items import ItemReader
from ckptctl.formats.dcp_metadata import read_small
from ckptctl.formats.torch_save_out import decode_value
from ckptctl.formats.unpickle import UnsafePickleError
from ckptctl.model import Checkpoint

COMMON = "common.pt"
COMMON_STATE = "common_state/shard_0_1"
COMMON_LIMIT = 64 << 20
"""The largest `common.pt` read (args, param groups, iteration: kilobytes in practice)."""


def checkpoint_args(ckpt: Checkpoint) -> argparse.Namespace | None:
    """The `args` entry Megatron saves (an argparse.Namespace), read with a restricted unpickler."""
    entry = ckpt.bytes_entries.get("args")
    if entry is None:
        return None
    with ItemReader(ckpt) as reader:
        value = reader.load_bytes_value(entry, safe_globals=[argparse.Namespace])
    return value if isinstance(value, argparse.Namespace) else None


@dataclass(frozen=True)
class Opaque:
    """A value of a class no allow-list knows, kept as its name and arguments (never built)."""

    name: str
    args: tuple

    def __repr__(self) -> str:
        return f"{self.name}{self.args!r}"


@dataclass(frozen=True)
class TrainingArgs:
    """Megatron's args as saved (`args`), where they were found, or why they could not be read."""

    where: str
    args: argparse.Namespace | None
    problem: str | None = None

    def get(self, name: str) -> Any:
        return getattr(self.args, name, None) if self.args is not None else None


def training_args(ckpt: Checkpoint) -> TrainingArgs | None:
    """The training args of a Megatron checkpoint, from wherever its format keeps them; None when
    it has none (megatron-core saved without Megatron-LM). Reads without torch: `inspect` shows them."""
    try:
        if "args" in ckpt.bytes_entries:
            return _found("args entry", _decoded(ckpt, "args"), lambda v: v)
        if (ckpt.path / COMMON).is_file():
            return _found(COMMON, decode_value(common_bytes(ckpt), opaque=Opaque), lambda v: v.get("args"))
        if COMMON_STATE in ckpt.bytes_entries:
            return _found(COMMON_STATE, _decoded(ckpt, COMMON_STATE),
                          lambda v: v[0].get("args") if isinstance(v, list) and v and isinstance(v[0], dict) else None)
    except UnsafePickleError as exc:
        where = "args entry" if "args" in ckpt.bytes_entries else COMMON if (ckpt.path / COMMON).is_file() else COMMON_STATE
        return TrainingArgs(where, None, f"not decoded without running code ({exc})")
    return None


def common_bytes(ckpt: Checkpoint, name: str = COMMON) -> bytes:
    """A small file beside the DCP ones (`common.pt`, `metadata.json`): a regular file, bounded."""
    path = ckpt.path / name
    data = read_small(path, COMMON_LIMIT + 1)
    if len(data) > COMMON_LIMIT:
        raise CheckpointError(path, f"over the {COMMON_LIMIT >> 20} MiB read for it")
    return data


def _decoded(ckpt: Checkpoint, fqn: str) -> Any:
    entry = ckpt.bytes_entries[fqn]
    with ItemReader(ckpt) as reader:
        return decode_value(reader.read_item_bytes(entry.file, entry.offset, entry.length, entry.transforms),
                            opaque=Opaque)


def _found(where: str, value: Any, pick) -> TrainingArgs | None:
    try:
        args = pick(value)
    except AttributeError:  # not a dict: no args in it
        args = None
    if args is None:
        return None
    if not isinstance(args, argparse.Namespace):
        return TrainingArgs(where, None, f"`args` is a {type(args).__name__}, not an argparse.Namespace")
    return TrainingArgs(where, args)

