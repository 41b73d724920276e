"""`export-torch`: a DCP checkpoint → one `torch.save` file, the one torch's `dcp_to_torch_save` writes.

torch's converter builds the whole state dict in memory and unpickles every non-tensor
entry with `weights_only=False` (running whatever code it names). Here the file is laid out
from metadata first (`formats.torch_save.writer`): the nested dict's `data.pkl`, one record per
tensor at a known offset, the zip directory. The engine that reshards then assembles each
record from the DCP chunks a block at a time, so memory does not grow with the model.
Non-tensor entries are decoded by an allow-list unpickler; one it cannot decode is refused
by name. Transformer Engine Float8Tensor weights are written dequantized, as TE computes their
values (the file's reader, `torch.load(weights_only=True)`, cannot build TE's class without TE),
and the report names them. The file is written inside a marked temporary sibling directory (`atomic.atomic_file`),
fsynced and renamed into place, so a run that dies leaves no OUT.
"""

from __future__ import annotations

import argparse
import functools
import math
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from ckptctl.storage.atomic import lands_in, recorded_reads
from ckptctl.storage.store import EntryKind, store_for
from ckptctl.core.dtypes import DType, cast_dtype
from ckptctl.engine import executor, resolve_device
from ckptctl.engine.cpu import ChunkSource, assemble_bytes, run_on_threads
from ckptctl.engine.output import write_files
from ckptctl.engine.crc import crc32
from ckptctl.util.errors import CheckpointError, UsageError
from ckptctl.formats.dcp.metadata import open_checkpoint
from ckptctl.formats.pickle.torch_pickle import Size
from ckptctl.formats.torch_save.writer import (
    LOAD_SAFE_GLOBALS, CorruptValueError, TensorSlot, TorchSaveFile, Value, decode_value, placed_torch_save, nest,
    state_pickle,
)
from ckptctl.formats.pickle.unpickle import UnsafePickleError
from ckptctl.core.geometry import union_volume
from ckptctl.core.checkpoint import Checkpoint
from ckptctl.core.output_plan import OutputPlan
from ckptctl.core.plan import CopyItem, SourceTensor, StreamItem, TargetTensor, identity_target, plan_box, source_view
from ckptctl.util.progress import Advance, Phases, ProgressObserver, RunTiming, timed_check
from ckptctl.core.selection import refuse_empty_selection, selected
from ckptctl.checks.output_check import check_torch_save
from ckptctl.checks.verify import check_decoded_source, row_blocks, tensor_read_back
from ckptctl.commands.options import RunOptions

_LOCAL_HEADER_BYTES = 30


@dataclass
class ExportTorchOptions(RunOptions):
    """What export-torch takes: the shared selection, cast and engine options, nothing of its own."""


@dataclass
class ExportTorchPlan:
    """The whole output, decided before any data moves."""

    file: TorchSaveFile
    tree: dict
    """The nested state dict with `TensorSlot`/`Value` leaves, as `data.pkl` pickles it."""
    targets: list[TargetTensor]
    """Tensors in storage order: `targets[i]` is record `data/i`."""
    sources: dict[str, SourceTensor]

    @property
    def tensor_bytes(self) -> int:
        return sum(t.nbytes for t in self.targets)

    def output_plan(self, sync: bool) -> OutputPlan:
        """The archive as the engine writes it: its head, each tensor's record, then the trailing
        records and the central directory, which need the records' CRCs."""
        file = self.file
        return OutputPlan({file.name: file.size}, lambda names: file.items if file.name in names else (),
                          len(file.items), self.sources, [CopyItem("", 0, len(file.head), file.name, 0, file.head)],
                          finish=functools.partial(file.write_trailer, sync=sync), finish_reads_records=True)


@dataclass
class ExportTorchReport(RunTiming):
    """What a run did, for `--json` and the summary line."""

    src: str
    out: str
    tensors: int
    values: int
    bytes_written: int
    dry_run: bool = False
    dequantized: list[str] = field(default_factory=list)
    """Transformer Engine Float8Tensor tensors written as their values (TE's dequantize: float32
    code × scale_inv, rounded to the logical dtype): `torch.load(weights_only=True)` of a
    Float8Tensor needs TE, so the file holds what it computes, plain tensors."""


def archive_name(out: Path) -> str:
    """The folder the records sit in inside the zip: torch names it after the file, without its suffix."""
    name = out.name
    return name[: name.rindex(".")] if name.rfind(".") > 0 else name


def read_values(ckpt: Checkpoint, chunks: ChunkSource, fqns: Sequence[str]) -> dict[str, Any]:
    """Every named non-tensor entry, decoded without running code from the checkpoint; the
    entries that cannot be are refused together, in one line that names them."""
    values: dict[str, Any] = {}
    refused: list[tuple[str, str]] = []
    for fqn in fqns:
        entry = ckpt.bytes_entries[fqn]
        raw = chunks.reader.read_item_bytes(entry.file, entry.offset, entry.length, entry.transforms)
        try:
            values[fqn] = decode_value(raw)
        except CorruptValueError as exc:  # damaged or hostile, not merely foreign: no --exclude advice
            raise CheckpointError(ckpt.path / entry.file, f"bytes entry {fqn} at byte {entry.offset}: {exc}") from None
        except UnsafePickleError as exc:
            refused.append((fqn, str(exc)))
    if refused:
        shown = ", ".join(f"{fqn} ({why})" for fqn, why in refused[:3])
        more = f" (+{len(refused) - 3} more)" if len(refused) > 3 else ""
        raise CheckpointError(ckpt.path, f"{len(refused)} non-tensor {'entry' if len(refused) == 1 else 'entries'} "
                                         f"cannot be decoded without running code from the checkpoint: {shown}{more}; "
                                         f"leave {'it' if len(refused) == 1 else 'them'} out with "
                                         + " ".join(f"--exclude {fqn!r}" for fqn, _ in refused[:3]))
    return values


def plan_export_torch(ckpt: Checkpoint, opts: ExportTorchOptions, values: dict[str, Any], name: str,
                      archive: str, force_zip64: bool = False) -> ExportTorchPlan:
    """The file's layout: selected tensors (cast as asked, each whole and unsharded, flat
    optimizer buffers kept flat as torch keeps them) and `values`, nested as torch nests them.

    Pure: reads nothing. Tensors whose saved chunks do not cover them are refused.
    """
    tensors = [f for f in ckpt.tensors if selected(f, opts.include, opts.exclude)]
    sources = {f: source_view(ckpt.tensors[f]) for f in tensors}
    problems = [ckpt.rank_conflicts[f] for f in tensors if f in ckpt.rank_conflicts]
    problems += [f"{f}: {gap} of {math.prod(s.shape)} elements are in no saved chunk"
                 for f, s in sources.items() if (gap := math.prod(s.shape) - union_volume([r for _, r in s.chunks]))]
    if problems:
        more = f" (+{len(problems) - 1} more; see `ckptctl inspect --check`)" if len(problems) > 1 else ""
        raise CheckpointError(ckpt.path, f"refusing incomplete checkpoint: {problems[0]}{more}")
    slots = {f: TensorSlot(identity_target(sources[f], dtype=cast_dtype(sources[f].dtype, opts.dtype)))
             for f in tensors}
    leaves = [*slots.items(), *((f, Value(f, v)) for f, v in values.items())]
    tree = nest(leaves, ckpt.planner_data, len(ckpt.tensors) + len(ckpt.bytes_entries), str(ckpt.path))
    pickled, order = state_pickle(tree, str(ckpt.path))
    return ExportTorchPlan(placed_torch_save(name, archive, pickled, order, force_zip64), tree, order, sources)


def check_output(out: Path, force: bool, src: Path) -> None:
    """Refuse OUT inside the source (by device and inode, so also through a link or bind mount),
    OUT that is a directory, and an existing OUT unless forced."""
    if lands_in(out, src):
        raise UsageError(f"{out}: output is inside the source {src}; the source is never modified")
    store = store_for(out)
    if store.kind(out) is EntryKind.FOLDER:
        raise UsageError(f"{out}: is a directory (export-torch writes one file)")
    if store.exists(out) and not force:
        raise UsageError(f"{out}: output exists (pass --force to replace it)")


@recorded_reads()
def export_torch(
    src: Path,
    out: Path,
    opts: ExportTorchOptions,
    *,
    force: bool = False,
    verify: bool = False,
    progress: ProgressObserver | None = None,
    dry_run: bool = False,
) -> ExportTorchReport:
    """Write the checkpoint at `src` as one `torch.save` file at `out` and report what happened
    (`dry_run`: what would be written, writing nothing; an existing OUT is no error then)."""
    started = time.perf_counter()
    src, out = Path(src), Path(out)
    ckpt = open_checkpoint(src)
    kept_values = [f for f in ckpt.bytes_entries if selected(f, opts.include, opts.exclude)]
    kept = sum(selected(f, opts.include, opts.exclude) for f in ckpt.tensors) + len(kept_values)
    refuse_empty_selection(kept, len(ckpt.tensors) + len(ckpt.bytes_entries), opts.include, opts.exclude)
    check_output(out, force or dry_run, src)
    chunks = ChunkSource(ckpt)
    chunks.reader.dequantize_fp8 = True  # a TE Float8Tensor: its values, as TE dequantizes it (`dequantized`)
    try:
        values = read_values(ckpt, chunks, kept_values)
        plan = plan_export_torch(ckpt, opts, values, out.name, archive_name(out))
        execute = executor(opts.device)
        report = ExportTorchReport(src=str(src), out=str(out), tensors=len(plan.targets), values=len(values),
                                   bytes_written=plan.file.size, device=resolve_device(opts.device), dry_run=dry_run,
                                   dequantized=[t.fqn for t in plan.targets
                                                if chunks.reader.holds_float8(ckpt.tensors[t.fqn])])
        if dry_run:
            return report
        phases = Phases(progress)
        output = plan.output_plan(opts.sync)
        with store_for(out).atomic_file(out, force, opts.sync) as tmp:
            advance = phases.start("writing", plan.file.size)
            write_files(output, tmp.parent, {tmp.name}, execute, chunks, max(1, opts.workers), opts.sync, advance)
            output.finish(tmp.parent)
            phases.stop()
            report.write_bytes = plan.file.size
            timed_check(report, check_torch_save)(
                ckpt, tmp, out, {f"{plan.file.archive}/data/{i}": t for i, t in enumerate(plan.targets)}, plan.sources)
            if verify:
                verify_torch_save(tmp, out, plan, chunks, max(1, opts.workers),
                                  phases.start("verifying", 2 * plan.tensor_bytes))
                phases.stop()
                report.verified = True
    finally:
        chunks.close()
    report.finish(phases, started)
    return report


def verify_torch_save(path: Path, shown: Path, plan: ExportTorchPlan, chunks: ChunkSource, workers: int = 1,
                      advance: Advance | None = None) -> None:
    """Re-read the written file and compare it with the source; CheckpointError (naming `shown`) if it differs.

    Independent of the writer: torch.load (mmap, weights_only) gives the nested keys, dtypes,
    shapes, non-tensor values and where each tensor's storage lies; zipfile gives every
    record's place and CRC-32. Tensor bytes are then read back in row blocks (positioned
    reads, so memory stays one block per worker) and compared with the source assembled
    block by block, and with every source item decoded by torch itself (not by the reader
    the copy used).
    """
    import torch

    try:
        with torch.serialization.safe_globals(list(LOAD_SAFE_GLOBALS)):
            loaded = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        with zipfile.ZipFile(path) as archive:
            infos = {i.filename: i for i in archive.infolist()}
    except Exception as exc:  # noqa: BLE001 - whatever torch or zipfile raise, the file is not what was planned
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()] or [""]
        reason = next((line for line in lines if line.startswith("WeightsUnpickler error")), lines[0])
        raise CheckpointError(shown, f"cannot re-read for verification ({type(exc).__name__}: {reason})") from None
    tensors: list[Any] = []
    _match(plan.tree, loaded, (), tensors, shown)
    handle = store_for(path).open_read(path)
    read = handle.positioned_reader()
    try:
        places = [_record_place(read, infos, f"{plan.file.archive}/data/{i}", shown) for i in range(len(tensors))]
        bases = {t.untyped_storage().data_ptr() - at for t, (at, _) in zip(tensors, places) if t.numel()}
        if len(bases) > 1:
            raise CheckpointError(shown, "verification failed (tensors are not in the records planned for them)")

        def check(index: int) -> None:
            _check_record(read, places[index], plan.targets[index], plan.sources, chunks, shown)
            if advance is not None:
                advance(plan.targets[index].nbytes)

        run_on_threads(range(len(tensors)), check, workers, "ckptctl-verify")
    finally:
        handle.close()
    loaded_by_fqn = {target.fqn: tensor for target, tensor in zip(plan.targets, tensors)}
    check_decoded_source(chunks.ckpt, {t.fqn: t for t in plan.targets}, plan.sources,
                         tensor_read_back(loaded_by_fqn.__getitem__), shown, workers, advance)


def _record_place(read: Callable[[int, int], bytes], infos: dict[str, zipfile.ZipInfo], name: str, shown: Path) -> tuple[int, int]:
    """(offset of the record's data in the file, its CRC-32) as zipfile reads the central directory."""
    info = infos.get(name)
    if info is None or info.compress_type != zipfile.ZIP_STORED:
        raise CheckpointError(shown, f"verification failed ({name} missing or compressed)")
    header = read(_LOCAL_HEADER_BYTES, info.header_offset)
    name_len, extra_len = int.from_bytes(header[26:28], "little"), int.from_bytes(header[28:30], "little")
    return info.header_offset + _LOCAL_HEADER_BYTES + name_len + extra_len, info.CRC


def _check_record(read: Callable[[int, int], bytes], place: tuple[int, int], target: TargetTensor, sources: dict[str, SourceTensor],
                  chunks: ChunkSource, shown: Path) -> None:
    at, want_crc = place
    row = math.prod(target.shape[1:]) * target.dtype.itemsize if target.shape else 0
    crc = 0
    for box in row_blocks(target.shape, target.dtype.itemsize):
        want = assemble_bytes(StreamItem("", 0, b"", target, box, plan_box(target, box, sources)), chunks)
        got = read(len(want), at + (box.offsets[0] * row if box.offsets else 0))
        if got != want:
            raise CheckpointError(shown, f"{target.fqn}: verification failed (rows from {box.offsets[:1]} "
                                         f"differ from the source)")
        crc = crc32(got, crc)
    if crc != want_crc:
        raise CheckpointError(shown, f"{target.fqn}: verification failed (zip CRC-32 does not match the data)")


def _match(node: Any, got: Any, path: tuple, tensors: list[Any], shown: Path) -> None:
    """Walk the planned tree and the loaded one together; collect the loaded tensors in storage order."""
    import torch

    where = ".".join(map(str, path)) or "the top level"
    if type(node) is dict or type(node) is list:
        keys = list(node) if type(node) is dict else list(range(len(node)))
        if type(got) is not type(node) or (list(got) if type(got) is dict else list(range(len(got)))) != keys:
            raise CheckpointError(shown, f"verification failed ({where}: other keys than planned)")
        for key in keys:
            _match(node[key], got[key], (*path, key), tensors, shown)
    elif isinstance(node, TensorSlot):
        t = node.target
        if (not isinstance(got, torch.Tensor) or got.dtype != t.dtype.torch or tuple(got.shape) != t.shape
                or got.storage_offset() != 0 or not got.is_contiguous()):
            raise CheckpointError(shown, f"{t.fqn}: verification failed (not a {t.dtype} {list(t.shape)} tensor)")
        tensors.append(got)
    elif isinstance(node, Value):
        if not same_value(node.value, got):
            raise CheckpointError(shown, f"{node.fqn}: verification failed (value differs)")
    elif got is not None:
        raise CheckpointError(shown, f"verification failed ({where}: a value where none was planned)")


def same_value(want: Any, got: Any, _seen: set | None = None) -> bool:
    """A decoded value equals what torch loaded: ckptctl's dtype and size stand-ins equal torch's,
    NaNs equal NaNs, containers compare in order (a value that contains itself is compared once)."""
    seen = set() if _seen is None else _seen
    if (id(want), id(got)) in seen:
        return True
    seen.add((id(want), id(got)))
    if isinstance(want, DType):
        return want == got
    if isinstance(want, Size):
        return type(got).__name__ == "Size" and tuple(want) == tuple(got)
    if type(want) is not type(got):
        return False
    if isinstance(want, float):
        return want == got or (want != want and got != got)
    if isinstance(want, (list, tuple)):
        return len(want) == len(got) and all(same_value(a, b, seen) for a, b in zip(want, got))
    if isinstance(want, dict):
        return list(want) == list(got) and all(same_value(want[k], got[k], seen) for k in want)
    if isinstance(want, argparse.Namespace):
        return same_value(vars(want), vars(got), seen)
    return want == got
