"""The helper process a plain run forks for a second core: the same bytes, its error or death
raised in the run with no output left, its progress relayed, never forked where unsafe."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ckptctl.engine import helper
from ckptctl.util.errors import CheckpointError, OutputError
from ckptctl.commands.reshard import ReshardOptions, reshard

ROOT = Path(__file__).resolve().parents[2]


def _tree(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def _cli_reshard(src: Path, dst: Path, min_records: str) -> None:
    env = {**os.environ, helper.MIN_RECORDS_ENV: min_records}
    done = subprocess.run([sys.executable, "-m", "ckptctl", "reshard", src, dst, "-n", "3", "--no-sync"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_a_run_with_a_helper_writes_the_same_bytes(fixture_ckpt, tmp_path, forks):
    src = fixture_ckpt("fsdp2_4ranks")
    _cli_reshard(src, tmp_path / "alone", "0")
    _cli_reshard(src, tmp_path / "cli", "1")  # the command line's own helper, from one record up
    report = reshard(src, tmp_path / "helped", ReshardOptions(world_size=3, sync=False), verify=True)
    assert len(forks) == 2 and report.verified  # one locates the check's source items while the run plans, one writes
    assert helper.share({"__0_0.distcp": 59561, "__1_0.distcp": 32568, "__2_0.distcp": 24330}) == {
        "__2_0.distcp", "__1_0.distcp"}  # what the helper wrote here: .metadata and two rank files
    assert _tree(tmp_path / "helped") == _tree(tmp_path / "alone") == _tree(tmp_path / "cli")


def test_a_helpers_error_is_the_runs_and_leaves_no_output(fixture_ckpt, tmp_path, forks, monkeypatch):
    from ckptctl.formats.dcp import writer

    def failing(out, directory):
        raise OutputError(directory / ".metadata", "cannot write: No space left on device")

    monkeypatch.setattr(writer, "write_metadata", failing)  # the helper writes .metadata
    with pytest.raises(helper.HelperFailedError, match=r"/\.metadata: cannot write: No space left on device$"):
        reshard(fixture_ckpt("fsdp2_4ranks"), tmp_path / "out", ReshardOptions(world_size=3, sync=False))
    assert len(forks) == 2 and list(tmp_path.iterdir()) == []  # the locating helper, the writing one


def test_a_helpers_error_and_progress_reach_the_run():
    def work(report, deliver):
        report(5)
        report(3 << 20)
        raise CheckpointError("/ckpt/__3_0.distcp", "item at byte 7: tensor record missing")

    seen: list[int] = []
    running = helper.start(work, seen.append)
    assert running.delivered() is None  # it failed before delivering
    with pytest.raises(helper.HelperFailedError) as caught:
        running.join()
    assert str(caught.value) == "/ckpt/__3_0.distcp: item at byte 7: tensor record missing"
    assert seen == [5 + (3 << 20)]  # batched per MB, every byte counted


def test_what_a_helper_delivers_reaches_the_run_before_it_ends(tmp_path):
    """The run takes what the helper delivers on the way while the helper still works (here: until
    the run lets it go), then its result at the end."""
    go = tmp_path / "go"

    def work(report, deliver):
        deliver(b"early" * 100_000)  # over a pipe's buffer: sent in parts
        while not go.exists():
            time.sleep(0.01)
        return b"late"

    running = helper.start(work, lambda n: None)
    assert running.delivered() == b"early" * 100_000
    go.touch()
    assert running.join() == b"late"


def test_a_helper_that_dies_is_reported():
    running = helper.start(lambda report, deliver: os.kill(os.getpid(), signal.SIGKILL), lambda n: None)
    with pytest.raises(helper.HelperFailedError, match=r"^the helper process ended by signal SIGKILL$"):
        running.join()


def test_stop_ends_a_running_helper_at_once():
    running = helper.start(lambda report, deliver: time.sleep(60), lambda n: None)
    began = time.monotonic()
    running.stop()
    running.stop()  # twice: a no-op
    assert time.monotonic() - began < 5
    with pytest.raises(ChildProcessError):
        os.waitpid(running.pid, os.WNOHANG)  # reaped


def test_the_helper_ignores_ctrl_c():
    running = helper.start(lambda report, deliver: time.sleep(1), lambda n: None)
    time.sleep(0.2)
    os.kill(running.pid, signal.SIGINT)
    running.join()  # ended by its own work, not by the signal


def test_never_forked_where_torch_is_imported_nor_below_the_threshold(monkeypatch):
    assert "torch" in sys.modules and not helper.wanted(10 ** 9)
    monkeypatch.delitem(sys.modules, "torch")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    assert helper.wanted(helper.MIN_RECORDS) and not helper.wanted(helper.MIN_RECORDS - 1)
    monkeypatch.setenv(helper.MIN_RECORDS_ENV, "0")
    assert not helper.wanted(10 ** 9)
    monkeypatch.setenv(helper.MIN_RECORDS_ENV, "5")
    assert helper.wanted(5)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    assert not helper.wanted(5)


def test_the_helpers_share_is_the_last_files_near_half_the_bytes_less_its_other_work():
    ten = {f"__{r}_0.distcp": 10 for r in range(10)}
    assert helper.share(ten) == {f"__{r}_0.distcp" for r in (5, 6, 7, 8, 9)}
    assert helper.share(ten, load=20) == {f"__{r}_0.distcp" for r in (6, 7, 8, 9)}  # .metadata's work: 20 bytes
    assert helper.share({"a": 100}) == frozenset()  # one file: no helper
    assert helper.share({"a": 1, "b": 100}) == {"b"}


def test_a_run_that_cannot_fork_writes_alone(fixture_ckpt, tmp_path, monkeypatch):
    import errno

    def no_fork():
        raise OSError(errno.EAGAIN, "Resource temporarily unavailable")

    monkeypatch.setattr(helper, "wanted", lambda records: True)
    monkeypatch.setattr(os, "fork", no_fork)
    assert helper.start(lambda report, deliver: None, lambda n: None) is None
    src = fixture_ckpt("fsdp2_4ranks")
    reshard(src, tmp_path / "alone", ReshardOptions(world_size=3, sync=False))
    _cli_reshard(src, tmp_path / "cli", "0")
    assert _tree(tmp_path / "alone") == _tree(tmp_path / "cli")


def test_a_threshold_that_is_not_a_number_is_one_line_and_exit_2(fixture_ckpt, tmp_path):
    env = {**os.environ, helper.MIN_RECORDS_ENV: "lots"}
    done = subprocess.run([sys.executable, "-m", "ckptctl", "reshard", fixture_ckpt("fsdp2_4ranks"), tmp_path / "o",
                           "-n", "3"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stderr) == (
        2, "ckptctl: error: CKPTCTL_HELPER_MIN_RECORDS must be a whole number (got 'lots')\n")
    assert list(tmp_path.iterdir()) == []
