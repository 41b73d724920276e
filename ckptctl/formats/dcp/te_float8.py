"""Transformer Engine Float8Tensor items written again: a reshard keeps TE's FP8 weights as TE saved them.

TE's FSDP2 support quantizes all shards of a parameter with one scale
(`transformer_engine/pytorch/tensor/float8_tensor.py`): `Float8Tensor.fsdp_pre_all_gather` sends
its `_data` shard to the all-gather with `_scale_inv` as metadata (for current scaling it first
reduces the amax over the FSDP mesh "so all weight shards get the same scale inverse"), and
`fsdp_post_all_gather` builds the gathered tensor from the gathered codes and that one
`scale_inv`. So the rows of such a parameter can be cut anew and every piece keeps the scale:
a target chunk's item is the source's reduce form again, `_make_float8_tensor_in_reduce_ex(data,
fp8_dtype, scale_inv, dtype, shape[, data_transpose=None])`, `data` its rows of the FP8 codes
(uint8, storage `data/0`, streamed from the sources' code records), `fp8_dtype` the same TE
`DType` under the same module's name, `scale_inv` float32 [1] (storage `data/1`) the scale its
source rows share. A chunk whose rows come from source chunks of different scales (a save TE's
FSDP2 path does not make) is refused: joining them needs new codes and a new scale, which is
requantizing, not keeping. Only items holding `data` are kept (`data_transpose` None; an item
holding only its transpose is refused where it is decoded, `pickle.subclass`).
"""

from __future__ import annotations

import functools
import math
import struct
from dataclasses import dataclass, replace
from typing import Iterable

from ckptctl.core.dtypes import DTYPES, DType
from ckptctl.core.geometry import Box
from ckptctl.core.plan import SourceTensor, TargetTensor
from ckptctl.formats.pickle.subclass import TE_FP8, TE_FLOAT8, TE_RECONSTRUCTOR
from ckptctl.formats.pickle.torch_pickle import Call, Size, dumps, ref
from ckptctl.formats.torch_save.zip import (TorchSaveRecord, _Skeleton, _TailTemplate, archive_skeleton, archive_tail,
                                           serialization_id, tensor_reduce)
from ckptctl.util.errors import CheckpointError

CODES = DTYPES["uint8"]
"""What a Float8Tensor target is planned and copied as: its FP8 codes, one byte an element."""
TE_CODE = {fp8: code for code, fp8 in TE_FP8.items()}
"""TE's DType value of each FP8 format."""


class KeptTeTensor:
    """A TE tensor a reshard keeps as TE's items (`TeFloat8Target`, `te_block_items.TeBlockTarget`): its
    target is planned as its codes (uint8); it has a `logical` dtype, `record(box, id)`,
    `record_length(sizes)`, and `settle(box)`, which refuses a chunk it cannot keep; `kind` names it."""

    logical: DType
    kind = TE_FLOAT8

    def settle(self, box: Box) -> None:
        raise NotImplementedError


@dataclass(frozen=True)
class Float8Rows:
    """Source rows [start, end) of a Float8Tensor tensor, held by one item (none, for an empty
    one), and its scale_inv's four bytes (float32, little-endian)."""

    start: int
    end: int
    scale: bytes


@dataclass(frozen=True)
class TeFloat8Target(KeptTeTensor):
    """A target's `properties` when its records are TE Float8Tensor items: the target's dtype is
    its codes' (uint8); `logical` is the tensor's dtype, which `.metadata` records, `fp8` the
    codes' format, `dtype_module` and `args` the source's reduce form (TE's DType class by its
    release's module; 5 or 6 arguments), `rows` each source item's rows and scale, by row."""

    fqn: str
    logical: DType
    fp8: DType
    dtype_module: str
    args: int
    rows: tuple[Float8Rows, ...]
    requires_grad: bool = False

    def scale_of(self, box: Box) -> bytes:
        """The scale_inv of a target chunk of whole rows: the one its source rows share; refused
        when they hold different scales. An empty chunk (no code to scale) takes the scale of the
        row before it (of an empty tensor, its first item's)."""
        lo, hi = box.offsets[0], box.offsets[0] + box.sizes[0]
        if hi == lo:
            row = max(lo - 1, 0)
            return next((r for r in self.rows if r.start <= row < r.end), self.rows[0]).scale
        scales = list(dict.fromkeys(r.scale for r in self.rows if r.start < hi and lo < r.end and r.start < r.end))
        if not scales:
            raise CheckpointError(self.fqn, f"rows [{lo}, {hi}) are in no saved {TE_FLOAT8} item: there is no "
                                            "scale_inv to keep")
        if len(scales) != 1:
            raise CheckpointError(self.fqn, f"rows [{lo}, {hi}) join {TE_FLOAT8} items of {len(scales)} different "
                                            f"scale_inv ({', '.join(_floats(scales[:4]))}{', …' if len(scales) > 4 else ''}): TE's FSDP2 "
                                            "shards share one scale, and keeping FP8 codes exactly needs one; "
                                            "reshard to a world size whose chunks keep within its saved shards, or "
                                            "export-hf it (dequantized)")
        return scales[0]

    def settle(self, box: Box) -> None:
        self.scale_of(box)

    def record(self, box: Box, serialization_id: str) -> Float8Record:
        """The item of target chunk `box`."""
        return Float8Record(self, box.sizes, self.scale_of(box), serialization_id)

    def record_length(self, sizes: tuple[int, ...]) -> int:
        """An item's length: the same for every scale and serialization id (all are 40 digits)."""
        return Float8Record(self, sizes, bytes(4), serialization_id("")).length

    @property
    def form(self) -> tuple[DType, DType, str, int]:
        return self.logical, self.fp8, self.dtype_module, self.args


def _floats(scales: list[bytes]) -> list[str]:
    return [repr(struct.unpack("<f", s)[0]) for s in scales]


@functools.lru_cache(maxsize=4096)
def _skeleton(form: tuple[DType, DType, str, int], sizes: tuple[int, ...]) -> _Skeleton:
    """The item's head: TE's reduce call over its codes (`data/0`) and scale (`data/1`), as
    `torch.save` pickles `Float8Tensor.__reduce_ex__`'s value."""
    logical, fp8, dtype_module, args = form
    call = (tensor_reduce(CODES, sizes, "0"), Call(ref(dtype_module, "DType"), (TE_CODE[fp8],)),
            tensor_reduce(DTYPES["float32"], (1,), "1"), logical, Size(sizes)) + (None,) * (args - 5)
    return archive_skeleton(dumps(Call(ref(*TE_RECONSTRUCTOR), call), protocol=2), math.prod(sizes), False)


@functools.lru_cache(maxsize=4096)
def _tail(form: tuple[DType, DType, str, int], sizes: tuple[int, ...], scale: bytes, id_len: int) -> _TailTemplate:
    return archive_tail(_skeleton(form, sizes), id_len, False, (("data/1", scale),))


class Float8Record(TorchSaveRecord):
    """A TE Float8Tensor item as bytes: `head` + the codes streamed in + `tail(crc)`, the scale
    record inside the tail (a `TorchSaveRecord` in every other respect)."""

    __slots__ = ()

    def __init__(self, target: TeFloat8Target, sizes: tuple[int, ...], scale: bytes, serialization_id: str) -> None:
        skeleton = _skeleton(target.form, tuple(sizes))
        self.dtype, self.shape = CODES, tuple(sizes)
        self.nbytes, self.head = skeleton.nbytes, skeleton.head
        self._id = serialization_id.encode()
        self._template = _tail(target.form, tuple(sizes), scale, len(self._id))


def float8_of(target: TargetTensor) -> KeptTeTensor | None:
    """The target's kept TE form (Float8Tensor, MXFP8Tensor), None for any other target."""
    return target.properties if isinstance(target.properties, KeptTeTensor) else None


def stored_dtype(target: TargetTensor) -> DType:
    """The dtype `.metadata` records for a target: a Float8Tensor's logical one, else its own."""
    float8 = float8_of(target)
    return float8.logical if float8 is not None else target.dtype


def as_values(target: TargetTensor) -> TargetTensor:
    """A Float8Tensor target seen as its values (logical dtype): what the output check compares,
    each side dequantized as TE does; any other target as it is."""
    float8 = float8_of(target)
    return target if float8 is None else replace(target, dtype=float8.logical, properties=None)


def value_view(view: SourceTensor, target: TargetTensor) -> SourceTensor:
    """`view` (a Float8Tensor's codes) seen as the values `as_values(target)` assembles."""
    float8 = float8_of(target)
    return view if float8 is None else replace(view, dtype=float8.logical)


def code_sources(targets: Iterable[TargetTensor]) -> frozenset[str]:
    """The source tensors read as FP8 codes (`ItemReader.fp8_codes`): those of Float8Tensor targets."""
    return frozenset(p.src for t in targets if float8_of(t) is not None for p in t.pieces)
