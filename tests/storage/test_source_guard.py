"""The source is never modified, whatever DST is, and never changes under a run unnoticed.

DST over a file source (its own file, the folder holding it, a folder above) or over a file the
run reads (`--hf-config`'s config.json) is refused by every writing command before anything is
moved, the source files byte-identical after; DST beside a file source is fine. A source file
rewritten in place or replaced while a reshard writes (the run frozen with SIGSTOP once it holds
the data file open, so the change lands mid-run every time) fails the run with one line naming
the file and leaves no DST, without `--verify`; under torchrun too (every worker frozen).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import ckptctl
from ckptctl.engine.dist import torchrun_command
from tests.conftest import FIXTURES, ROOT, run_cli
from tests.test_hostile_input import copy_fixture, snapshot

OVERLAP = "destination overlaps the source {src}; the source is never modified"
CKPTCTL = [sys.executable, "-m", "ckptctl"]
CHANGED = "changed while it was read (rewritten, replaced or resized since it was opened); no output is written"


def hf_folder(root: Path) -> Path:
    """A one-file Hugging Face folder: model.safetensors, config.json and generation_config.json."""
    folder = root / "HF"
    folder.mkdir()
    save_file({"model.embed_tokens.weight": torch.arange(12.0).reshape(4, 3), "lm_head.weight": torch.ones(4, 3)},
              folder / "model.safetensors")
    (folder / "config.json").write_text('{"model_type": "llama"}')
    (folder / "generation_config.json").write_text('{"bos_token_id": 1}')
    return folder


def import_args(src: Path, dst: Path) -> list:
    return ["import-hf", src, dst, "-n", "2", "--no-name-check", "--force"]


@pytest.mark.parametrize("where", ["its-folder", "the-file", "a-folder-above"])
def test_import_hf_over_a_file_source_is_refused_and_the_folder_stays_as_it_was(tmp_path: Path, where: str) -> None:
    folder = hf_folder(tmp_path)
    src = folder / "model.safetensors"
    dst = {"its-folder": folder, "the-file": src, "a-folder-above": tmp_path}[where]
    before = snapshot(folder)
    result = run_cli(*import_args(src, dst))
    assert (result.returncode, result.stderr) == (2, f"ckptctl: error: {dst}: {OVERLAP.format(src=src)}\n")
    assert snapshot(folder) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["HF"]  # no temporary sibling either


def test_import_hf_over_a_file_source_reached_relatively_is_refused(tmp_path: Path) -> None:
    folder = hf_folder(tmp_path)
    before = snapshot(folder)
    result = subprocess.run([sys.executable, "-m", "ckptctl", *import_args(Path("model.safetensors"), Path("."))],
                            capture_output=True, text=True, cwd=folder, timeout=120)
    assert (result.returncode, result.stderr) == (
        2, f"ckptctl: error: .: {OVERLAP.format(src='model.safetensors')}\n")
    assert snapshot(folder) == before


def test_import_hf_writes_beside_a_file_source_and_leaves_it_as_it_was(tmp_path: Path) -> None:
    """The folder holding a file source is not the source: `import-hf model.safetensors out` in
    the model's folder is the common way to call it."""
    folder = hf_folder(tmp_path)
    before = snapshot(folder)
    result = run_cli(*import_args(folder / "model.safetensors", folder / "out"))
    assert result.returncode == 0, result.stderr
    after = snapshot(folder)
    assert {name: after[name] for name in before} == before
    assert (folder / "out" / ".metadata").is_file()


@pytest.mark.parametrize("where", ["the-source", "a-folder-above"])
def test_reshard_and_export_hf_over_the_source_are_refused(tmp_path: Path, where: str) -> None:
    src = copy_fixture(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "raw"}')
    dst = src if where == "the-source" else tmp_path
    before, config = snapshot(src), (tmp_path / "config.json").read_bytes()
    for args in (["reshard", src, dst, "-n", "2", "--force"],
                 ["export-hf", src, dst, "--hf-config", tmp_path / "config.json", "--arch", "raw", "--no-name-check",
                  "--force"]):
        result = run_cli(*args)
        assert (result.returncode, result.stderr) == (2, f"ckptctl: error: {dst}: {OVERLAP.format(src=src)}\n"), args
    assert snapshot(src) == before and (tmp_path / "config.json").read_bytes() == config


@pytest.mark.parametrize("where", ["the-config-folder", "the-config-file"])
def test_export_hf_over_its_hf_config_is_refused(tmp_path: Path, where: str) -> None:
    ref = tmp_path / "ref"
    ref.mkdir()
    (ref / "config.json").write_text('{"model_type": "raw"}')
    (ref / "tokenizer.json").write_text('{"model": {}}')
    dst = ref if where == "the-config-folder" else ref / "config.json"
    before = snapshot(ref)
    result = run_cli("export-hf", FIXTURES / "fsdp2_4ranks", dst, "--hf-config", ref, "--arch", "raw",
                     "--no-name-check", "--force")
    assert (result.returncode, result.stderr) == (
        2, f"ckptctl: error: {dst}: destination overlaps {ref / 'config.json'}, which this run reads; "
           "the source is never modified\n")
    assert snapshot(ref) == before


@pytest.mark.parametrize("name", [".metadata", "__0_0.distcp"])
def test_export_torch_over_a_source_file_is_refused(tmp_path: Path, name: str) -> None:
    src = copy_fixture(tmp_path)
    before = snapshot(src)
    result = run_cli("export-torch", src, src / name, "--force")
    assert (result.returncode, result.stderr) == (
        2, f"ckptctl: error: {src / name}: output is inside the source {src}; the source is never modified\n")
    assert snapshot(src) == before


# -- a source that changes during the run ----------------------------------------------------------------

BIG_ELEMENTS = 8 << 20
"""32 MB of float32: the reshard's copy and fsync outlast the moment it takes to stop it."""


@pytest.fixture(scope="module")
def big_source(tmp_path_factory) -> Path:
    """A single-file DCP checkpoint of one 32 MB tensor, saved by torch's own dcp.save."""
    import torch.distributed.checkpoint as dcp

    src = tmp_path_factory.mktemp("big") / "src"
    dcp.save({"w": torch.arange(BIG_ELEMENTS, dtype=torch.float32)}, checkpoint_id=src, no_dist=True)
    return src


def _holds_open(pid: int, target: str) -> bool:
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") == target:
                return True
        except OSError:
            continue
    return False


def stopped_while_reading(argv: list, data_file: Path, dst: Path) -> tuple[subprocess.Popen, list[int]] | None:
    """`argv` started, and it and every process it started stopped (SIGSTOP) as soon as one of them
    holds `data_file` open, before DST exists: the process and the pids to continue. None when the
    run got past its rename before it could be stopped."""
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}  # torchrun's workers talk over loopback
    proc = subprocess.Popen([str(a) for a in argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=ROOT, env=env)
    target = os.path.realpath(data_file)
    deadline = time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < deadline:
        tree = [proc.pid, *_descendants(proc.pid)]
        if any(_holds_open(pid, target) for pid in tree):
            for pid in tree:
                os.kill(pid, signal.SIGSTOP)
            if not dst.exists():
                return proc, tree
            _continue(tree)
            break
        time.sleep(0.0002)
    proc.communicate(timeout=120)
    return None


def _continue(pids: list[int]) -> None:
    for pid in pids:
        os.kill(pid, signal.SIGCONT)


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                parent = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def rewrite_in_place(path: Path) -> None:
    """Other bytes in the middle of `path`, written into the same inode: same size, new mtime."""
    with open(path, "r+b") as fh:
        fh.seek(path.stat().st_size // 2)
        block = fh.read(4096)
        fh.seek(-len(block), os.SEEK_CUR)
        fh.write(bytes(b ^ 0xFF for b in block))


def replace_by_a_copy(path: Path) -> None:
    """The same bytes under the same name, as a new inode (a writer that saves and renames)."""
    fresh = path.with_name(path.name + ".new")
    fresh.write_bytes(path.read_bytes())
    os.replace(fresh, path)


def assert_caught_mid_run(argv: list, source: Path, watched: Path, changed: Path, change, dst: Path,
                          torchrun: bool = False) -> None:
    """Run `argv`, stop it once it holds `watched` open, `change(changed)`, let it go on: it fails
    with the one line naming `changed` and leaves nothing beside the source (under torchrun, the
    one ckptctl line among the launcher's).

    A run stopped between opening `watched` and noting it (an fstat: microseconds) reads only
    the changed file, so when `changed` is `watched` it may end well, its output then equal to
    the changed source; that run is made again, and one of five must be caught."""
    for _ in range(5):
        stopped = stopped_while_reading(argv, watched, dst)
        if stopped is None:
            shutil.rmtree(dst, ignore_errors=True)
            continue
        proc, tree = stopped
        time.sleep(0.01)  # a later modification time than the one the run saw, on coarse clocks too
        change(changed)
        _continue(tree)
        _, err = proc.communicate(timeout=120)
        if proc.returncode == 0 and changed == watched:
            assert ckptctl.diff(source, dst).equal
            shutil.rmtree(dst)
            continue
        line = f"ckptctl: error: {changed}: {CHANGED}"
        if torchrun:
            assert proc.returncode != 0 and [x for x in err.splitlines() if x.startswith("ckptctl: ")] == [line]
        else:
            assert (proc.returncode, err) == (2, line + "\n")
        assert sorted(p.name for p in dst.parent.iterdir()) == [source.name]
        return
    pytest.fail("no run was stopped once it had noted the file")


def same_bytes_again(path: Path) -> None:
    """The same bytes written again: only the modification time says it was written."""
    path.write_bytes(path.read_bytes())


@pytest.mark.parametrize("name,change", [("__0_0.distcp", rewrite_in_place), (".metadata", same_bytes_again),
                                         ("__0_0.distcp", replace_by_a_copy)],
                         ids=["data-rewritten", "metadata-rewritten", "data-replaced"])
def test_a_source_file_changed_mid_run_fails_the_run_and_leaves_no_dst(tmp_path: Path, big_source: Path, name,
                                                                       change) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for part in big_source.iterdir():
        (src / part.name).write_bytes(part.read_bytes())
    dst = tmp_path / "dst"
    assert_caught_mid_run(CKPTCTL + ["reshard", src, dst, "-n", "2", "-q"], src, src / "__0_0.distcp", src / name,
                          change, dst)


@pytest.mark.parametrize("name", ["config.json", "model.safetensors"])
def test_an_hf_file_changed_mid_import_fails_the_run_and_leaves_no_dst(tmp_path: Path, name: str) -> None:
    """import-hf: the folder's config.json and weights are checked as DCP files are."""
    folder = tmp_path / "HF"
    folder.mkdir()
    save_file({"model.embed_tokens.weight": torch.arange(BIG_ELEMENTS, dtype=torch.float32).reshape(-1, 1024)},
              folder / "model.safetensors")
    (folder / "config.json").write_text('{"model_type": "llama"}')
    dst = tmp_path / "dst"
    assert_caught_mid_run(CKPTCTL + ["import-hf", folder, dst, "-n", "2", "--no-name-check", "-q"], folder,
                          folder / "model.safetensors", folder / name, rewrite_in_place, dst)


def test_a_source_changed_between_two_runs_of_one_process_is_read_anew(tmp_path: Path) -> None:
    """What one command read is forgotten when it ends: a library caller that reshards, changes
    the source, and reshards again gets the new source, no error."""
    src = copy_fixture(tmp_path)
    ckptctl.reshard(src, tmp_path / "a", ckptctl.ReshardOptions(world_size=2))
    data = sorted(src.glob("*.distcp"))[0]
    replace_by_a_copy(data)
    ckptctl.reshard(src, tmp_path / "b", ckptctl.ReshardOptions(world_size=2))
    assert ckptctl.diff(tmp_path / "a", tmp_path / "b").equal
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "src"]


def test_a_source_file_changed_while_torchrun_workers_write_fails_the_run(tmp_path: Path, big_source: Path) -> None:
    """Under torchrun every worker checks what it read: the run fails with the line, no DST."""
    src = tmp_path / "src"
    ckptctl.reshard(big_source, src, ckptctl.ReshardOptions(world_size=2))  # two data files of 16 MB
    dst, data = tmp_path / "dst", src / "__1_0.distcp"
    assert_caught_mid_run(torchrun_command(2, ["-q", "reshard", src, dst, "-n", "2"]), src, data, data,
                          rewrite_in_place, dst, torchrun=True)
