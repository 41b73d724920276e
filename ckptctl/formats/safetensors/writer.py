"""Stream tensors into safetensors files: header computed first, then raw bytes at their offsets.

A safetensors file is 8 bytes of header length, a JSON header (names, dtypes, shapes,
byte ranges; padded to 8 bytes) and the tensors' raw row-major bytes. Tensors are laid out
in the order safetensors' own writer uses (dtype, widest first, then name), so every
tensor's data starts at a multiple of its item size. Everything about a file is known
before any data moves, so each tensor becomes `StreamItem`s (raw records,
`tail=None`) at fixed offsets that the engine fills in any order and in parallel,
without ever holding a whole tensor, let alone a whole shard (`verify.verify_safetensors_file`
re-reads a written file in row blocks through safetensors' own lazy reader).
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Mapping, Sequence

from ckptctl.core.dtypes import DType, as_dtype
from ckptctl.util.errors import CheckpointError
from ckptctl.core.geometry import Box, full_box, rows_box
from ckptctl.core.plan import StreamItem, TargetTensor
from ckptctl.storage.store import store_for

WRITE_ORDER = ("BOOL", "F4", "F6_E2M3", "F6_E3M2", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0", "F8_E4M3FNUZ",
               "F8_E5M2FNUZ", "I16", "U16", "F16", "BF16", "I32", "U32", "F32", "C64", "F64", "I64", "U64")
"""safetensors' dtype order (its `Dtype` enum), narrowest first: its writer lays tensors out in
descending order of this, then by name. A code it does not list sorts before all of them."""
_WRITE_RANK = {code: rank for rank, code in enumerate(WRITE_ORDER)}
ITEM_BYTES = 64 << 20
"""Tensors larger than this are written as several row-block items, so workers share big tensors."""


@dataclass(frozen=True)
class SafetensorsFile:
    """One output file: its header bytes and where each tensor's data starts (absolute offsets)."""

    name: str
    header: bytes
    offsets: dict[str, int]
    size: int

    @property
    def data_bytes(self) -> int:
        return self.size - len(self.header)


def dtype_code(dtype: DType, name: str) -> str:
    code = as_dtype(dtype).safetensors
    if code is None:
        raise CheckpointError(name, f"dtype {dtype} has no safetensors encoding")
    return code


def write_order(targets: Sequence[TargetTensor]) -> list[TargetTensor]:
    """`targets` in the order safetensors' writer lays them out: dtype (widest first), then name.
    Widest first keeps every data offset a multiple of its tensor's item size."""
    def key(target: TargetTensor) -> tuple[int, str]:
        return -_WRITE_RANK.get(dtype_code(target.dtype, target.fqn), len(WRITE_ORDER)), target.fqn

    return sorted(targets, key=key)


def placed_file(name: str, targets: Sequence[TargetTensor],
                metadata: Mapping[str, str] | None = None) -> SafetensorsFile:
    """The header of a file holding `targets` (in `write_order`), and each tensor's absolute data offset."""
    header: dict[str, object] = {"__metadata__": dict(metadata or {"format": "pt"})}
    at = 0
    relative: dict[str, int] = {}
    for target in write_order(targets):
        nbytes = target.nbytes
        header[target.fqn] = {"dtype": dtype_code(target.dtype, target.fqn), "shape": list(target.shape),
                              "data_offsets": [at, at + nbytes]}
        relative[target.fqn] = at
        at += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    head = struct.pack("<Q", len(text)) + text
    return SafetensorsFile(name, head, {k: len(head) + v for k, v in relative.items()}, len(head) + at)


def item_boxes(shape: tuple[int, ...], itemsize: int, item_bytes: int = ITEM_BYTES) -> list[Box]:
    """Whole-row boxes of about `item_bytes` covering a tensor in order (row-major contiguous)."""
    if not shape or shape[0] == 0 or math.prod(shape) == 0:
        return [full_box(shape)]
    row = math.prod(shape[1:]) * itemsize
    step = max(1, item_bytes // max(row, 1))
    return [rows_box(shape, r, min(shape[0], r + step)) for r in range(0, shape[0], step)]


def file_records(file: SafetensorsFile, targets: Sequence[TargetTensor], item_bytes: int = ITEM_BYTES
                 ) -> Iterator[StreamItem]:
    """Every raw record of `file`: row blocks of each target, their copy runs not yet planned."""
    for target in targets:
        row = math.prod(target.shape[1:]) * target.dtype.itemsize if target.shape else 0
        for box in item_boxes(target.shape, target.dtype.itemsize, item_bytes):
            offset = file.offsets[target.fqn] + (box.offsets[0] * row if box.offsets else 0)
            yield StreamItem(file.name, offset, b"", target, box, (), tail=None)


def write_index(path: Path, total_parameters: int, total_size: int, weight_map: Mapping[str, str]) -> None:
    """`model.safetensors.index.json` as transformers' `save_pretrained` writes it (keys sorted)."""
    doc = {"metadata": {"total_parameters": total_parameters, "total_size": total_size},
           "weight_map": dict(weight_map)}
    store_for(path).write_whole(path, (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode())
