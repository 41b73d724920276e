"""Part of an open file as a file: what a format's own reader (zipfile, torch's) reads an item through.

A DCP item is a whole archive at (offset, length) inside a rank file; readers that take a file
object find its central directory from its end, so they are handed the item's bytes alone, read
with positioned reads (threads share the file), never copied out first.
"""

from __future__ import annotations

import io
import zipfile
from typing import Any, Callable


class FileWindow(io.RawIOBase):
    """Bytes [start, start + length) of an open entry, read by `read_at` ((length, offset) → bytes,
    a handle's `positioned_reader`), as a read-only, seekable file. With `max_read`, a larger
    single read is refused: a zip directory declaring a huge size cannot make its reader allocate it."""

    def __init__(self, read_at: Callable[[int, int], bytes], start: int, length: int,
                 max_read: int | None = None) -> None:
        self.read_at, self.start, self.length, self.pos, self.max_read = read_at, start, length, 0, max_read

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        self.pos = max(0, (0, self.pos, self.length)[whence] + pos)
        return self.pos

    def tell(self) -> int:
        return self.pos

    def read(self, size: int = -1) -> bytes:
        n = max(0, self.length - self.pos) if size is None or size < 0 else size
        buffer = bytearray(self._allowed(n))
        return bytes(buffer[:self.readinto(buffer)])

    def readinto(self, buffer: Any) -> int:
        data = self.read_at(max(0, min(self._allowed(len(buffer)), self.length - self.pos)), self.start + self.pos)
        buffer[:len(data)] = data
        self.pos += len(data)
        return len(data)

    def _allowed(self, n: int) -> int:
        if self.max_read is not None and min(n, self.length - self.pos) > self.max_read:
            raise zipfile.BadZipFile(f"zip structure of {n} bytes is implausibly large")
        return n


def window(read_at: Callable[[int, int], bytes], start: int, length: int,
           max_read: int | None = None) -> io.BufferedReader:
    """`FileWindow` buffered, as readers expect a file to be."""
    return io.BufferedReader(FileWindow(read_at, start, length, max_read))
