"""A store without descriptors, standing in for an object store's client: entries read and written
as bytes at offsets (ranged GETs, parts of an upload), nothing else. No `os.pread` on a shared
descriptor, no in-kernel copy, no block reservation, no writeback hint, no mmap: every such
shortcut of the local store falls back to the `Store` interface's own defaults. Listing, kinds,
versions, the source checks of `open_source` and the atomic commit stay the local filesystem's
(the files are local; what differs is only how their bytes are reached).

`python -m tests.storage.plain_store ARGS` runs the `ckptctl` program with this store in place of
the local one: what the seam test (`test_store_seam.py`) proves by reading the code, this proves by
running it: outputs written through it are byte-identical to the local store's.
"""

from __future__ import annotations

import contextlib
import io
import threading
from pathlib import Path
from typing import BinaryIO, ContextManager, Iterator

from ckptctl.storage import store
from ckptctl.storage.store import LOCAL_STORE, EntryInfo, EntryKind, ReadHandle, Store, WriteHandle


class _PlainRead(ReadHandle):
    """Reads of a Python file object under a lock (seek, then read): no descriptor handed out."""

    def __init__(self, path: Path, size: int, version: tuple[int | str, ...]) -> None:
        self.path, self.size, self._version = path, size, version
        self._file: io.BufferedReader | None = open(path, "rb")  # noqa: SIM115 - closed by close()
        self._lock = threading.Lock()

    def read_at(self, length: int, offset: int) -> bytes:
        with self._lock:
            self._file.seek(offset)
            return self._file.read(length)

    def readinto_at(self, buffer: memoryview | bytearray, offset: int) -> int:
        with self._lock:
            self._file.seek(offset)
            return self._file.readinto(buffer)

    @contextlib.contextmanager
    def whole(self) -> Iterator[memoryview]:
        yield memoryview(self.read_at(self.size, 0))

    def version(self) -> tuple[int | str, ...]:
        return self._version

    def close(self) -> None:
        if self._file is not None:
            file, self._file = self._file, None
            file.close()


class _PlainWrite(WriteHandle):
    """Writes of a Python file object under a lock (seek, then write)."""

    def __init__(self, path: Path, mode: str) -> None:
        self.path = path
        self._file: io.BufferedRandom | None = open(path, mode)  # noqa: SIM115 - closed by close()
        self._lock = threading.Lock()

    def write_at(self, data: bytes | memoryview, offset: int) -> int:
        with self._lock:
            self._file.seek(offset)
            return self._file.write(data)

    def sync(self) -> None:
        with self._lock:
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            file, self._file = self._file, None
            file.close()


class PlainStore(Store):
    """Local files reached only through positioned reads and writes of bytes."""

    def list(self, folder: Path) -> list[str]:
        return LOCAL_STORE.list(folder)

    def exists(self, path: Path) -> bool:
        return LOCAL_STORE.exists(path)

    def info(self, path: Path) -> EntryInfo:
        return LOCAL_STORE.info(path)

    def kind(self, path: Path) -> EntryKind:
        return LOCAL_STORE.kind(path)

    def version(self, path: Path) -> tuple[int | str, ...]:
        return LOCAL_STORE.version(path)

    def open_read(self, path: Path, limit: int | None = None) -> ReadHandle:
        with LOCAL_STORE.open_read(path, limit) as checked:  # a regular file within its limit, noted as read
            size, version = checked.size, checked.version()
        return _PlainRead(path, size, version)

    def create(self, path: Path) -> WriteHandle:
        path.parent.mkdir(parents=True, exist_ok=True)
        return _PlainWrite(path, "w+b")

    def reopen(self, path: Path) -> WriteHandle:
        return _PlainWrite(path, "r+b")

    def write_stream(self, path: Path) -> ContextManager[BinaryIO]:
        return LOCAL_STORE.write_stream(path)

    def atomic_folder(self, dst: Path, force: bool, tag: str = "", sync: bool = True) -> ContextManager[Path]:
        return LOCAL_STORE.atomic_folder(dst, force, tag, sync)

    def atomic_file(self, out: Path, force: bool, sync: bool = True) -> ContextManager[Path]:
        return LOCAL_STORE.atomic_file(out, force, sync)


if __name__ == "__main__":
    import sys

    store.LOCAL_STORE = PlainStore()  # `store_for` answers with it from now on
    sys.argv[0] = "ckptctl"
    from ckptctl.cli import run

    run()
