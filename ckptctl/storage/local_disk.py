"""Kernel hints that let the disk keep up with the copy: blocks reserved up front, writeback started
early, bytes copied file to file in the kernel. The local store's write handles use them.

- **Reserve.** Output files get their blocks at creation (Linux `fallocate`), not one
  delayed allocation per page at writeback; a full disk then fails the run at its start
  instead of at the final fsync. Measured on the 2.2 GB bench reshard (alternating runs):
  durable 0.94 s → 0.85 s, `--no-sync` 0.67 s → 0.56 s. Where `fallocate` is missing or
  unsupported (tmpfs before 3.5, some network filesystems, other systems) the file is only
  sized (`ftruncate`): never the glibc emulation, which would write every byte twice.
- **Early writeback.** Output is fsynced before the atomic rename. Left to itself the kernel
  holds written pages and writes them back only then, so a run would copy at memory speed
  and then wait for the disk with the CPU idle. `sync_file_range(SYNC_FILE_RANGE_WRITE)`
  (start, do not wait) on each written range overlaps the disk's work with the copy, and
  the final fsync finds little left (2 GB reshard 1.4 s → 1.05 s). Elsewhere it does nothing.
- **In-kernel copies.** A record copied verbatim goes file to file by `copy_file_range` (a
  reflink or server-side copy where the filesystem has one), never through the process.
"""

from __future__ import annotations

import ctypes
import errno
import os
import sys

SYNC_FILE_RANGE_WRITE = 2
_UNSUPPORTED = (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


def _libc_function(name: str, argtypes: list) -> ctypes._CFuncPtr | None:
    """A function of the process's own libc, on Linux; None where it is not there."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        func = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return None
    func.argtypes = argtypes
    func.restype = ctypes.c_int
    return func


_SYNC_FILE_RANGE = _libc_function("sync_file_range", [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint])
_FALLOCATE = _libc_function("fallocate", [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64])


def reserve(fd: int, size: int) -> None:
    """Make `fd` `size` bytes long (reading as zeros) with its blocks allocated when the filesystem can.

    Raises OSError when the space is not there (ENOSPC, EFBIG, EDQUOT).
    """
    if _FALLOCATE is not None and size > 0:
        if _FALLOCATE(fd, 0, 0, size) == 0:
            return
        err = ctypes.get_errno()
        if err not in _UNSUPPORTED:
            raise OSError(err, os.strerror(err))
    os.ftruncate(fd, size)


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Ask the kernel to start writing bytes [offset, offset+length) of `fd` to disk; never waits, never fails."""
    if _SYNC_FILE_RANGE is not None:
        _SYNC_FILE_RANGE(fd, offset, length, SYNC_FILE_RANGE_WRITE)


_NO_KERNEL_COPY = (errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL)
"""Another filesystem, an old kernel, a filesystem or file kind without it: copied by hand instead."""


def copy_range(src_fd: int, dst_fd: int, length: int, src_offset: int, dst_offset: int) -> int:
    """Copy up to `length` bytes in the kernel; how many were copied, 0 where it cannot. Raises
    OSError for any other failure (a full disk)."""
    if not hasattr(os, "copy_file_range"):
        return 0
    try:
        return os.copy_file_range(src_fd, dst_fd, length, src_offset, dst_offset)
    except OSError as exc:
        if exc.errno in _NO_KERNEL_COPY:
            return 0
        raise
