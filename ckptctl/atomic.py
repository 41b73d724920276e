"""Atomic outputs: a run that dies leaves DST absent or complete, never partial, and never touches the source.

Work happens in a hidden sibling `.{name}.ckptctl-tmp-{pid}-{token}` that carries an owner
marker (`.ckptctl-owner`: host, boot id, pid and the process's start time); only a
finished, fsynced tree is renamed into place (a single file is written inside such a
directory and renamed out of it). A later run removes a sibling only when it carries the
marker and the marker names a process of this host that is gone (its pid absent, or
reused by a process that started at another time, or the host rebooted since). A
directory without the marker (a user's, whatever its name) and another host's run on a
shared filesystem are never removed. `sync=False` (`--no-sync`) skips the fsyncs: a
killed process still leaves DST absent or complete, but a crash of the machine may not.

`--force` over a DST that is a symbolic link replaces the link itself; its target is
never written into or removed.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import socket
import stat
from pathlib import Path
from typing import Iterator

from ckptctl.errors import OutputError, PathError, UsageError

_TMP_MARK = ".ckptctl-tmp-"
_NEW_MARK = ".ckptctl-new-"
"""A temporary directory is made under this name, marked, then renamed to its `_TMP_MARK` name:
a directory that has the temporary name always has a whole marker."""
MARKER = ".ckptctl-owner"
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


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _read_marker(folder: Path) -> dict | None:
    """The owner marker of `folder` (a real directory, not a link), or None when it has none."""
    try:
        if not stat.S_ISDIR(os.lstat(folder).st_mode) or not stat.S_ISREG(os.lstat(folder / MARKER).st_mode):
            return None
    except OSError:
        return None
    try:
        record = json.loads(_read_small(str(folder / MARKER)) or "")
    except ValueError:
        return None
    if not isinstance(record, dict) or record.get("ckptctl") != 1 or type(record.get("pid")) is not int:
        return None
    return record


def owner_gone(record: dict) -> bool:
    """True only when the marker's process is certainly gone: same host, and rebooted since, or its
    pid is free, or the pid now belongs to a process that started at another time."""
    if record.get("host") != socket.gethostname():
        return False  # another host's run, maybe live, on a shared filesystem: never ours to judge
    boot = _boot_id()
    if boot is not None and record.get("boot") is not None and record["boot"] != boot:
        return True
    pid = record["pid"]
    if not _alive(pid):
        return True
    start = process_start(pid)
    return start is not None and record.get("start") is not None and start != record["start"]


def _clean_stale(dst: Path) -> None:
    """Remove temporary siblings of `dst` that killed runs of this host left (marked ones only)."""
    prefix = f".{dst.name}{_TMP_MARK}"
    try:
        names = os.listdir(dst.parent)
    except OSError:
        return
    for name in names:
        if not name.startswith(prefix):
            continue
        record = _read_marker(dst.parent / name)
        if record is not None and owner_gone(record):
            shutil.rmtree(dst.parent / name, ignore_errors=True)


def _make_marked_dir(parent: Path, name: str, tag: str = "") -> Path:
    """A new, empty but for its marker, temporary directory for output `name` in `parent`."""
    token = f"{os.getpid()}{('-' + tag) if tag else ''}-{secrets.token_hex(4)}"
    staging = parent / f".{name}{_NEW_MARK}{token}"
    staging.mkdir()
    with open(staging / MARKER, "x") as fh:
        fh.write(json.dumps(owner_record()))
    tmp = parent / f".{name}{_TMP_MARK}{token}"
    os.rename(staging, tmp)
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
    Starts at the nearest existing ancestor when `path` does not exist."""
    path = Path(path) if Path(path).is_absolute() else Path.cwd() / path  # `..` left for the kernel
    while _identity(path) is None and path != path.parent:
        path = path.parent
    chain: list[tuple[int, int]] = []
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


def check_destination(dst: Path, force: bool, src: Path | None = None) -> None:
    """Refuse an existing DST unless forced, and a DST that is (or contains, or lies in) the source,
    by device and inode: a DST reached through a symlink or bind mount into the source is refused."""
    dst = Path(dst)
    if src is not None and (lands_in(dst, Path(src)) or holds(dst, Path(src))):
        raise UsageError(f"{dst}: destination overlaps the source {src}; the source is never modified")
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
        yield tmp
        os.unlink(tmp / MARKER)  # what is renamed into place is exactly what the body wrote
        if sync:
            fsync_tree(tmp)
        if os.path.lexists(dst):
            if not force:
                raise UsageError(f"{dst}: destination appeared while writing (pass --force to replace it)")
            trash = _discard(dst)
            os.rename(tmp, dst)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.rename(tmp, dst)
        if sync:
            fsync_path(dst.parent)
    except PathError as exc:  # a write or verification error inside the temporary directory names DST
        shutil.rmtree(tmp, ignore_errors=True)
        raise type(exc)(_as_seen(exc.path, tmp, dst), exc.reason) from None
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if not exc.filename or not any(_within(exc.filename, d) for d in (tmp, dst)):
            raise
        raise OutputError(_as_seen(exc.filename, tmp, dst), f"cannot write: {exc.strerror or exc}") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
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
        yield tmp
        if os.path.lexists(out) and not force:
            raise UsageError(f"{out}: output appeared while writing (pass --force to replace it)")
        os.replace(tmp, out)
        if sync:
            fsync_path(out.parent)
        shutil.rmtree(folder, ignore_errors=True)
    except PathError as exc:
        shutil.rmtree(folder, ignore_errors=True)
        raise type(exc)(out if _within(exc.path, folder) else exc.path, exc.reason) from None
    except OSError as exc:
        shutil.rmtree(folder, ignore_errors=True)
        if exc.filename is None or not (_within(exc.filename, folder) or Path(exc.filename) == out):
            raise
        raise OutputError(out, f"cannot write: {exc.strerror or exc}") from None
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise


def _within(path: str | os.PathLike, folder: Path) -> bool:
    path = Path(path)
    return path == folder or folder in path.parents


def _as_seen(path: str | os.PathLike, tmp: Path, dst: Path) -> Path:
    """A path inside the temporary directory, named as the user will look for it: inside DST."""
    return dst / Path(path).relative_to(tmp) if _within(path, tmp) else Path(path)
