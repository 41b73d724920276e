"""`reshard` of an HF Trainer / accelerate checkpoint folder (`storage.trainer_folder`): every DCP
part resharded to the same world size into the same folder names, and the files of no rank copied
byte for byte, all inside one atomic output.

A resumed job loads the model and optimizer parts together, so they are written together: DST
appears whole or not at all. Each part is an ordinary `reshard` (planned, written, checked),
into the output's temporary directory. The per-rank files follow only a reshard to their own
world size (`core.rank_state.refuse_world_size_change`); `--exclude` drops them by name, and
`--keep-common-ranks` keeps those of the ranks both sizes have (`core.rank_state.common_ranks`).
"""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from ckptctl.commands.reshard import ReshardOptions, ReshardReport, reshard
from ckptctl.core.rank_state import common_ranks, refuse_world_size_change
from ckptctl.core.selection import selected
from ckptctl.engine.dist import LOCAL, Comm
from ckptctl.storage.atomic import check_destination
from ckptctl.storage.store import store_for
from ckptctl.storage.trainer_folder import TrainerFolder
from ckptctl.util.errors import CheckpointError, OutputError, UsageError
from ckptctl.util.progress import ProgressObserver, RunTiming

_BLOCK = 1 << 22


@dataclass
class FolderReport(RunTiming):
    """What a folder reshard did: each part's report, and the files copied or dropped."""

    src: str = ""
    dst: str = ""
    world_size: int = 0
    dry_run: bool = False
    parts: dict[str, ReshardReport] = field(default_factory=dict)
    copied: dict[str, int] = field(default_factory=dict)
    """Each file copied byte for byte, by name: its size."""
    dropped: tuple[str, ...] = ()


def _refuse_unreshardable(folder: TrainerFolder, opts: ReshardOptions, comm: Comm) -> None:
    if comm.world_size > 1:
        raise UsageError(f"{folder.path}: a Trainer checkpoint folder is resharded by one process; run it without "
                         "torchrun")
    if opts.megatron:
        raise UsageError(f"{folder.path}: a Trainer checkpoint folder's parts are resharded as FSDP2 saves them; "
                         "--layout, --tp, --dp and the other Megatron options apply to Megatron checkpoints")
    if opts.include:
        raise UsageError("--include selects the entries of one DCP checkpoint; on a Trainer checkpoint folder pass "
                         f"one of its parts ({', '.join(str(folder.path / p) for p in folder.parts)}) or use "
                         "--exclude")
    if folder.rank_shards:
        raise CheckpointError(folder.path / folder.rank_shards[0],
                              "a process's shard saved with use_dcp=False (torch.save); ckptctl reshards DCP parts "
                              "only")
    if folder.others:
        raise CheckpointError(folder.path / folder.others[0], "neither a DCP part of the Trainer checkpoint folder "
                                                              "nor a file: no rule carries it to another world size")


def _copy(src: Path, dst: Path) -> int:
    """Copy file `src` to the new file `dst` byte for byte and read the copy back: the same bytes, or an error."""
    digest = hashlib.sha256()
    size = 0
    with store_for(src).open_read(src) as source, store_for(dst).write_stream(dst) as out:
        while block := source.read_at(_BLOCK, size):
            digest.update(block)
            out.write(block)
            size += len(block)
    check = hashlib.sha256()
    with store_for(dst).open_read(dst) as back:
        at = 0
        while block := back.read_at(_BLOCK, at):
            check.update(block)
            at += len(block)
    if check.digest() != digest.digest():
        raise OutputError(dst, "the copy reads back different bytes than its source")
    return size


def _snapshot(folder: TrainerFolder, files: list[str]) -> dict[Path, tuple[int | str, ...] | None]:
    """What each file of the parts and each of `files` is now (its store's `version`: locally device, inode,
    size, modification time)."""
    store = store_for(folder.path)
    paths = [folder.path / n for n in files]
    for part in folder.parts:
        paths += [folder.path / part / name for name in store.list(folder.path / part)]
    seen: dict[Path, tuple[int | str, ...] | None] = {}
    for path in paths:
        try:
            seen[path] = store.version(path)
        except OSError:
            seen[path] = None
    return seen


def reshard_folder(folder: TrainerFolder, dst: str | os.PathLike, opts: ReshardOptions, *, force: bool = False,
                   verify: bool = False, dry_run: bool = False, progress: ProgressObserver | None = None,
                   comm: Comm = LOCAL, keep_common_ranks: bool = False) -> FolderReport:
    """Reshard every part of `folder` to `opts.world_size` into the same names under `dst`, copy
    its files of no rank, and refuse per-rank files of another world size unless excluded (or, with
    `keep_common_ranks`, keep those of the ranks both sizes have).

    Each part's reshard keeps its own record of what it read (`recorded_reads`), checked before
    the part takes its name inside the output; the folder's files, read or not, must still be
    what they were at the start when the whole output takes its name (`_snapshot`)."""
    started = time.perf_counter()
    dst = Path(dst)
    _refuse_unreshardable(folder, opts, comm)
    keep = [n for n in folder.files if selected(n, (), opts.exclude)]
    dropped = tuple(n for n in folder.files if n not in keep)
    for state in folder.rank_files:
        kept = [n for n in state.names if selected(n, (), opts.exclude)]
        if kept and len(kept) < len(state.names):
            raise UsageError(f"--exclude keeps {len(kept)} of the {len(state.names)} files of {state.shown}: drop "
                             f"them all (--exclude '{state.glob}') or none")
        if kept and keep_common_ranks and opts.world_size is not None and state.ranks != opts.world_size:
            kept = list(common_ranks(state, opts.world_size))
        elif opts.world_size is not None:
            refuse_world_size_change([state], lambda n: n in kept, opts.world_size)
        keep += kept
        dropped += tuple(n for n in state.names if n not in kept)
    report = FolderReport(src=str(folder.path), dst=str(dst), world_size=opts.world_size or 0, dry_run=dry_run,
                          dropped=tuple(sorted(dropped)))
    if dry_run:
        for part in folder.parts:
            report.parts[part] = reshard(folder.path / part, dst / part, opts, dry_run=True, comm=comm)
        report.copied = {n: store_for(folder.path).size(folder.path / n) for n in sorted(keep)}
        return report
    check_destination(dst, force, folder.path)
    before = _snapshot(folder, keep)
    with store_for(dst).atomic_folder(dst, force, sync=opts.sync) as tmp:
        for part in folder.parts:
            report.parts[part] = reshard(folder.path / part, tmp / part, opts, verify=verify, progress=progress,
                                         comm=comm)
            report.parts[part].dst = str(dst / part)
        for name in sorted(keep):
            report.copied[name] = _copy(folder.path / name, tmp / name)
        after = _snapshot(folder, keep)
        changed = next((p for p in sorted(set(before) | set(after)) if before.get(p) != after.get(p)), None)
        if changed is not None:
            raise CheckpointError(changed, "changed while the folder was resharded (rewritten, replaced, resized, "
                                           "added or removed); no output is written")
    first = report.parts[folder.parts[0]]
    report.processes, report.device = first.processes, first.device
    report.verified = all(r.verified for r in report.parts.values())
    report.write_bytes = sum(r.write_bytes for r in report.parts.values())
    report.seconds = time.perf_counter() - started
    report.write_seconds = sum(r.write_seconds for r in report.parts.values())
    report.verify_seconds = sum(r.verify_seconds for r in report.parts.values())
    report.check_seconds = sum(r.check_seconds for r in report.parts.values())
    report.peak_rss_bytes = max(r.peak_rss_bytes for r in report.parts.values())
    return report
