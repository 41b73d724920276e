"""FP8 block-scaled weights written as DeepSeek-V3/R1 publish them (`export-hf --quantize`).

A quantized weight W [M, N] is written as `W` float8_e4m3fn codes and `W_scale_inv` scales on
the ceil grid [⌈M/bm⌉, ⌈N/bn⌉] of its `bm × bn` blocks, value = code × its block's scale. Each
block's scale is Megatron-Bridge's (`quantization_utils.scale_from_amax`): amax / 448 in
float32, 1 for an all-zero block (never 0 or NaN), and with `scale_fmt: ue8m0` rounded up to a
power of two (clamped to 2^±127); codes are (W in float32 / scale) cast to float8_e4m3fn. W is
what the export writes unquantized (the source's values, cast by `--dtype` first), so the FP8
folder is the quantization of the plain one. An edge block is the part of it inside W (the
padding Megatron-Bridge adds is zeros: no amax changes).

`fp8-block` quantizes the 2-D `…proj….weight` of linear layers (attention and MLP projections,
experts' ones), as DeepSeek-V3 and Qwen3-FP8 do, and leaves norms, embeddings, router gates,
biases, 1-D tensors and `lm_head` as they are. transformers' FP8 integration (5.24) swaps every
`nn.Linear` for an `FP8Linear` expecting codes and scales, except `modules_to_not_convert`, which
when absent defaults to the output embedding (`lm_head`) alone: so the key is written only when
another 2-D weight stays unquantized (a gate that is an `nn.Linear`, as Qwen3-Next's
`shared_expert_gate`), listing each such module and `lm_head`. `like:REF` takes the set of
quantized weights, block, scale name, scale dtype and `scale_fmt` from a quantized folder REF,
so a fine-tuned model goes back out in its original format; a REF layout not written here is
refused, naming the tensor. A block whose values REF's scale codes exactly (each code × scale,
rounded to the written dtype, gives the value back: an unchanged weight) keeps that scale and
those codes, so the folder comes back as REF holds it, bit for bit, whatever formula made REF's
scales; a changed block is quantized afresh, as Megatron-Bridge's `quantize_fp8_e4m3fn_like_scale`
does (it takes only the geometry and dtype from REF's scale).

The engine writes a quantized weight in row bands of whole block rows: each band's codes at its
place, and the band's scale rows into the weight's scale tensor, which is laid out in the same
file (`Fp8Codes.scale_offset`): memory is one band, and the source is read once.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from ckptctl.core.dtypes import DTYPES, DType, float32
from ckptctl.formats.safetensors.quantized import Fp8Format, quant_format
from ckptctl.formats.safetensors.reader import StoredTensor, shown_name, stored_tensors
from ckptctl.storage.hf_files import read_json_object
from ckptctl.storage.store import store_for
from ckptctl.util.errors import CheckpointError, UsageError

FP8_BLOCK = "fp8-block"
LIKE = "like:"
SCHEMES = f"{FP8_BLOCK} or {LIKE}REF (the layout of a quantized model folder REF)"
BLOCK = (128, 128)
E4M3_MAX = 448.0
"""The largest float8_e4m3fn value: a block's amax is coded as ±448."""
SCALE_SUFFIX = "_scale_inv"
BAND_BYTES = 4 << 20
"""Codes bytes of one record of a quantized weight (whole block rows): its rows are held in float32
with a few temporaries (~6× this) per worker while they are quantized."""
float8_e4m3fn, float8_e8m0fnu, uint8 = DTYPES["float8_e4m3fn"], DTYPES["float8_e8m0fnu"], DTYPES["uint8"]
_LINEAR = re.compile(r"(^|\.)[A-Za-z0-9_]*proj[A-Za-z0-9_]*\.weight$")
"""A linear projection's weight (`q_proj`, `kv_a_proj_with_mqa`, `gate_up_proj`, `down_proj`…)."""


@dataclass(frozen=True)
class RefWeight:
    """A weight REF holds quantized: its shape and its scale tensor (kept where it codes the
    exported block exactly: `Fp8Codes.kept`)."""

    shape: tuple[int, ...]
    scale: StoredTensor


@dataclass(frozen=True)
class Fp8Scheme:
    """How `--quantize` writes weights: which are quantized, their block, and their scales' name,
    dtype and format."""

    scheme: str
    block: tuple[int, int] = BLOCK
    ue8m0: bool = False
    scale_dtype: DType = float32
    quantized: Mapping[str, RefWeight] | None = None
    """`like:REF`: each weight quantized in REF, by name; None: the `fp8-block` rule."""
    config: Mapping[str, Any] = field(default_factory=dict)
    """The `quantization_config` written into config.json."""

    def wants(self, name: str, shape: tuple[int, ...]) -> bool:
        """Whether the weight `name` of `shape` is written quantized."""
        if self.quantized is not None:
            return name in self.quantized
        return len(shape) == 2 and bool(_LINEAR.search(name)) and not name.startswith("lm_head")

    def scale_of(self, name: str) -> tuple[str, DType]:
        """The scale tensor's name and dtype of quantized weight `name`."""
        if self.quantized is not None:
            return self.quantized[name].scale.name, self.quantized[name].scale.dtype
        return name + SCALE_SUFFIX, self.scale_dtype

    def describe(self) -> str:
        return (f"FP8 e4m3 with {self.block[0]}×{self.block[1]} blocks, "
                f"{'power-of-two (ue8m0)' if self.ue8m0 else 'float'} scales")

    def as_json(self) -> dict[str, Any]:
        return {"scheme": self.scheme, "block": list(self.block), "scale_fmt": "ue8m0" if self.ue8m0 else "float"}


@dataclass(frozen=True)
class Fp8Codes:
    """A quantized weight's codes target's `properties`: the dtype of the values it quantizes (what
    the export writes unquantized: the source's, or `--dtype`'s), its block, scale format, and where
    its scale tensor lies in the same file (absolute offset; -1 until the file is laid out)."""

    values: DType
    block: tuple[int, int]
    ue8m0: bool
    scale: str
    scale_dtype: DType
    kept: StoredTensor | None = None
    """`like:REF`: REF's scale of this weight, kept for each block it codes exactly."""
    scale_offset: int = -1


@dataclass(frozen=True)
class Fp8Scales:
    """A scale tensor's target's `properties`: the codes target it scales (its bytes are written by
    that target's records, never read from a source)."""

    codes: Any
    """The codes' `TargetTensor`."""


def grid(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    """The ceil grid of blocks over a 2-D weight."""
    return -(-shape[0] // block[0]), -(-shape[1] // block[1])


def parse_quantize(value: str | None, hub_timeout: float | None = None) -> Fp8Scheme | None:
    """The layout `--quantize VALUE` asks for (None without one); an unknown scheme, or a REF
    layout not written here, refused in one line."""
    if value is None:
        return None
    if value == FP8_BLOCK:
        return Fp8Scheme(FP8_BLOCK, config=_config(BLOCK, False))
    if value.startswith(LIKE) and len(value) > len(LIKE):
        return like_folder(Path(value[len(LIKE):]))
    raise UsageError(f"--quantize {value!r}: not a scheme ckptctl writes ({SCHEMES})")


def _config(block: tuple[int, int], ue8m0: bool) -> dict[str, Any]:
    """`quantization_config` as DeepSeek-V3 publishes it (V3.1/V4: with `scale_fmt: ue8m0`)."""
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block),
            **({"scale_fmt": "ue8m0"} if ue8m0 else {})}


def like_folder(ref: Path) -> Fp8Scheme:
    """The layout of the FP8 block-scaled folder `ref`: its quantized weights (float8_e4m3fn with a
    `_scale_inv` on the 2-D ceil grid), block, scale dtypes and `scale_fmt`, and its
    `quantization_config` as it is."""
    config_path = ref / "config.json"
    if not store_for(config_path).exists(config_path):
        raise UsageError(f"--quantize like:{ref}: cannot read {config_path} (no such file)")
    config = read_json_object(config_path, "config")
    if not isinstance(config, dict) or "quantization_config" not in config:
        raise UsageError(f"--quantize like:{ref}: {config_path} has no quantization_config (not a quantized folder)")
    fmt = quant_format(config, config_path)
    if not isinstance(fmt, Fp8Format) or fmt.block is None:
        what = fmt.describe() if fmt is not None else "?"
        raise UsageError(f"--quantize like:{ref}: {what} is not a layout ckptctl writes (FP8 with "
                         "weight_block_size)")
    stored = stored_tensors(ref)
    quantized: dict[str, RefWeight] = {}
    for name, data in sorted(stored.items()):
        if data.dtype != float8_e4m3fn:
            _refuse_scale_alone(ref, name, data, stored)
            continue
        scale = stored.get(name + SCALE_SUFFIX)
        if not name.endswith("weight") or scale is None or len(data.shape) != 2 \
                or scale.shape != grid(data.shape, fmt.block):
            raise UsageError(f"--quantize like:{ref}: {_where(ref, data)}{shown_name(name)}: "
                             f"float8_e4m3fn {list(data.shape)} without a {name}{SCALE_SUFFIX} on the "
                             f"{fmt.block[0]}×{fmt.block[1]} ceil grid of a 2-D weight: a layout ckptctl "
                             "does not write")
        if scale.dtype not in (float32, float8_e8m0fnu) + ((uint8,) if fmt.ue8m0 else ()):  # bf16: not exact
            raise UsageError(f"--quantize like:{ref}: {_where(ref, scale)}{shown_name(scale.name)}: "
                             f"{scale.dtype.name} scales are not a layout ckptctl writes")
        if scale.dtype in (float8_e8m0fnu, uint8) and not fmt.ue8m0:
            raise UsageError(f"--quantize like:{ref}: {_where(ref, scale)}{shown_name(scale.name)}: E8M0 scales "
                             "without scale_fmt ue8m0 in quantization_config")
        quantized[name] = RefWeight(data.shape, scale)
    if not quantized:
        raise UsageError(f"--quantize like:{ref}: holds no float8_e4m3fn weight (nothing to copy the layout of)")
    return Fp8Scheme(f"{LIKE}{ref}", fmt.block, fmt.ue8m0, float32, quantized, dict(config["quantization_config"]))


def _refuse_scale_alone(ref: Path, name: str, data: StoredTensor, stored: Mapping[str, StoredTensor]) -> None:
    """A scale-like tensor without its FP8 weight (another spelling, a scalar scale) is a layout not written here."""
    spelled = name.endswith(("_scale_inv", ".scale", "qscale_weight", "weight_scale", "input_scale"))
    weight = name.removesuffix(SCALE_SUFFIX)
    if spelled and not (name.endswith(SCALE_SUFFIX) and weight in stored
                        and stored[weight].dtype == float8_e4m3fn):
        raise UsageError(f"--quantize like:{ref}: {_where(ref, data)}{shown_name(name)}: a scale "
                         f"{data.dtype.name} {list(data.shape)} of a layout ckptctl does not write")


def _where(ref: Path, st: StoredTensor) -> str:
    """The file of REF that holds `st`, as an error line names it."""
    return f"{st.file.name}: " if st.file != ref else ""


def quantize_fp8(values: Any, block: tuple[int, int], ue8m0: bool, kept: Any = None,
                 written: DType | None = None) -> tuple[Any, Any]:
    """(float8_e4m3fn codes [R, N], float32 scales [⌈R/bm⌉, ⌈N/bn⌉]) of float32 `values` [R, N]:
    Megatron-Bridge's `_quantize_fp8_2d_blocks` arithmetic, done on a zero-padded copy of the band.
    With `kept` (float32 scales of the same grid: REF's), a block whose values, of dtype `written`,
    those scales code exactly (each code × scale rounded to `written` gives the value back) keeps
    its scale and those codes: an unchanged weight is written as REF holds it, bit for bit."""
    import torch

    rows, cols = values.shape
    (bm, bn), (gm, gn) = block, grid(values.shape, block)
    padded = values
    if gm * bm != rows or gn * bn != cols:
        padded = torch.zeros(gm * bm, gn * bn, dtype=torch.float32)
        padded[:rows, :cols] = values
    blocks = padded.view(gm, bm, gn, bn).transpose(1, 2)
    amax = blocks.abs().amax(dim=(-1, -2))
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    if ue8m0:
        scale = torch.exp2(torch.ceil(torch.log2(scale.clamp(min=2.0 ** -127, max=2.0 ** 127))))
    codes = (blocks / scale[:, :, None, None]).to(torch.float8_e4m3fn)
    if kept is not None:
        again = (blocks / kept[:, :, None, None]).to(torch.float8_e4m3fn)
        back = (again.float() * kept[:, :, None, None]).to(written.torch).float()
        exact = (back == blocks).flatten(2).all(dim=2) & (kept > 0)  # NaN codes or scales compare unequal
        scale = torch.where(exact, kept, scale)
        codes = torch.where(exact[:, :, None, None], again, codes)
    codes = codes.transpose(1, 2).reshape(gm * bm, gn * bn)[:rows, :cols].contiguous()
    return codes, scale


def stored_scales(scale: StoredTensor, first: int, stop: int) -> Any:
    """Rows [first, stop) of a REF scale tensor as float32 (E8M0 bytes b as 2^(b-127)), read from its
    file at the place its header gives."""
    import torch

    cols = scale.shape[1]
    size = scale.dtype.itemsize
    length = (stop - first) * cols * size
    try:
        with store_for(scale.file).open_read(scale.file) as handle:
            raw = handle.read_at(length, scale.start + first * cols * size)
    except OSError as exc:
        raise CheckpointError(scale.file, f"cannot read {scale.name}: {exc.strerror or exc}") from None
    if len(raw) != length:
        raise CheckpointError(scale.file, f"{shown_name(scale.name)}: short read")
    values = torch.frombuffer(bytearray(raw), dtype=torch.uint8 if scale.dtype == uint8 else scale.dtype.torch)
    if scale.dtype == uint8:
        return torch.exp2(values.float() - 127).view(stop - first, cols)
    return values.float().view(stop - first, cols)


def scale_bytes(scale: Any, dtype: DType) -> bytes:
    """Float32 scales stored as `dtype` (float32, bfloat16, float8_e8m0fnu, or uint8 E8M0 bytes
    2^(b-127)); bytes little-endian, row-major."""
    import torch

    if dtype == uint8:
        stored = (torch.log2(scale) + 127).to(torch.uint8)
    else:
        stored = scale.to(dtype.torch)
    return stored.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def band_rows(rows: int, cols: int, block_rows: int, item_bytes: int | None = None) -> int:
    """Rows of each record of a quantized weight: whole block rows, about `item_bytes` of codes."""
    item_bytes = BAND_BYTES if item_bytes is None else item_bytes
    return max(block_rows, item_bytes // max(1, cols) // block_rows * block_rows) if rows else 1


def quantized_count(targets: Mapping[str, Any]) -> int:
    """How many of the targets are quantized weights."""
    return sum(isinstance(t.properties, Fp8Codes) for t in targets.values())


def quantized_targets(targets: Mapping[str, Any], layout: Fp8Scheme, path: Path, selected: bool) -> dict[str, Any]:
    """`targets` with each weight `layout` quantizes as its codes (float8_e4m3fn, the same pieces)
    followed by its scale (no pieces: the codes' records write it). A REF weight the export
    lacks, or has in another shape, and a weight that is not floating point, are refused."""
    from dataclasses import replace

    out: dict[str, Any] = {}
    for name, target in targets.items():
        if not layout.wants(name, target.shape):
            out[name] = target
            continue
        if len(target.shape) != 2 or not target.dtype.is_floating_point or target.delta is not None:
            why = ("a merged weight" if target.delta is not None else
                   f"{target.dtype.name} {list(target.shape)}, not a 2-D floating-point weight")
            raise CheckpointError(path, f"{name}: {why}, cannot be written as {layout.describe()}")
        scale, scale_dtype = layout.scale_of(name)
        ref = layout.quantized[name] if layout.quantized is not None else None
        if ref is not None and ref.shape != target.shape:
            raise UsageError(f"--quantize {layout.scheme}: {shown_name(name)} is {list(ref.shape)} "
                             f"there, {list(target.shape)} in this export")
        if scale in targets:
            raise CheckpointError(path, f"{name}: its scale's name {scale} is already an output tensor")
        codes = replace(target, dtype=float8_e4m3fn,
                        properties=Fp8Codes(target.dtype, layout.block, layout.ue8m0, scale, scale_dtype,
                                            ref.scale if ref is not None else None))
        out[name] = codes
        out[scale] = type(target)(scale, grid(target.shape, layout.block), scale_dtype, (), Fp8Scales(codes))
    if layout.quantized is not None and not selected:
        lacking = sorted(set(layout.quantized) - set(targets))
        if lacking:
            raise UsageError(f"--quantize {layout.scheme}: {shown_name(lacking[0])} is quantized there but not in "
                             f"this export" + (f" (+{len(lacking) - 1} more)" if len(lacking) > 1 else ""))
    return out


def quantization_config(layout: Fp8Scheme, targets: Mapping[str, Any]) -> dict[str, Any]:
    """config.json's `quantization_config`: REF's as it is (`like:REF`), else DeepSeek's, with
    `modules_to_not_convert` where a 2-D weight other than the embeddings and `lm_head` is kept."""
    if layout.quantized is not None:
        return dict(layout.config)
    kept = sorted(name.removesuffix(".weight") for name, t in targets.items()
                  if name.endswith(".weight") and len(t.shape) == 2 and t.properties is None
                  and "embed" not in name and not name.startswith("lm_head"))
    return {**layout.config, **({"modules_to_not_convert": ["lm_head", *kept]} if kept else {})}


def placed(targets: Mapping[str, Any], file_offsets: Mapping[str, int]) -> None:
    """Give each codes target of a file laid out at `file_offsets` the offset of its scale there,
    and each scale target the final codes target (in place in `targets`)."""
    from dataclasses import replace

    for name in list(file_offsets):
        target = targets[name]
        if isinstance(target.properties, Fp8Codes):
            codes = replace(target, properties=replace(target.properties,
                                                       scale_offset=file_offsets[target.properties.scale]))
            targets[name] = codes
            scale = targets[target.properties.scale]
            targets[scale.fqn] = replace(scale, properties=Fp8Scales(codes))
