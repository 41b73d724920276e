"""Megatron's `args`: the training settings saved beside a Megatron checkpoint.

An `argparse.Namespace`, pickled by `torch.save`: in a DCP bytes entry `args` (Megatron-FSDP),
in `common.pt` (torch_dist up to megatron-core 0.18) or in the bytes item
`common_state/shard_0_1` (torch_dist from 0.19). `checkpoint_args` reads the first (for the TP
size and model dims), `training_args` any of them, without torch and without running anything:
values of classes they do not know (enum members such as Megatron-LM's `AttnBackend`) become
inert `Opaque` names. `common_state` reads a torch_dist common
state the same way, and writes it back (`CommonState.encoded`) without torch, opaque values as
the same calls.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from ckptctl.util.errors import CheckpointError
from ckptctl.formats.dcp.items import ItemReader
from ckptctl.formats.dcp.metadata import read_small
from ckptctl.formats.pickle.torch_pickle import Call, Global, ref
from ckptctl.formats.torch_save.writer import CorruptValueError, decode_value, encode_value
from ckptctl.formats.pickle.unpickle import STORAGE, UnsafePickleError
from ckptctl.core.checkpoint import Checkpoint
from ckptctl.storage.store import EntryKind, store_for

COMMON = "common.pt"
COMMON_STATE = "common_state/shard_0_1"
COMMON_LIMIT = 64 << 20
"""The largest `common.pt` read (args, param groups, iteration: kilobytes in practice)."""


def checkpoint_args(ckpt: Checkpoint) -> argparse.Namespace | None:
    """The `args` entry Megatron-FSDP saves (an argparse.Namespace), decoded without torch: values
    of classes no allow-list knows (Megatron-LM's enum members, `attention_backend`) stay inert
    `Opaque` names, and `encode_value` writes them back as they were."""
    if "args" not in ckpt.bytes_entries:
        return None
    try:
        value = decoded_item(ckpt, "args")
    except UnsafePickleError as exc:
        raise CheckpointError(ckpt.path, f"args: cannot decode it without running code ({exc})") from None
    return value if isinstance(value, argparse.Namespace) else None


def context_parallel(ckpt: Checkpoint) -> int:
    """The saved run's CP size (Megatron-FSDP's args), 1 where args do not say."""
    cp = getattr(checkpoint_args(ckpt), "context_parallel_size", None)
    return cp if type(cp) is int and cp > 0 else 1


@dataclass(frozen=True)
class Opaque:
    """A value of a class no allow-list knows, kept as its global's name and arguments (never
    built; None: the global itself, named as a value); `encode_value` pickles it again as that call
    (or reference). A tensor (its storage) cannot be."""

    module: str
    name: str
    args: tuple | None

    def __repr__(self) -> str:
        return f"{self.module}.{self.name}{'' if self.args is None else repr(self.args)}"

    def __torch_pickle__(self) -> Call | Global:
        if self.name == STORAGE and not self.module:
            raise UnsafePickleError("holds a tensor, which is not written back")
        if self.args is None:
            return ref(self.module, self.name)
        return Call(ref(self.module, self.name), self.args)


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
    where = "args entry" if "args" in ckpt.bytes_entries else common_where(ckpt)
    try:
        if "args" in ckpt.bytes_entries:
            return _found(where, decoded_item(ckpt, "args"), lambda v: v)
        common = common_state(ckpt)
        if common is not None:
            return _found(common.where, common.state, lambda v: v.get("args"))
    except UnsafePickleError as exc:
        return TrainingArgs(where, None, f"not decoded without running code ({exc})")
    return None


@dataclass(frozen=True)
class CommonState:
    """A torch_dist checkpoint's common state (args, iteration, the optimizer's sharding type and
    content metadata), decoded without torch, and where it is kept."""

    where: str
    """`common.pt` (megatron-core up to 0.18) or the bytes item `common_state/shard_0_1` (from 0.19)."""
    state: Any
    """The dict saved (the item's one-element list unwrapped), or whatever else was found."""

    def encoded(self, state: Any) -> bytes:
        """`state` saved as this common state is: `torch.save` bytes (the item's in a one-element
        list). Raises UnsafePickleError for a value that cannot be written back (a tensor)."""
        return encode_value(state if self.where == COMMON else [state])


def common_where(ckpt: Checkpoint) -> str | None:
    """Where a torch_dist checkpoint keeps its common state, None when it has none."""
    if store_for(ckpt.path).kind(ckpt.path / COMMON) is EntryKind.FILE:
        return COMMON
    return COMMON_STATE if COMMON_STATE in ckpt.bytes_entries else None


@dataclass(frozen=True)
class SavingReleases:
    """The megatron-core releases that can have saved a torch_dist checkpoint, and what tells."""

    versions: str
    """In words, as `inspect` shows them (`0.19 or newer`)."""
    evidence: str
    newest: tuple[int, int] | None
    """The newest release that saves this way; None when every release since `oldest` does."""
    oldest: tuple[int, int] | None
    """The oldest release that saves this way; None when the way is older than any release told apart."""


def megatron_core_versions(ckpt: Checkpoint) -> SavingReleases | None:
    """Which megatron-core releases can have saved a torch_dist checkpoint, and what tells: only
    ≤ 0.15 pickle `.metadata` as their `MCoreMetadata`; up to 0.18 the common state is `common.pt`,
    from 0.19 the `common_state` item. None for any other checkpoint."""
    if ckpt.megatron_backend is None:
        return None
    if ckpt.mcore_metadata:
        return SavingReleases("0.15 or older", "MCoreMetadata in .metadata", (0, 15), None)
    return {COMMON: SavingReleases("0.18 or older", f"common state in {COMMON}", (0, 18), None),
            COMMON_STATE: SavingReleases("0.19 or newer", f"common state in the {COMMON_STATE} item", None, (0, 19)),
            }.get(common_where(ckpt))


def common_state(ckpt: Checkpoint) -> CommonState | None:
    """The common state, decoded: unknown classes (0.19's enum members in args) stay inert `Opaque`
    values. Raises UnsafePickleError for a pickle that would have to run something, CheckpointError
    naming the file for a damaged or hostile one."""
    where = common_where(ckpt)
    if where == COMMON:
        try:
            return CommonState(COMMON, decode_value(common_bytes(ckpt), opaque=Opaque))
        except CorruptValueError as exc:
            raise CheckpointError(ckpt.path / COMMON, str(exc)) from None
    if where == COMMON_STATE:
        value = decoded_item(ckpt, COMMON_STATE)
        return CommonState(COMMON_STATE, value[0] if isinstance(value, list) and len(value) == 1 else value)
    return None


def common_bytes(ckpt: Checkpoint, name: str = COMMON) -> bytes:
    """A small file beside the DCP ones (`common.pt`, `metadata.json`): a regular file, bounded."""
    path = ckpt.path / name
    data = read_small(path, COMMON_LIMIT + 1)
    if len(data) > COMMON_LIMIT:
        raise CheckpointError(path, f"over the {COMMON_LIMIT >> 20} MiB read for it")
    return data


def decoded_item(ckpt: Checkpoint, fqn: str, reader: ItemReader | None = None) -> Any:
    """Bytes entry `fqn`'s value, decoded without torch (unknown classes as `Opaque`); pass the
    `reader` of a loop over many items, so that each file is opened once. A damaged or hostile
    pickle is a CheckpointError naming the item's file."""
    entry = ckpt.bytes_entries[fqn]
    if reader is None:
        with ItemReader(ckpt) as own:
            return decoded_item(ckpt, fqn, own)
    try:
        return decode_value(reader.read_item_bytes(entry.file, entry.offset, entry.length, entry.transforms),
                            opaque=Opaque)
    except CorruptValueError as exc:
        raise CheckpointError(ckpt.path / entry.file, f"bytes entry {fqn} at byte {entry.offset}: {exc}") from None


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

