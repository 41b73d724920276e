"""The records ckptctl writes are torch.save archives: torch, mmap and zipfile all read them."""

from __future__ import annotations

import io
import zipfile
import zlib

import pytest
import torch

from ckptctl.formats.torch_save.zip import ALIGNMENT, TorchSaveRecord, serialization_id

CASES = [
    (torch.float32, (3, 4)), (torch.bfloat16, (5,)), (torch.float16, (2, 3, 2)), (torch.int64, ()),
    (torch.float32, (0, 3)), (torch.bool, (7,)), (torch.float8_e4m3fn, (2, 3)), (torch.uint8, (9,)),
]


def sample(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    if dtype == torch.bool:
        return torch.rand(shape, generator=gen) > 0.5
    if not dtype.is_floating_point:
        return torch.randint(0, 100, shape, generator=gen).to(dtype)
    return (torch.randn(shape, generator=gen) * 3).to(dtype)


def archive(tensor: torch.Tensor, zip64: bool) -> bytes:
    record = TorchSaveRecord(tensor.dtype, tuple(tensor.shape), serialization_id("k"), force_zip64=zip64)
    data = tensor.reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b""
    blob = record.head + data + record.tail(zlib.crc32(data))
    assert len(blob) == record.length
    return blob


@pytest.mark.parametrize("zip64", [False, True], ids=["zip32", "zip64"])
@pytest.mark.parametrize("dtype,shape", CASES, ids=[f"{d}-{list(s)}" for d, s in CASES])
def test_torch_loads_streamed_record_bit_exact(dtype, shape, zip64, tmp_path):
    tensor = sample(dtype, shape)
    blob = archive(tensor, zip64)
    for loaded in (torch.load(io.BytesIO(blob), weights_only=True),
                   (tmp_path / "t.pt").write_bytes(blob) and torch.load(tmp_path / "t.pt", mmap=True, weights_only=True)):
        assert loaded.dtype == dtype and tuple(loaded.shape) == shape
        assert loaded.reshape(-1).view(torch.uint8).tolist() == tensor.reshape(-1).view(torch.uint8).tolist()
    assert zipfile.ZipFile(io.BytesIO(blob)).testzip() is None  # every CRC-32 is right


def test_tensor_data_is_64_byte_aligned():
    record = TorchSaveRecord(torch.float32, (10, 10), serialization_id("k"))
    assert len(record.head) % ALIGNMENT == 0


def test_a_record_is_deterministic():
    a = TorchSaveRecord(torch.bfloat16, (4, 4), serialization_id("x@[0, 0]"))
    b = TorchSaveRecord(torch.bfloat16, (4, 4), serialization_id("x@[0, 0]"))
    assert a.head == b.head and a.tail(123) == b.tail(123)
    assert serialization_id("x") != serialization_id("y") and len(serialization_id("x")) == 40


@pytest.mark.parametrize("zip64", [False, True], ids=["zip32", "zip64"])
def test_each_item_carries_its_own_id_and_crc_in_a_shared_shape(zip64):
    """Items of one shape share a tail template; the id and the CRCs patched into it are each item's own."""
    blobs = {}
    for key, value in (("a@[0]", 1.0), ("b@[4]", 2.0)):
        tensor = torch.full((4, 4), value)
        record = TorchSaveRecord(tensor.dtype, (4, 4), serialization_id(key), force_zip64=zip64)
        data = tensor.numpy().tobytes()
        blobs[key] = zipfile.ZipFile(io.BytesIO(record.head + data + record.tail(zlib.crc32(data))))
    for key, archive in blobs.items():
        assert archive.testzip() is None
        assert archive.read("archive/.data/serialization_id") == serialization_id(key).encode()
        assert archive.getinfo("archive/data/0").CRC == zlib.crc32(torch.full((4, 4), 1.0 if key[0] == "a" else 2.0)
                                                                    .numpy().tobytes())
