"""Atomic output directories: a run that dies leaves DST absent or complete, never partial.

Work happens in a hidden sibling `.{name}.ckptctl-tmp-{pid}`; only a finished, fsynced tree
is renamed into place. Siblings left by runs that were killed (their pid is gone) are
removed by the next run. `sync=False` (`--no-sync`) skips the fsyncs: a killed process
still leaves DST absent or complete, but a crash of the machine may not.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import Iterator

from ckptctl.errors import OutputError, UsageError

_TMP_MARK = ".ckptctl-tmp-"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _clean_stale(dst: Path) -> None:
    prefix = f".{dst.name}{_TMP_MARK}"
    for sibling in dst.parent.glob(f"{prefix}*"):
        pid = sibling.name[len(prefix):].split("-")[0]
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            shutil.rmtree(sibling, ignore_errors=True)


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


def check_destination(dst: Path, force: bool, src: Path | None = None) -> None:
    """Refuse an existing DST unless forced, and a DST that is (or contains) the source."""
    if src is not None:
        s, d = src.resolve(), dst.resolve()
        if d == s or s in d.parents or d in s.parents:
            raise UsageError(f"{dst}: destination overlaps the source {src}; the source is never modified")
    if dst.exists() and not force:
        raise UsageError(f"{dst}: destination exists (pass --force to replace it)")
    if dst.exists() and not dst.is_dir():
        raise UsageError(f"{dst}: destination exists and is not a directory")


@contextlib.contextmanager
def atomic_directory(dst: Path, force: bool, tag: str = "", sync: bool = True) -> Iterator[Path]:
    """Yield a temporary sibling to fill; rename it to `dst` when the body finishes without error."""
    dst = Path(dst)
    tmp = dst.parent / f".{dst.name}{_TMP_MARK}{os.getpid()}{('-' + tag) if tag else ''}"
    try:
        dst.parent.mkdir(parents=True, exist_ok=True)
        _clean_stale(dst)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    except OSError as exc:
        raise OutputError(exc.filename or dst, f"cannot create: {exc.strerror or exc}") from None
    try:
        yield tmp
        if sync:
            fsync_tree(tmp)
        if dst.exists():
            if not force:
                raise UsageError(f"{dst}: destination appeared while writing (pass --force to replace it)")
            old = dst.parent / f".{dst.name}{_TMP_MARK}{os.getpid()}-old"
            os.rename(dst, old)
            os.rename(tmp, dst)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, dst)
        if sync:
            fsync_path(dst.parent)
    except OutputError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise OutputError(_as_seen(exc.path, tmp, dst), exc.reason) from None
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if not exc.filename or not any(_within(exc.filename, d) for d in (tmp, dst)):
            raise
        raise OutputError(_as_seen(exc.filename, tmp, dst), f"cannot write: {exc.strerror or exc}") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _within(path: str | os.PathLike, folder: Path) -> bool:
    path = Path(path)
    return path == folder or folder in path.parents


def _as_seen(path: str | os.PathLike, tmp: Path, dst: Path) -> Path:
    """A path inside the temporary directory, named as the user will look for it: inside DST."""
    return dst / Path(path).relative_to(tmp) if _within(path, tmp) else Path(path)
