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
how many).

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
import os
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, Sequence

from ckptctl.core.dtypes import DType
from ckptctl.engine.cpu import ASSEMBLE_BYTES, ChunkSource, assemble_bytes, run_on_threads
from ckptctl.util.errors import CheckpointError, UsageError
from ckptctl.storage.source_files import missing
from ckptctl.formats.dcp.metadata import open_checkpoint
from ckptctl.formats.safetensors.hf_sharded import is_sharded_folder
from ckptctl.formats.safetensors.reader import StoredTensor, stored_tensors
from ckptctl.core.geometry import Box, full_box
from ckptctl.families.base import is_model_key
from ckptctl.core.analysis import analysis, source_tensors
from ckptctl.core.checkpoint import Checkpoint
from ckptctl.core.plan import SourceTensor, StreamItem, TargetTensor, identity_target, plan_box
from ckptctl.util.progress import Advance, Phases, ProgressObserver
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
    tensors: dict[str, TensorInfo]
    bytes_entries: dict[str, BytesInfo]
    notes: list[str]

    def check_complete(self, names: Sequence[str]) -> None:
        """Raise CheckpointError when a tensor to compare has elements no saved chunk holds."""

    def read(self, name: str, start: int, stop: int) -> bytearray:
        """Row-major bytes of elements [start, stop) of tensor `name` (thread-safe)."""

    def read_bytes(self, name: str) -> bytes:
        """The whole content of bytes entry `name`."""

    def close(self) -> None:
        """Release open files."""


class DcpSide:
    """A DCP checkpoint: tensors assembled from their chunks by the copy planner.

    `model_only` (against safetensors) keeps the tensors export-hf would export: under the
    checkpoint's model prefix, not optimizer or other state, named without the prefix.
    """

    format = DCP

    def __init__(self, ckpt: Checkpoint, model_only: bool) -> None:
        self.path = ckpt.path
        self.ckpt = ckpt
        self.notes: list[str] = []
        views = source_tensors(ckpt)
        if model_only:
            prefixes = analysis(ckpt).prefixes.model
            self.prefix: str | None = prefixes[0] if prefixes else ""
            self._fqn = {fqn[len(self.prefix):]: fqn for fqn in ckpt.tensors
                         if fqn.startswith(self.prefix) and is_model_key(fqn)}
            left_out = len(ckpt.tensors) + len(ckpt.bytes_entries) - len(self._fqn)
            stripped = f", prefix {self.prefix!r} stripped" if self.prefix else ""
            self.notes.append(f"{self.path}: model tensors only{stripped}; {left_out} optimizer and other "
                              "entries left out (only model weights are in a safetensors folder)")
            self.bytes_entries: dict[str, BytesInfo] = {}
        else:
            self.prefix = None
            self._fqn = {fqn: fqn for fqn in ckpt.tensors}
            self.bytes_entries = {fqn: BytesInfo(fqn, b.length) for fqn, b in ckpt.bytes_entries.items()}
        self._sources: dict[str, SourceTensor] = views
        """Keyed by FQN, as the pieces of every target name their source."""
        self.tensors = {name: TensorInfo(fqn, views[fqn].shape, views[fqn].dtype) for name, fqn in self._fqn.items()}
        self._chunks = ChunkSource(ckpt)
        self._targets: dict[str, TargetTensor] = {}

    def check_complete(self, names: Sequence[str]) -> None:
        wanted = {self._fqn[n] for n in names}
        for problem in analysis(self.ckpt).problems:
            if problem.kind == "gaps" and problem.fqn in wanted:
                raise CheckpointError(self.path, f"{problem.message}: cannot compare elements that were never saved")

    def _target(self, name: str) -> TargetTensor:
        """The tensor as a 1-D run of items (N-D ones as a flat target), so any item range can be assembled."""
        target = self._targets.get(name)
        if target is None:
            src = self._sources[self._fqn[name]]
            whole = identity_target(src, fqn=name)
            if len(src.shape) > 1:
                whole = TargetTensor(name, (math.prod(src.shape),), src.dtype, whole.pieces, logical_shape=src.shape)
            target = self._targets[name] = whole
        return target

    def read(self, name: str, start: int, stop: int) -> bytearray:
        target = self._target(name)
        box = Box((start,), (stop - start,)) if target.shape else full_box(())
        return assemble_bytes(StreamItem("", 0, b"", target, box, plan_box(target, box, self._sources)), self._chunks)

    def read_bytes(self, name: str) -> bytes:
        entry = self.ckpt.bytes_entries[name]
        return self._chunks.reader.read_item_bytes(entry.file, entry.offset, entry.length, entry.transforms)

    def close(self) -> None:
        self._chunks.close()


class SafetensorsSide:
    """A safetensors model folder (with or without an index) or one `.safetensors` file.

    Headers are parsed by `formats.safetensors_in` and data read with positioned reads: a
    lazy reader that needs no torch, so equal tensors are compared without importing it.
    """

    format = SAFETENSORS
    prefix = None

    def __init__(self, path: Path) -> None:
        self.path = path
        self.notes: list[str] = []
        self.bytes_entries: dict[str, BytesInfo] = {}
        self._fds: dict[Path, int] = {}
        self._lock = threading.Lock()
        self._stored: dict[str, StoredTensor] = stored_tensors(path)
        self.tensors: dict[str, TensorInfo] = {name: TensorInfo(name, st.shape, st.dtype) for name, st in self._stored.items()}

    def check_complete(self, names: Sequence[str]) -> None:
        """A safetensors tensor is always whole (its header was checked against the file size)."""

    def _fd(self, file: Path) -> int:
        with self._lock:
            if file not in self._fds:
                try:
                    self._fds[file] = os.open(file, os.O_RDONLY)
                except OSError as exc:
                    raise CheckpointError(file, f"cannot open: {exc.strerror or exc}") from None
            return self._fds[file]

    def read(self, name: str, start: int, stop: int) -> bytearray:
        stored, isz = self._stored[name], self.tensors[name].dtype.itemsize
        out = bytearray((stop - start) * isz)
        offset = stored.start + start * isz
        try:
            got = os.preadv(self._fd(stored.file), [out], offset)
        except OSError as exc:
            raise CheckpointError(stored.file, f"cannot read at byte {offset}: {exc.strerror or exc}") from None
        if got != len(out):
            raise CheckpointError(stored.file, f"short read at byte {offset}")
        return out

    def read_bytes(self, name: str) -> bytes:
        raise CheckpointError(self.path, f"{name}: safetensors files hold tensors only, no bytes entries")

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()


def open_side(path: Path, kind: str, other_kind: str) -> Side:
    """The side at `path` (of `format_of` kind); a DCP side facing safetensors keeps its model tensors only."""
    if kind == DCP:
        return DcpSide(open_checkpoint(path), model_only=other_kind == SAFETENSORS)
    return SafetensorsSide(path)


def format_of(path: Path) -> str:
    """`dcp` for a directory with DCP metadata, `safetensors` for a folder of them or one file."""
    if not path.exists():
        raise CheckpointError(path, missing(path))
    if path.is_file():
        if path.suffix == ".safetensors":
            return SAFETENSORS
        raise CheckpointError(path, "not a directory (diff takes DCP checkpoints, safetensors model folders "
                                    "or .safetensors files)")
    try:
        names = os.listdir(path)
    except OSError as exc:
        raise CheckpointError(path, f"cannot list: {exc.strerror or exc}") from None
    if ".metadata" in names or any(_RANK_METADATA.match(n) for n in names):
        return DCP
    if any(n.endswith(".safetensors") for n in names):
        return DCP if is_sharded_folder(path) else SAFETENSORS  # torch's HF writer's sharded save is a checkpoint
    raise CheckpointError(path, "neither a DCP checkpoint (no .metadata) nor a safetensors model folder "
                                "(no *.safetensors)")


def diff(a: Path, b: Path, *, atol: float = 0.0, rtol: float = 0.0, include: Sequence[str] = (),
         exclude: Sequence[str] = (), progress: ProgressObserver | None = None,
         workers: int = 4) -> DiffReport:
    """Compare checkpoints `a` and `b` entry by entry (see the module docstring for what is compared).

    Raises CheckpointError on unreadable input and UsageError for a bad tolerance or filters
    that select nothing on either side; differences are never errors, they are the report.
    """
    for flag, value in (("--atol", atol), ("--rtol", rtol)):
        if not (value >= 0 and math.isfinite(value)):
            raise UsageError(f"{flag} must be a finite number >= 0 (got {value})")
    started = time.monotonic()
    a, b = Path(a), Path(b)
    a_format, b_format = format_of(a), format_of(b)
    side_a = open_side(a, a_format, b_format)
    try:
        side_b = open_side(b, b_format, a_format)
        try:
            report = _diff_sides(side_a, side_b, atol, rtol, include, exclude, progress, workers)
        finally:
            side_b.close()
    finally:
        side_a.close()
    report.seconds = time.monotonic() - started
    return report


@dataclass(frozen=True)
class _Pair:
    """A tensor both sides hold with one shape and dtype: the work item of a comparing thread."""

    name: str
    a: TensorInfo
    b: TensorInfo


def _diff_sides(side_a: Side, side_b: Side, atol: float, rtol: float, include: Sequence[str],
                exclude: Sequence[str], progress: ProgressObserver | None, workers: int) -> DiffReport:
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
        elif ta.dtype != tb.dtype:
            results[name] = EntryDiff(name, DTYPE_DIFFERS, ta, tb)
        else:
            pairs.append(_Pair(name, ta, tb))
    both_bytes = [n for n in bytes_names if n in side_a.bytes_entries and n in side_b.bytes_entries]
    for name in bytes_names:
        ba, bb = side_a.bytes_entries.get(name), side_b.bytes_entries.get(name)
        if ba is None or bb is None:
            bytes_results[name] = EntryDiff(name, MISSING_IN_A if ba is None else MISSING_IN_B, ba, bb)
    side_a.check_complete([p.name for p in pairs])
    side_b.check_complete([p.name for p in pairs])

    total = sum(p.a.nbytes for p in pairs) + sum(side_a.bytes_entries[n].nbytes for n in both_bytes)
    phases = Phases(progress)
    advance = phases.start("comparing", total)

    def compare(pair: _Pair) -> None:
        results[pair.name] = _compare_tensor(pair, side_a, side_b, atol, rtol, advance)

    pairs.sort(key=lambda p: -p.a.nbytes)  # biggest first, so threads finish together
    run_on_threads(pairs, compare, max(1, workers), "ckptctl-diff")
    for name in both_bytes:
        bytes_results[name] = _compare_bytes(name, side_a, side_b, advance)
    phases.stop()
    return DiffReport(
        a=str(side_a.path), b=str(side_b.path), a_format=side_a.format, b_format=side_b.format,
        atol=float(atol), rtol=float(rtol),
        tensors=[results[n] for n in tensor_names], bytes_entries=[bytes_results[n] for n in bytes_names],
        a_prefix=side_a.prefix, b_prefix=side_b.prefix, notes=[*side_a.notes, *side_b.notes], bytes_compared=total,
    )


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
    """Stream both sides through in item blocks; only blocks whose bytes differ are examined numerically."""
    info = pair.a
    step = max(1, ASSEMBLE_BYTES // info.dtype.itemsize)
    found = _Mismatches(info.dtype, atol, rtol)
    for start in range(0, info.numel, step):
        stop = min(info.numel, start + step)
        x, y = side_a.read(pair.name, start, stop), side_b.read(pair.name, start, stop)
        if x != y:
            found.add_block(x, y, start)
        advance(len(x))
    if found.identical:
        return EntryDiff(pair.name, EQUAL, pair.a, pair.b, 0.0, None, 0)
    max_abs = float("nan") if found.nan else found.max_abs
    if not found.count:
        return EntryDiff(pair.name, CLOSE, pair.a, pair.b, max_abs, None, 0)
    return EntryDiff(pair.name, DIFFERS, pair.a, pair.b, max_abs, _unravel(found.first, info.shape), found.count)


def _unravel(flat: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The N-D index of row-major element `flat`."""
    index = []
    for dim in reversed(shape):
        flat, rest = divmod(flat, dim)
        index.append(rest)
    return tuple(reversed(index))


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
