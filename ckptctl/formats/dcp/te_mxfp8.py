"""Transformer Engine MXFP8Tensor items written again: a reshard keeps TE's MXFP8 weights as TE saved them.

An MXFP8Tensor's rowwise scales are one E8M0 byte per 1×32 block of a row, so a row's codes and
its scales travel together. TE's FSDP2 path does exactly that (`transformer_engine/pytorch/tensor/
mxfp8_tensor.py`): `fsdp_pre_all_gather` cuts the rowwise `scale_inv` to the shard's rows
(dropping the padding rows, keeping each row's padded width round_up(N/32, 4)) and sends it with
the rowwise codes; `fsdp_post_all_gather` concatenates the gathered rows and pads the rows again
to a multiple of 128 with `torch.nn.functional.pad`, i.e. with zeros. A target chunk of whole
rows is written the same way: its rows' codes (uint8, storage `data/0`, streamed from the
sources' code records), its rows' scale rows as saved (padding columns included), then zero rows
up to round_up(rows, 128) (storage `data/1`, [round_up(M, 128), round_up(N/32, 4)] as
`MXFP8Quantizer.get_scale_shape` allocates it), in TE ≥ 2.16's reduce form again:
`_make_mxfp8_tensor_in_reduce_ex(rowwise_data, rowwise_scale_inv, columnwise_data,
columnwise_scale_inv, fp8_dtype, dtype, shape[, quantizer[, with_gemm_swizzled_scales]])`, with the
source's argument count, DType module and quantizer state (its fields as BUILD gave them).

The columnwise copy (scales per 32×1 block, down the rows) cannot follow a cut that is not a
multiple of 32 rows, so it is written as None, as TE's FSDP2 gathers a weight for the forward pass
(rowwise only, `rowwise_usage` without `columnwise_usage`); TE's dequantize and its forward GEMM
read the rowwise records only. TE ≤ 2.15's classmethod form, GEMM-swizzled scales and a quantizer
holding a tensor are refused where they are planned.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

from ckptctl.core.dtypes import DTYPES, DType
from ckptctl.core.geometry import Box
from ckptctl.formats.dcp.block_scaled import MXFP8
from ckptctl.formats.dcp.te_float8 import CODES, TE_CODE, KeptTeTensor
from ckptctl.formats.pickle.subclass import _TeDType
from ckptctl.formats.pickle.te_blocks import TE_TENSOR, Quantizer
from ckptctl.formats.pickle.torch_pickle import Call, Instance, Size, dumps, ref
from ckptctl.formats.torch_save.zip import (TorchSaveRecord, _Skeleton, archive_skeleton, archive_tail,
                                           serialization_id, tensor_reduce)
from ckptctl.util.errors import CheckpointError

RECONSTRUCTOR = (f"{TE_TENSOR}.mxfp8_tensor", "_make_mxfp8_tensor_in_reduce_ex")
SCALE_ROWS = 128
"""TE pads an MXFP8 tensor's rowwise scales to a multiple of 128 rows (`get_scale_shape`)."""


@dataclass(frozen=True)
class Mxfp8Rows:
    """Source rows [start, end) of an MXFP8Tensor, held by one item, and that item's rowwise
    scale rows as saved (`width` bytes each, padding rows left out)."""

    start: int
    end: int
    scales: bytes


@dataclass(frozen=True)
class TeMxfp8Target(KeptTeTensor):
    """A target's `properties` when its records are TE MXFP8Tensor items: the target's dtype is its
    codes' (uint8); `logical` the tensor's dtype, `fp8` the codes' format, `dtype_module`, `args`
    and `quantizer` the source's reduce form, `width` a scale row's bytes, `rows` each source
    item's rows and scales, by row."""

    fqn: str
    logical: DType
    fp8: DType
    dtype_module: str
    args: int
    quantizer: Quantizer | None
    width: int
    rows: tuple[Mxfp8Rows, ...]
    requires_grad: bool = False
    kind = f"transformer_engine {MXFP8}"

    def scales_of(self, box: Box) -> bytes:
        """The rowwise scale_inv of a target chunk of whole rows, padded as TE pads it."""
        lo, hi = box.offsets[0], box.offsets[0] + box.sizes[0]
        out, at = bytearray(), lo
        for r in self.rows:
            if r.start <= at < r.end:
                stop = min(hi, r.end)
                out += r.scales[(at - r.start) * self.width:(stop - r.start) * self.width]
                at = stop
        if at < hi:
            raise CheckpointError(self.fqn, f"rows [{at}, {hi}) are in no saved {MXFP8} item: there are no "
                                            "scales to keep")
        padded = -(-(hi - lo) // SCALE_ROWS) * SCALE_ROWS
        return bytes(out) + bytes((padded - (hi - lo)) * self.width)

    def settle(self, box: Box) -> None:
        self.scales_of(box)

    def record(self, box: Box, serialization_id: str) -> Mxfp8Record:
        """The item of target chunk `box`."""
        return Mxfp8Record(self, box.sizes, self.scales_of(box), serialization_id)

    def record_length(self, sizes: tuple[int, ...]) -> int:
        """An item's length: the same for all scales and serialization ids (all are 40 digits)."""
        scales = bytes(self.width * -(-math.prod(sizes[:-1]) // SCALE_ROWS) * SCALE_ROWS)
        return Mxfp8Record(self, sizes, scales, serialization_id("")).length

    @property
    def form(self) -> tuple[DType, DType, str, int, Quantizer | None, int]:
        return self.logical, self.fp8, self.dtype_module, self.args, self.quantizer, self.width


def _te_value(value: Any) -> Any:
    """A quantizer field as TE ≥ 2.16 pickles it (its DType by a call)."""
    return Call(ref(value.module, "DType"), (value.value,)) if type(value) is _TeDType else value


@functools.lru_cache(maxsize=4096)
def _skeleton(form: tuple, sizes: tuple[int, ...]) -> _Skeleton:
    """The item's head: TE's reduce call over its codes (`data/0`) and scales (`data/1`), as
    `torch.save` pickles `MXFP8Tensor.__reduce_ex__`'s value."""
    logical, fp8, dtype_module, args, quantizer, width = form
    rows = -(-math.prod(sizes[:-1]) // SCALE_ROWS) * SCALE_ROWS
    made = None if quantizer is None else Instance(ref(quantizer.module, quantizer.name),
                                                    {k: _te_value(v) for k, v in quantizer.fields})
    call = (tensor_reduce(CODES, sizes, "0"), tensor_reduce(DTYPES["uint8"], (rows, width), "1"), None, None,
            Call(ref(dtype_module, "DType"), (TE_CODE[fp8],)), logical, Size(sizes), made, False)[:args]
    return archive_skeleton(dumps(Call(ref(*RECONSTRUCTOR), call), protocol=2), math.prod(sizes), False)


class Mxfp8Record(TorchSaveRecord):
    """A TE MXFP8Tensor item as bytes: `head` + the codes streamed in + `tail(crc)`, the scales
    record inside the tail (a `TorchSaveRecord` in every other respect)."""

    __slots__ = ()

    def __init__(self, target: TeMxfp8Target, sizes: tuple[int, ...], scales: bytes, serialization_id: str) -> None:
        skeleton = _skeleton(target.form, tuple(sizes))
        self.dtype, self.shape = CODES, tuple(sizes)
        self.nbytes, self.head = skeleton.nbytes, skeleton.head
        self._id = serialization_id.encode()
        self._template = archive_tail(skeleton, len(self._id), False, (("data/1", scales),))
