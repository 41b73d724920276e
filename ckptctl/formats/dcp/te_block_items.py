"""TE block-scaled items written again: a reshard keeps TE's MXFP8 and blockwise FP8 weights as TE saved them.

A target chunk is whole rows (FSDP2's `Shard(0)`); its item holds its rows' codes (uint8, storage
`data/0`, streamed from the sources' code records) and the scales of those rows (storage `data/1`,
of the shape TE's quantizer allocates for the chunk's row count, `BlockScaling.scale_shape`), in
TE ≥ 2.16's reduce form again with the source's argument count, DType module and quantizer state
(its fields as BUILD gave them). Facts from TE's source (`transformer_engine/pytorch/tensor/`):

* MXFP8 (`mxfp8_tensor.py`): a scale covers 1×32 of one row, [round_up(M, 128), round_up(N/32, 4)].
  TE's FSDP2 `fsdp_pre_all_gather` cuts the scales to the shard's M rows (each keeping its padded
  width) and `fsdp_post_all_gather` concatenates them and pads the rows to a multiple of 128 with
  `F.pad`, i.e. zeros: so does a kept chunk.
* Blockwise 1-D (`float8_blockwise_tensor.py`, 1×128 of one row): scales [⌈N/128⌉, round_up(M, 4)],
  a row's scales in its column. TE's FSDP2 does not gather these ("the scale layout has M in
  dim1"); a kept chunk takes its rows' columns and zero padding columns (TE allocates the padding
  uninitialized and never reads it).
* Blockwise 2-D (128×128): scales [⌈M/128⌉, round_up(⌈N/128⌉, 4)], one row per 128-row block. A
  chunk's block b (its rows [128b, 128b + 128)) keeps a saved block's scale row only when all its
  rows lie in one saved block; any other chunk is refused by name (its blocks would need new
  scales, which is requantizing). TE's FSDP2 gathers the rowwise scale rows by concatenation.
* `_make_mxfp8_tensor_in_reduce_ex(rowwise_data, rowwise_scale_inv, columnwise_data,
  columnwise_scale_inv, fp8_dtype, dtype, shape[, quantizer[, with_gemm_swizzled_scales]])` and
  `_make_float8_blockwise_tensor_in_reduce_ex(shape, rowwise_data, rowwise_scale_inv,
  columnwise_data, columnwise_scale_inv, fp8_dtype, dtype, quantizer, is_2D_scaled[, data_format])`.

The columnwise copy (scales down 32-row blocks for MXFP8, a transpose for blockwise) cannot
follow an arbitrary row cut, so it is written as None, as TE's FSDP2 gathers a weight for its
forward pass (rowwise only; TE derives blockwise 2-D's columnwise copy locally). TE's dequantize
and its forward GEMM read the rowwise records only. TE ≤ 2.15's classmethod form, GEMM-swizzled
scales and a quantizer holding a tensor are refused where they are planned (`planners.te_float8`).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

from ckptctl.core.dtypes import DTYPES, DType
from ckptctl.core.geometry import Box
from ckptctl.formats.dcp.block_scaled import BLOCKWISE, MXFP8, BlockScaling
from ckptctl.formats.dcp.te_float8 import CODES, TE_CODE, KeptTeTensor
from ckptctl.formats.pickle.subclass import _TeDType
from ckptctl.formats.pickle.te_blocks import TE_TENSOR, Quantizer
from ckptctl.formats.pickle.torch_pickle import Call, Instance, Size, dumps, ref
from ckptctl.formats.torch_save.zip import (TorchSaveRecord, _Skeleton, archive_skeleton, archive_tail,
                                           serialization_id, tensor_reduce)
from ckptctl.util.errors import CheckpointError

RECONSTRUCTORS = {MXFP8: (f"{TE_TENSOR}.mxfp8_tensor", "_make_mxfp8_tensor_in_reduce_ex"),
                  BLOCKWISE: (f"{TE_TENSOR}.float8_blockwise_tensor", "_make_float8_blockwise_tensor_in_reduce_ex")}


@dataclass(frozen=True)
class BlockRows:
    """Source rows [start, end) of a block-scaled tensor, held by one item, and that item's
    rowwise scales as saved (padding included)."""

    start: int
    end: int
    scales: bytes


@dataclass(frozen=True)
class TeBlockTarget(KeptTeTensor):
    """A target's `properties` when its records are TE MXFP8Tensor or Float8BlockwiseQTensor items:
    the target's dtype is its codes' (uint8); `scaling` the format, `logical` the tensor's dtype,
    `dtype_module`, `args` and `quantizer` the source's reduce form, `columns` its last dim, `rows`
    each source item's rows and scales, by row."""

    fqn: str
    scaling: BlockScaling
    logical: DType
    dtype_module: str
    args: int
    quantizer: Quantizer | None
    columns: int
    rows: tuple[BlockRows, ...]
    requires_grad: bool = False

    @property
    def kind(self) -> str:  # type: ignore[override]
        return f"transformer_engine {self.scaling.kind}"

    @property
    def fp8(self) -> DType:
        return DTYPES[self.scaling.codes]

    def scale_shape(self, rows: int) -> tuple[int, int]:
        return self.scaling.scale_shape((rows, self.columns))

    def scales_of(self, box: Box) -> bytes:
        """The rowwise scales of a target chunk of whole rows, padded as TE pads them; refused when
        a 128×128 block would join saved blocks."""
        lo, hi = box.offsets[0], box.offsets[0] + box.sizes[0]
        size = 4 if self.scaling.scales == "float32" else 1
        shape = self.scale_shape(hi - lo)
        out = bytearray(math.prod(shape) * size)  # zero padding
        if self.scaling.block == (128, 128):
            for b in range(shape[0]):
                first, last = lo + 128 * b, min(hi, lo + 128 * b + 128) - 1
                held = self._holding(first, last + 1)
                if len(held) != 1 or (first - held[0].start) // 128 != (last - held[0].start) // 128:
                    raise CheckpointError(self.fqn, f"the target chunk of rows [{lo}, {hi}): its 128-row block "
                                                    f"[{first}, {last + 1}) spans more than one saved 128×128 block, "
                                                    "each of its own scales; one scale for it would need "
                                                    "requantizing (reshard to a world size whose chunks keep within "
                                                    "saved blocks, or export-hf it dequantized)")
                width = shape[1] * size
                at = (first - held[0].start) // 128 * width
                out[b * width:(b + 1) * width] = held[0].scales[at:at + width]
            return bytes(out)
        for r in self._holding(lo, hi):
            a, b = max(lo, r.start), min(hi, r.end)
            if self.scaling.block == (1, 128):  # a row's scales in its column
                saved = self.scale_shape(r.end - r.start)[1]
                for k in range(shape[0]):
                    out[(k * shape[1] + a - lo) * size:(k * shape[1] + b - lo) * size] = \
                        r.scales[(k * saved + a - r.start) * size:(k * saved + b - r.start) * size]
            else:  # MXFP8: a row's scales in its row
                width = shape[1] * size
                out[(a - lo) * width:(b - lo) * width] = r.scales[(a - r.start) * width:(b - r.start) * width]
        return bytes(out)

    def _holding(self, lo: int, hi: int) -> list[BlockRows]:
        """The source items holding rows [lo, hi), every row held, in order."""
        held = [r for r in self.rows if r.start < hi and lo < r.end and r.start < r.end]
        if sum(min(hi, r.end) - max(lo, r.start) for r in held) != hi - lo:
            raise CheckpointError(self.fqn, f"rows [{lo}, {hi}) are not all in saved {self.scaling.kind} items: "
                                            "there are no scales to keep")
        return held

    def settle(self, box: Box) -> None:
        self.scales_of(box)

    def record(self, box: Box, serialization_id: str) -> BlockRecord:
        """The item of target chunk `box`."""
        return BlockRecord(self, box.sizes, self.scales_of(box), serialization_id)

    def record_length(self, sizes: tuple[int, ...]) -> int:
        """An item's length: the same for all scales and serialization ids (all are 40 digits)."""
        size = 4 if self.scaling.scales == "float32" else 1
        scales = bytes(math.prod(self.scale_shape(sizes[0])) * size)
        return BlockRecord(self, sizes, scales, serialization_id("")).length

    @property
    def form(self) -> tuple[BlockScaling, DType, str, int, Quantizer | None, int]:
        return self.scaling, self.logical, self.dtype_module, self.args, self.quantizer, self.columns


def _te_value(value: Any) -> Any:
    """A quantizer field as TE ≥ 2.16 pickles it (its DType by a call)."""
    return Call(ref(value.module, "DType"), (value.value,)) if type(value) is _TeDType else value


@functools.lru_cache(maxsize=4096)
def _skeleton(form: tuple, sizes: tuple[int, ...]) -> _Skeleton:
    """The item's head: TE's reduce call over its codes (`data/0`) and scales (`data/1`), as
    `torch.save` pickles the tensor's `__reduce_ex__` value."""
    scaling, logical, dtype_module, args, quantizer, columns = form
    scales = tensor_reduce(DTYPES[scaling.scales if scaling.scales == "float32" else "uint8"],
                           scaling.scale_shape((sizes[0], columns)), "1")
    codes = tensor_reduce(CODES, sizes, "0")
    made = None if quantizer is None else Instance(ref(quantizer.module, quantizer.name),
                                                    {k: _te_value(v) for k, v in quantizer.fields})
    fp8 = Call(ref(dtype_module, "DType"), (TE_CODE[DTYPES[scaling.codes]],))
    if scaling.kind == MXFP8:
        call = (codes, scales, None, None, fp8, logical, Size(sizes), made, False)[:args]
    else:
        call = (Size(sizes), codes, scales, None, None, fp8, logical, made, scaling.block == (128, 128), None)[:args]
    return archive_skeleton(dumps(Call(ref(*RECONSTRUCTORS[scaling.kind]), call), protocol=2), math.prod(sizes),
                            False)


class BlockRecord(TorchSaveRecord):
    """A TE block-scaled item as bytes: `head` + the codes streamed in + `tail(crc)`, the scales
    record inside the tail (a `TorchSaveRecord` in every other respect)."""

    __slots__ = ()

    def __init__(self, target: TeBlockTarget, sizes: tuple[int, ...], scales: bytes, serialization_id: str) -> None:
        skeleton = _skeleton(target.form, tuple(sizes))
        self.dtype, self.shape = CODES, tuple(sizes)
        self.nbytes, self.head = skeleton.nbytes, skeleton.head
        self._id = serialization_id.encode()
        self._template = archive_tail(skeleton, len(self._id), False, (("data/1", scales),))
