"""CPU engine details: the order workers take records in, early writeback, small records written
together and read ahead, the records' CRC-32, a target's add."""

from __future__ import annotations

import dataclasses
import errno
import os
import threading
import warnings
import zlib

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ckptctl.core.dtypes import float32
from ckptctl.engine import cpu
from ckptctl.engine.cpu import ChunkSource, OutputFiles, assemble_bytes, interleaved_by_file
from ckptctl.engine.crc import crc32
from ckptctl.formats.dcp.metadata import open_checkpoint
from ckptctl.core.geometry import Box, full_box
from ckptctl.core.plan import StreamItem, TargetTensor, identity_target, plan_box, source_view
from ckptctl.storage import store


def item(file: str, offset: int) -> StreamItem:
    target = TargetTensor(f"{file}@{offset}", (4,), float32, ())
    return StreamItem(file, offset, b"", target, Box((0,), (4,)), ())


def test_workers_take_files_in_turn_each_front_to_back():
    items = [item("b", 30), item("a", 50), item("c", 0), item("a", 0), item("b", 0), item("a", 20)]
    order = [(i.file, i.offset) for i in interleaved_by_file(items)]
    assert order == [("a", 0), ("b", 0), ("c", 0), ("a", 20), ("b", 30), ("a", 50)]


def test_no_items_no_order():
    assert interleaved_by_file([]) == []


def test_each_threads_sequential_run_is_handed_to_the_disk_every_writeback_bytes(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(store, "start_writeback", lambda fd, offset, length: calls.append((offset, length)))
    files = OutputFiles(tmp_path, {"a": 100}, sync=True)
    monkeypatch.setattr(cpu, "WRITEBACK_BYTES", 10)
    for offset in (0, 4, 8, 12):  # one run: handed over at 12 bytes, 4 left
        files.write("a", b"x" * 4, offset)
    files.write("a", b"y" * 9, 50)  # another record: a new run, the old one's rest waits for fsync
    files.write("a", b"y" * 1, 59)
    files.wrote("a", 60, 30)  # an in-kernel copy continues the run
    files.close()
    assert calls == [(0, 12), (50, 10), (60, 30)]
    assert (tmp_path / "a").read_bytes()[:16] == b"x" * 16


def test_without_sync_nothing_is_handed_over(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(store, "start_writeback", lambda fd, offset, length: calls.append((offset, length)))
    files = OutputFiles(tmp_path, {"a": 8 << 20}, sync=False)
    files.write("a", bytes(8 << 20), 0)
    files.close()
    assert calls == []


def test_output_files_are_sized_up_front_and_read_as_zeros(tmp_path):
    files = OutputFiles(tmp_path, {"a": 3 << 20, "sub/b": 0}, sync=False)
    files.write("a", b"xy", 5)
    files.close()
    data = (tmp_path / "a").read_bytes()
    assert len(data) == 3 << 20 and data[:7] == b"\0" * 5 + b"xy" and data[7:] == bytes((3 << 20) - 7)
    assert (tmp_path / "sub" / "b").read_bytes() == b""


def test_a_failure_cancels_the_items_not_yet_started():
    import time

    from ckptctl.engine.cpu import run_on_threads

    started = []

    def run(item: int) -> None:
        if item == 0:
            raise ValueError("disk full")
        started.append(item)
        time.sleep(0.05)  # 99 such items on 2 threads would take 2.5 s

    begin = time.monotonic()
    with pytest.raises(ValueError, match="disk full"):
        run_on_threads(list(range(100)), run, 2, "test")
    assert len(started) < 10 and time.monotonic() - begin < 1.0


def test_meanwhile_runs_on_the_calling_thread_while_the_pool_runs_the_items():
    import threading

    from ckptctl.engine.cpu import run_on_threads

    where: dict[str, str] = {}

    def run(item: str) -> None:
        where[item] = threading.current_thread().name

    run_on_threads(["big1", "big2"], run, 2, "pool", meanwhile=lambda: run("small"))
    me = threading.current_thread().name
    assert where["small"] == me
    assert where["big1"].startswith("pool") and where["big2"].startswith("pool")


@pytest.mark.parametrize("err", [errno.EOPNOTSUPP, errno.ENOSYS])
def test_without_fallocate_files_are_only_sized(tmp_path, monkeypatch, err):
    import ctypes

    from ckptctl.storage import local_disk as disk

    def unsupported(fd, mode, offset, length):
        ctypes.set_errno(err)
        return -1

    monkeypatch.setattr(disk, "_FALLOCATE", unsupported)
    with open(tmp_path / "f", "wb") as fh:
        disk.reserve(fh.fileno(), 5000)
    assert (tmp_path / "f").read_bytes() == bytes(5000)


def test_no_space_to_reserve_is_an_error_not_a_sparse_file(tmp_path, monkeypatch):
    import ctypes

    from ckptctl.storage import local_disk as disk

    def full(fd, mode, offset, length):
        ctypes.set_errno(errno.ENOSPC)
        return -1

    monkeypatch.setattr(disk, "_FALLOCATE", full)
    with open(tmp_path / "f", "wb") as fh, pytest.raises(OSError) as exc:
        disk.reserve(fh.fileno(), 5000)
    assert exc.value.errno == errno.ENOSPC and (tmp_path / "f").stat().st_size == 0


def test_record_crc_is_zlibs_whichever_implementation_runs():
    data = os.urandom((1 << 20) + 7)
    assert crc32(data) == zlib.crc32(data)
    assert crc32(data[1000:], crc32(data[:1000])) == zlib.crc32(data)
    assert crc32(memoryview(bytearray(data))[5:]) == zlib.crc32(data[5:])


@pytest.mark.parametrize("src_dtype,dtype", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32),
                                             (torch.float32, torch.float32)])
def test_add_is_computed_in_the_wider_dtype(tmp_path, src_dtype, dtype):
    """HF's GDN norm = gamma + 1: fp32 gamma exported as bf16 is bf16(gamma + 1), never bf16(gamma) + 1.

    2^-8 + 2^-20 rounds to 2^-8 in bf16, and 1 + 2^-8 is a tie that rounds to 1; the true sum rounds up.
    """
    x = torch.tensor([2.0**-8 + 2.0**-20, -3.5, 0.25, float("nan")]).to(src_dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"g": x}, checkpoint_id=tmp_path / "ckpt", no_dist=True)
    ckpt = open_checkpoint(tmp_path / "ckpt")
    src = source_view(ckpt.tensors["g"])
    target = dataclasses.replace(identity_target(src, dtype=dtype), add=1.0)
    item = StreamItem("", 0, b"", target, full_box(target.shape), plan_box(target, full_box(target.shape), {"g": src}))
    sources = ChunkSource(ckpt)
    try:
        got = torch.frombuffer(assemble_bytes(item, sources), dtype=dtype)
    finally:
        sources.close()
    wide = src_dtype if src_dtype.itemsize >= dtype.itemsize else dtype
    want = (x.to(wide) + 1.0).to(dtype)
    assert torch.equal(got[:3], want[:3]) and torch.isnan(got[3])
    if (src_dtype, dtype) == (torch.float32, torch.bfloat16):
        assert got[0].item() == 1.0078125  # not 1.0


def test_small_records_that_follow_one_another_are_written_together(fixture_ckpt, tmp_path, monkeypatch):
    """Each rank file's tiny records go out in one write, not one per record."""
    from ckptctl.commands.reshard import ReshardOptions, reshard

    writes: list[tuple[str, int, int]] = []
    real_write = OutputFiles.write
    monkeypatch.setattr(OutputFiles, "write",
                        lambda self, name, data, offset: (writes.append((name, offset, len(memoryview(data)))),
                                                          real_write(self, name, data, offset)))
    reshard(fixture_ckpt("fsdp2_4ranks"), tmp_path / "out", ReshardOptions(world_size=3, sync=False))
    by_file: dict[str, list] = {}
    for entry in open_checkpoint(tmp_path / "out").tensors.values():
        for chunk in entry.chunks:
            by_file.setdefault(chunk.file, []).append(chunk)
    assert sorted(by_file) == ["__0_0.distcp", "__1_0.distcp", "__2_0.distcp"]
    for file, chunks in by_file.items():
        start, end = min(c.offset for c in chunks), max(c.offset + c.length for c in chunks)
        assert [w for w in writes if w[0] == file] == [(file, start, end - start)]


def test_small_items_read_front_to_back_are_read_ahead(tmp_path, monkeypatch):
    """64 tiny items of one kind in one file, read in order: a few windows growing from 32 KB, not a
    read per item; the output loads equal."""
    from ckptctl.formats.dcp import items
    from ckptctl.commands.reshard import ReshardOptions, reshard

    state = {f"w{i:02d}": torch.arange(64, dtype=torch.float32).reshape(4, 16) + i for i in range(64)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # no process group: a single-process save
        dcp.save(state, checkpoint_id=tmp_path / "src")
    reads: list[int] = []
    positioned_reader = items.ItemReader.positioned_reader

    def counting(reader: items.ItemReader, file: str):
        read = positioned_reader(reader, file)

        def counted(n: int, at: int) -> bytes:  # the copy's reads, not the output check's thread's
            if threading.current_thread().name != "ckptctl-check":
                reads.append(n)
            return read(n, at)
        return counted

    monkeypatch.setattr(items.ItemReader, "positioned_reader", counting)
    reshard(tmp_path / "src", tmp_path / "out", ReshardOptions(world_size=2, sync=False))
    length = open_checkpoint(tmp_path / "src").tensors["w00"].chunks[0].length
    window = items.READ_AHEAD_MIN
    # each output rank's pass over the 64 items: one item alone, then windows of 32, 64 and 128 KB
    # (the first item's validation reads its zip records, each shorter than the item); the
    # output's check reads items of its own after the copy
    assert [n for n in reads if n >= length][:8] == [length, window, 2 * window, 4 * window] * 2
    loaded = {k: torch.zeros(4, 16) for k in state}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(loaded, checkpoint_id=tmp_path / "out")
    assert all(torch.equal(loaded[k], state[k]) for k in state)
