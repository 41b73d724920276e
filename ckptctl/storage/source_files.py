"""Opening a file a command reads from its input: a regular file, of a plausible size, noted;
and, for a path that is not there or holds no checkpoint, a line that says what to pass instead.

A FIFO blocks an open or a read forever and a device (`/dev/zero`) never ends, so every input
file is opened without blocking and must be a regular file (a link to one is followed), no
larger than its kind ever is, before a byte is read. Each is noted as a source read
(`atomic.note_read`): it must not change before the output is put in place.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path
from typing import Callable

from ckptctl.storage.atomic import note_read
from ckptctl.util.errors import CheckpointError

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


_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*:/")
"""A URL's scheme (`s3://b/k` is `s3:/b/k` once a `Path`)."""
LISTED = 3
"""Checkpoints inside a folder named in a refusal."""


def looks_like_repo_id(text: str) -> bool:
    """`org/name` as the Hub spells model ids (one slash, no `..`, no leading `.` or `/`)."""
    return bool(_REPO_ID.fullmatch(text)) and ".." not in text and "--" not in text \
        and not text.endswith((".", "-"))


def as_typed(path: Path) -> str:
    """`path` as the user typed it: an object store's URL with its `//` back (`Path` folds it)."""
    text = str(path)
    match = _URL.match(text)
    return text if match is None or text[match.end():].startswith("/") else f"{match.group()}/{text[match.end():]}"


def missing(path: Path, model_folder: bool = False) -> str:
    """Why `path`, which does not exist, cannot be read: an object store's URL, nothing there, or
    (where a Hugging Face model folder is wanted) a Hub model id, which a local path also looks
    like (`out/ckpt`), so only there."""
    if _URL.match(str(path)):
        return "object stores are not supported yet: copy the checkpoint to a local folder first"
    if model_folder and looks_like_repo_id(str(path)):
        return ("no such file or directory; a Hub model id is read by --hf-config only: download the model "
                f"first (`huggingface-cli download {path} --local-dir DIR`) and pass DIR")
    return "no such file or directory"


def checkpoints_inside(folder: Path, is_checkpoint: Callable[[Path], bool], scanned: int = 1000) -> str:
    """`; checkpoints inside: A, B, C (+N more)` when folders among the first `scanned` entries of
    `folder` are checkpoints (a run's parent folder, or `demo` for `demo/ckpt`; Trainer checkpoint
    folders count), else nothing. An HF Trainer / accelerate checkpoint folder names its parts, and
    the commands that take it whole."""
    from ckptctl.storage.trainer_folder import trainer_folder  # it reads no file: no cycle at import

    if (trainer := trainer_folder(folder)) is not None:
        return ("; an HF Trainer / accelerate checkpoint folder: inspect, reshard and export-hf take it whole, "
                f"other commands one of its DCP parts: {', '.join(str(trainer.path / p) for p in trainer.parts)}")
    found = []
    try:
        with os.scandir(folder) as entries:
            for n, entry in enumerate(entries):
                if n >= scanned:
                    break
                if entry.is_dir(follow_symlinks=False) and (is_checkpoint(Path(entry.path))
                                                             or trainer_folder(Path(entry.path)) is not None):
                    found.append(entry.path)
    except OSError:
        return ""
    if not found:
        return ""
    found.sort()
    more = f" (+{len(found) - LISTED} more)" if len(found) > LISTED else ""
    return f"; checkpoints inside: {', '.join(found[:LISTED])}{more}"
