"""A Hugging Face safetensors model folder as a source: where each tensor's bytes are.

A folder is `model.safetensors`, or shards listed by one `*.safetensors.index.json`, or
all its `*.safetensors` when there is no index; a single `.safetensors` file is a folder
of one. Each file is an 8-byte header length, a JSON header naming every tensor's dtype,
shape and byte range, then the raw little-endian bytes: a tensor is one dense record, read
with positioned reads and never loaded. Headers are checked against the file's size before
anything is read from them, and an index may name only files inside its folder.

`open_safetensors_folder` gives the folder as a `Checkpoint` of whole-tensor chunks, so
import-hf plans and streams it with the engine every other command uses.
"""

from __future__ import annotations

import math
import struct
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckptctl.core.dtypes import BY_SAFETENSORS, DType, bfloat16
from ckptctl.util.errors import CheckpointError
from ckptctl.storage.hf_files import (MAX_INDEX_BYTES, MAX_INDEX_VALUES, ImplausibleJson, parse_json,
                              read_json_object)
from ckptctl.core.checkpoint import Checkpoint, Chunk, TensorEntry, dtype_name
from ckptctl.storage.source_files import as_typed, missing
from ckptctl.storage.store import EntryKind, ReadHandle, store_for

MAX_HEADER_BYTES = 100 << 20
"""A safetensors header longer than this is refused (safetensors' own reader refuses it too)."""
MAX_DIMS = 64
"""Dims a tensor may have (a model's have at most 5)."""
MAX_TENSORS_PER_FILE = 1 << 18
"""Tensors one file may list (a 1T-parameter model has about 100,000 in all its files together)."""
MAX_TENSORS = 1 << 19
"""Tensors a folder may hold in all its files."""
FREE_TENSORS = 1 << 12
MIN_MEAN_TENSOR_BYTES = 64
"""Past FREE_TENSORS (empty ones, tiny norms of a test model) a file's tensors must average this
many bytes: 1.6 million empty tensors listed over no data are no model."""
VALUES_PER_TENSOR = 32
"""JSON values a header may hold per tensor it may list: about 10 (dtype, offsets, a few dims, the
entry itself), and as many again in a DCP file's `__metadata__` sharding info."""
METADATA_VALUES = 1 << 16
"""… and for `__metadata__` (string to string)."""
SHOWN_NAME = 200
SHARDING_KEY = "DCP_SHARDING_INFO"
"""The `__metadata__` entry DCP's safetensors writers put each record's offsets in its global tensor in:
`{name: {"saved_offsets": [...]}}` (`hf_sharded`)."""
CHUNK_BYTES = 64 << 20
"""A tensor is seen as chunks of whole rows of about this size: `--verify` decodes one chunk at a
time (safetensors' own slicing), never a whole embedding."""


HEADER_CACHE_BYTES = 64 << 20
"""Header text `blob_header` keeps parsed (about 5 times as much memory)."""
_HEADERS: dict[tuple[int, ...], tuple[dict, int]] = {}
_HEADERS_BYTES = 0
_HEADERS_LOCK = threading.Lock()


@dataclass(frozen=True)
class StoredTensor:
    """A tensor of a safetensors file: its name there, dtype, shape and the absolute offset of element 0."""

    name: str
    shape: tuple[int, ...]
    dtype: DType
    file: Path
    start: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def folder_files(path: Path) -> dict[Path, list[str] | None]:
    """The files of a safetensors folder, each with the names its index assigns it (None: all it holds)."""
    store = store_for(path)
    if store.kind(path) is not EntryKind.FOLDER:
        return {path: None}
    indexes = store.glob(path, "*.safetensors.index.json")
    if len(indexes) > 1:
        raise CheckpointError(path, f"several safetensors indexes ({', '.join(p.name for p in indexes)})")
    if not indexes:  # a FIFO or device among them is refused when its header is read
        return {p: None for p in store.glob(path, "*.safetensors") if store.kind(p) is not EntryKind.FOLDER}
    index = indexes[0]
    weight_map = read_json_object(index, "safetensors index", MAX_INDEX_BYTES, MAX_INDEX_VALUES).get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(index, "not a safetensors index (no weight_map of names to files)")
    files: dict[Path, list[str]] = {}
    for name, file in weight_map.items():
        parts = Path(file).parts
        if not parts or Path(file).is_absolute() or ".." in parts:
            raise CheckpointError(index, f"{shown_name(name)}: file {file[:SHOWN_NAME]!r} is outside the folder")
        full = path / file
        if not store.exists(full):
            raise CheckpointError(full, f"listed by {index.name} but missing")
        files.setdefault(full, []).append(name)
    return {file: names for file, names in files.items()}


def plausible_tensors(data_size: int) -> int:
    """The most tensors a safetensors file of `data_size` bytes of data may list."""
    return min(MAX_TENSORS_PER_FILE, FREE_TENSORS + data_size // MIN_MEAN_TENSOR_BYTES)


def header_values(data_size: int) -> int:
    """The most JSON values the header of a file of `data_size` bytes of data may hold
    (`storage.hf_files.parse_json`): `plausible_tensors` entries of a few dims each."""
    return plausible_tensors(data_size) * VALUES_PER_TENSOR + METADATA_VALUES


def blob_header(handle: ReadHandle, at: int) -> tuple[dict, int]:
    """The JSON header of the safetensors blob at byte `at` of open entry `handle` (a model file's is at
    0; a SAFETENSORS-format DCP file's after its bytes items), and where the blob's data starts.
    ValueError when there is no header of a plausible length, or it is not a JSON object.

    Headers read lately are remembered (`HEADER_CACHE_BYTES`), by the file's identity and `at`:
    each record of a file is looked up in turn, and a sharded save's files hold thousands each,
    which would otherwise parse the same header thousands of times. Not to be changed by callers."""
    key = (*handle.version(), at)
    with _HEADERS_LOCK:
        found = _HEADERS.get(key)
    if found is not None:
        return found
    found = _blob_header(handle, at)
    with _HEADERS_LOCK:
        global _HEADERS_BYTES
        if _HEADERS_BYTES + found[1] - at > HEADER_CACHE_BYTES:
            _HEADERS.clear()
            _HEADERS_BYTES = 0
        _HEADERS[key] = found
        _HEADERS_BYTES += found[1] - at
    return found


def _blob_header(handle: ReadHandle, at: int) -> tuple[dict, int]:
    file_size = handle.size
    head = handle.read_at(8, at)
    if len(head) != 8:
        raise ValueError(f"no safetensors header at byte {at}")
    (length,) = struct.unpack("<Q", head)
    if length > min(file_size - at - 8, MAX_HEADER_BYTES):
        raise ValueError(f"safetensors header of {length} bytes at byte {at}")
    header = parse_json(handle.read_at(length, at + 8), header_values(file_size - at - 8 - length))
    if not isinstance(header, dict):
        raise ValueError("safetensors header is not a JSON object")
    return header, at + 8 + length


def read_header(file: Path) -> dict[str, StoredTensor]:
    """Every tensor of a safetensors file, checked against the file's size; CheckpointError if
    malformed or implausible (a FIFO or device, a header longer than MAX_HEADER_BYTES, more
    tensors than `plausible_tensors`, more dims than MAX_DIMS)."""
    return read_header_and_metadata(file)[0]


def read_header_and_metadata(file: Path) -> tuple[dict[str, StoredTensor], dict[str, str]]:
    """`read_header`'s tensors and the file's `__metadata__` (empty when it has none); a
    `__metadata__` other than strings by string is refused, as safetensors' own reader does."""
    handle = store_for(file).open_read(file)
    size = handle.size
    try:
        head = handle.read_at(8, 0)
        (length,) = struct.unpack("<Q", head) if len(head) == 8 else (None,)
        if length is None or length > min(size - 8, MAX_HEADER_BYTES):
            raise CheckpointError(file, "not a safetensors file (no header of a plausible length)")
        raw = handle.read_at(length, 8)
    except OSError as exc:
        raise CheckpointError(file, f"cannot read: {exc.strerror or exc}") from None
    finally:
        handle.close()
    data_start, data_size = 8 + length, size - 8 - length
    try:
        header = parse_json(raw, header_values(data_size))
    except ImplausibleJson as exc:
        raise CheckpointError(file, f"implausible safetensors header ({exc} for {data_size} bytes of data)") from None
    except ValueError:
        raise CheckpointError(file, "not a safetensors file (header is not JSON)") from None
    if not isinstance(header, dict):
        raise CheckpointError(file, "not a safetensors file (header is not a JSON object)")
    metadata = header.get("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CheckpointError(file, "not a safetensors file (__metadata__ is not strings by string)")
    count = len(header) - ("__metadata__" in header)
    if count > plausible_tensors(data_size):
        raise CheckpointError(file, f"implausible safetensors header ({count} tensors in {data_size} bytes of data)")
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            code, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
            ok = isinstance(code, str) and isinstance(shape, list) and all(
                type(d) is int and d >= 0 for d in (*shape[:MAX_DIMS + 1], begin, end))
        except (KeyError, TypeError, ValueError):
            ok = False
        if not ok:
            raise CheckpointError(file, f"{shown_name(name)}: malformed header entry")
        if len(shape) > MAX_DIMS:
            raise CheckpointError(file, f"{shown_name(name)}: {len(shape)} dims (a tensor has at most {MAX_DIMS})")
        dtype = BY_SAFETENSORS.get(code)
        if dtype is None:
            raise CheckpointError(file, f"{shown_name(name)}: unsupported dtype {code[:32]!r}")
        shape = tuple(shape)
        if end - begin != math.prod(shape) * dtype.itemsize or end > data_size:
            raise CheckpointError(file, f"{shown_name(name)}: bytes {begin}..{end} do not hold {dtype_name(dtype)} "
                                        f"{list(shape)} inside the file")
        out[name] = StoredTensor(name, shape, dtype, file, data_start + begin)
    return out, metadata


def shown_name(name: str) -> str:
    """A tensor name as an error line shows it: as it is when short and printable, else its start, quoted."""
    return name if len(name) <= SHOWN_NAME and name.isprintable() else repr(name[:SHOWN_NAME]) + "…"


def stored_tensors(path: Path) -> dict[str, StoredTensor]:
    """Every tensor of a folder (or one file) by name: each name once, each indexed name where its index says."""
    stored: dict[str, StoredTensor] = {}
    for file, names in folder_files(path).items():
        header, metadata = read_header_and_metadata(file)
        if len(stored) + len(header) > MAX_TENSORS:
            raise CheckpointError(path, f"implausible model folder (more than {MAX_TENSORS} tensors)")
        for name in names if names is not None else header:
            if name in stored:
                sharded = (" (a distributed save of torch's HuggingFaceStorageWriter: a checkpoint, which "
                           "reshard turns into DCP)") if SHARDING_KEY in metadata else ""
                raise CheckpointError(file, f"{shown_name(name)}: also in {stored[name].file.name}{sharded}")
            if name not in header:
                raise CheckpointError(file, f"{shown_name(name)}: listed by the index but not in this file")
            stored[name] = header[name]
    return stored


def row_chunks(st: StoredTensor, file: str) -> tuple[Chunk, ...]:
    """The tensor's dense bytes as consecutive chunks of whole rows, each about CHUNK_BYTES."""
    if not st.shape or st.nbytes == 0:
        return (Chunk(file, st.start, st.nbytes, (0,) * len(st.shape), st.shape),)
    rows, trailing = st.shape[0], st.shape[1:]
    row_bytes = st.nbytes // rows
    step = max(1, CHUNK_BYTES // row_bytes)
    return tuple(Chunk(file, st.start + r * row_bytes, (min(rows, r + step) - r) * row_bytes,
                       (r, *(0 for _ in trailing)), (min(rows, r + step) - r, *trailing))
                 for r in range(0, rows, step))


def quantized_kind(name: str, dtype: DType) -> str | None:
    """What a stored tensor holds if it is quantized codes or their scales (None: values): by
    its dtype (FP8), or its name and uint8 dtype (MXFP4), or its name (an FP8 weight's scale)."""
    if dtype.name.startswith("float8"):
        return f"{dtype_name(dtype)} codes"
    if name.endswith(("_scale_inv", ".qscale_weight")):
        return "an FP8 weight's scale"
    if dtype.name == "uint8" and name.endswith(("_blocks", "_scales")):
        return f"MXFP4 {name.rsplit('_', 1)[1]}"
    return None


def refuse_quantized(stored: dict[str, StoredTensor], fmt: Any) -> None:
    """Refuse quantized codes or scales left to read as values (`fmt`: the folder's quantization
    format, whose tensors were decoded; None: it names none), naming the first and its file: an FP8
    weight cast without its scale is ~1/scale off, and its scale would become a tensor of its own."""
    found = sorted((name, kind) for name, st in stored.items() if (kind := quantized_kind(name, st.dtype)))
    if not found:
        return
    name, kind = found[0]
    more = f" (+{len(found) - 1} more quantized tensors)" if len(found) > 1 else ""
    why = (f"{fmt.describe()} does not decode it" if fmt is not None else
           "config.json has no quantization_config saying how to decode it (fp8 and mxfp4 ones are decoded)")
    raise CheckpointError(stored[name].file, f"{shown_name(name)}: {kind}{more}; {why}: refusing to read quantized "
                                             "bytes as values")


def open_safetensors_folder(path: Path, fmt: Any = None, fp8_dtype: DType = bfloat16) -> Checkpoint:
    """The folder as a checkpoint of its tensors by name, each in chunks of whole rows.

    Each chunk's (offset, length) are its tensor's dense bytes (`Checkpoint.safetensors_folder`
    says so), but for the weights of a quantized folder (`fmt`, `quantized.quant_format`): each is
    seen as its dequantized tensor (FP8 ones of `fp8_dtype`), whose chunks are decoded. Quantized
    tensors not decoded are refused, whether or not the folder says it is quantized."""
    kind = store_for(path).kind(path)
    if kind is EntryKind.MISSING:
        raise CheckpointError(as_typed(path), missing(path, model_folder=True))
    if kind is not EntryKind.FOLDER and path.suffix != ".safetensors":
        raise CheckpointError(path, "not a safetensors model folder or .safetensors file")
    stored = stored_tensors(path)
    if not stored:
        raise CheckpointError(path, "no safetensors tensors here (a Hugging Face model folder has "
                                    "model.safetensors or *.safetensors shards)")
    root = path if kind is EntryKind.FOLDER else path.parent
    tensors: dict[str, TensorEntry] = {}
    used: set[str] = set()
    if fmt is not None:
        from ckptctl.formats.safetensors.quantized import dequantized_entries  # which builds on this module

        tensors, used = dequantized_entries(stored, fmt, root, path, fp8_dtype)
    refuse_quantized({n: st for n, st in stored.items() if n not in used}, fmt)
    files: dict[str, int] = {}
    for name, st in sorted(stored.items()):
        rel = st.file.relative_to(root).as_posix()
        if rel not in files:
            files[rel] = store_for(st.file).size(st.file)
        if name not in used:
            tensors[name] = TensorEntry(name, st.shape, st.dtype, row_chunks(st, rel))
    tensors = dict(sorted(tensors.items()))
    return Checkpoint(path=root, tensors=tensors, bytes_entries={}, files=files, safetensors_folder=True,
                      metadata_files=())
