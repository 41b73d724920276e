"""Files of a Hugging Face model folder (or `--hf-config`) read as the untrusted input they are.

A FIFO blocks an open or a read forever, a device (`/dev/zero`) never ends, a sparse 1 GB
`config.json` is gigabytes of memory before a parser sees it, and 100,000 nested arrays
overflow the parser. So each such file is opened without blocking, must be a regular file
no larger than its kind ever is, and its JSON is measured (values, nesting) on the raw bytes
before anything is built from it. Every refusal is a `CheckpointError` naming the file.
"""

from __future__ import annotations

import json
import os
from itertools import accumulate
from pathlib import Path
from typing import Any

from ckptctl.util.errors import CheckpointError
from ckptctl.storage.source_files import open_source

MAX_CONFIG_BYTES = 4 << 20
"""`config.json`, `generation_config.json`: a few kB in every published model."""
MAX_INDEX_BYTES = 64 << 20
"""`*.safetensors.index.json`: about 100 bytes a tensor, 10 MB for a model of 100,000 tensors."""
MAX_COPIED_BYTES = 1 << 30
"""A tokenizer or other side file export-hf copies from REF (tokenizer files run to tens of MB)."""
MAX_JSON_DEPTH = 64
"""Nesting a config or header may have (a published config nests 4 or 5 deep)."""
MAX_CONFIG_VALUES = 1 << 20
"""JSON values (scalars and containers) a config may hold."""
MAX_INDEX_VALUES = 4 << 20
"""… and a safetensors index (about 2 a tensor)."""

_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_DEPTH_STEP = [0] * 256
_DEPTH_STEP[ord("[")] = _DEPTH_STEP[ord("{")] = 1
_DEPTH_STEP[ord("]")] = _DEPTH_STEP[ord("}")] = -1


def read_regular(path: Path, limit: int) -> bytes:
    """The whole of regular file `path`, of at most `limit` bytes (`open_source`)."""
    fd, _ = open_source(path, limit)
    try:
        data = os.pread(fd, limit + 1, 0)
    except OSError as exc:
        raise CheckpointError(path, f"cannot read: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    if len(data) > limit:  # grown since it was measured
        raise CheckpointError(path, f"implausibly large (over {limit} bytes; at most {limit} are read)")
    return data


def copy_regular(path: Path, dest: Path, limit: int = MAX_COPIED_BYTES) -> None:
    """Copy regular file `path` (`open_source`) to `dest`, from the descriptor that was checked."""
    fd, _ = open_source(path, limit)
    try:
        with os.fdopen(fd, "rb", closefd=False) as src, open(dest, "wb") as out:
            copied = 0
            while chunk := src.read(min(1 << 20, limit + 1 - copied)):
                out.write(chunk)
                copied += len(chunk)
                if copied > limit:  # grown since it was measured
                    raise CheckpointError(path, f"implausibly large (over {limit} bytes; at most {limit} are read)")
    finally:
        os.close(fd)


def json_problem(data: bytes, max_values: int) -> str | None:
    """Why `data` may not be parsed (more than `max_values` values, or nested deeper than
    MAX_JSON_DEPTH), None when it may. Measured on the raw bytes, with no copy of their parts:
    quotes, commas and brackets inside strings count too, so both are upper bounds."""
    values = data.count(b'"') // 2 + data.count(b",") + data.count(b"[") + data.count(b"{")
    if values > max_values:
        return f"more than {max_values} JSON values"
    depth = max(accumulate(map(_DEPTH_STEP.__getitem__, data.translate(None, _NOT_BRACKETS))), default=0)
    if depth > MAX_JSON_DEPTH:
        return f"nested deeper than {MAX_JSON_DEPTH} levels"
    return None


class ImplausibleJson(ValueError):
    """JSON too big or too deep to be parsed (`json_problem`)."""


def parse_json(data: bytes, max_values: int) -> Any:
    """`data` parsed, once `json_problem` finds nothing wrong with it (ImplausibleJson saying what
    it found); ValueError with the parser's first line when it is not JSON."""
    problem = json_problem(data, max_values)
    if problem is not None:
        raise ImplausibleJson(problem)
    try:
        return json.loads(data)
    except RecursionError:
        raise ImplausibleJson(f"nested deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        raise ValueError(str(exc).splitlines()[0] if str(exc) else type(exc).__name__) from None


def read_json_object(path: Path, what: str, limit: int = MAX_CONFIG_BYTES,
                     max_values: int = MAX_CONFIG_VALUES) -> dict[str, Any]:
    """The JSON object in regular file `path` (a `what`: "config", "safetensors index"), bounded
    in size, values and nesting; CheckpointError naming the file otherwise."""
    data = read_regular(path, limit)
    try:
        value = parse_json(data, max_values)
    except ValueError as exc:
        raise CheckpointError(path, f"not a readable JSON {what} ({exc})") from None
    if not isinstance(value, dict):
        raise CheckpointError(path, f"not a JSON object (is this a {what}?)")
    return value
