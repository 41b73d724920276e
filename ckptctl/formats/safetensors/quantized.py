"""Quantized Hugging Face folders (FP8 block-scaled, MXFP4) read as the values they encode.

A quantized weight is its stored codes plus scales in other tensors; read alone its bytes
are no values (an FP8 weight without its scale is ~1/scale off). So the folder is seen as
its dequantized twin: each quantized weight becomes one tensor under its dequantized name
and shape, whose chunks carry the `DEQUANT` transform, and the scales, `_blocks` and
`_scales` names disappear. Everything above (names, shapes, family rules, layouts) works on
it as on a bf16 folder; the engine decodes the rows of an FP8 chunk it reads straight into
its block (`dequantized_into`), an MXFP4 chunk whole (`dequantized_chunk`).
Formats, from their producers' code (DeepSeek-V3 inference, transformers' integrations):

- `quant_method: fp8`: `X.weight` float8_e4m3fn [..., M, N] and its scale `X.weight_scale_inv`
  (also spelled `X.scale`, `X.qscale_weight`) on the ceil grid [..., ⌈M/bm⌉, ⌈N/bn⌉] of
  `weight_block_size` [bm, bn] (a single value without one): float32 or bfloat16, or E8M0
  power-of-two scales (`scale_fmt: ue8m0`; stored F8_E8M0, or U8 bytes b meaning 2^(b-127)).
  Value = fp8 widened to float32 × its block's scale in float32, rounded once to the output
  dtype: the one rounding DeepSeek's dequant kernel, Megatron-Bridge and transformers make.
- `quant_method: mxfp4` (gpt-oss): `P_blocks` uint8 [E, R, G, 16], two E2M1 codes a byte, low
  nibble first, and `P_scales` uint8 [E, R, G], one E8M0 exponent (b - 127) per 32 values.
  The codes are [E, out, in] by format; transformers' model holds `P` as [E, in, out], so
  the decoded tensor is transposed, by format and never by shape (square experts look alike).
  Every value (E2M1 × a power of two) is exact in bfloat16.

Memory: one decoded chunk (≤ DEQUANT_CHUNK_BYTES, whole scale blocks) and its scale rows; an FP8
decode's codes and widened values pass through buffers each thread keeps (7 bytes a value).
"""

from __future__ import annotations

import functools
import math
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from ckptctl.core.checkpoint import Chunk, TensorEntry, dtype_name
from ckptctl.core.dtypes import DTYPES, DType, bfloat16, float32
from ckptctl.core.geometry import flat_index, unravel
from ckptctl.formats.safetensors.reader import StoredTensor, shown_name
from ckptctl.storage.store import ReadHandle
from ckptctl.util.errors import CheckpointError, UsageError
from ckptctl.util.wording import counted

DEQUANT = "ckptctl.dequantize"
"""The transform of a dequantized tensor's chunks: its bytes are decoded (`dequantized_chunk`), not read."""
DEQUANT_CHUNK_BYTES = 2 << 20
"""A dequantized tensor is decoded in chunks of about this many output bytes (at least one block row,
one expert): small enough for a chunk's passes to stay in the cache. Measured on the 2.1 GB FP8 →
4.3 GB bf16 bench (2 workers, 2 cores): 2 MiB 13-20 s, 8 MiB 23-27 s, 32 MiB 27-43 s."""
KNOWN_METHODS = "fp8 (block-scaled or per-tensor float8_e4m3fn) and mxfp4"
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""An E2M1 code's value by its 4 bits (bit 3 the sign)."""
MXFP4_GROUP = 32
"""Values one MXFP4 scale byte scales (16 bytes of two codes)."""
float8_e4m3fn, float8_e8m0fnu, uint8 = DTYPES["float8_e4m3fn"], DTYPES["float8_e8m0fnu"], DTYPES["uint8"]


@dataclass(frozen=True)
class Fp8Format:
    """`quant_method: fp8`: float8_e4m3fn weights, each with one scale per `block` (rows, cols) of it,
    or a single scale when `block` is None."""

    block: tuple[int, int] | None
    ue8m0: bool

    def describe(self) -> str:
        blocks = f"{self.block[0]}×{self.block[1]} blocks" if self.block else "one scale each"
        return f"FP8 ({blocks}, {'E8M0' if self.ue8m0 else 'float'} scales)"


@dataclass(frozen=True)
class Mxfp4Format:
    """`quant_method: mxfp4`: E2M1 codes in `_blocks`, one E8M0 exponent per 32 in `_scales`."""

    def describe(self) -> str:
        return "MXFP4 (E2M1, one E8M0 scale per 32 values)"


QuantFormat = Fp8Format | Mxfp4Format


@dataclass(frozen=True)
class Fp8Weight:
    """An FP8 weight and its scale, as a dequantized tensor's `TensorEntry.properties`."""

    data: StoredTensor
    scale: StoredTensor
    block: tuple[int, int] | None
    root: Path

    def file(self, st: StoredTensor) -> str:
        return st.file.relative_to(self.root).as_posix()

    @functools.cached_property
    def scale_file(self) -> str:
        """The scale's file, as `open_file` names it: asked for every block decoded."""
        return self.file(self.scale)


@dataclass(frozen=True)
class Mxfp4Weight:
    """An MXFP4 stack's blocks and scales, as a dequantized tensor's `TensorEntry.properties`."""

    blocks: StoredTensor
    scales: StoredTensor
    root: Path

    def file(self, st: StoredTensor) -> str:
        return st.file.relative_to(self.root).as_posix()


def quant_format(config: Mapping[str, Any] | None, config_path: Path) -> QuantFormat | None:
    """The folder's quantization as its config.json's `quantization_config` names it; None when
    it names none. A method or layout not decoded here is refused, naming it."""
    qc = (config or {}).get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise CheckpointError(config_path, "quantization_config is not an object")
    method = qc.get("quant_method")
    if method == "mxfp4":
        return Mxfp4Format()
    if method != "fp8":
        raise UsageError(f"{config_path}: quantization_config quant_method {str(method)[:40]!r} is not one "
                         f"ckptctl dequantizes ({KNOWN_METHODS})")
    fmt, scale_fmt = qc.get("fmt", "e4m3"), qc.get("scale_fmt", "float")
    block = qc.get("weight_block_size", [128, 128])  # transformers' default; null: one scale per weight
    if fmt not in ("e4m3", None):
        raise UsageError(f"{config_path}: quantization_config fmt {str(fmt)[:40]!r}: ckptctl dequantizes e4m3 FP8")
    if scale_fmt not in ("float", "ue8m0", None):
        raise UsageError(f"{config_path}: quantization_config scale_fmt {str(scale_fmt)[:40]!r} is not float or "
                         "ue8m0")
    if qc.get("expert_dtype", "fp8") != "fp8":
        raise UsageError(f"{config_path}: quantization_config expert_dtype {str(qc['expert_dtype'])[:40]!r}: "
                         "ckptctl dequantizes FP8 experts only")
    if block is not None and not (isinstance(block, list) and len(block) == 2
                                  and all(type(b) is int and 0 < b <= 1 << 20 for b in block)):
        raise CheckpointError(config_path, f"quantization_config weight_block_size {str(block)[:40]} is not two "
                                           "positive integers")
    return Fp8Format(tuple(block) if block else None, scale_fmt == "ue8m0")


def dequantized_entries(stored: Mapping[str, StoredTensor], fmt: QuantFormat, root: Path, path: Path,
                        fp8_dtype: DType) -> tuple[dict[str, TensorEntry], set[str]]:
    """The folder's quantized weights as dequantized tensors (FP8 ones of `fp8_dtype`, MXFP4
    ones bfloat16, which holds them exactly), and the stored names they consume. Every FP8
    weight must have its scale on the format's grid and every scale its weight; anything else
    quantized is refused, naming it."""
    if isinstance(fmt, Mxfp4Format):
        return _mxfp4_entries(stored, root, path)
    return _fp8_entries(stored, fmt, root, path, fp8_dtype)


def _fp8_entries(stored: Mapping[str, StoredTensor], fmt: Fp8Format, root: Path, path: Path,
                 dtype: DType) -> tuple[dict[str, TensorEntry], set[str]]:
    entries: dict[str, TensorEntry] = {}
    used: set[str] = set()
    for name, data in sorted(stored.items()):
        if data.dtype != float8_e4m3fn:
            continue
        base = name.removesuffix("weight")
        scales = [s for s in (name + "_scale_inv", base + "scale", base + "qscale_weight") if s in stored]
        if not name.endswith("weight") or len(scales) != 1:
            why = "no scale" if not scales else f"{len(scales)} scales ({', '.join(scales)})"
            raise CheckpointError(path, f"{shown_name(name)}: float8_e4m3fn {list(data.shape)} with {why} (a "
                                        f"weight's is {name}_scale_inv): refusing FP8 bytes without their scale")
        scale = stored[scales[0]]
        _check_fp8_scale(data, scale, fmt, path)
        entries[name] = TensorEntry(name, data.shape, dtype, fp8_chunks(data, fmt.block, dtype, root),
                                    Fp8Weight(data, scale, fmt.block, root))
        used.update((name, scale.name))
    orphans = sorted(n for n, st in stored.items() if n not in used and n.endswith(("_scale_inv", "qscale_weight")))
    if orphans:
        raise CheckpointError(path, f"{shown_name(orphans[0])}: a scale with no float8_e4m3fn weight "
                                    f"{orphans[0].removesuffix('_scale_inv')}" + _more(len(orphans)))
    return entries, used


def _check_fp8_scale(data: StoredTensor, scale: StoredTensor, fmt: Fp8Format, path: Path) -> None:
    """Refuse a scale of a dtype or shape the format does not decode, naming both tensors."""
    dtypes = (float32, bfloat16, float8_e8m0fnu) + ((uint8,) if fmt.ue8m0 else ())
    if scale.dtype not in dtypes:
        raise CheckpointError(path, f"{shown_name(scale.name)}: {dtype_name(scale.dtype)} scales "
                                    f"({'/'.join(dtype_name(d) for d in dtypes)} decoded"
                                    f"{'' if fmt.ue8m0 else '; uint8 ones with scale_fmt ue8m0'})")
    if fmt.block is None:
        if math.prod(scale.shape) != 1 or len(data.shape) < 2:
            raise CheckpointError(path, f"{shown_name(scale.name)}: scale of shape {list(scale.shape)} for "
                                        f"{data.name} {list(data.shape)}; weight_block_size null means one scale "
                                        "per 2-D (or more) weight")
        return
    bm, bn = fmt.block
    grid = (*data.shape[:-2], -(-data.shape[-2] // bm), -(-data.shape[-1] // bn)) if len(data.shape) >= 2 else None
    if grid is None or scale.shape != grid:
        want = f"the {bm}×{bn}-block grid {list(grid)}" if grid else "a 2-D (or more) weight"
        raise CheckpointError(path, f"{shown_name(scale.name)}: scale of shape {list(scale.shape)} for "
                                    f"{data.name} {list(data.shape)}, not {want} (other scale layouts are not "
                                    "decoded)")


def fp8_chunks(data: StoredTensor, block: tuple[int, int] | None, dtype: DType, root: Path) -> tuple[Chunk, ...]:
    """The weight's chunks: for each index of its leading dims, runs of whole block rows of about
    DEQUANT_CHUNK_BYTES of output; each chunk's (offset, length) are its FP8 rows' bytes."""
    *lead, rows, cols = data.shape
    unit = block[0] if block else 1
    step = max(unit, DEQUANT_CHUNK_BYTES // max(1, cols * dtype.itemsize) // unit * unit)
    file = data.file.relative_to(root).as_posix()
    chunks = []
    for flat in range(math.prod(lead)):
        index = unravel(flat, lead)
        for r in range(0, rows, step):
            n = min(rows, r + step) - r
            chunks.append(Chunk(file, data.start + (flat * rows + r) * cols, n * cols, (*index, r, 0),
                                (*(1 for _ in lead), n, cols), (DEQUANT,)))
    if not chunks:
        chunks.append(Chunk(file, data.start, 0, (0,) * len(data.shape), data.shape, (DEQUANT,)))
    return tuple(chunks)


def _mxfp4_entries(stored: Mapping[str, StoredTensor], root: Path,
                   path: Path) -> tuple[dict[str, TensorEntry], set[str]]:
    entries: dict[str, TensorEntry] = {}
    used: set[str] = set()
    for name, blocks in sorted(stored.items()):
        if not name.endswith("_blocks"):
            continue
        base = name.removesuffix("_blocks")
        scales = stored.get(base + "_scales")
        if scales is None or base in stored:
            why = f"without {base}_scales" if scales is None else f"beside a tensor {base} of its own"
            raise CheckpointError(path, f"{shown_name(name)}: MXFP4 blocks {why}")
        if blocks.dtype != uint8 or scales.dtype != uint8 or len(blocks.shape) != 4 or blocks.shape[-1] != 16 \
                or scales.shape != blocks.shape[:-1]:
            raise CheckpointError(path, f"{shown_name(name)}: {dtype_name(blocks.dtype)} {list(blocks.shape)} with "
                                        f"{dtype_name(scales.dtype)} scales {list(scales.shape)}, not MXFP4 experts "
                                        "(uint8 [E, R, G, 16] blocks, uint8 [E, R, G] scales)")
        experts, out_rows, groups, _ = blocks.shape
        shape = (experts, groups * MXFP4_GROUP, out_rows)
        entries[base] = TensorEntry(base, shape, bfloat16, mxfp4_chunks(blocks, root),
                                    Mxfp4Weight(blocks, scales, root))
        used.update((name, scales.name))
    orphans = sorted(n for n in stored if n.endswith("_scales") and n not in used)
    if orphans:
        raise CheckpointError(path, f"{shown_name(orphans[0])}: MXFP4 scales without "
                                    f"{orphans[0].removesuffix('_scales')}_blocks" + _more(len(orphans)))
    return entries, used


def mxfp4_chunks(blocks: StoredTensor, root: Path) -> tuple[Chunk, ...]:
    """Runs of whole experts of about DEQUANT_CHUNK_BYTES decoded (bfloat16); each chunk's
    (offset, length) are its experts' block bytes."""
    experts, rows, groups, _ = blocks.shape
    expert_bytes = rows * groups * 16
    step = max(1, DEQUANT_CHUNK_BYTES // max(1, 2 * rows * groups * MXFP4_GROUP))
    file = blocks.file.relative_to(root).as_posix()
    return tuple(Chunk(file, blocks.start + e * expert_bytes, (min(experts, e + step) - e) * expert_bytes, (e, 0, 0),
                       (min(experts, e + step) - e, groups * MXFP4_GROUP, rows), (DEQUANT,))
                 for e in range(0, experts, step)) or (
        Chunk(file, blocks.start, 0, (0, 0, 0), (experts, groups * MXFP4_GROUP, rows), (DEQUANT,)),)


def _more(n: int) -> str:
    return f" (+{n - 1} more)" if n > 1 else ""


def _read(open_file: Callable[[str], ReadHandle], root: Path, file: str, offset: int, length: int) -> bytearray:
    out = bytearray(length)
    _read_into(open_file, root, file, offset, memoryview(out))
    return out


def _read_into(open_file: Callable[[str], ReadHandle], root: Path, file: str, offset: int, out: memoryview) -> None:
    """Fill `out` with the file's bytes at `offset`; a short read is refused."""
    try:
        got = open_file(file).readinto_at(out, offset) if len(out) else 0
    except OSError as exc:
        raise CheckpointError(root / file, f"cannot read at byte {offset}: {exc.strerror or exc}") from None
    if got != len(out):
        raise CheckpointError(root / file, f"short read at byte {offset}")


def dequantized_chunk(entry: TensorEntry, chunk: Chunk, open_file: Callable[[str], ReadHandle]) -> Any:
    """The chunk's values as a dense tensor of `entry.dtype`, decoded from its codes and their
    scales with positioned reads (`open_file` opens a folder file by its relative name, once)."""
    weight = entry.properties
    if isinstance(weight, Fp8Weight):
        return _fp8_chunk(weight, entry, chunk, open_file)
    if isinstance(weight, Mxfp4Weight):
        return _mxfp4_chunk(weight, chunk, open_file)
    raise CheckpointError(chunk.file, f"{entry.fqn}: a chunk to dequantize of a tensor that is not quantized")


def _fp8_chunk(weight: Fp8Weight, entry: TensorEntry, chunk: Chunk, open_file: Callable[[str], ReadHandle]) -> Any:
    import torch

    out = torch.empty(chunk.sizes, dtype=entry.dtype.torch)
    _fp8_rows(weight, entry, chunk, 0, chunk.sizes[-2], out.reshape(-1), open_file)
    return out


def dequantized_into(entry: TensorEntry, chunk: Chunk, byte_start: int, out: memoryview,
                     open_file: Callable[[str], ReadHandle]) -> bool:
    """Fill `out` with a dequantized chunk's bytes from `byte_start` on, decoding only the rows
    they lie in, straight into `out` when they are whole rows: what the engine reads of an FP8
    weight, each row decoded once and nothing kept. False (nothing read) for an MXFP4 chunk,
    whose rows are columns of its codes: it is decoded whole (`dequantized_chunk`)."""
    import torch

    weight = entry.properties
    if not isinstance(weight, Fp8Weight):
        return False
    isz, cols = entry.dtype.itemsize, chunk.sizes[-1]
    first, count = byte_start // isz, len(out) // isz
    if not count:
        return True
    lo, hi = first // cols, -(-(first + count) // cols)
    target = torch.frombuffer(out, dtype=entry.dtype.torch)
    if first == lo * cols and count == (hi - lo) * cols:
        _fp8_rows(weight, entry, chunk, lo, hi - lo, target, open_file)
        return True
    rows = torch.empty((hi - lo) * cols, dtype=entry.dtype.torch)
    _fp8_rows(weight, entry, chunk, lo, hi - lo, rows, open_file)
    target.copy_(rows[first - lo * cols:first - lo * cols + count])
    return True


def _fp8_rows(weight: Fp8Weight, entry: TensorEntry, chunk: Chunk, r0: int, n: int, out: Any,
              open_file: Callable[[str], ReadHandle]) -> None:
    """Rows [r0, r0 + n) of the chunk (counted from its first) decoded into `out`, a flat tensor
    of `entry.dtype`: each code widened to float32, times its block's scale in float32, rounded
    once to the dtype. The codes and their widened values pass through this thread's buffers
    (`_decode_buffers`): fresh ones for every block cost a page fault per 4 KiB."""
    data, scale = weight.data, weight.scale
    cols = chunk.sizes[-1]
    if not n * cols:
        return
    codes, bits, values = _decode_buffers(n * cols)
    _read_into(open_file, weight.root, chunk.file, chunk.offset + r0 * cols, memoryview(codes.numpy()).cast("B"))
    if weight.block is None:
        raw = _read(open_file, weight.root, weight.scale_file, scale.start, scale.nbytes)
        factors = _scale_values(raw, scale.dtype)
        _refuse_non_finite(factors, entry, weight, 0)
        per_row, bn = factors.reshape(1, 1), cols
    else:
        bm, bn = weight.block
        grid_rows, grid_cols = scale.shape[-2:]
        lead = flat_index(chunk.offsets[:-2], data.shape[:-2])
        row = chunk.offsets[-2] + r0
        first, stop = row // bm, -(-(row + n) // bm)
        isz = scale.dtype.itemsize
        raw = _read(open_file, weight.root, weight.scale_file,
                    scale.start + (lead * grid_rows + first) * grid_cols * isz, (stop - first) * grid_cols * isz)
        factors = _scale_values(raw, scale.dtype).reshape(stop - first, grid_cols)
        _refuse_non_finite(factors, entry, weight, (lead * grid_rows + first) * grid_cols)
        per_row = factors.repeat_interleave(bm, dim=0)[row % bm:row % bm + n]  # n × grid_cols: 1/bn of the rows
    values = _fp8_scaled_codes(codes, bits, values, per_row).reshape(n, cols)
    whole = cols // bn
    if whole:
        values[:, :whole * bn].unflatten(1, (whole, bn)).mul_(per_row[:, :whole, None])
    if whole < per_row.shape[1]:
        values[:, whole * bn:].mul_(per_row[:, whole:])
    out.copy_(values.reshape(-1))


_BUFFERS = threading.local()


def _decode_buffers(count: int) -> tuple[Any, Any, Any]:
    """This thread's int8, int16 and float32 buffers of at least `count` elements (a block's codes,
    their bfloat16 bits, their float32 values), cut to `count`: allocated once, not per block."""
    import torch

    held = getattr(_BUFFERS, "held", None)
    if held is None or held[0].numel() < count:
        held = _BUFFERS.held = tuple(torch.empty(count, dtype=d) for d in (torch.int8, torch.int16, torch.float32))
    return tuple(t[:count] for t in held)


def _fp8_scaled_codes(codes: Any, bits: Any, values: Any, factors: Any) -> Any:
    """The codes' values as float32 (in `values`, through `bits`), over `SHIFTED` when the
    factors that will scale them can be taken `SHIFTED` times larger exactly (they are, in
    place): then their products are the codes' values times the factors, rounded once, as
    transformers computes them.

    An e4m3 byte shifted into a bfloat16's sign, exponent and mantissa bits (`_shifted_codes`) is
    its value over 2^120 (its zero exponent one of bfloat16's subnormals), so it is widened with
    integer passes instead of a lookup per byte: about 4× faster. Bytes of NaN (0x7F, 0xFF: the
    bytes whose low seven bits are all set; `bits`' first bytes hold each byte with its eighth
    set, to find them), factors that would overflow, or a CPU treating subnormal operands as
    zero take the lookup `_fp8_values`, torch's own widening."""
    import numpy
    import torch

    shifted = factors * SHIFTED
    unsigned = codes.view(torch.uint8).numpy()
    nan = int(numpy.bitwise_or(unsigned, 0x80, out=bits.view(torch.uint8)[:len(codes)].numpy()).max()) == 0xFF
    if nan or bool(torch.isinf(shifted).any()) or not _shift_is_exact():
        return torch.from_numpy(_fp8_values()[unsigned])
    factors.copy_(shifted)
    values.copy_(_shifted_codes(codes, bits))
    return values


SHIFTED = 2.0 ** 120
"""An e4m3 exponent's bias (7) below a bfloat16's (127): a code's bits in a bfloat16's are its value over this."""


def _shifted_codes(codes: Any, bits: Any) -> Any:
    """int8 e4m3 codes as bfloat16s of their value over `SHIFTED`, in `bits` (int16): the sign to
    bit 15, exponent and mantissa to bits 4–10 (a byte sign-extended, times 16, masked)."""
    import torch

    bits.copy_(codes)
    return bits.mul_(16).bitwise_and_(0x87F0 - 0x10000).view(torch.bfloat16)


@functools.cache
def _shift_is_exact() -> bool:
    """Whether every non-NaN e4m3 byte, shifted and scaled back by `SHIFTED`, is the value torch
    widens it to, bit for bit (false on a CPU flushing subnormal operands to zero)."""
    import torch

    codes = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)
    widened = _shifted_codes(codes.view(torch.int8), torch.empty(len(codes), dtype=torch.int16)).float() * SHIFTED
    return torch.equal(widened.view(torch.int32), torch.from_numpy(_fp8_values()[codes.numpy()]).view(torch.int32))


def _refuse_non_finite(factors: Any, entry: TensorEntry, weight: Fp8Weight, first: int) -> None:
    """Refuse a NaN or infinite scale (an E8M0 byte 255 among them): every value of its block would
    be NaN or infinite, a model no training or serving resumes from. `first`: the flat index in the
    scale tensor of `factors`' first element."""
    import torch

    bad = (~torch.isfinite(factors)).flatten().nonzero()
    if len(bad):
        at = first + int(bad[0])
        scale = weight.scale
        raise CheckpointError(scale.file, f"{entry.fqn}: its scale {scale.name} holds "
                                          f"{float(factors.flatten()[int(bad[0])])} at "
                                          f"{list(unravel(at, scale.shape))}: the weights it scales "
                                          "cannot be decoded")


@functools.cache
def _fp8_values() -> Any:
    """Each float8_e4m3fn byte's value as float32, as torch widens it: a lookup is twice as fast."""
    import torch

    return torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float32).numpy()


def _scale_values(raw: bytearray, dtype: DType) -> Any:
    """Scales as float32: float ones widened, E8M0 bytes b as 2^(b-127) (255: inf, as transformers reads it)."""
    import torch

    if dtype == uint8:
        return _powers_of_two(-127, torch.float32)[torch.frombuffer(raw, dtype=torch.uint8).long()]
    return torch.frombuffer(raw, dtype=dtype.torch).to(torch.float32)


def _powers_of_two(bias: int, dtype: Any) -> Any:
    """2^(b + bias) for every byte b, in `dtype` (exact down to its subnormals; inf past its range)."""
    import torch

    return torch.tensor([2.0 ** (b + bias) for b in range(256)], dtype=torch.float64).to(dtype)


def _mxfp4_chunk(weight: Mxfp4Weight, chunk: Chunk, open_file: Callable[[str], ReadHandle]) -> Any:
    import torch

    experts, rows, groups, _ = weight.blocks.shape
    count, first = chunk.sizes[0], chunk.offsets[0]
    codes = torch.frombuffer(_read(open_file, weight.root, chunk.file, chunk.offset, chunk.length), dtype=torch.uint8)
    raw = _read(open_file, weight.root, weight.file(weight.scales), weight.scales.start + first * rows * groups,
                count * rows * groups)
    exponents = torch.frombuffer(raw, dtype=torch.uint8).long().reshape(count, rows, groups, 1)
    lut = torch.tensor(E2M1_VALUES, dtype=torch.bfloat16)
    codes = codes.reshape(count, rows, groups, 16)
    values = torch.empty(count, rows, groups, MXFP4_GROUP, dtype=torch.bfloat16)
    values[..., 0::2] = lut[(codes & 0x0F).long()]
    values[..., 1::2] = lut[(codes >> 4).long()]
    # code × 2^(b-127) as code × 2^(b-128) × 2: both products exact in bfloat16 (2^128 is not a
    # bfloat16, 2^-129 is), so a zero code stays zero at b = 255, as transformers decodes it
    values.mul_(_powers_of_two(-128, torch.bfloat16)[exponents]).mul_(2)
    return values.reshape(count, rows, groups * MXFP4_GROUP).transpose(1, 2).contiguous()


def describe_dequantized(tensors: Mapping[str, TensorEntry], fmt: QuantFormat, dtype: DType) -> str:
    """A note of what was dequantized: `7 FP8 weights dequantized from FP8 (…) to bfloat16`."""
    count = sum(isinstance(e.properties, (Fp8Weight, Mxfp4Weight)) for e in tensors.values())
    what = "MXFP4 expert stack" if isinstance(fmt, Mxfp4Format) else "FP8 weight"
    return f"{counted(count, what)} dequantized from {fmt.describe()} to {dtype_name(dtype)}"
