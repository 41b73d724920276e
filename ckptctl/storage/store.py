"""The one interface formats and engines read and write checkpoint bytes through.

A `Store` lists a folder, says what an entry is (a folder, a file, nothing) and how large,
opens an entry for positioned reads,
creates output entries written at offsets, and puts an output folder or file in place
atomically. `LocalStore`, the local filesystem, is the one store today; an object store
(S3, GCS, Azure, `hf://`) plugs in as another `Store`, as torch DCP's `StorageReader` /
`StorageWriter` sit behind its planner, without touching the formats.

The local store opens inputs with `source_files.open_source` (regular files only, size
limits, each noted as a source read) and commits with `atomic` (temporary sibling, rename).
A hot loop that reads millions of times takes a handle's `positioned_reader()` once: a function
(length, offset) → bytes with no layer in between (locally `os.pread` bound to the descriptor).
No format, engine or command holds a descriptor: the kernel's tricks (blocks reserved, writeback
started early, in-kernel copies) are the local handles' own (`local_disk`), and a store without
them copies through `read_at` / `write_at`.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import fnmatch
import functools
import io
import mmap
import os
import stat
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Callable, ContextManager, Iterator

from ckptctl.storage.atomic import atomic_directory, atomic_file
from ckptctl.storage.file_window import FileWindow
from ckptctl.storage.local_disk import copy_range, reserve, start_writeback
from ckptctl.storage.source_files import open_source


class EntryKind(enum.Enum):
    """What is at a path, links followed (a broken link is MISSING), as `Path.exists` / `is_dir` /
    `is_file` tell it: how a command decides whether it was given a folder, a file or nothing."""

    MISSING = "missing"
    FOLDER = "folder"
    FILE = "file"
    OTHER = "other"
    """A FIFO, device or socket: refused where it is opened."""


@dataclass(frozen=True, slots=True)
class EntryInfo:
    """What a store says of one entry without opening it."""

    size: int
    regular: bool
    """A regular file (a local link to one counts); a folder, FIFO or device is not."""


class _Handle(ABC):
    """An entry a store opened, closed once done with."""

    path: Path

    @abstractmethod
    def close(self) -> None:
        """Let go of the entry (idempotent)."""

    def __enter__(self) -> "_Handle":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ReadHandle(_Handle):
    """An input entry opened for positioned reads; threads share it (no read moves a cursor)."""

    size: int

    @abstractmethod
    def read_at(self, length: int, offset: int) -> bytes:
        """At most `length` bytes from `offset` (fewer at the entry's end), in `os.pread`'s order."""

    @abstractmethod
    def readinto_at(self, buffer: memoryview | bytearray, offset: int) -> int:
        """Fill `buffer` from `offset`; the number of bytes read (fewer at the entry's end)."""

    @abstractmethod
    def version(self) -> tuple[int | str, ...]:
        """What changes when the entry read is rewritten, replaced or resized (`Store.version`, of
        the entry this handle holds open)."""

    def positioned_reader(self) -> Callable[[int, int], bytes]:
        """`read_at` as a plain function, taken once by a loop of millions of reads (the local
        store's is `os.pread` bound to its descriptor: no method call in between)."""
        return self.read_at

    @abstractmethod
    def whole(self) -> ContextManager[memoryview | mmap.mmap]:
        """The entry as one buffer, pages read as they are touched where the store can (local: an mmap)."""

    def window(self, start: int, length: int, max_read: int | None = None) -> io.RawIOBase:
        """Bytes [start, start + length) as a read-only seekable file, unbuffered, for readers that take
        one (zipfile); with `max_read`, a larger single read is refused (`file_window.FileWindow`)."""
        return FileWindow(self.positioned_reader(), start, length, max_read)


class WriteHandle(_Handle):
    """An output entry written at offsets (records land where the plan puts them, in any order)."""

    @abstractmethod
    def write_at(self, data: bytes | memoryview, offset: int) -> int:
        """Write some of `data` at `offset`; how many bytes were written (as `os.pwrite`)."""

    def positioned_writer(self) -> Callable[[bytes | memoryview, int], int]:
        """`write_at` as a plain function, taken once by a loop of millions of writes."""
        return self.write_at

    def write_all_at(self, data: bytes | memoryview, offset: int) -> None:
        """Write all of `data` at `offset`."""
        view = memoryview(data)
        while len(view):
            n = self.write_at(view, offset)
            view, offset = view[n:], offset + n

    @abstractmethod
    def sync(self) -> None:
        """Make what was written durable."""

    def reserve(self, size: int) -> None:
        """Prepare the entry for `size` bytes written at offsets (locally: sized, its blocks
        allocated, so a full disk fails the run at its start; OSError when the space is not there).
        By default nothing: a plan's writes cover every byte of its files."""

    def start_writeback(self, offset: int, length: int) -> None:
        """Hint that bytes [offset, offset + length) are final: the store may start making them
        durable while the run goes on. Never waits, never fails."""

    def copy_from(self, source: ReadHandle, length: int, source_offset: int, offset: int) -> int:
        """Copy up to `length` bytes of `source` from `source_offset` to `offset` without passing
        them through this process, where the store can (locally: `copy_file_range`); how many were
        copied, 0 when it cannot (the caller then reads and writes them)."""
        return 0


class Store(ABC):
    """Where a checkpoint's entries live: listed, sized, read at offsets, written, committed."""

    @abstractmethod
    def list(self, folder: Path) -> list[str]:
        """The names of `folder`'s entries, in no particular order."""

    @abstractmethod
    def exists(self, path: Path) -> bool:
        """Whether anything is at `path` (a broken link counts: what it is, opening it says)."""

    @abstractmethod
    def info(self, path: Path) -> EntryInfo:
        """Size and kind of the entry at `path`; OSError when there is none."""

    @abstractmethod
    def kind(self, path: Path) -> EntryKind:
        """Whether `path` is a folder, a file, something else or nothing (an object store: a prefix
        is a folder); OSError only for a reason other than absence (e.g. permission)."""

    def glob(self, folder: Path, pattern: str) -> list[Path]:
        """`folder`'s entries whose names match `pattern` (`fnmatch`, case-sensitive; a leading dot
        matched like any character, as `Path.glob` does), sorted; none when `folder` is not one."""
        try:
            names = self.list(folder)
        except (FileNotFoundError, NotADirectoryError, PermissionError):
            return []
        return sorted(folder / name for name in names if fnmatch.fnmatchcase(name, pattern))

    def size(self, path: Path) -> int:
        """The size of the entry at `path` in bytes."""
        return self.info(path).size

    @abstractmethod
    def version(self, path: Path) -> tuple[int | str, ...]:
        """What changes when the entry at `path` is rewritten, replaced or resized (an object
        store's generation or ETag); compared, never read. OSError when there is none."""

    @abstractmethod
    def open_read(self, path: Path, limit: int | None = None) -> ReadHandle:
        """Open input `path` for positioned reads: a regular entry of at most `limit` bytes, noted as a
        source read (it must not change before the output is committed); else a CheckpointError."""

    @abstractmethod
    def create(self, path: Path) -> WriteHandle:
        """A new, empty output entry at `path` (its folder made; an existing entry emptied)."""

    @abstractmethod
    def reopen(self, path: Path) -> WriteHandle:
        """Output entry `path`, written before, opened again to write at offsets (a trailer)."""

    @abstractmethod
    def write_stream(self, path: Path) -> ContextManager[BinaryIO]:
        """A new output entry at `path` written front to back as a file (a pickler's output)."""

    def write_whole(self, path: Path, data: bytes) -> None:
        """A new output entry at `path` holding `data`."""
        with self.write_stream(path) as out:
            out.write(data)

    @abstractmethod
    def atomic_folder(self, dst: Path, force: bool, tag: str = "", sync: bool = True) -> ContextManager[Path]:
        """A temporary folder to fill, put in place as `dst` only when the body finishes without
        error; on any failure nothing is left, and `dst` is untouched."""

    @abstractmethod
    def atomic_file(self, out: Path, force: bool, sync: bool = True) -> ContextManager[Path]:
        """A temporary path to fill, put in place as `out` only when the body finishes without error."""


def _local_version(found: os.stat_result) -> tuple[int, ...]:
    return found.st_dev, found.st_ino, found.st_size, found.st_mtime_ns


class _LocalDescriptor:
    """A local file's descriptor, closed once."""

    _fd: int

    def close(self) -> None:
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            os.close(fd)


class LocalReadHandle(_LocalDescriptor, ReadHandle):
    """A local file opened by `open_source`: its descriptor and size."""

    __slots__ = ("path", "size", "_fd")

    def __init__(self, path: Path, fd: int, size: int) -> None:
        self.path, self._fd, self.size = path, fd, size

    def read_at(self, length: int, offset: int) -> bytes:
        return os.pread(self._fd, length, offset)

    def readinto_at(self, buffer: memoryview | bytearray, offset: int) -> int:
        return os.preadv(self._fd, [buffer], offset)

    def positioned_reader(self) -> Callable[[int, int], bytes]:
        return functools.partial(os.pread, self._fd)

    def version(self) -> tuple[int, ...]:
        return _local_version(os.fstat(self._fd))

    @contextlib.contextmanager
    def whole(self) -> Iterator[mmap.mmap]:
        with mmap.mmap(self._fd, self.size, access=mmap.ACCESS_READ) as data:
            yield data


class LocalWriteHandle(_LocalDescriptor, WriteHandle):
    """A local output file's descriptor."""

    __slots__ = ("path", "_fd")

    def __init__(self, path: Path, fd: int) -> None:
        self.path, self._fd = path, fd

    def write_at(self, data: bytes | memoryview, offset: int) -> int:
        return os.pwrite(self._fd, data, offset)

    def positioned_writer(self) -> Callable[[bytes | memoryview, int], int]:
        return functools.partial(os.pwrite, self._fd)

    def sync(self) -> None:
        os.fsync(self._fd)

    def reserve(self, size: int) -> None:
        reserve(self._fd, size)

    def start_writeback(self, offset: int, length: int) -> None:
        start_writeback(self._fd, offset, length)

    def copy_from(self, source: ReadHandle, length: int, source_offset: int, offset: int) -> int:
        if not isinstance(source, LocalReadHandle):
            return 0
        return copy_range(source._fd, self._fd, length, source_offset, offset)


_ABSENT = (errno.ENOENT, errno.ENOTDIR, errno.EBADF, errno.ELOOP)
"""Errors that mean nothing usable is at a path: the ones `Path.exists` takes for "no"."""


class LocalStore(Store):
    """The local filesystem."""

    def list(self, folder: Path) -> list[str]:
        return os.listdir(folder)

    def exists(self, path: Path) -> bool:
        return os.path.lexists(path)

    def info(self, path: Path) -> EntryInfo:
        found = os.stat(path)
        return EntryInfo(found.st_size, stat.S_ISREG(found.st_mode))

    def kind(self, path: Path) -> EntryKind:
        try:
            mode = os.stat(path).st_mode
        except OSError as e:
            if e.errno in _ABSENT:
                return EntryKind.MISSING
            raise
        return EntryKind.FOLDER if stat.S_ISDIR(mode) else EntryKind.FILE if stat.S_ISREG(mode) else EntryKind.OTHER

    def version(self, path: Path) -> tuple[int, ...]:
        return _local_version(os.stat(path))

    def open_read(self, path: Path, limit: int | None = None) -> LocalReadHandle:
        fd, size = open_source(path, limit)
        return LocalReadHandle(path, fd, size)

    def create(self, path: Path) -> LocalWriteHandle:
        path.parent.mkdir(parents=True, exist_ok=True)
        return LocalWriteHandle(path, os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644))

    def reopen(self, path: Path) -> LocalWriteHandle:
        return LocalWriteHandle(path, os.open(path, os.O_WRONLY))

    def write_stream(self, path: Path) -> ContextManager[BinaryIO]:
        return open(path, "wb")

    def atomic_folder(self, dst: Path, force: bool, tag: str = "", sync: bool = True) -> ContextManager[Path]:
        return atomic_directory(dst, force, tag, sync)

    def atomic_file(self, out: Path, force: bool, sync: bool = True) -> ContextManager[Path]:
        return atomic_file(out, force, sync)


LOCAL_STORE = LocalStore()


def store_for(path: Path) -> Store:
    """The store that holds `path`. Only the local one today: an object store's URL is refused where
    it is opened (`source_files.missing`); here its store will be chosen by scheme."""
    return LOCAL_STORE
