"""Atomic outputs: a run that dies leaves DST absent or complete, never partial, and never touches the source.

Work happens in a hidden sibling `.{name}.ckptctl-tmp-{token}` whose owner marker lies
beside it, `.{name}.ckptctl-owner-{token}` (host, boot id, pid and the process's start
time), written before the directory is made and removed after it is renamed: so what is
renamed into place is exactly what the body wrote, and a run killed at any moment leaves
its temporary directory marked. Only a finished, fsynced tree is renamed into place (a
single file is written inside such a directory and renamed out of it). A later run
removes a sibling only when its marker names a process of this host that is gone (its
pid absent, or reused by a process that started at another time, or the host rebooted
since), and then the marker too. A directory without a marker (a user's, whatever its
name) and another host's run on a shared filesystem are never removed. `sync=False` (`--no-sync`) skips the fsyncs: a
killed process still leaves DST absent or complete, but a crash of the machine may not.

`--force` over a DST that is a symbolic link replaces the link itself; its target is
never written into or removed.

The source holds still, or nothing is put in place: while a command runs (`recorded_reads`),
each source file it opens is noted with its device, inode, size and modification time
(`note_read`: one fstat), and just before the output is renamed into place every one is
stat'ed again; one that differs fails the run (`refuse_changed_reads`), so an output never
mixes two versions of a file that was rewritten in place or replaced while it was read.
The same record lets `check_destination` refuse a DST over any file the run has read.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import socket
import stat
import threading
from pathlib import Path
from typing import Iterable, Iterator

from ckptctl.util.errors import CheckpointError, CkptctlError, OutputError, PathError, UsageError

_TMP_MARK = ".ckptctl-tmp-"
_OWNER_MARK = ".ckptctl-owner-"
_MARKER_LIMIT = 4096


def _read_small(path: str) -> str | None:
    try:
        with open(path, "rb") as fh:
            return fh.read(_MARKER_LIMIT).decode("ascii", "replace")
    except OSError:
        return None


def process_start(pid: int) -> int | None:
    """When `pid` started, in clock ticks since boot (`/proc/PID/stat` field 22), or None if unknown."""
    text = _read_small(f"/proc/{pid}/stat")
    if not text or ")" not in text:
        return None
    fields = text[text.rindex(")") + 2:].split()  # field 3 onwards; the name (field 2) may hold spaces
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


def _boot_id() -> str | None:
    text = _read_small("/proc/sys/kernel/random/boot_id")
    return text.strip() if text else None


def owner_record() -> dict:
    """What this process writes into its temporary directories' marker."""
    return {"ckptctl": 1, "host": socket.gethostname(), "boot": _boot_id(), "pid": os.getpid(),
            "start": process_start(os.getpid())}


def process_alive(pid: int) -> bool:
    """Whether a process `pid` exists (one of another user's counts: signalling it is refused)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _read_marker(marker: Path) -> dict | None:
    """The owner record in `marker` (a regular file, not a link), or None when it holds none."""
    try:
        if not stat.S_ISREG(os.lstat(marker).st_mode):
            return None
        record = json.loads(_read_small(str(marker)) or "")
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("ckptctl") != 1 or type(record.get("pid")) is not int:
        return None
    return record


def _marker_of(folder: Path) -> Path:
    """The owner marker beside temporary directory `folder` (`….ckptctl-tmp-T` → `….ckptctl-owner-T`)."""
    at = folder.name.rindex(_TMP_MARK)
    return folder.with_name(folder.name[:at] + _OWNER_MARK + folder.name[at + len(_TMP_MARK):])


def _remove_marked(folder: Path) -> None:
    """Remove a temporary directory of this process, then its marker."""
    shutil.rmtree(folder, ignore_errors=True)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(_marker_of(folder))


def owner_gone(record: dict) -> bool:
    """True only when the marker's process is certainly gone: same host, and rebooted since, or its
    pid is free, or the pid now belongs to a process that started at another time."""
    if record.get("host") != socket.gethostname():
        return False  # another host's run, maybe live, on a shared filesystem: never ours to judge
    boot = _boot_id()
    if boot is not None and record.get("boot") is not None and record["boot"] != boot:
        return True
    pid = record["pid"]
    if not process_alive(pid):
        return True
    start = process_start(pid)
    return start is not None and record.get("start") is not None and start != record["start"]


def _clean_stale(dst: Path) -> None:
    """Remove temporary siblings of `dst` (real directories, never links) that killed runs of this
    host left, and their markers: only those a marker names."""
    marks = f".{dst.name}{_OWNER_MARK}"
    try:
        names = os.listdir(dst.parent)
    except OSError:
        return
    for name in names:
        if not name.startswith(marks):
            continue
        record = _read_marker(dst.parent / name)
        if record is None or not owner_gone(record):
            continue
        folder = dst.parent / f".{dst.name}{_TMP_MARK}{name[len(marks):]}"
        try:
            is_dir = stat.S_ISDIR(os.lstat(folder).st_mode)
        except FileNotFoundError:
            is_dir = None  # its run got as far as removing it: only the marker is left
        except OSError:
            continue
        if is_dir is False:  # a link or a file under a temporary name: not ours to remove
            continue
        if is_dir:
            shutil.rmtree(folder, ignore_errors=True)
        with contextlib.suppress(OSError):
            os.unlink(dst.parent / name)


def _make_marked_dir(parent: Path, name: str, tag: str = "") -> Path:
    """A new, empty temporary directory for output `name` in `parent`, its marker written first;
    neither is left when making them fails or is interrupted (Ctrl-C between the two)."""
    token = f"{os.getpid()}{('-' + tag) if tag else ''}-{secrets.token_hex(4)}"
    tmp = parent / f".{name}{_TMP_MARK}{token}"
    try:
        with open(_marker_of(tmp), "x") as fh:
            fh.write(json.dumps(owner_record()))
        tmp.mkdir()
    except FileExistsError:  # another run's of the same token (its pid and 32 random bits): not ours
        raise
    except BaseException:
        _remove_marked(tmp)
        raise
    return tmp


def fsync_path(path: Path) -> None:
    """fsync a file or directory by path."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file and directory under `root`, itself last (quick for files already synced)."""
    for folder, dirs, files in os.walk(root, topdown=False):
        for name in (*files, *dirs):
            fsync_path(Path(folder) / name)
    fsync_path(root)


def _identity(path: Path) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def physical_ancestry(path: Path) -> list[tuple[int, int]]:
    """(st_dev, st_ino) of `path` (links followed) and of every directory above it as the kernel
    walks `..`: what a path really is, whatever symlinks or bind mounts it was reached through.
    Starts at the nearest existing ancestor when `path` does not exist; a file is followed by the
    directories above where it really lies (`file/..` is no path)."""
    path = Path(path) if Path(path).is_absolute() else Path.cwd() / path  # `..` left for the kernel
    while _identity(path) is None and path != path.parent:
        path = path.parent
    chain: list[tuple[int, int]] = []
    if not path.is_dir() and (ident := _identity(path)) is not None:
        chain.append(ident)
        path = Path(os.path.realpath(path)).parent
    here = str(path)
    while (ident := _identity(Path(here))) is not None and ident not in chain:
        chain.append(ident)
        here = os.path.join(here, "..")
    return chain


def lands_in(path: Path, src: Path) -> bool:
    """True when writing `path` (a file or directory to be created or replaced) would write into
    `src` or `src` itself: its parent, or the existing `path` followed through links, lies in `src`."""
    ident = _identity(src)
    if ident is None:
        return False
    path = Path(path) if Path(path).is_absolute() else Path.cwd() / path
    return ident in physical_ancestry(path.parent) or ident in (
        physical_ancestry(path) if _identity(path) is not None else [])


def holds(path: Path, src: Path) -> bool:
    """True when an existing `path` (links followed) is `src` or one of the directories above it."""
    ident = _identity(path)
    return ident is not None and ident in physical_ancestry(src)


def overlapped_input(dst: Path, inputs: Iterable[Path]) -> Path | None:
    """The first of `inputs` (files or directories) that writing or replacing `dst` would touch:
    `dst` is one of them or a directory above one, or lies inside one, by device and inode (so
    also through a symlink or bind mount). None when `dst` touches none."""
    for path in inputs:
        if lands_in(dst, Path(path)) or holds(dst, Path(path)):
            return Path(path)
    return None


def check_destination(dst: Path, force: bool, src: Path | None = None) -> None:
    """Refuse an existing DST unless forced, and a DST that is (or contains, or lies in) the source
    or is (or contains) a file the command has read so far (`read_paths`: export-hf's config and
    the side files it copies), by device and inode: a DST reached through a symlink or bind mount
    into the source is refused. A file source's folder is not the source: DST may lie beside it."""
    dst = Path(dst)
    if src is not None and overlapped_input(dst, [Path(src)]) is not None:
        raise UsageError(f"{dst}: destination overlaps the source {src}; the source is never modified")
    read = overlapped_input(dst, read_paths())
    if read is not None:
        raise UsageError(f"{dst}: destination overlaps {read}, which this run reads; the source is never modified")
    if os.path.lexists(dst) and not force:
        raise UsageError(f"{dst}: destination exists (pass --force to replace it)")
    if os.path.lexists(dst) and not dst.is_symlink() and not dst.is_dir():
        raise UsageError(f"{dst}: destination exists and is not a directory")


def _discard(dst: Path) -> Path:
    """Move an existing `dst` (a directory, or a link: the link itself) out of the way, into a
    marked temporary directory that is removed next (or by a later run if this one dies)."""
    trash = _make_marked_dir(dst.parent, dst.name, "old")
    os.rename(dst, trash / dst.name)
    return trash


@contextlib.contextmanager
def atomic_directory(dst: Path, force: bool, tag: str = "", sync: bool = True) -> Iterator[Path]:
    """Yield a marked temporary sibling to fill; rename it to `dst` when the body finishes without error."""
    dst = Path(dst)
    try:
        dst.parent.mkdir(parents=True, exist_ok=True)
        _clean_stale(dst)
        tmp = _make_marked_dir(dst.parent, dst.name, tag)
    except OSError as exc:
        raise OutputError(exc.filename or dst, f"cannot create: {exc.strerror or exc}") from None
    try:
        with changed_reads_first(tmp):
            yield tmp
        if sync:
            fsync_tree(tmp)
        refuse_changed_reads(tmp)
        if os.path.lexists(dst):
            if not force:
                raise UsageError(f"{dst}: destination appeared while writing (pass --force to replace it)")
            trash = _discard(dst)
            os.rename(tmp, dst)
            _remove_marked(trash)
        else:
            os.rename(tmp, dst)
        os.unlink(_marker_of(tmp))
        if sync:
            fsync_path(dst.parent)
    except PathError as exc:  # a write or verification error inside the temporary directory names DST
        _remove_marked(tmp)
        raise type(exc)(_as_seen(exc.path, tmp, dst), exc.reason) from None
    except OSError as exc:
        _remove_marked(tmp)
        if not exc.filename or not any(_within(exc.filename, d) for d in (tmp, dst)):
            raise
        raise OutputError(_as_seen(exc.filename, tmp, dst), f"cannot write: {exc.strerror or exc}") from None
    except BaseException:
        _remove_marked(tmp)
        raise


@contextlib.contextmanager
def atomic_file(out: Path, force: bool, sync: bool = True) -> Iterator[Path]:
    """Yield the path of a temporary file to fill (and fsync), named as `out`, inside a marked
    temporary sibling directory; rename it to `out` once the body succeeds.

    The single-file counterpart of `atomic_directory`, with the same marker and clean-up:
    errors name `out`, never the temporary file, which is removed on any failure. An `out`
    that is a symbolic link is replaced by the file (the link's target is not written).
    """
    out = Path(out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        _clean_stale(out)
        folder = _make_marked_dir(out.parent, out.name)
    except OSError as exc:
        raise OutputError(exc.filename or out, f"cannot create: {exc.strerror or exc}") from None
    tmp = folder / out.name
    try:
        with changed_reads_first(folder):
            yield tmp
        refuse_changed_reads(folder)
        if os.path.lexists(out) and not force:
            raise UsageError(f"{out}: output appeared while writing (pass --force to replace it)")
        os.replace(tmp, out)
        if sync:
            fsync_path(out.parent)
        _remove_marked(folder)
    except PathError as exc:
        _remove_marked(folder)
        raise type(exc)(out if _within(exc.path, folder) else exc.path, exc.reason) from None
    except OSError as exc:
        _remove_marked(folder)
        if exc.filename is None or not (_within(exc.filename, folder) or Path(exc.filename) == out):
            raise
        raise OutputError(out, f"cannot write: {exc.strerror or exc}") from None
    except BaseException:
        _remove_marked(folder)
        raise


def _within(path: str | os.PathLike, folder: Path) -> bool:
    path = Path(path)
    return path == folder or folder in path.parents


def _as_seen(path: str | os.PathLike, tmp: Path, dst: Path) -> Path:
    """A path inside the temporary directory, named as the user will look for it: inside DST."""
    return dst / Path(path).relative_to(tmp) if _within(path, tmp) else Path(path)


_reads_lock = threading.Lock()
_reads: dict[str, tuple[str, tuple[int, int, int, int]]] | None = None
"""While a command runs: each source file it opened (by absolute path) → the path as it was opened
and what the file was then (`_seen`); None when no command runs."""
_commands = 0


@contextlib.contextmanager
def recorded_reads() -> Iterator[None]:
    """Note the files opened from here to the block's end (`note_read`) for the checks before the
    output's rename; a command's function wears it as a decorator (`@recorded_reads()`). Nested
    commands share the outermost record. Outside any, nothing is noted (inspect, diff, a library
    caller's `open_checkpoint`): a long-lived process keeps no record of what it read."""
    global _reads, _commands
    with _reads_lock:
        _commands += 1
        if _commands == 1:
            _reads = {}
    try:
        yield
    finally:
        with _reads_lock:
            _commands -= 1
            if _commands == 0:
                _reads = None


def _seen(info: os.stat_result) -> tuple[int, int, int, int]:
    return info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns


def note_read(path: str | os.PathLike, fd: int) -> None:
    """Note source file `path`, just opened as `fd`, as it is now (kept from its first opening on)."""
    if _reads is None:
        return
    seen = _seen(os.fstat(fd))
    with _reads_lock:
        if _reads is not None:
            _reads.setdefault(os.path.abspath(path), (os.fspath(path), seen))


def read_paths() -> list[Path]:
    """The files noted so far by the running command (none outside `recorded_reads`)."""
    with _reads_lock:
        return [Path(shown) for shown, _ in (_reads or {}).values()]


def refuse_changed_reads(skip: Path | None = None) -> None:
    """CheckpointError naming the first noted file (outside `skip`: the output's own temporary
    directory, which verification reads) that is no longer what it was when it was opened:
    another inode, size or modification time, or gone."""
    with _reads_lock:
        noted = list((_reads or {}).items())
    skip = Path(os.path.abspath(skip)) if skip is not None else None
    for path, (shown, seen) in noted:
        if skip is not None and _within(path, skip):
            continue
        try:
            now = _seen(os.stat(path))
        except OSError:
            now = None
        if now != seen:
            raise CheckpointError(shown, "changed while it was read (rewritten, replaced or resized since it was "
                                         "opened); no output is written")


@contextlib.contextmanager
def changed_reads_first(skip: Path) -> Iterator[None]:
    """A body's error stands only if no source file changed: a changed one explains it (an output
    sample that differs from the source, an item that no longer reads) and is named instead."""
    try:
        yield
    except CkptctlError:
        refuse_changed_reads(skip)
        raise
