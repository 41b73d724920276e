"""Pure parts of the CPU engine: the order workers take records in, the records' CRC-32."""

from __future__ import annotations

import os
import zlib

from ckptctl.dtypes import float32
from ckptctl.engine.cpu import interleaved_by_file
from ckptctl.engine.crc import crc32
from ckptctl.geometry import Box
from ckptctl.plan import StreamItem, TargetTensor


def item(file: str, offset: int) -> StreamItem:
    target = TargetTensor(f"{file}@{offset}", (4,), float32, ())
    return StreamItem(file, offset, b"", target, Box((0,), (4,)), ())


def test_workers_take_files_in_turn_each_front_to_back():
    items = [item("b", 30), item("a", 50), item("c", 0), item("a", 0), item("b", 0), item("a", 20)]
    order = [(i.file, i.offset) for i in interleaved_by_file(items)]
    assert order == [("a", 0), ("b", 0), ("c", 0), ("a", 20), ("b", 30), ("a", 50)]


def test_no_items_no_order():
    assert interleaved_by_file([]) == []


def test_record_crc_is_zlibs_whichever_implementation_runs():
    data = os.urandom((1 << 20) + 7)
    assert crc32(data) == zlib.crc32(data)
    assert crc32(data[1000:], crc32(data[:1000])) == zlib.crc32(data)
    assert crc32(memoryview(bytearray(data))[5:]) == zlib.crc32(data[5:])
