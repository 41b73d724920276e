"""Find a chunk's raw tensor bytes inside a `.distcp` file without loading the item.

A DCP tensor item is a whole `torch.save` zip archive at (offset, length) in its file; its
tensor bytes are one stored (uncompressed) record. Reading the archive's central directory
and its restricted `data.pkl` gives the exact byte offset of element 0, so every later read
is a plain positioned read of exactly the bytes needed. Items written through a stream
transform (zstd) cannot be addressed that way and are decoded through torch instead; items
of `SerializationFormat.SAFETENSORS` checkpoints are located through the safetensors header.
"""

from __future__ import annotations

import io
import json
import os
import struct
import threading
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from ckptctl.dtypes import BY_SAFETENSORS
from ckptctl.errors import CheckpointError
from ckptctl.formats.unpickle import UnsafePickleError, load_tensor_record_spec
from ckptctl.model import BytesEntry, Checkpoint, Chunk, TensorEntry, dtype_name

_LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")
_LOCAL_SIGNATURE = 0x04034B50


@dataclass(frozen=True)
class RawRecord:
    """A chunk's tensor bytes, row-major and dense: `nbytes` bytes at `byte_offset` of `path`."""

    path: Path
    byte_offset: int
    nbytes: int


class _Window(io.RawIOBase):
    """A read-only, seekable view of bytes [start, start+length) of an open file."""

    def __init__(self, fd: int, start: int, length: int) -> None:
        self._fd, self._start, self._length, self._pos = fd, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self._length}[whence]
        self._pos = max(0, base + pos)
        return self._pos

    def readinto(self, buffer: Any) -> int:
        n = max(0, min(len(buffer), self._length - self._pos))
        data = os.pread(self._fd, n, self._start + self._pos)
        buffer[: len(data)] = data
        self._pos += len(data)
        return len(data)


class ItemReader:
    """Opens a checkpoint's files read-only, lazily, and answers where each chunk's bytes are."""

    def __init__(self, ckpt: Checkpoint) -> None:
        self.ckpt = ckpt
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()
        self._safetensors_headers: dict[tuple[str, int], dict | None] = {}

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()

    def __enter__(self) -> "ItemReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def fd(self, file: str) -> int:
        with self._lock:
            if file not in self._fds:
                try:
                    self._fds[file] = os.open(self.ckpt.path / file, os.O_RDONLY)
                except OSError as exc:
                    raise CheckpointError(self.ckpt.path / file, f"cannot open: {exc.strerror}") from exc
            return self._fds[file]

    def _bad(self, chunk: Chunk, reason: str) -> CheckpointError:
        return CheckpointError(self.ckpt.path / chunk.file, f"item at byte {chunk.offset}: {reason}")

    def locate(self, entry: TensorEntry, chunk: Chunk) -> RawRecord | None:
        """Where the chunk's dense bytes are, or None when the item must be decoded (transforms)."""
        if chunk.transforms:
            return None
        header = self._safetensors_header(chunk.file, chunk.offset)
        if header is not None:
            return self._locate_safetensors(entry, chunk, header)
        return self._locate_torch_save(entry, chunk)

    def _locate_torch_save(self, entry: TensorEntry, chunk: Chunk) -> RawRecord | None:
        fd = self.fd(chunk.file)
        try:
            archive = zipfile.ZipFile(_Window(fd, chunk.offset, chunk.length))
            names = {info.filename: info for info in archive.infolist()}
            pkl = next((n for n in names if n.endswith("/data.pkl") or n == "data.pkl"), None)
            if pkl is None:
                raise self._bad(chunk, "torch.save archive without data.pkl")
            spec = load_tensor_record_spec(archive.read(pkl))
        except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, struct.error) as exc:
            raise self._bad(chunk, f"not a torch.save archive ({exc})") from exc
        except UnsafePickleError as exc:
            raise self._bad(chunk, f"hostile or foreign data.pkl: {exc}") from exc
        if spec.dtype != entry.dtype or spec.size != chunk.sizes:
            raise self._bad(chunk, f"{entry.fqn}: item holds {dtype_name(spec.dtype)} {list(spec.size)}, "
                                   f"metadata says {entry.dtype_name} {list(chunk.sizes)}")
        record = names.get(pkl[: -len("data.pkl")] + f"data/{spec.storage_key}")
        if record is None or record.compress_type != zipfile.ZIP_STORED:
            raise self._bad(chunk, "tensor record missing or compressed")
        itemsize = spec.dtype.itemsize
        if record.file_size < spec.storage_numel * itemsize:
            raise self._bad(chunk, "tensor record shorter than its storage")
        if not spec.is_dense:
            return None
        numel = chunk.numel
        if numel and (spec.storage_offset + numel) > spec.storage_numel:
            raise self._bad(chunk, "tensor view runs past its storage")
        head = os.pread(fd, _LOCAL_HEADER.size, chunk.offset + record.header_offset)
        if len(head) != _LOCAL_HEADER.size or _LOCAL_HEADER.unpack(head)[0] != _LOCAL_SIGNATURE:
            raise self._bad(chunk, "corrupt zip local header")
        name_len, extra_len = _LOCAL_HEADER.unpack(head)[-2:]
        data_start = record.header_offset + _LOCAL_HEADER.size + name_len + extra_len
        start = data_start + spec.storage_offset * itemsize
        if data_start + record.file_size > chunk.length:
            raise self._bad(chunk, "tensor record runs past the item")
        return RawRecord(self.ckpt.path / chunk.file, chunk.offset + start, numel * itemsize)

    def _safetensors_header(self, file: str, offset: int) -> dict | None:
        """The JSON header when a SAFETENSORS-format DCP blob starts at `offset` of `file`, else None.

        Such a writer puts a rank's bytes items first and then one safetensors blob holding
        all its tensors; every tensor item's (offset, length) is (blob start, numel × itemsize).
        """
        key = (file, offset)
        if key not in self._safetensors_headers:
            fd = self.fd(file)
            header = None
            prefix = os.pread(fd, 9, offset)
            if len(prefix) == 9 and prefix[8:9] == b"{":
                (n,) = struct.unpack("<Q", prefix[:8])
                if n < min(self.ckpt.files.get(file, 0) - offset, 1 << 28):
                    try:
                        parsed = json.loads(os.pread(fd, n, offset + 8))
                        meta = parsed.get("__metadata__") if isinstance(parsed, dict) else None
                        if isinstance(meta, dict) and "DCP_SHARDING_INFO" in meta:
                            header = {"json": parsed, "data_start": offset + 8 + n}
                    except ValueError:
                        header = None
            self._safetensors_headers[key] = header
        return self._safetensors_headers[key]

    def _locate_safetensors(self, entry: TensorEntry, chunk: Chunk, header: dict) -> RawRecord:
        info = header["json"].get(entry.fqn)
        if not isinstance(info, dict):
            raise self._bad(chunk, f"{entry.fqn} not in safetensors header")
        try:
            start, end = (int(v) for v in info["data_offsets"])
            dtype, shape = BY_SAFETENSORS.get(info["dtype"]), tuple(info["shape"])
        except (KeyError, TypeError, ValueError) as exc:
            raise self._bad(chunk, f"{entry.fqn}: malformed safetensors header entry") from exc
        if (dtype != entry.dtype or shape != chunk.sizes or not 0 <= start <= end
                or end - start != chunk.numel * dtype.itemsize):
            raise self._bad(chunk, f"{entry.fqn}: safetensors record does not match metadata")
        if not self._saved_offsets_match(header, entry.fqn, chunk.offsets):
            raise self._bad(chunk, f"{entry.fqn}: safetensors record is the chunk at other offsets")
        if header["data_start"] + end > self.ckpt.files.get(chunk.file, 0):
            raise self._bad(chunk, f"{entry.fqn}: safetensors record runs past the file")
        return RawRecord(self.ckpt.path / chunk.file, header["data_start"] + start, end - start)

    @staticmethod
    def _saved_offsets_match(header: dict, fqn: str, offsets: tuple[int, ...]) -> bool:
        """torch's HF reader takes a record's global offsets from `DCP_SHARDING_INFO`; so do we."""
        try:
            info = json.loads(header["json"]["__metadata__"]["DCP_SHARDING_INFO"])
            return tuple(info[fqn]["saved_offsets"]) == offsets
        except (ValueError, KeyError, TypeError):
            return False

    def read_item_bytes(self, file: str, offset: int, length: int, transforms: tuple[str, ...]) -> bytes:
        """An item's bytes with any stream transforms undone."""
        data = os.pread(self.fd(file), length, offset)
        if len(data) != length:
            raise CheckpointError(self.ckpt.path / file, f"short read at byte {offset}")
        if not transforms:
            return data
        from torch.distributed.checkpoint._extension import ExtensionRegistry, StreamTransformExtension

        stream: IO[bytes] = io.BytesIO(data)
        try:
            for ext in ExtensionRegistry().from_descriptor_list(list(transforms)):
                if isinstance(ext, StreamTransformExtension):
                    stream = ext.transform_from(stream)
            return stream.read()
        except ValueError as exc:
            raise CheckpointError(self.ckpt.path / file, f"cannot undo transforms {list(transforms)}: {exc}") from exc

    def read_chunk(self, entry: TensorEntry, chunk: Chunk) -> Any:
        """The chunk as a dense torch tensor (one chunk in memory): the fallback and verification path."""
        import torch

        record = self.locate(entry, chunk)
        if record is not None:
            data = bytearray(os.pread(self.fd(chunk.file), record.nbytes, record.byte_offset))
            if len(data) != record.nbytes:
                raise self._bad(chunk, "short read")
            flat = torch.frombuffer(data, dtype=entry.dtype.torch) if data else torch.empty(0, dtype=entry.dtype.torch)
            return flat.reshape(chunk.sizes)
        raw = self.read_item_bytes(chunk.file, chunk.offset, chunk.length, chunk.transforms)
        try:
            tensor = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
        except Exception as exc:  # torch raises many types for a corrupt archive
            raise self._bad(chunk, f"cannot decode item ({type(exc).__name__})") from exc
        if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != chunk.sizes or tensor.dtype != entry.dtype:
            raise self._bad(chunk, f"{entry.fqn}: decoded item does not match metadata")
        return tensor.contiguous()

    def load_bytes_value(self, entry: BytesEntry, safe_globals: list | None = None) -> Any:
        """A bytes entry's object, via `torch.load(weights_only=True)` (plus any named safe globals)."""
        import torch

        raw = self.read_item_bytes(entry.file, entry.offset, entry.length, entry.transforms)
        try:
            with torch.serialization.safe_globals(safe_globals or []):
                return torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
        except Exception as exc:  # weights_only refusals and corrupt archives alike
            raise CheckpointError(self.ckpt.path / entry.file, f"{entry.fqn}: cannot decode bytes entry ({exc})".splitlines()[0]) from exc
