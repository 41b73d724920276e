"""What a quantized export's FP8 weights and scales must hold, recomputed for the checks.

A code or a scale cannot be compared with one source element: it depends on its whole block
(the block's amax). So the expected bytes of any box of a quantized weight, or of its scale
tensor, are those of the source rows of the block rows it meets, read by the reader the check
hands in (the output check's independent item reader, or `--verify`'s), quantized again as the
writer does (`quantize_fp8.quantize_fp8`, Megatron-Bridge's arithmetic), and cut to the box.
"""

from __future__ import annotations

from typing import Any, Mapping

from ckptctl.core.geometry import Box
from ckptctl.core.plan import SourceTensor, StreamItem, TargetTensor, missing_elements, plan_box
from ckptctl.engine.cpu import fp8_band
from ckptctl.formats.safetensors.quantize_fp8 import Fp8Codes, Fp8Scales, scale_bytes
from ckptctl.util.errors import IncompleteCheckpointError


def is_quantized(target: TargetTensor) -> bool:
    """Whether `target` is an FP8 weight's codes or scales (bytes recomputed, never copied)."""
    return isinstance(target.properties, (Fp8Codes, Fp8Scales))


def requantized(codes: TargetTensor, first: int, stop: int, sources: Mapping[str, SourceTensor], chunks: Any
                ) -> tuple[Any, Any]:
    """(codes, float32 scales) of block rows [first, stop) of quantized weight `codes`, from the
    source read by `chunks`."""
    block = codes.properties.block[0]
    rows = (first * block, min(codes.shape[0], stop * block))
    box = Box((rows[0], 0), (rows[1] - rows[0], codes.shape[1]))
    reads = plan_box(codes, box, sources)
    if missing_elements(box, reads):
        srcs = ", ".join(sorted({p.src for p in codes.pieces}))
        raise IncompleteCheckpointError(srcs, [f"{codes.fqn}: rows {rows[0]}..{rows[1]} are in no saved chunk"])
    return fp8_band(StreamItem("", 0, b"", codes, box, reads), chunks)


def expected_bytes(target: TargetTensor, box: Box, sources: Mapping[str, SourceTensor], chunks: Any) -> bytes:
    """The bytes `box` of a quantized weight's codes or scales must hold."""
    import torch

    props = target.properties
    codes = props.codes if isinstance(props, Fp8Scales) else target
    block = codes.properties.block[0]
    if isinstance(props, Fp8Scales):
        first, stop = box.offsets[0], box.offsets[0] + box.sizes[0]
    else:
        first, stop = box.offsets[0] // block, -(-(box.offsets[0] + box.sizes[0]) // block)
    values, scale = requantized(codes, first, stop, sources, chunks)
    if isinstance(props, Fp8Scales):
        part = scale[:, box.offsets[1]:box.offsets[1] + box.sizes[1]]
        return scale_bytes(part, codes.properties.scale_dtype)
    top = box.offsets[0] - first * block
    part = values[top:top + box.sizes[0], box.offsets[1]:box.offsets[1] + box.sizes[1]]
    return part.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
