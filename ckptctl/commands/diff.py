"""`diff`: compare two checkpoints tensor by tensor, whatever their layouts and world sizes.

A sharded checkpoint cannot be compared file by file: the same model saved at 4 ranks and
resharded to 3 has other files, other chunks and other byte offsets, yet the same values.
So each side is read as its *logical* tensors (global shape, row-major bytes) and both are
streamed through in blocks of about ASSEMBLE_BYTES of items, assembled from whatever
chunks hold them: memory stays at a block per worker and side, whatever the tensor size.

Sides are DCP checkpoints (read through the copy planner, as `--verify` reads them) or
safetensors model folders (`model.safetensors`, or shards listed by a
`*.safetensors.index.json`) or single `.safetensors` files, read with positioned reads
from the offsets their header gives. DCP against DCP compares every tensor under its FQN
(flat 1-D optimizer buffers in their param's shape, so a flat save equals its reshard) and
every bytes entry byte for byte. DCP against safetensors compares only the DCP side's model
tensors, named as export-hf names them: the checkpoint's model prefix (`model.`,
`model.module.`, ...) stripped, optimizer state and other entries left out (a note says
how many). When a DCP side's names are torchtitan's or Megatron's (`arch` auto, or a
family named) and the other's are Hugging Face's (a safetensors model, or a DCP checkpoint
whose model tensors are compared as against safetensors), its tensors are the Hugging Face
tensors export-hf would write, planned by `export_hf.plan_export` with the model's config
(the safetensors folder's `config.json`, or `hf_config`): the family's own tables, so a
fused or split tensor is compared as the views export-hf cuts of it, and the mapping can
never disagree with an export.

`compare_as` (a floating dtype) compares every floating-point tensor in that dtype: a side
not already in it is cast block by block with `engine.cast.cast_into`, the cast export-hf
`--dtype` writes (round to nearest even, NaNs made canonical), so an fp32 checkpoint
equals its bf16 export bit for bit. Without it, floating tensors of other dtypes are
`dtype differs` (a note names the option).

Blocks are compared as bytes first: an equal pair of checkpoints is a run of memcmps and
never imports torch (unless DCP items are zstd-compressed: decoding needs it). Only a block whose bytes differ is looked at numerically (torch, in
float64 or complex128, a slice of SLICE_ITEMS at a time) for the tolerance test, the
largest |a - b| and the first element outside the tolerance.

Statuses (`STATUSES`): `equal` (bit-identical), `close` (bytes differ but every element is
within tolerance as `torch.isclose(a, b, rtol, atol, equal_nan=True)` has it:
|a - b| <= atol + rtol * |b|, equal infinities, NaN where both are NaN; integers compare
exactly, then by that rule), `differs`, `missing in A`, `missing in B`, `shape differs`,
`dtype differs` (shape is checked first). Bytes entries are `equal` or `differs` (or
missing). The run is *equal* when every entry is `equal` or `close`.
"""

from __future__ import annotations

import math
import re
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, ContextManager, Protocol, Sequence

from ckptctl.core.dtypes import CAST_CHOICES, DType
from ckptctl.engine.cpu import ASSEMBLE_BYTES, ChunkSource, assemble_bytes, run_on_threads
from ckptctl.util.errors import CastOverflowError, CheckpointError, UsageError
from ckptctl.storage.source_files import as_typed, missing
from ckptctl.storage.store import EntryKind, ReadHandle, store_for
from ckptctl.formats.dcp.metadata import open_checkpoint
from ckptctl.formats.safetensors.hf_sharded import is_sharded_folder
from ckptctl.formats.safetensors.reader import StoredTensor, quantized_kind, shown_name, stored_tensors
from ckptctl.core.geometry import Box, full_box, unravel
from ckptctl.families.base import HFConfig, is_model_key, load_hf_config, megatron_prefix
from ckptctl.families.torchtitan import torchtitan_prefix
from ckptctl.storage.hub import DEFAULT_HUB_TIMEOUT
from ckptctl.core.analysis import analysis, source_tensors
from ckptctl.core.checkpoint import Checkpoint
from ckptctl.core.plan import SourceTensor, StreamItem, TargetTensor, identity_target, plan_box
from ckptctl.util.progress import Advance, Phases, ProgressObserver
from ckptctl.util.wording import counted
from ckptctl.core.selection import selected

EQUAL, CLOSE, DIFFERS = "equal", "close", "differs"
MISSING_IN_A, MISSING_IN_B = "missing in A", "missing in B"
SHAPE_DIFFERS, DTYPE_DIFFERS = "shape differs", "dtype differs"
STATUSES = (EQUAL, CLOSE, DIFFERS, SHAPE_DIFFERS, DTYPE_DIFFERS, MISSING_IN_A, MISSING_IN_B)
"""Every tensor status, in the order counts and summaries list them."""
BYTES_STATUSES = (EQUAL, DIFFERS, MISSING_IN_A, MISSING_IN_B)
PASSING = frozenset({EQUAL, CLOSE})
"""Statuses that leave a run equal (exit status 0)."""

DCP, SAFETENSORS = "dcp", "safetensors"
SLICE_ITEMS = 1 << 20
"""A differing block is compared numerically this many elements at a time (8 MB per float64 copy)."""
BYTES_ONLY = frozenset({"float4_e2m1fn_x2"})
"""Dtypes torch cannot convert to float64: differing elements are found by their bytes, no |a - b|."""
_RANK_METADATA = re.compile(r"^__\d+\.metadata$")


@dataclass(frozen=True)
class TensorInfo:
    """A tensor as one side holds it: its own name there, its logical shape and dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: DType

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True)
class BytesInfo:
    """A DCP bytes entry (a pickled non-tensor value): its name and stored length."""

    name: str
    nbytes: int


@dataclass(frozen=True)
class EntryDiff:
    """The verdict on one compared name.

    `max_abs_diff` is max |a - b| over the elements (NaN when some element is NaN on one
    side only, as torch's max has it; 0.0 for equal tensors; None when not compared or for
    dtypes without arithmetic). `first_diff_index` is the row-major first element outside
    the tolerance, in the logical shape (for bytes entries: `[byte offset]`), set only for
    `differs`. `mismatches` counts the elements outside the tolerance (None when not compared).
    """

    name: str
    status: str
    a: TensorInfo | BytesInfo | None
    b: TensorInfo | BytesInfo | None
    max_abs_diff: float | None = None
    first_diff_index: tuple[int, ...] | None = None
    mismatches: int | None = None
    compared_as: DType | None = None
    """The dtype the values were compared in when a side was cast to it (`compare_as`)."""


@dataclass
class DiffReport:
    """Everything a diff found, in name order, for the table, the summary line and `--json`."""

    a: str
    b: str
    a_format: str
    b_format: str
    atol: float
    rtol: float
    tensors: list[EntryDiff]
    bytes_entries: list[EntryDiff]
    a_prefix: str | None = None
    """The model prefix stripped from A's names (DCP against safetensors only)."""
    b_prefix: str | None = None
    a_family: str | None = None
    """The family whose export-hf rules named A's tensors as Hugging Face ones (None: names as saved)."""
    b_family: str | None = None
    compare_as: DType | None = None
    notes: list[str] = field(default_factory=list)
    bytes_compared: int = 0
    """Bytes of one side read and compared (the `comparing` phase's total)."""
    seconds: float = 0.0

    @property
    def equal(self) -> bool:
        """Every entry on both sides, and equal or within tolerance."""
        return all(e.status in PASSING for e in (*self.tensors, *self.bytes_entries))

    @property
    def counts(self) -> dict[str, int]:
        """Tensors per status (every status present)."""
        return _count(self.tensors, STATUSES)

    @property
    def bytes_counts(self) -> dict[str, int]:
        """Bytes entries per status (every status present)."""
        return _count(self.bytes_entries, BYTES_STATUSES)


def _count(entries: Sequence[EntryDiff], statuses: Sequence[str]) -> dict[str, int]:
    counts = dict.fromkeys(statuses, 0)
    for e in entries:
        counts[e.status] += 1
    return counts


class Side(Protocol):
    """One checkpoint as diff reads it: tensors (and bytes entries) by compared name."""

    path: Path
    format: str
    prefix: str | None
    family: str | None
    tensors: dict[str, TensorInfo]
    bytes_entries: dict[str, BytesInfo]
    notes: list[str]

    def check_complete(self, names: Sequence[str]) -> None:
        """Raise CheckpointError when a tensor to compare has elements no saved chunk holds."""

    def reads_with_torch(self, names: Sequence[str]) -> bool:
        """Whether reading one of these tensors needs torch (rows placed transposed, a constant added)."""

    def read(self, name: str, start: int, stop: int, dtype: DType | None = None) -> bytearray:
        """Row-major bytes of elements [start, stop) of tensor `name`, cast to `dtype` when given
        as export-hf `--dtype` casts (thread-safe)."""

    def read_bytes(self, name: str) -> bytes:
        """The whole content of bytes entry `name`."""

    def close(self) -> None:
        """Release open files."""


class DcpSide:
    """A DCP checkpoint: each compared tensor a target of the copy planner, assembled from its chunks.

    Built by `whole_side` (every tensor by FQN), `model_side` (the model tensors export-hf
    would export, the model prefix stripped) or `mapped_side` (the HF tensors a family's
    export-hf rules make of them).
    """

    format = DCP

    def __init__(self, ckpt: Checkpoint, targets: dict[str, TargetTensor], sources: dict[str, SourceTensor], *,
                 prefix: str | None = None, family: str | None = None, notes: Sequence[str] = (),
                 with_bytes: bool = False) -> None:
        self.path = ckpt.path
        self.ckpt = ckpt
        self.prefix = prefix
        self.family = family
        self.notes = list(notes)
        self.bytes_entries = {fqn: BytesInfo(fqn, b.length) for fqn, b in ckpt.bytes_entries.items()} \
            if with_bytes else {}
        self._sources = sources
        self._targets = {name: _flat(t) for name, t in targets.items()}
        self._chunks = ChunkSource(ckpt)
        self._chunks.reader.dequantize_fp8 = True  # a TE Float8Tensor item compares by its value, as TE dequantizes it
        self.tensors = {name: TensorInfo(", ".join(_sources_of(t)), t.shape, t.dtype) for name, t in targets.items()}

    def check_complete(self, names: Sequence[str]) -> None:
        wanted = {fqn for n in names for fqn in _sources_of(self._targets[n])}
        for problem in analysis(self.ckpt).problems:
            if problem.kind == "gaps" and problem.fqn in wanted:
                raise CheckpointError(self.path, f"{problem.message}: cannot compare elements that were never saved")

    def reads_with_torch(self, names: Sequence[str]) -> bool:
        return any(self._targets[n].add or any(p.axes is not None for p in self._targets[n].pieces) for n in names)

    def read(self, name: str, start: int, stop: int, dtype: DType | None = None) -> bytearray:
        """Assembled by the engine export-hf writes with: cast (and a constant added) as it does."""
        target = self._targets[name]
        if dtype is not None and dtype != target.dtype:
            target = replace(target, dtype=dtype)
        box = Box((start,), (stop - start,)) if target.shape else full_box(())
        return assemble_bytes(StreamItem("", 0, b"", target, box, plan_box(target, box, self._sources)),
                              self._chunks)

    def read_bytes(self, name: str) -> bytes:
        entry = self.ckpt.bytes_entries[name]
        return self._chunks.reader.read_item_bytes(entry.file, entry.offset, entry.length, entry.transforms)

    def close(self) -> None:
        self._chunks.close()


def _sources_of(target: TargetTensor) -> tuple[str, ...]:
    return tuple(dict.fromkeys(p.src for p in target.pieces))


def _flat(target: TargetTensor) -> TargetTensor:
    """The tensor as a 1-D run of items (an N-D one as a flat target of its logical shape), so
    any item range can be assembled."""
    if len(target.shape) <= 1:
        return target
    return replace(target, shape=(math.prod(target.shape),), logical_shape=target.logical_shape or target.shape)


def whole_side(ckpt: Checkpoint) -> DcpSide:
    """Every tensor under its FQN (flat optimizer buffers in their param's shape), and every bytes entry."""
    views = source_tensors(ckpt)
    return DcpSide(ckpt, {fqn: identity_target(view) for fqn, view in views.items()}, views, with_bytes=True)


def model_side(ckpt: Checkpoint, why: str) -> DcpSide:
    """The model tensors export-hf `--arch raw` exports, named without the checkpoint's model
    prefix; `why` the rest is left out, for the note."""
    views = source_tensors(ckpt)
    prefixes = analysis(ckpt).prefixes.model
    prefix = prefixes[0] if prefixes else ""
    targets = {fqn[len(prefix):]: identity_target(views[fqn]) for fqn in ckpt.tensors
               if fqn.startswith(prefix) and is_model_key(fqn)}
    left_out = len(ckpt.tensors) + len(ckpt.bytes_entries) - len(targets)
    stripped = f"prefix {prefix!r} stripped" if prefix else ""
    if left_out:
        notes = [f"{ckpt.path}: model tensors only{', ' if stripped else ''}{stripped}; {left_out} optimizer and "
                 f"other entries left out ({why})"]
    else:
        notes = [f"{ckpt.path}: {stripped}"] if stripped else []
    return DcpSide(ckpt, targets, views, prefix=prefix, notes=notes)


NAME_CHECK_NOTE = "tensor names not checked (--no-name-check): the output may not load"
"""export-hf's note on a plan made without transformers' names: it speaks of an output diff does not write."""


def mapped_side(ckpt: Checkpoint, cfg: HFConfig, arch: str, tp: int | None) -> DcpSide:
    """The Hugging Face tensors export-hf would write of the checkpoint (`plan_export` without the
    name check, in the saved dtypes), named as HF names them: each a target of row views of its
    torchtitan or Megatron tensors, by the family's own rules."""
    from ckptctl.commands.export_hf import ExportOptions, plan_export

    plan = plan_export(ckpt, cfg, ExportOptions(arch=arch, tp=tp, name_check=False))
    used = {fqn for t in plan.targets.values() for fqn in _sources_of(t)}
    left_out = len(ckpt.tensors) + len(ckpt.bytes_entries) - len(used)
    hf = counted(len(plan.targets), "Hugging Face tensor")
    rest = f"; {counted(left_out, 'other entry', 'other entries')} left out" if left_out else ""
    note = (f"{ckpt.path}: {counted(len(used), 'model tensor')} mapped to {hf} by export-hf's {plan.family} rules "
            f"({cfg.path}){rest}")
    return DcpSide(ckpt, plan.targets, plan.sources, prefix=plan.prefix or None, family=plan.family,
                   notes=[note, *(n for n in plan.notes if n != NAME_CHECK_NOTE)])


class SafetensorsSide:
    """A safetensors model folder (with or without an index) or one `.safetensors` file.

    Headers are parsed by `formats.safetensors.reader` and data read with positioned reads: a
    lazy reader that needs no torch, so equal tensors are compared without importing it.
    """

    format = SAFETENSORS
    prefix = None
    family = None

    def __init__(self, path: Path) -> None:
        self.path = path
        self.notes: list[str] = []
        self.bytes_entries: dict[str, BytesInfo] = {}
        self._store = store_for(path)
        self._handles: dict[Path, ReadHandle] = {}
        self._lock = threading.Lock()
        self._stored: dict[str, StoredTensor] = stored_tensors(path)
        # quantized codes and scales by name: `--compare-as` refuses to read them as values
        self._quantized = {name: kind for name, st in self._stored.items() if (kind := quantized_kind(name, st.dtype))}
        self.tensors: dict[str, TensorInfo] = {name: TensorInfo(name, st.shape, st.dtype) for name, st in self._stored.items()}

    def check_complete(self, names: Sequence[str]) -> None:
        """A safetensors tensor is always whole (its header was checked against the file size)."""

    def reads_with_torch(self, names: Sequence[str]) -> bool:
        return False

    def _handle(self, file: Path) -> ReadHandle:
        with self._lock:
            if file not in self._handles:
                self._handles[file] = self._store.open_read(file)
            return self._handles[file]

    def read(self, name: str, start: int, stop: int, dtype: DType | None = None) -> bytearray:
        stored, isz = self._stored[name], self.tensors[name].dtype.itemsize
        kind = self._quantized.get(name) if dtype is not None else None
        if kind is not None:
            raise CheckpointError(stored.file, f"{shown_name(name)}: {kind}: --compare-as would read quantized bytes "
                                               "as values (import-hf dequantizes such a folder; compare that)")
        out = bytearray((stop - start) * isz)
        offset = stored.start + start * isz
        try:
            got = self._handle(stored.file).readinto_at(out, offset)
        except OSError as exc:
            raise CheckpointError(stored.file, f"cannot read at byte {offset}: {exc.strerror or exc}") from None
        if got != len(out):
            raise CheckpointError(stored.file, f"short read at byte {offset}")
        if dtype is None:
            return out
        try:
            return _cast(out, stored.dtype, dtype)
        except CastOverflowError as exc:
            raise UsageError(f"{stored.file}: {name}: {exc} (--compare-as)") from None

    def read_bytes(self, name: str) -> bytes:
        raise CheckpointError(self.path, f"{name}: safetensors files hold tensors only, no bytes entries")

    def close(self) -> None:
        with self._lock:
            for handle in self._handles.values():
                handle.close()
            self._handles.clear()


def open_sides(a: Path, b: Path, arch: str, hf_config: str | Path | None, tp: int | None,
               hub_timeout: float) -> tuple[Side, Side]:
    """Both sides as they are compared. Safetensors against safetensors, and DCP against DCP,
    every entry by name; a DCP checkpoint against safetensors, its model tensors by the names
    export-hf gives them. A DCP checkpoint whose names are torchtitan's or Megatron's (or any,
    when `arch` names a family), facing Hugging Face names, is `mapped_side`: against a
    safetensors model by default, against a DCP checkpoint whose names are neither when
    `hf_config` (or a family) is given, as no folder holds a config; `arch` raw keeps names as
    saved."""
    from ckptctl.families.registry import ARCHES

    if arch not in ARCHES:
        raise UsageError(f"--arch must be one of {', '.join(ARCHES)} (got {arch!r})")
    paths, kinds = (a, b), (format_of(a), format_of(b))
    ckpts = [open_checkpoint(path) if kind == DCP else None for path, kind in zip(paths, kinds)]
    names = [_saved_names(ckpt) if ckpt is not None else None for ckpt in ckpts]
    dcps = [i for i in (0, 1) if ckpts[i] is not None]
    named = [i for i in dcps if names[i]]
    if arch == "raw":
        mapped, why = None, "--arch raw compares the names as saved"
    elif len(dcps) == 1:
        mapped = dcps[0] if arch != "auto" or named else None
        why = f"{paths[dcps[0]]}'s names are neither torchtitan's nor Megatron's"
    else:  # two DCP checkpoints: no folder holds a config, so mapping is asked for (or they differ by name)
        mapped = named[0] if len(named) == 1 and (hf_config is not None or arch != "auto") else None
        why = (f"both {a} and {b} have such names" if len(named) == 2 else
               f"neither {a} nor {b} has such names" if dcps else f"{a} and {b} are both safetensors models")
    if mapped is None:
        given = [flag for flag, value in (("--arch", arch not in ("auto", "raw")), ("--hf-config", hf_config),
                                          ("--tp", tp)) if value]
        if given:
            raise UsageError(f"{given[0]} is for mapping torchtitan or Megatron names to Hugging Face ones, and {why}")
    sides: list[Side] = []
    try:
        for i, (path, kind, ckpt) in enumerate(zip(paths, kinds, ckpts)):
            if ckpt is None:
                sides.append(SafetensorsSide(path))
            elif i == mapped:
                config = _mapping_config(ckpt, paths[1 - i], kinds[1 - i], hf_config, arch, names[i])
                sides.append(mapped_side(ckpt, load_hf_config(config, hub_timeout), arch, tp))
            elif SAFETENSORS in kinds:
                sides.append(model_side(ckpt, "only model weights are in a safetensors folder"))
            elif mapped is not None:
                sides.append(model_side(ckpt, "only model weights have Hugging Face names"))
            else:
                sides.append(whole_side(ckpt))
    except BaseException:
        for side in sides:
            side.close()
        raise
    return sides[0], sides[1]


def _saved_names(ckpt: Checkpoint) -> str | None:
    """`torchtitan` or `Megatron` when export-hf would see the checkpoint's names as such, else None."""
    if torchtitan_prefix(ckpt) is not None:
        return "torchtitan"
    return "Megatron" if megatron_prefix(ckpt) is not None else None


def _mapping_config(ckpt: Checkpoint, other: Path, other_kind: str, hf_config: str | Path | None, arch: str,
                    names: str | None) -> str | Path:
    """The config the names are mapped with: `hf_config`, else the one beside the other side's
    safetensors files."""
    if hf_config is not None:
        return hf_config
    where = ""
    if other_kind == SAFETENSORS:
        store = store_for(other)
        folder = other if store.kind(other) is EntryKind.FOLDER else other.parent
        if store.exists(folder / "config.json"):
            return folder
        where = f", and {folder} has none"
    whose = f"{names} names" if arch == "auto" and names else "names"
    raise UsageError(f"{ckpt.path}: its {whose} are mapped to Hugging Face ones by export-hf's rules, which need the "
                     f"model's config.json{where}: pass --hf-config (or --arch raw to compare the names as saved)")


def format_of(path: Path) -> str:
    """`dcp` for a directory with DCP metadata, `safetensors` for a folder of them or one file."""
    kind = store_for(path).kind(path)
    if kind is EntryKind.MISSING:
        raise CheckpointError(as_typed(path), missing(path))
    if kind is EntryKind.FILE:
        if path.suffix == ".safetensors":
            return SAFETENSORS
        raise CheckpointError(path, "not a directory (diff takes DCP checkpoints, safetensors model folders "
                                    "or .safetensors files)")
    try:
        names = store_for(path).list(path)
    except OSError as exc:
        raise CheckpointError(path, f"cannot list: {exc.strerror or exc}") from None
    if ".metadata" in names or any(_RANK_METADATA.match(n) for n in names):
        return DCP
    if any(n.endswith(".safetensors") for n in names):
        return DCP if is_sharded_folder(path) else SAFETENSORS  # torch's HF writer's sharded save is a checkpoint
    raise CheckpointError(path, "neither a DCP checkpoint (no .metadata) nor a safetensors model folder "
                                "(no *.safetensors)")


def diff(a: Path, b: Path, *, atol: float = 0.0, rtol: float = 0.0, include: Sequence[str] = (),
         exclude: Sequence[str] = (), progress: ProgressObserver | None = None, workers: int = 4,
         compare_as: DType | str | None = None, arch: str = "auto", hf_config: str | Path | None = None,
         tp: int | None = None, hub_timeout: float = DEFAULT_HUB_TIMEOUT,
         preparing: Callable[[str], ContextManager[None]] | None = None) -> DiffReport:
    """Compare checkpoints `a` and `b` entry by entry (see the module docstring for what is compared).

    `arch`, `hf_config` and `tp` say how a DCP checkpoint's names map to a safetensors model's
    (`open_sides`); `compare_as` the dtype floating-point values are compared in. `preparing(what)`
    is the context torch is imported in when the comparison needs it (a cast, rows placed
    transposed), before the comparing phase starts: the CLI shows a bar saying so. Raises
    CheckpointError on unreadable input and UsageError for a bad option or filters that select
    nothing on either side; differences are never errors, they are the report.
    """
    for flag, value in (("--atol", atol), ("--rtol", rtol)):
        if not (value >= 0 and math.isfinite(value)):
            raise UsageError(f"{flag} must be a finite number >= 0 (got {value})")
    key = compare_as.name if isinstance(compare_as, DType) else compare_as
    wanted = None if key is None else CAST_CHOICES.get(key)
    if compare_as is not None and wanted is None:
        raise UsageError(f"--compare-as must be one of {', '.join(c for c in CAST_CHOICES if c != 'keep')} "
                         f"(got {compare_as!r})")
    started = time.monotonic()
    side_a, side_b = open_sides(Path(a), Path(b), arch, hf_config, tp, hub_timeout)
    try:
        report = _diff_sides(side_a, side_b, atol, rtol, include, exclude, progress, workers, wanted, preparing)
    finally:
        side_a.close()
        side_b.close()
    report.seconds = time.monotonic() - started
    return report


@dataclass(frozen=True)
class _Pair:
    """A tensor both sides hold in one shape, and the dtype its values are compared in: the work
    item of a comparing thread."""

    name: str
    a: TensorInfo
    b: TensorInfo
    dtype: DType


def _compared_dtype(a: DType, b: DType, compare_as: DType | None) -> DType | None:
    """The dtype two sides' values are compared in: `compare_as` for floating tensors torch can
    cast, else their common dtype; None when they have none."""
    if compare_as is not None and all(d.is_floating_point and d.name not in BYTES_ONLY for d in (a, b)):
        return compare_as
    return a if a == b else None


def _diff_sides(side_a: Side, side_b: Side, atol: float, rtol: float, include: Sequence[str],
                exclude: Sequence[str], progress: ProgressObserver | None, workers: int,
                compare_as: DType | None = None,
                preparing: Callable[[str], ContextManager[None]] | None = None) -> DiffReport:
    def pick(names: Sequence[str]) -> list[str]:
        return [n for n in names if selected(n, include, exclude)]

    tensor_names = sorted(set(pick(list(side_a.tensors))) | set(pick(list(side_b.tensors))))
    bytes_names = sorted(set(pick(list(side_a.bytes_entries))) | set(pick(list(side_b.bytes_entries))))
    if (include or exclude) and not tensor_names and not bytes_names:
        raise UsageError(f"{_filters(include, exclude)} select no tensor or bytes entry of {side_a.path} "
                         f"or {side_b.path}")
    results: dict[str, EntryDiff] = {}
    bytes_results: dict[str, EntryDiff] = {}
    pairs: list[_Pair] = []
    for name in tensor_names:
        ta, tb = side_a.tensors.get(name), side_b.tensors.get(name)
        if ta is None or tb is None:
            results[name] = EntryDiff(name, MISSING_IN_A if ta is None else MISSING_IN_B, ta, tb)
        elif ta.shape != tb.shape:
            results[name] = EntryDiff(name, SHAPE_DIFFERS, ta, tb)
        elif (dtype := _compared_dtype(ta.dtype, tb.dtype, compare_as)) is None:
            results[name] = EntryDiff(name, DTYPE_DIFFERS, ta, tb)
        else:
            pairs.append(_Pair(name, ta, tb, dtype))
    both_bytes = [n for n in bytes_names if n in side_a.bytes_entries and n in side_b.bytes_entries]
    for name in bytes_names:
        ba, bb = side_a.bytes_entries.get(name), side_b.bytes_entries.get(name)
        if ba is None or bb is None:
            bytes_results[name] = EntryDiff(name, MISSING_IN_A if ba is None else MISSING_IN_B, ba, bb)
    side_a.check_complete([p.name for p in pairs])
    side_b.check_complete([p.name for p in pairs])

    why = _why_torch(pairs, side_a, side_b)
    if why and preparing is not None and "torch" not in sys.modules:  # not under the comparing bar, stuck at 0
        with preparing(f"starting torch {why}"):
            import torch  # noqa: F401

    total = sum(p.a.nbytes for p in pairs) + sum(side_a.bytes_entries[n].nbytes for n in both_bytes)
    phases = Phases(progress)
    advance = phases.start("comparing", total) if total else _uncounted  # no bar for nothing to compare

    def compare(pair: _Pair) -> None:
        results[pair.name] = _compare_tensor(pair, side_a, side_b, atol, rtol, advance)

    pairs.sort(key=lambda p: -p.a.nbytes)  # biggest first, so threads finish together
    run_on_threads(pairs, compare, max(1, workers), "ckptctl-diff")
    for name in both_bytes:
        bytes_results[name] = _compare_bytes(name, side_a, side_b, advance)
    phases.stop()
    tensors = [results[n] for n in tensor_names]
    return DiffReport(
        a=str(side_a.path), b=str(side_b.path), a_format=side_a.format, b_format=side_b.format,
        atol=float(atol), rtol=float(rtol), tensors=tensors, bytes_entries=[bytes_results[n] for n in bytes_names],
        a_prefix=side_a.prefix, b_prefix=side_b.prefix, a_family=side_a.family, b_family=side_b.family,
        compare_as=compare_as, notes=[*side_a.notes, *side_b.notes, *_dtype_notes(pairs, tensors, compare_as)],
        bytes_compared=total,
    )


def _why_torch(pairs: Sequence[_Pair], side_a: Side, side_b: Side) -> str | None:
    """Why comparing these pairs will import torch (a cast, rows placed transposed), or None."""
    casts = sorted({p.dtype.name for p in pairs if p.a.dtype != p.b.dtype})  # one dtype: cast only where bytes differ
    if casts:
        return f"for the {', '.join(casts)} cast"
    names = [p.name for p in pairs]
    if side_a.reads_with_torch(names) or side_b.reads_with_torch(names):
        return "to reorder rows"
    return None


def _uncounted(nbytes: int) -> None:
    """The byte counter when there are no bytes to compare (and so no bar)."""


SHORT_NAMES = {dtype.name: short for short, dtype in CAST_CHOICES.items() if dtype is not None and len(short) == 4}
"""`--compare-as` values by dtype name: `bfloat16` → `bf16`."""


def _dtype_notes(pairs: Sequence[_Pair], tensors: Sequence[EntryDiff], compare_as: DType | None) -> list[str]:
    """What `compare_as` cast, or, without it, how to compare the floating tensors that differ in dtype only."""
    if compare_as is not None:
        casts = Counter((side, info.dtype.name) for p in pairs for side, info in (("A", p.a), ("B", p.b))
                        if info.dtype != p.dtype)
        cast = ", ".join(f"{side}'s {counted(n, dtype + ' tensor')}" for (side, dtype), n in sorted(casts.items()))
        return [f"values compared as {compare_as.name}: {cast or 'no tensor'} cast to it, rounding to nearest even "
                "(as export-hf --dtype casts)"]
    only = [e for e in tensors if e.status == DTYPE_DIFFERS and
            _compared_dtype(e.a.dtype, e.b.dtype, e.a.dtype if e.a.dtype.is_floating_point else None) is not None]
    if not only:
        return []
    dtypes = {d for e in only for d in (e.a.dtype, e.b.dtype)}
    narrowest = {d for d in dtypes if d.itemsize == min(x.itemsize for x in dtypes)}
    target = next(iter(narrowest)).name if len(narrowest) == 1 else "float32"
    if target not in SHORT_NAMES:
        return []
    verb = "differs" if len(only) == 1 else "differ"
    return [f"{counted(len(only), 'floating-point tensor')} {verb} in dtype only: --compare-as {SHORT_NAMES[target]} "
            f"compares their values as {target}"]


def _filters(include: Sequence[str], exclude: Sequence[str]) -> str:
    return " ".join([*(f"--include {g!r}" for g in include), *(f"--exclude {g!r}" for g in exclude)])


def _compare_bytes(name: str, side_a: Side, side_b: Side, advance: Advance) -> EntryDiff:
    x, y = side_a.read_bytes(name), side_b.read_bytes(name)
    advance(side_a.bytes_entries[name].nbytes)
    info_a, info_b = side_a.bytes_entries[name], side_b.bytes_entries[name]
    if x == y:
        return EntryDiff(name, EQUAL, info_a, info_b)
    first = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
    return EntryDiff(name, DIFFERS, info_a, info_b, first_diff_index=(first,))


def _compare_tensor(pair: _Pair, side_a: Side, side_b: Side, atol: float, rtol: float,
                    advance: Advance) -> EntryDiff:
    """Stream both sides through in item blocks, each read in the compared dtype; only blocks
    whose bytes differ are examined numerically. Blocks of one dtype are read as saved first:
    the same bytes are equal in any dtype, and only a block that differs is read again, cast."""
    a, b, dtype = pair.a, pair.b, pair.dtype
    step = max(1, ASSEMBLE_BYTES // max(a.dtype.itemsize, b.dtype.itemsize))
    found = _Mismatches(dtype, atol, rtol)
    for start in range(0, a.numel, step):
        stop = min(a.numel, start + step)
        if a.dtype == b.dtype:
            x, y = side_a.read(pair.name, start, stop), side_b.read(pair.name, start, stop)
            if x == y:
                advance(len(x))
                continue
            if dtype != a.dtype:
                x, y = side_a.read(pair.name, start, stop, dtype), side_b.read(pair.name, start, stop, dtype)
        else:
            x, y = side_a.read(pair.name, start, stop, dtype), side_b.read(pair.name, start, stop, dtype)
        advance((stop - start) * a.dtype.itemsize)
        if x != y:
            found.add_block(x, y, start)
    cast = dtype if dtype != a.dtype or dtype != b.dtype else None
    if found.identical:
        return EntryDiff(pair.name, EQUAL, a, b, 0.0, None, 0, cast)
    max_abs = float("nan") if found.nan else found.max_abs
    if not found.count:
        return EntryDiff(pair.name, CLOSE, a, b, max_abs, None, 0, cast)
    return EntryDiff(pair.name, DIFFERS, a, b, max_abs, unravel(found.first, a.shape), found.count, cast)


def _cast(data: bytearray, src: DType, dst: DType) -> bytearray:
    """Elements of `src` as `dst`, by the cast export-hf `--dtype` writes (`engine.cast.cast_into`;
    a DCP side's engine casts with it too)."""
    if src == dst or not data:
        return data
    import torch

    from ckptctl.engine.cast import cast_into

    out = bytearray(len(data) // src.itemsize * dst.itemsize)
    cast_into(torch.frombuffer(out, dtype=dst.torch), torch.frombuffer(data, dtype=src.torch))
    return out


class _Mismatches:
    """What the differing blocks of one tensor held: elements outside tolerance, the first, max |a - b|."""

    def __init__(self, dtype: DType, atol: float, rtol: float) -> None:
        self.dtype, self.atol, self.rtol = dtype, atol, rtol
        self.identical = True
        self.count = 0
        self.first = 0
        self.max_abs: float | None = 0.0 if dtype.name not in BYTES_ONLY else None
        self.nan = False

    def add_block(self, x: bytearray, y: bytearray, start: int) -> None:
        import torch  # only blocks whose bytes differ get here

        self.identical = False
        isz = self.dtype.itemsize
        n = len(x) // isz
        for lo in range(0, n, SLICE_ITEMS):
            hi = min(n, lo + SLICE_ITEMS)
            a = torch.frombuffer(x, dtype=torch.uint8, offset=lo * isz, count=(hi - lo) * isz)
            b = torch.frombuffer(y, dtype=torch.uint8, offset=lo * isz, count=(hi - lo) * isz)
            if self.max_abs is None:
                bad = (a.view(-1, isz) != b.view(-1, isz)).any(dim=1)
            else:
                bad = self._outside(a.view(self.dtype.torch), b.view(self.dtype.torch))
            count = int(bad.sum())
            if count and not self.count:
                self.first = start + lo + int(torch.argmax(bad.to(torch.uint8)))
            self.count += count

    def _outside(self, a: Any, b: Any) -> Any:
        """Which elements are outside the tolerance; updates max |a - b| and the one-sided NaN flag."""
        import torch

        wide = torch.complex128 if self.dtype.is_complex else torch.float64
        wa, wb = a.to(wide), b.to(wide)
        if self.dtype.kind in "ib":  # integers are exact: equal values are never "outside"
            same = a == b
            bad = ~same if not (self.atol or self.rtol) else ~(same | _within(wa, wb, self.atol, self.rtol))
        else:
            bad = ~torch.isclose(wa, wb, rtol=self.rtol, atol=self.atol, equal_nan=True)
            same = (wa == wb) | (torch.isnan(wa) & torch.isnan(wb))
        dist = (wa - wb).abs()
        dist[same] = 0
        one_nan = torch.isnan(dist)
        if bool(one_nan.any()):
            self.nan = True
            dist[one_nan] = 0
        self.max_abs = max(self.max_abs or 0.0, float(dist.max()) if dist.numel() else 0.0)
        return bad


def _within(a: Any, b: Any, atol: float, rtol: float) -> Any:
    return (a - b).abs() <= atol + rtol * b.abs()
