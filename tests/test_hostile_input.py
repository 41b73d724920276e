"""Hostile or broken checkpoints, made by mutating the committed real fixtures, end in one line.

Each case runs the real CLI on the mutated copy and checks the exact error line, exit status
2, no traceback, the child's peak RSS and wall time, and that the source is unchanged.
"""

from __future__ import annotations

import io
import json
import math
import os
import pickle
import shutil
import struct
import subprocess
import sys
import time
import zipfile
import zlib
from pathlib import Path
from typing import Callable

import pytest

from ckptctl.core import dtypes
from ckptctl.formats.dcp.classes import BytesStorageMetadata
from ckptctl.util.errors import CheckpointError
from ckptctl.formats.dcp.items import ITEM_OVERHEAD, ItemReader
from ckptctl.formats.dcp.metadata import open_checkpoint
from ckptctl.formats.pickle.unpickle import MalformedPickleError, UnsafePickleError, load_metadata_pickle, load_tensor_record_spec
from tests.conftest import FIXTURES, ROOT

MAX_RSS_MB = 256
MAX_SECONDS = 10.0
SENTINEL = "@@SENTINEL@@"

_MEASURE = (
    "import resource, subprocess, sys, json; "
    "r = subprocess.run([sys.executable, '-m', 'ckptctl', *sys.argv[2:]]); "
    "open(sys.argv[1], 'w').write(json.dumps([r.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss]))"
)


def run_measured(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, float, float]:
    """Run `python -m ckptctl ARGS` in a fresh wrapper: (result, child's peak RSS in MB, seconds)."""
    report = tmp_path / "rusage.json"
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", _MEASURE, str(report), *map(str, args)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    seconds = time.monotonic() - start
    code, rss_kb = json.loads(report.read_text())
    proc.returncode = code
    return proc, rss_kb / 1024, seconds


SNAPSHOT_BYTES = 64 << 20
"""Files up to this size are compared byte for byte; bigger ones (the sparse gigabyte files of
the bomb tests) by size, mtime and ctime, which any write changes and no user code can set back."""


def snapshot(root: Path) -> dict[str, tuple[bytes | str | tuple[int, int], int]]:
    """Every entry's bytes (or link target, or a big file's size and ctime) and mtime: what 'the
    source is unchanged' compares."""
    out = {}
    for path in sorted(root.rglob("*")):
        st = path.lstat()
        if path.is_symlink():
            out[path.name] = (os.readlink(path), st.st_mtime_ns)
        elif path.is_file():
            whole = path.read_bytes() if st.st_size <= SNAPSHOT_BYTES else (st.st_size, st.st_ctime_ns)
            out[path.name] = (whole, st.st_mtime_ns)
    return out


def copy_fixture(tmp_path: Path, name: str = "fsdp2_4ranks") -> Path:
    dst = tmp_path / "src"
    shutil.copytree(FIXTURES / name, dst)
    return dst


def real_metadata(src: Path):
    """The fixture's metadata as torch's own objects (test side only: the fixture is trusted)."""
    return pickle.loads((src / ".metadata").read_bytes())


def with_sentinel(src: Path, place: Callable[[object], None], replacement: bytes) -> None:
    """Write `.metadata` with one value replaced, at the opcode level, by `replacement` (pickle bytes
    that leave exactly one value on the stack): real metadata around a hand-made hostile part."""
    md = real_metadata(src)
    place(md)
    data = pickle.dumps(md, protocol=2)
    needle = b"X" + struct.pack("<I", len(SENTINEL)) + SENTINEL.encode()
    assert data.count(needle) == 1
    (src / ".metadata").write_bytes(data.replace(needle, replacement))


def first_tensor(md):
    return next(v for v in md.state_dict_metadata.values() if type(v).__name__ == "TensorStorageMetadata")


def first_storage(md):
    return next(iter(md.storage_data.values()))


def set_planner(md, value=SENTINEL) -> None:
    md.planner_data = value


def item_of(src: Path) -> tuple[Path, int, int]:
    """(file, offset, length) of the first tensor item of rank 0."""
    md = real_metadata(src)
    info = min((v for v in md.storage_data.values() if v.relative_path == "__0_0.distcp"), key=lambda v: v.offset)
    return src / "__0_0.distcp", info.offset, info.length


def central_record(blob: bytearray, offset: int, length: int, name: str) -> int:
    """Position in `blob` of the item's central-directory record for `name`."""
    item = bytes(blob[offset:offset + length])
    start = zipfile.ZipFile(io.BytesIO(item)).start_dir
    at = start
    while item[at:at + 4] == b"PK\x01\x02":
        name_len, extra_len, comment_len = struct.unpack_from("<HHH", item, at + 28)
        if item[at + 46:at + 46 + name_len].decode() == name:
            return offset + at
        at += 46 + name_len + extra_len + comment_len
    raise AssertionError(f"{name} not in the item")


def mutate_item(src: Path, change: Callable[[bytearray, int, int], None]) -> None:
    path, offset, length = item_of(src)
    blob = bytearray(path.read_bytes())
    change(blob, offset, length)
    path.write_bytes(bytes(blob))


def _pkl_payload(blob: bytearray, offset: int) -> int:
    name_len, extra_len = struct.unpack_from("<HH", blob, offset + 26)
    return offset + 30 + name_len + extra_len


def _fix_crc(blob: bytearray, offset: int, length: int) -> None:
    """Recompute data.pkl's CRC-32 in the central directory, so only the pickle is wrong."""
    size = struct.unpack_from("<I", blob, central_record(blob, offset, length, "archive/data.pkl") + 24)[0]
    at = _pkl_payload(blob, offset)
    struct.pack_into("<I", blob, central_record(blob, offset, length, "archive/data.pkl") + 16,
                     zlib.crc32(blob[at:at + size]))


def garbage_data_pkl(blob: bytearray, offset: int, length: int) -> None:
    at = _pkl_payload(blob, offset)
    blob[at:at + 8] = b"\x00" * 8
    _fix_crc(blob, offset, length)


def truncated_data_pkl(blob: bytearray, offset: int, length: int) -> None:
    at = _pkl_payload(blob, offset)
    blob[at + 2] = pickle.STOP[0]  # after PROTO: STOP on an empty stack
    _fix_crc(blob, offset, length)


def cd_field(name: str, fmt: str, at: int, value: int) -> Callable[[bytearray, int, int], None]:
    def change(blob: bytearray, offset: int, length: int) -> None:
        struct.pack_into(fmt, blob, central_record(blob, offset, length, name) + at, value)
    return change


def record_points_at_data_pkl(blob: bytearray, offset: int, length: int) -> None:
    struct.pack_into("<I", blob, central_record(blob, offset, length, "archive/data/0") + 42, 0)


def bad_local_signature(blob: bytearray, offset: int, length: int) -> None:
    item = zipfile.ZipFile(io.BytesIO(bytes(blob[offset:offset + length])))
    blob[offset + item.getinfo("archive/data/0").header_offset] ^= 0xFF


def nested_lists(depth: int) -> bytes:
    return b"]" * depth + b"a" * (depth - 1)


M = "corrupt metadata pickle: "
H = "hostile or foreign pickle: "
I0 = "item at byte 0: "

METADATA_CASES = {
    "build-on-dtype": (lambda md: set_planner(md), b"ctorch\nfloat32\n}X\x08\x00\x00\x00itemsizeK\x01sb",
                       H + "refuses to set the state of a DType (only of a new object)"),
    "slot-build-on-class": (lambda md: set_planner(md),
                            b"cpathlib\nPosixPath\nN}X\x05\x00\x00\x00_rootX\x01\x00\x00\x00/s\x86b",
                            H + "refuses to set the state of pathlib.PosixPath (only of a new object)"),
    "planner-nested-10000": (lambda md: set_planner(md), nested_lists(10_000),
                             M + "Metadata.planner_data should be a dict but is a list"),
    "string-length-2**40": (lambda md: set_planner(md), b"\x8d" + struct.pack("<Q", 1 << 40),
                            M + "string of 1099511627776 bytes is over the 1048576-byte limit"),
    "bytes-length-2**64-1": (lambda md: set_planner(md), b"\x8e" + struct.pack("<Q", (1 << 64) - 1),
                             M + "bytes value of 18446744073709551615 bytes is over the 1048576-byte limit"),
    "list-length-2**40": (lambda md: set_planner(md), b"\x8a\x06" + (1 << 40).to_bytes(6, "little"),
                          M + "Metadata.planner_data should be a dict but is a int"),
    "relative-path-5000": (lambda md: setattr(first_storage(md), "relative_path", SENTINEL),
                           b"X" + struct.pack("<I", 5000) + b"a" * 5000,
                           M + "_StorageInfo.relative_path is not a usable name (5000 characters)"),
    "relative-path-nul": (lambda md: setattr(first_storage(md), "relative_path", SENTINEL),
                          b"X\x05\x00\x00\x00a\x00b.c", M + "_StorageInfo.relative_path is not a usable name (5 characters)"),
    "sizes-none": (lambda md: setattr(first_tensor(md).chunks[0], "sizes", SENTINEL), b"N",
                   M + "ChunkStorageMetadata.sizes should be a torch.Size but is a NoneType"),
    "sizes-float": (lambda md: setattr(first_tensor(md), "size", SENTINEL), b"G" + struct.pack(">d", 2.0),
                    M + "TensorStorageMetadata.size should be a torch.Size but is a float"),
    "chunks-int": (lambda md: setattr(first_tensor(md), "chunks", SENTINEL), b"K\x07",
                   M + "TensorStorageMetadata.chunks should be a list but is a int"),
    "properties-none": (lambda md: setattr(first_tensor(md), "properties", SENTINEL), b"N",
                        M + "TensorStorageMetadata.properties should be a TensorProperties but is a NoneType"),
    "storage-data-list": (lambda md: setattr(md, "storage_data", SENTINEL), b"]",
                          M + "Metadata.storage_data should be a dict but is a list"),
    "transforms-int": (lambda md: setattr(first_storage(md), "transform_descriptors", SENTINEL), b"K\x01",
                       M + "_StorageInfo.transform_descriptors should be a list but is a int"),
    "offset-none": (lambda md: setattr(first_storage(md), "offset", SENTINEL), b"N",
                    M + "_StorageInfo.offset should be an integer but is a NoneType"),
}


@pytest.mark.parametrize("case", sorted(METADATA_CASES))
def test_hostile_metadata_is_one_line(case: str, tmp_path: Path) -> None:
    place, replacement, expected = METADATA_CASES[case]
    src = copy_fixture(tmp_path)
    with_sentinel(src, place, replacement)
    assert_one_line(tmp_path, src, ["inspect", src], f"{src / '.metadata'}: {expected}")


def assert_one_line(tmp_path: Path, src: Path, args: list, line: str, max_rss_mb: float = MAX_RSS_MB) -> None:
    before = snapshot(src)
    proc, rss, seconds = run_measured(tmp_path, *args)
    assert proc.stderr == f"ckptctl: error: {line}\n"
    assert proc.returncode == 2 and "Traceback" not in proc.stdout + proc.stderr
    assert rss <= max_rss_mb and seconds <= MAX_SECONDS, (rss, seconds)
    assert snapshot(src) == before


def test_memo_references_cost_what_distinct_chunks_cost(tmp_path: Path) -> None:
    src = copy_fixture(tmp_path)
    md = real_metadata(src)
    tensor = first_tensor(md)
    tensor.chunks = tensor.chunks[:1] * 2_000_000
    (src / ".metadata").write_bytes(pickle.dumps(md, protocol=4))
    assert_one_line(tmp_path, src, ["inspect", src], f"{src / '.metadata'}: " + M +
                    "pickle builds more values than its size allows (memo amplification?)")


def test_metadata_that_is_a_link_to_a_device_is_refused_before_reading(tmp_path: Path) -> None:
    src = copy_fixture(tmp_path)
    (src / ".metadata").unlink()
    (src / ".metadata").symlink_to("/dev/zero")
    assert_one_line(tmp_path, src, ["inspect", src], f"{src / '.metadata'}: not a regular file (a character device)")


def test_rank_metadata_fifo_is_refused_without_blocking(tmp_path: Path) -> None:
    src = copy_fixture(tmp_path)
    (src / ".metadata").rename(src / "__0.metadata")
    (src / "__1.metadata").unlink(missing_ok=True)
    os.mkfifo(src / "__1.metadata")
    assert_one_line(tmp_path, src, ["inspect", src], f"{src / '__1.metadata'}: not a regular file (a FIFO)")


def test_sparse_two_gigabyte_metadata_costs_no_memory(tmp_path: Path) -> None:
    src = copy_fixture(tmp_path)
    with open(src / ".metadata", "wb") as f:
        f.truncate(2_000_000_000)
    assert_one_line(tmp_path, src, ["inspect", src], f"{src / '.metadata'}: " + M + "invalid pickle opcode b'\\x00' at byte 0")


ITEM_CASES = {
    "data-pkl-garbage": (garbage_data_pkl, "corrupt data.pkl: invalid pickle opcode b'\\x00' at byte 0"),
    "data-pkl-stack-underflow": (truncated_data_pkl, "corrupt data.pkl: pickle stack underflow"),
    "unknown-compression": (cd_field("archive/data.pkl", "<H", 10, 99),
                            "zip entry archive/data.pkl is compressed (method 99); torch.save stores entries"),
    "deflated-data-pkl": (cd_field("archive/data.pkl", "<H", 10, 8),
                          "zip entry archive/data.pkl is compressed (method 8); torch.save stores entries"),
    "encrypted": (cd_field("archive/data.pkl", "<H", 8, 0x809), "zip entry archive/data.pkl is encrypted"),
    "record-offset-at-data-pkl": (record_points_at_data_pkl,
                                  "zip entry archive/data.pkl overlaps entry archive/data/0"),
    "record-offset-negative": (cd_field("archive/data/0", "<I", 42, 0xFFFFFFF0),
                               "zip entry archive/data/0 has its header outside the item"),
    "local-signature": (bad_local_signature, "zip entry archive/data/0: corrupt local header"),
    "odd-version-needed": (cd_field("archive/data.pkl", "<H", 6, 63),
                           "zip entry archive/data.pkl needs zip version 63, not one torch.save archives use"),
    "unknown-flag-bit": (cd_field("archive/data.pkl", "<H", 8, 0x80A),
                         "zip entry archive/data.pkl has unknown flag bits 0x0002"),
}


@pytest.mark.parametrize("case", sorted(ITEM_CASES))
def test_hostile_item_is_one_line(case: str, tmp_path: Path) -> None:
    change, reason = ITEM_CASES[case]
    src = copy_fixture(tmp_path)
    mutate_item(src, change)
    assert_one_line(tmp_path, src, ["reshard", src, tmp_path / "dst", "--world-size", "2"],
                    f"{src / '__0_0.distcp'}: {I0}{reason}")
    assert not (tmp_path / "dst").exists()


def test_unpickling_never_changes_a_shared_object() -> None:
    """The BUILD attacks of the issue, in process: the shared dtype and the classes stay as they were."""
    before = (dtypes.float32.itemsize, vars(BytesStorageMetadata).copy())
    for data in (b"\x80\x02ctorch\nfloat32\n}X\x08\x00\x00\x00itemsizeK\x01sb.",
                 b"\x80\x02ctorch.distributed.checkpoint.metadata\nBytesStorageMetadata\nN}X\x01\x00\x00\x00xK\x01s\x86b.",
                 b"\x80\x02ctorch.serialization\n_get_layout\nN}X\x08\x00\x00\x00__code__K\x01s\x86b."):
        with pytest.raises(UnsafePickleError, match="refuses to set the state"):
            load_metadata_pickle(data)
    assert (dtypes.float32.itemsize, vars(BytesStorageMetadata)) == before


def test_negative_storage_offset_is_refused() -> None:
    import torch

    buf = io.BytesIO()
    torch.save(torch.zeros(4), buf)
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as archive:
        pkl = archive.read(next(n for n in archive.namelist() if n.endswith("data.pkl")))
    at = pkl.index(b"Q") + 1  # the persistent storage reference, then the storage offset
    assert pkl[at:at + 2] == b"K\x00"
    hostile = pkl[:at] + b"J" + struct.pack("<i", -4) + pkl[at + 2:]
    with pytest.raises(MalformedPickleError, match=r"^storage offset is out of range \(-4\)$"):
        load_tensor_record_spec(hostile)


def replace_first_item(src: Path, item: bytes) -> None:
    """Append `item` to rank 0's file and point rank 0's first tensor item at it (test side: real metadata)."""
    md = real_metadata(src)
    info = min((v for v in md.storage_data.values() if v.relative_path == "__0_0.distcp"), key=lambda v: v.offset)
    path = src / "__0_0.distcp"
    info.offset, info.length = path.stat().st_size, len(item)
    with open(path, "ab") as fh:
        fh.write(item)
    (src / ".metadata").write_bytes(pickle.dumps(md))


def deflate_bomb(inflated: int) -> tuple[bytes, int]:
    """Raw deflate data inflating to `inflated` zero bytes (~1/1000 of it), and its CRC-32: one
    block of 1 MiB zeros, repeated (a full flush makes every copy the same), then an end block."""
    block = 1 << 20
    one = zlib.compressobj(9, zlib.DEFLATED, -15)
    piece = one.compress(bytes(block)) + one.flush(zlib.Z_FULL_FLUSH)
    crc, zeros = 0, bytes(block)
    for _ in range(inflated // block):
        crc = zlib.crc32(zeros, crc)
    return piece * (inflated // block) + one.flush(zlib.Z_FINISH), crc


def one_entry_zip(name: str, method: int, data: bytes, size: int, crc: int) -> bytes:
    local = struct.pack("<IHHHHHIIIHH", 0x04034B50, 20, 0, method, 0, 0, crc, len(data), size, len(name), 0)
    central = struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 20, 20, 0, method, 0, 0, crc, len(data), size,
                          len(name), 0, 0, 0, 0, 0, 0)
    body = local + name.encode() + data
    end = struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, 1, 1, len(central) + len(name), len(body), 0)
    return body + central + name.encode() + end


def test_deflate_bomb_data_pkl_is_refused_without_inflating(tmp_path: Path) -> None:
    src = copy_fixture(tmp_path)
    data, crc = deflate_bomb(1500 << 20)
    assert len(data) < 2 << 20
    replace_first_item(src, one_entry_zip("archive/data.pkl", zipfile.ZIP_DEFLATED, data, 1500 << 20, crc))
    at = (src / "__0_0.distcp").stat().st_size - len(data) - 2 * len("archive/data.pkl") - 30 - 46 - 22
    assert_one_line(tmp_path, src, ["reshard", src, tmp_path / "dst", "--world-size", "2"],
                    f"{src / '__0_0.distcp'}: item at byte {at}: zip entry archive/data.pkl is compressed (method 8); "
                    "torch.save stores entries")


def test_item_faking_a_256_mb_safetensors_header_is_refused_before_reading_it(tmp_path: Path) -> None:
    src = copy_fixture(tmp_path)
    path, offset, _ = item_of(src)
    with open(path, "r+b") as fh:
        fh.seek(offset)
        fh.write(struct.pack("<Q", 256 << 20) + b"{")
        fh.truncate(300 << 20)  # sparse: the claimed header fits in the file
    assert_one_line(tmp_path, src, ["reshard", src, tmp_path / "dst", "--world-size", "2"],
                    f"{path}: item at byte {offset}: safetensors header of {256 << 20} bytes is over the "
                    f"{16 << 20}-byte limit")


def test_bytes_entry_claiming_2_gib_is_refused_before_allocating(tmp_path: Path) -> None:
    src = copy_fixture(tmp_path, "flat_optim")
    md = real_metadata(src)
    info = next(v for k, v in md.storage_data.items() if k.offset is None)
    path = src / info.relative_path
    with open(path, "r+b") as fh:
        fh.truncate(info.offset + (2 << 30))  # sparse
    info.length = 2 << 30
    (src / ".metadata").write_bytes(pickle.dumps(md))
    assert_one_line(tmp_path, src, ["export-torch", src, tmp_path / "o.pt"],
                    f"{path}: item at byte {info.offset}: {2 << 30} bytes, over the {1 << 30}-byte limit for an "
                    "item read whole")


def test_sigint_during_start_up_is_one_line_and_130(tmp_path: Path) -> None:
    """SIGINT once `python -m ckptctl` runs, at a few moments of its start-up: exit 130 and one line,
    or, once the command has finished, its own status; never death by signal.
    (A signal that lands while the interpreter itself starts, before ckptctl's handler is in
    place, is Python's to report: on a busy machine the first delays can land there.)"""
    import signal

    from tests.util.test_interrupt import before_the_handler

    hits = 0
    for delay in (0.08, 0.1, 0.12, 0.15, 0.2, 0.3, 0.4, 0.6, 1.0):  # inspect takes about 0.15 s on an idle machine
        proc = subprocess.Popen([sys.executable, "-m", "ckptctl", "inspect", FIXTURES / "fsdp2_4ranks"], cwd=ROOT,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        time.sleep(delay)
        if proc.poll() is not None:
            proc.communicate()
            continue
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
        if (proc.returncode, err) == (0, ""):
            continue  # finished before the signal landed
        if before_the_handler(proc.returncode, err):
            continue
        # never death by signal: not after the output is complete, nor after the one line
        assert (proc.returncode, err) == (130, "ckptctl: interrupted\n"), delay
        hits += 1
    assert hits, "every run ended before it could be interrupted"


def test_zstd_bomb_item_is_refused_after_decompressing_past_its_tensor_size(tmp_path: Path) -> None:
    """A `stream.zstd` item that undoes to 1.5 GB: decompression stops one byte past what the
    chunk's tensor can need (its bytes plus a torch.save archive's overhead), then refuses.
    Undoing transforms imports torch.distributed (about 250 MB by itself), so the bound here
    is a sound reshard of the same fixture plus 32 MB."""
    zstandard = pytest.importorskip("zstandard")
    src = copy_fixture(tmp_path, "zstd")
    sound, sound_rss, _ = run_measured(tmp_path, "reshard", src, tmp_path / "sound", "--world-size", "2")
    assert sound.returncode == 0
    compressor = zstandard.ZstdCompressor(level=19).compressobj()
    zeros = bytes(1 << 20)
    bomb = b"".join(compressor.compress(zeros) for _ in range(1500)) + compressor.flush()
    assert len(bomb) < 1 << 20
    md = real_metadata(src)
    index, info = min(((k, v) for k, v in md.storage_data.items() if v.relative_path == "__0_0.distcp"),
                      key=lambda kv: kv[1].offset)
    tensor = md.state_dict_metadata[index.fqn]
    chunk = next(c for c in tensor.chunks if tuple(c.offsets) == tuple(index.offset))
    limit = math.prod(chunk.sizes) * tensor.properties.dtype.itemsize + ITEM_OVERHEAD
    path = src / "__0_0.distcp"
    at = path.stat().st_size
    replace_first_item(src, bomb)
    assert_one_line(tmp_path, src, ["reshard", src, tmp_path / "dst", "--world-size", "2"],
                    f"{path}: item at byte {at}: transforms undo to more than {limit} bytes", sound_rss + 32)


@pytest.mark.parametrize("case", sorted(ITEM_CASES))
def test_hostile_item_after_a_sound_one_of_its_shape_is_refused_alike(case: str, tmp_path: Path) -> None:
    """The reader locates an item like one it validated by comparing their bytes (CRCs and the
    serialization id aside): a hostile item located after a sound one of the same shape and
    length is refused with the same message as when it comes first; `small_data` (one read of a
    small item checked against its kind's template) never gives its bytes."""
    change, reason = ITEM_CASES[case]
    src = copy_fixture(tmp_path)
    mutate_item(src, change)
    path, offset, _ = item_of(src)
    ckpt = open_checkpoint(src)
    entry, chunk = next((e, c) for e in ckpt.tensors.values() for c in e.chunks
                        if c.file == "__0_0.distcp" and c.offset == offset)
    twin = next(c for c in entry.chunks if c.file != chunk.file and c.sizes == chunk.sizes and c.length == chunk.length)
    with ItemReader(ckpt) as reader:
        assert reader.small_data(entry, twin) is None  # no template of its kind yet
        sound = reader.locate(entry, twin)
        assert sound is not None and len(reader._templates) == 1
        assert reader.small_data(entry, chunk) is None
        with pytest.raises(CheckpointError) as caught:
            reader.locate(entry, chunk)
    assert str(caught.value) == f"{path}: {I0}{reason}"


def test_small_items_are_read_in_one_go_as_located(fixture_ckpt) -> None:
    """The bytes `small_data` gives are those `locate` points at, for every item it reads."""
    ckpt = open_checkpoint(fixture_ckpt("fsdp2_4ranks"))
    read = 0
    with ItemReader(ckpt) as reader:
        for entry in ckpt.tensors.values():
            for chunk in entry.chunks:
                data = reader.small_data(entry, chunk)
                record = reader.locate(entry, chunk)
                if data is not None:
                    read += 1
                    assert bytes(data) == reader.read_item_bytes(chunk.file, record.byte_offset, record.nbytes, ())
    assert read > 0


def test_items_like_a_validated_one_are_located_by_compare_at_the_same_place(fixture_ckpt) -> None:
    """Sound items differing from the template only in serialization id and CRCs are located by
    the compare, at the places a fresh parse finds."""
    ckpt = open_checkpoint(fixture_ckpt("fsdp2_4ranks"))
    chunks = [(e, c) for e in ckpt.tensors.values() for c in e.chunks if c.numel]
    with ItemReader(ckpt) as reader:
        shared = [reader.locate(e, c) for e, c in chunks]
        assert 0 < len(reader._templates) < len(chunks)
    fresh = []
    for e, c in chunks:
        with ItemReader(ckpt) as alone:
            fresh.append(alone.locate(e, c))
    assert shared == fresh


def shared_tuple_key(depth: int) -> bytes:
    """A dict whose one key is t_depth, where t_0 = () and t_(i+1) = (t_i, t_i) through the memo:
    a few bytes per level, 2^depth tuples for CPython to hash."""
    levels = b"".join(b"h%ch%c\x86q%c0" % (i, i, i + 1) for i in range(depth))
    return b"}" + b")q\x000" + levels + b"h%cK\x01s" % depth


def test_memo_shared_tuple_key_is_refused_before_unpickling(tmp_path: Path) -> None:
    src = copy_fixture(tmp_path)
    (src / ".metadata").write_bytes(b"\x80\x02" + shared_tuple_key(60) + b".")
    assert_one_line(tmp_path, src, ["inspect", src], f"{src / '.metadata'}: {M}a dict key or set member made of "
                    f"{2 ** 61 - 1} tuples: tuples nested or shared so that hashing a dict key would crash or hang")


def test_deeply_nested_tuple_key_in_a_big_pickle_is_refused_by_the_probe(tmp_path: Path) -> None:
    """200,000 nested tuples as a key: CPython's recursive tuple hash overflows the C stack. The
    pickle is over the scan limit, so a forked child unpickles it first and dies instead."""
    src = copy_fixture(tmp_path)
    (src / ".metadata").write_bytes(b"\x80\x02}" + b")" + b"\x85" * 200_000 + b"K\x01s.")
    assert_one_line(tmp_path, src, ["inspect", src], f"{src / '.metadata'}: {M}unpickling kills the interpreter "
                    "(signal 11): tuples nested or shared so that hashing a dict key would crash or hang")


def test_probe_refuses_a_big_pickle_that_hashes_past_its_deadline(monkeypatch) -> None:
    from ckptctl.formats.pickle import hash_guard

    monkeypatch.setattr(hash_guard, "PROBE_SECONDS", 0.5)
    monkeypatch.setattr(hash_guard, "PROBE_SECONDS_PER_MB", 0.0)
    padding = b"X" + struct.pack("<I", 100_000) + b"p" * 100_000 + b"0"  # a long string, popped
    started = time.monotonic()
    with pytest.raises(MalformedPickleError, match=r"^unpickling does not finish in 0.5 s: tuples nested or shared"):
        load_metadata_pickle(b"\x80\x02" + padding + shared_tuple_key(60) + b".")
    assert time.monotonic() - started < 5


def test_the_scan_and_the_probe_pass_real_metadata() -> None:
    from ckptctl.formats.pickle import hash_guard
    from ckptctl.formats.pickle.unpickle import METADATA_GLOBALS, _Source

    for name in ("fsdp2_4ranks", "flat_optim", "megatron_tp2_dp2", "zstd"):
        data = (FIXTURES / name / ".metadata").read_bytes()
        assert len(data) <= hash_guard.SCAN_LIMIT
        hash_guard._scan(data)
        hash_guard._probe(data, METADATA_GLOBALS, _Source)


def test_byteorder_record_with_a_bad_crc_is_one_line(tmp_path: Path) -> None:
    """Found by the fuzzer: the byteorder record is read after the zip checks, and a bad CRC
    there escaped as zipfile's own BadZipFile."""
    src = copy_fixture(tmp_path)
    mutate_item(src, cd_field("archive/byteorder", "<I", 16, 0))
    assert_one_line(tmp_path, src, ["reshard", src, tmp_path / "dst", "--world-size", "2"],
                    f"{src / '__0_0.distcp'}: {I0}not a torch.save archive (BadZipFile: Bad CRC-32 for file "
                    "'archive/byteorder')")


def test_megatron_dist_checkpointing_backends_but_torch_dist_are_refused_by_name(tmp_path: Path) -> None:
    """A `metadata.json` naming another dist_checkpointing backend (zarr) is refused before any
    pickle is read; torch_dist is read, and rewritten by reshard at its own layout only."""
    src = copy_fixture(tmp_path)
    (src / "metadata.json").write_text(json.dumps({"sharded_backend": "zarr", "sharded_backend_version": 1}))
    for args in (["inspect", src], ["reshard", src, tmp_path / "dst", "-n", "2"], ["export-torch", src,
                                                                                 tmp_path / "o.pt"]):
        assert_one_line(tmp_path, src, args, f"{src}: a Megatron-Core dist_checkpointing checkpoint (metadata.json: "
                        "sharded_backend 'zarr'); ckptctl reads its 'torch_dist' backend only")
    (src / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1}))
    assert_one_line(tmp_path, src, ["reshard", src, tmp_path / "dst", "-n", "7"],
                    "a torch_dist checkpoint is rewritten at its own layout with its optimizer state in model space "
                    "(fully_reshardable), which megatron-core loads at any TP and DP: pass no --world-size (or its "
                    "own, 4), layout, TP, filter or dtype options")
    (src / "metadata.json").write_text("{not json")  # not a Megatron marker: not ours to judge
    assert run_measured(tmp_path, "inspect", "--check", src)[0].returncode == 0


def test_without_fork_a_big_pickle_is_scanned(monkeypatch) -> None:
    monkeypatch.delattr(os, "fork")
    padding = b"X" + struct.pack("<I", 100_000) + b"p" * 100_000 + b"0"  # over the scan limit
    with pytest.raises(MalformedPickleError, match=r"^a dict key or set member made of 2305843009213693951 tuples"):
        load_metadata_pickle(b"\x80\x02" + padding + shared_tuple_key(60) + b".")


def test_a_damaged_record_no_check_reads_is_located_without_a_template(tmp_path: Path) -> None:
    """Found by the fuzzer: a central-directory offset of 2^32-16 for `version`, a record the
    item checks never read, broke building the item's template (a struct.error). Such an item
    is still located (its tensor record is sound), just not used as a template."""
    src = copy_fixture(tmp_path)
    mutate_item(src, cd_field("archive/version", "<I", 42, 0xFFFFFFF0))
    ckpt = open_checkpoint(src)
    path, offset, _ = item_of(src)
    entry, chunk = next((e, c) for e in ckpt.tensors.values() for c in e.chunks
                        if c.file == "__0_0.distcp" and c.offset == offset)
    with ItemReader(ckpt) as reader:
        assert reader.locate(entry, chunk) is not None and not reader._templates


def test_the_probe_child_crashing_prints_nothing_even_with_faulthandler_on(tmp_path: Path) -> None:
    src = copy_fixture(tmp_path)
    (src / ".metadata").write_bytes(b"\x80\x02}" + b")" + b"\x85" * 200_000 + b"K\x01s.")
    proc = subprocess.run([sys.executable, "-m", "ckptctl", "inspect", str(src)], capture_output=True, text=True,
                          cwd=ROOT, env={**os.environ, "PYTHONFAULTHANDLER": "1"}, timeout=60)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "kills the interpreter" in proc.stderr
