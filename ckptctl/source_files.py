"""Opening a file a command reads from its input: a regular file, of a plausible size, noted.

A FIFO blocks an open or a read forever and a device (`/dev/zero`) never ends, so every input
file is opened without blocking and must be a regular file (a link to one is followed), no
larger than its kind ever is, before a byte is read. Each is noted as a source read
(`atomic.note_read`): it must not change before the output is put in place.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from ckptctl.atomic import note_read
from ckptctl.errors import CheckpointError

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def open_source(path: Path, limit: int | None = None) -> tuple[int, int]:
    """A read-only descriptor of regular file `path` and its size; anything but a regular file, or
    a file over `limit` bytes, is refused (a CheckpointError naming it) before a byte is read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise CheckpointError(path, f"cannot open: {exc.strerror or exc}") from None
    info = os.fstat(fd)
    problem = None
    if not stat.S_ISREG(info.st_mode):
        kind = next((name for test, name in _KINDS if test(info.st_mode)), "a special file")
        problem = f"not a regular file ({kind})"
    elif limit is not None and info.st_size > limit:
        problem = f"implausibly large ({info.st_size} bytes; at most {limit} are read)"
    if problem is not None:
        os.close(fd)
        raise CheckpointError(path, problem)
    note_read(path, fd)
    return fd, info.st_size
