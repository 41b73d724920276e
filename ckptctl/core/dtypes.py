"""Tensor dtypes as plain data, so reading, planning and copying never import torch.

`import torch` costs over a second, more than copying a gigabyte. A checkpoint names its
dtypes by torch's names (`torch.float32` in `.metadata`, `FloatStorage` in each record's
`data.pkl`), and moving bytes needs only each dtype's size, so ckptctl keeps its own table
and imports torch only to compute (casts, sums, verification) via `DType.torch`.
A `DType` compares equal to the torch dtype of the same name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, eq=False)
class DType:
    """One torch dtype: its name, element size, kind, and its names in the file formats."""

    name: str
    itemsize: int
    kind: str  # "f" floating, "c" complex, "i" integer, "b" bool
    storage: str | None = None  # the legacy storage class torch.save names (`FloatStorage`)
    safetensors: str | None = None  # the safetensors header code (`F32`)

    @property
    def is_floating_point(self) -> bool:
        return self.kind == "f"

    @property
    def is_complex(self) -> bool:
        return self.kind == "c"

    @property
    def torch(self) -> Any:
        """The torch dtype (imports torch)."""
        import torch

        return getattr(torch, self.name)

    def __str__(self) -> str:
        return f"torch.{self.name}"

    __repr__ = __str__

    def __eq__(self, other: object) -> bool:
        if isinstance(other, DType):
            return other.name == self.name
        if type(other).__name__ == "dtype" and type(other).__module__ == "torch":
            return str(other) == str(self)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.name)


_TABLE = [
    DType("float64", 8, "f", "DoubleStorage", "F64"),
    DType("float32", 4, "f", "FloatStorage", "F32"),
    DType("float16", 2, "f", "HalfStorage", "F16"),
    DType("bfloat16", 2, "f", "BFloat16Storage", "BF16"),
    DType("float8_e4m3fn", 1, "f", None, "F8_E4M3"),
    DType("float8_e5m2", 1, "f", None, "F8_E5M2"),
    DType("float8_e4m3fnuz", 1, "f"),
    DType("float8_e5m2fnuz", 1, "f"),
    DType("float8_e8m0fnu", 1, "f", None, "F8_E8M0"),
    DType("float4_e2m1fn_x2", 1, "f"),
    DType("complex128", 16, "c", "ComplexDoubleStorage", "C128"),
    DType("complex64", 8, "c", "ComplexFloatStorage", "C64"),
    DType("complex32", 4, "c"),
    DType("int64", 8, "i", "LongStorage", "I64"),
    DType("int32", 4, "i", "IntStorage", "I32"),
    DType("int16", 2, "i", "ShortStorage", "I16"),
    DType("int8", 1, "i", "CharStorage", "I8"),
    DType("uint64", 8, "i", None, "U64"),
    DType("uint32", 4, "i", None, "U32"),
    DType("uint16", 2, "i", None, "U16"),
    DType("uint8", 1, "i", "ByteStorage", "U8"),
    DType("bool", 1, "b", "BoolStorage", "BOOL"),
]

DTYPES: dict[str, DType] = {d.name: d for d in _TABLE}
"""Every dtype a checkpoint may hold, by torch's short name (`bfloat16`)."""

BY_STORAGE: dict[str, DType] = {d.storage: d for d in _TABLE if d.storage}
BY_SAFETENSORS: dict[str, DType] = {d.safetensors: d for d in _TABLE if d.safetensors}

float32, float16, bfloat16 = DTYPES["float32"], DTYPES["float16"], DTYPES["bfloat16"]

CAST_CHOICES: dict[str, DType | None] = {"keep": None, "bf16": bfloat16, "fp16": float16, "fp32": float32,
                                         "bfloat16": bfloat16, "float16": float16, "float32": float32}
"""`--dtype` values: the dtype floating tensors are cast to (`keep`: none), by its short or torch name."""


def as_dtype(value: Any) -> DType:
    """A DType from a DType, a torch dtype, or a name (`bfloat16`, `torch.bfloat16`)."""
    if isinstance(value, DType):
        return value
    name = str(value).removeprefix("torch.")
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unsupported dtype {value!r}") from None


def cast_dtype(src: DType, wanted: DType | None) -> DType:
    """`--dtype` casts floating tensors only; integer and bool tensors keep their dtype."""
    return as_dtype(wanted) if wanted is not None and src.is_floating_point else src
