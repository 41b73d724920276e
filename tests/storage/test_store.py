"""`LocalStore`, the one store today: positioned reads of exactly the bytes asked for, the same
refusals as any source opening (a directory, a FIFO, a device, a file over its limit: one line,
before a byte is read), each opened file noted as a source read, outputs written at offsets, and
an atomic folder that leaves nothing behind when its body fails."""

from __future__ import annotations

import os
import threading
import zipfile
from pathlib import Path

import pytest

from ckptctl.storage.atomic import read_paths, recorded_reads, refuse_changed_reads
from ckptctl.storage.store import LOCAL_STORE, EntryInfo, EntryKind, LocalStore, store_for
from ckptctl.util.errors import CheckpointError

DATA = bytes(range(256)) * 40


@pytest.fixture
def data_file(tmp_path: Path) -> Path:
    path = tmp_path / "__0_0.distcp"
    path.write_bytes(DATA)
    return path


def test_every_path_is_in_the_local_store_today(tmp_path: Path) -> None:
    assert store_for(tmp_path) is LOCAL_STORE and isinstance(LOCAL_STORE, LocalStore)


def test_positioned_reads_return_exactly_the_bytes_at_their_offsets(data_file: Path) -> None:
    with LOCAL_STORE.open_read(data_file) as handle:
        assert (handle.path, handle.size) == (data_file, len(DATA))
        assert handle.read_at(7, 1000) == DATA[1000:1007]
        assert handle.read_at(100, len(DATA) - 3) == DATA[-3:]  # fewer at the end
        assert handle.read_at(5, len(DATA) + 10) == b""
        buffer = bytearray(300)
        assert handle.readinto_at(memoryview(buffer)[10:60], 4000) == 50
        assert buffer == bytes(10) + DATA[4000:4050] + bytes(240)
        with handle.whole() as whole:
            assert whole[:] == DATA
        window = handle.window(256, 512)
        window.seek(-4, os.SEEK_END)
        assert window.read() == DATA[764:768]
        read = handle.positioned_reader()  # for hot loops: os.pread bound to the descriptor
        assert read(3, 9) == DATA[9:12] and read(8, len(DATA) - 4) == DATA[-4:]
        assert handle.version() == LOCAL_STORE.version(data_file)


def test_threads_read_one_handle_at_their_own_offsets(data_file: Path) -> None:
    got: dict[int, bytes] = {}
    with LOCAL_STORE.open_read(data_file) as handle:
        threads = [threading.Thread(target=lambda k=k: got.__setitem__(k, handle.read_at(64, k * 64)))
                   for k in range(32)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert b"".join(got[k] for k in range(32)) == DATA[:2048]


def test_a_window_refuses_a_read_over_its_bound(data_file: Path) -> None:
    with LOCAL_STORE.open_read(data_file) as handle:
        window = handle.window(0, 4096, max_read=100)
        assert window.read(100) == DATA[:100]
        with pytest.raises(zipfile.BadZipFile, match="zip structure of 101 bytes is implausibly large"):
            window.read(101)


def test_a_closed_handle_closes_its_descriptor_once(data_file: Path) -> None:
    handle = LOCAL_STORE.open_read(data_file)
    fd = handle._fd  # the local descriptor, checked closed
    handle.close()
    handle.close()
    with pytest.raises(OSError):
        os.fstat(fd)


@pytest.mark.parametrize("kind", ["directory", "fifo", "device", "over-limit", "missing"])
def test_anything_but_a_regular_file_within_its_limit_is_refused_in_one_line(tmp_path: Path, kind: str) -> None:
    path = {"directory": tmp_path, "fifo": tmp_path / "pipe", "device": Path("/dev/zero"),
            "over-limit": tmp_path / "big", "missing": tmp_path / "absent"}[kind]
    if kind == "fifo":
        os.mkfifo(path)  # an open without O_NONBLOCK, or a read, would block this test forever
    if kind == "over-limit":
        path.write_bytes(bytes(11))
    reason = {"directory": "not a regular file (a directory)", "fifo": "not a regular file (a FIFO)",
              "device": "not a regular file (a character device)",
              "over-limit": "implausibly large (11 bytes; at most 10 are read)",
              "missing": "cannot open: No such file or directory"}[kind]
    with pytest.raises(CheckpointError) as refused:
        LOCAL_STORE.open_read(path, limit=10)
    assert str(refused.value) == f"{path}: {reason}"


def test_each_file_opened_is_noted_and_a_change_before_commit_is_named(data_file: Path) -> None:
    with recorded_reads():
        LOCAL_STORE.open_read(data_file).close()
        assert read_paths() == [data_file]
        data_file.write_bytes(DATA + b"!")
        with pytest.raises(CheckpointError, match="changed while it was read"):
            refuse_changed_reads()


def test_listing_and_sizes(tmp_path: Path, data_file: Path) -> None:
    (tmp_path / "sub").mkdir()
    assert sorted(LOCAL_STORE.list(tmp_path)) == ["__0_0.distcp", "sub"]
    assert LOCAL_STORE.info(data_file) == EntryInfo(len(DATA), True)
    assert LOCAL_STORE.info(tmp_path / "sub").regular is False
    assert LOCAL_STORE.size(data_file) == len(DATA)
    assert LOCAL_STORE.exists(data_file) and not LOCAL_STORE.exists(tmp_path / "absent")
    os.symlink(tmp_path / "absent", tmp_path / "dangling")
    assert LOCAL_STORE.exists(tmp_path / "dangling")  # there, though it leads nowhere: opening it says why
    with pytest.raises(FileNotFoundError):
        LOCAL_STORE.info(tmp_path / "absent")


def test_kinds_and_globs_answer_as_pathlib_does(tmp_path: Path) -> None:
    """Commands tell a folder from a file from nothing by the store (`kind`, `glob`), and must
    decide exactly as they did with `Path.exists` / `is_dir` / `is_file` / `glob`: links followed,
    a dangling one absent, a FIFO neither, hidden names matched, a missing folder globbing to none."""
    (tmp_path / "model-00001.safetensors").write_bytes(b"x")
    (tmp_path / ".hidden.safetensors").write_bytes(b"x")
    (tmp_path / "dir.safetensors").mkdir()
    (tmp_path / "tokenizer.json").write_bytes(b"{}")
    (tmp_path / "Tokenizer.json").write_bytes(b"{}")
    os.mkfifo(tmp_path / "fifo.safetensors")
    os.symlink(tmp_path / "model-00001.safetensors", tmp_path / "link.safetensors")
    os.symlink(tmp_path / "dir.safetensors", tmp_path / "dirlink")
    os.symlink(tmp_path / "absent", tmp_path / "dangling.safetensors")
    kinds = {p.name: LOCAL_STORE.kind(p) for p in [*tmp_path.iterdir(), tmp_path / "absent", tmp_path / "f" / "x"]}
    assert kinds == {"model-00001.safetensors": EntryKind.FILE, ".hidden.safetensors": EntryKind.FILE,
                     "dir.safetensors": EntryKind.FOLDER, "tokenizer.json": EntryKind.FILE,
                     "Tokenizer.json": EntryKind.FILE, "fifo.safetensors": EntryKind.OTHER,
                     "link.safetensors": EntryKind.FILE, "dirlink": EntryKind.FOLDER,
                     "dangling.safetensors": EntryKind.MISSING, "absent": EntryKind.MISSING, "x": EntryKind.MISSING}
    for p in [*tmp_path.iterdir(), tmp_path / "absent"]:
        assert (LOCAL_STORE.kind(p) is not EntryKind.MISSING, LOCAL_STORE.kind(p) is EntryKind.FOLDER,
                LOCAL_STORE.kind(p) is EntryKind.FILE) == (p.exists(), p.is_dir(), p.is_file()), p
    for pattern in ("*.safetensors", "tokenizer*", "*.json", "*.index.json", "x*"):
        assert LOCAL_STORE.glob(tmp_path, pattern) == sorted(tmp_path.glob(pattern)), pattern
    assert LOCAL_STORE.glob(tmp_path / "absent", "*") == [] == LOCAL_STORE.glob(tmp_path / "tokenizer.json", "*")


def test_outputs_are_written_at_offsets_in_any_order_and_whole(tmp_path: Path) -> None:
    path = tmp_path / "deep" / "er" / "out.bin"
    with LOCAL_STORE.create(path) as out:
        out.write_all_at(b"world", 6)
        out.write_all_at(b"hello ", 0)
        out.sync()
    assert path.read_bytes() == b"hello world"
    with LOCAL_STORE.reopen(path) as out:
        out.write_all_at(b"W", 6)
    assert path.read_bytes() == b"hello World"
    with LOCAL_STORE.create(path):
        pass
    assert path.read_bytes() == b""  # created again: emptied
    LOCAL_STORE.write_whole(tmp_path / "index.json", b"{}\n")
    with LOCAL_STORE.write_stream(tmp_path / ".metadata") as stream:
        stream.write(b"pick")
        stream.write(b"le")
    assert ((tmp_path / "index.json").read_bytes(), (tmp_path / ".metadata").read_bytes()) == (b"{}\n", b"pickle")


def test_an_atomic_folder_appears_whole_when_its_body_finishes(tmp_path: Path) -> None:
    dst = tmp_path / "out"
    with LOCAL_STORE.atomic_folder(dst, force=False) as work:
        assert not dst.exists()
        LOCAL_STORE.write_whole(work / ".metadata", b"md")
    assert sorted(os.listdir(tmp_path)) == ["out"]
    assert (dst / ".metadata").read_bytes() == b"md"


@pytest.mark.parametrize("failure", [CheckpointError("src", "bad item"), RuntimeError("boom"), KeyboardInterrupt()])
def test_an_atomic_folder_whose_body_fails_leaves_nothing(tmp_path: Path, failure: BaseException) -> None:
    with pytest.raises(type(failure)):
        with LOCAL_STORE.atomic_folder(tmp_path / "out", force=False) as work:
            with LOCAL_STORE.create(work / "__0_0.distcp") as out:
                out.write_all_at(b"partial", 0)
            raise failure
    assert os.listdir(tmp_path) == []  # no DST, no temporary sibling, no marker


def test_an_atomic_file_whose_body_fails_leaves_nothing_and_keeps_what_was_there(tmp_path: Path) -> None:
    out = tmp_path / "model.pt"
    out.write_bytes(b"old")
    with pytest.raises(RuntimeError):
        with LOCAL_STORE.atomic_file(out, force=True) as work:
            LOCAL_STORE.write_whole(work, b"new")
            raise RuntimeError("boom")
    assert os.listdir(tmp_path) == ["model.pt"] and out.read_bytes() == b"old"
    with LOCAL_STORE.atomic_file(out, force=True) as work:
        LOCAL_STORE.write_whole(work, b"new")
    assert os.listdir(tmp_path) == ["model.pt"] and out.read_bytes() == b"new"


def test_a_version_changes_when_an_entry_is_rewritten_and_not_when_it_is_only_read(data_file: Path) -> None:
    before = LOCAL_STORE.version(data_file)
    with LOCAL_STORE.open_read(data_file) as handle:
        assert handle.read_at(len(DATA), 0) == DATA
    assert LOCAL_STORE.version(data_file) == before
    os.utime(data_file, ns=(0, 0))
    assert LOCAL_STORE.version(data_file) != before
    with pytest.raises(FileNotFoundError):
        LOCAL_STORE.version(data_file.parent / "absent")
