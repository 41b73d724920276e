"""Runs under torchrun: each worker writes a balanced share, the output equals a single-process run.

Real multi-process runs: `python -m torch.distributed.run --standalone` launching
`-m ckptctl` (gloo over loopback), and gloo ranks spawned by `fixtures.gloo.run_ranks` for
the collective directory protocol with injected failures.
"""

from __future__ import annotations

import filecmp
import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from ckptctl.engine.dist import (
    WorkerFailedError,
    assign_files,
    comm_from_group,
    distributed_from_env,
    launch_local,
    torchrun_command,
    write_atomically,
)
from ckptctl.util.errors import CheckpointError, CkptctlError
from ckptctl.commands.export_hf import ExportOptions, export_hf
from ckptctl.formats.dcp.metadata import open_checkpoint
from ckptctl.formats.dcp.writer import metadata_load
from ckptctl.core.plan import planned_batches
from ckptctl.commands.reshard import ReshardOptions, plan_reshard, reshard
from fixtures.gloo import run_ranks

RESHARD_ARGS = ("--world-size", "5", "--dtype", "bf16")
EXPORT_ARGS = ("--arch", "raw", "--no-name-check", "--max-shard-size", "150", "--dtype", "bf16")  # 4 safetensors files


def same_export(expected: Path, got: Path) -> None:
    """Every file byte-identical: safetensors shards, index.json, config.json."""
    names = sorted(p.name for p in expected.iterdir())
    assert sorted(p.name for p in got.iterdir()) == names and "model.safetensors.index.json" in names
    assert len([n for n in names if n.endswith(".safetensors")]) == 4
    match, mismatch, errors = filecmp.cmpfiles(expected, got, names, shallow=False)
    assert (mismatch, errors) == ([], []) and match == names


def same_output(expected: Path, got: Path) -> None:
    """Data files byte-identical, `.metadata` equal in content (torch's classes compare by value)."""
    names = sorted(p.name for p in expected.iterdir())
    assert sorted(p.name for p in got.iterdir()) == names
    data = [n for n in names if n != ".metadata"]
    match, mismatch, errors = filecmp.cmpfiles(expected, got, data, shallow=False)
    assert (mismatch, errors) == ([], []) and match == data
    with open(expected / ".metadata", "rb") as a, open(got / ".metadata", "rb") as b:
        assert pickle.load(a) == pickle.load(b)
    ours_a, ours_b = open_checkpoint(expected), open_checkpoint(got)
    assert ours_a.tensors == ours_b.tensors and ours_a.bytes_entries == ours_b.bytes_entries


def leftovers(dst: Path) -> list[str]:
    return sorted(p.name for p in dst.parent.iterdir() if p.name.startswith(f".{dst.name}."))


# ---------------------------------------------------------------- balanced shares (pure)


def test_shares_are_whole_files_largest_first_onto_least_loaded():
    sizes = {"a": 10, "b": 70, "c": 40, "d": 30, "e": 30, "f": 5}
    shares = assign_files(sizes, 3)
    assert shares == [frozenset({"b"}), frozenset({"c", "a", "f"}), frozenset({"d", "e"})]  # loads 70, 55, 60
    assert sorted(n for s in shares for n in s) == sorted(sizes)
    assert assign_files(dict(reversed(list(sizes.items()))), 3) == shares  # order-independent


def test_rank_0_takes_fewer_files_for_the_metadata_it_writes_meanwhile():
    sizes = {f"__{r}_0.distcp": 10 for r in range(8)}
    assert [len(s) for s in assign_files(sizes, 2, lead_load=20)] == [3, 5]  # loads 20 + 30, 50
    assert [len(s) for s in assign_files(sizes, 2)] == [4, 4]
    assert metadata_load(1_280_000, 430_000_000) == 85_283_749  # a fifth of a million tiny records' bytes
    assert metadata_load(300, 2_200_000_000) == 2_386_980  # next to nothing of a model's
    assert metadata_load(0, 0) == 0


def test_one_worker_gets_everything_and_extra_workers_get_nothing():
    sizes = {"__0_0.distcp": 3, "__1_0.distcp": 2}
    assert assign_files(sizes, 1) == [frozenset(sizes)]
    assert assign_files(sizes, 4) == [frozenset({"__0_0.distcp"}), frozenset({"__1_0.distcp"}), frozenset(), frozenset()]


def test_plain_run_is_a_world_of_one(monkeypatch):
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR"):
        monkeypatch.delenv(key, raising=False)
    with distributed_from_env() as comm:
        assert (comm.rank, comm.world_size) == (0, 1)
        assert comm.broadcast("x") == "x" and comm.all_gather(3) == [3]


def test_torchrun_command_line():
    cmd = torchrun_command(2, ["reshard", "a", "b", "-n", "3"])
    assert cmd[1:] == ["-m", "torch.distributed.run", "--standalone", "--nnodes=1", "--nproc-per-node=2",
                       "-m", "ckptctl", "reshard", "a", "b", "-n", "3"]


# ---------------------------------------------------------------- collective atomic directory


def _write_named(tmp: Path, names: frozenset[str]) -> None:
    for name in names:
        (tmp / name).write_text(name)


def _atomic_rank(rank: int, world_size: int, root: str) -> dict[str, str]:
    """Three collective writes: one succeeding, one whose rank-1 share fails, one whose finish fails."""
    comm = comm_from_group()
    base = Path(root)
    sizes = {f"f{i}": 10 + i for i in range(5)}
    outcome: dict[str, str] = {}

    def finish_ok(tmp: Path) -> None:
        (tmp / "index.json").write_text(json.dumps(sorted(p.name for p in tmp.iterdir())))

    def write_fails_on_1(tmp: Path, names: frozenset[str]) -> None:
        if rank == 1:
            raise CheckpointError(tmp / "f0", "disk on fire")
        _write_named(tmp, names)

    def finish_fails(tmp: Path) -> None:
        raise CheckpointError(tmp / ".metadata", "cannot write")

    for case, write, finish in (("ok", _write_named, finish_ok), ("write", write_fails_on_1, finish_ok),
                                ("finish", _write_named, finish_fails)):
        try:
            mine = write_atomically(base / case, False, sizes, write, finish, comm)
            outcome[case] = "ok " + ",".join(sorted(mine))
        except WorkerFailedError as exc:
            outcome[case] = f"peer {exc.rank} quiet={exc.quiet}: {exc.message}"
        except CkptctlError as exc:
            outcome[case] = f"own: {exc}"
    return outcome


def test_collective_directory_is_atomic_and_a_failure_fails_every_worker(tmp_path):
    results = run_ranks(_atomic_rank, 3, str(tmp_path), timeout=90)
    shares = assign_files({f"f{i}": 10 + i for i in range(5)}, 3)
    assert [r["ok"] for r in results] == [f"ok {','.join(sorted(s))}" for s in shares]
    assert sorted(p.name for p in (tmp_path / "ok").iterdir()) == ["f0", "f1", "f2", "f3", "f4", "index.json"]
    assert json.loads((tmp_path / "ok" / "index.json").read_text()) == ["f0", "f1", "f2", "f3", "f4"]

    assert results[1]["write"].startswith("own: ") and "disk on fire" in results[1]["write"]
    assert results[0]["write"].startswith("peer 1 quiet=False: ") and "disk on fire" in results[0]["write"]
    assert results[2]["write"].startswith("peer 1 quiet=True: ")
    assert results[0]["finish"].startswith("own: ") and "cannot write" in results[0]["finish"]
    assert all(r["finish"].startswith("peer 0 quiet=True: ") and "cannot write" in r["finish"] for r in results[1:])
    assert not (tmp_path / "write").exists() and not (tmp_path / "finish").exists()
    assert leftovers(tmp_path / "write") == [] and leftovers(tmp_path / "finish") == []


# ---------------------------------------------------------------- torchrun end to end


@pytest.fixture(scope="module")
def single(fixture_ckpt, tmp_path_factory) -> Path:
    """The single-process reference output of the reshard under test."""
    dst = tmp_path_factory.mktemp("single") / "out"
    reshard(fixture_ckpt("fsdp2_4ranks"), dst, ReshardOptions(world_size=5, dtype=torch.bfloat16))
    return dst


NPROCS = [pytest.param(2, marks=pytest.mark.full), 3]
"""Workers to launch: 3 (the files do not divide evenly among them) in `make test`, 2 under full."""


@pytest.mark.parametrize("nproc", NPROCS)
def test_torchrun_reshard_equals_the_single_process_run(fixture_ckpt, single, tmp_path, nproc):
    dst = tmp_path / "out"
    result = launch_local(nproc, ["reshard", fixture_ckpt("fsdp2_4ranks"), dst, *RESHARD_ARGS, "--json",
                                  "--device", "cpu", "--workers", "1"], timeout=120)
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)  # rank 0 alone reports
    assert doc["processes"] == nproc and doc["device"] == "cpu" and doc["files"] == 6
    same_output(single, dst)
    assert leftovers(dst) == []


def test_torchrun_worker_failure_fails_the_run_and_leaves_no_output(fixture_ckpt, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(fixture_ckpt("fsdp2_4ranks"), src)
    ckpt = open_checkpoint(src)
    out = plan_reshard(ckpt, ReshardOptions(world_size=5))
    shares = assign_files(out.files, 2)
    planned = [i for batch in planned_batches(out.records.in_files(out.files), out.sources) for i in batch]
    chunks = {rank: {(r.chunk.file, r.chunk.offset, r.chunk.length) for i in planned
                     if i.file in shares[rank] for r in i.reads} for rank in (0, 1)}
    file, offset, length = sorted(chunks[1] - chunks[0])[0]  # read by worker 1 only
    with open(src / file, "r+b") as fh:  # wipe the item's end-of-central-directory record
        fh.seek(offset + length - 22)
        fh.write(b"\0" * 22)
    dst = tmp_path / "out"
    result = launch_local(2, ["reshard", src, dst, "--world-size", "5", "--device", "cpu"], timeout=120)
    assert result.returncode != 0
    assert f"{file}: item at byte {offset}: not a torch.save archive" in result.stderr
    assert not dst.exists() and leftovers(dst) == []



@pytest.fixture(scope="module")
def hf_config(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("hf-config")
    (path / "config.json").write_text(json.dumps({"model_type": "raw", "architectures": ["Sequential"]}))
    return path


@pytest.fixture(scope="module")
def single_export(fixture_ckpt, hf_config, tmp_path_factory) -> Path:
    dst = tmp_path_factory.mktemp("single-export") / "out"
    export_hf(fixture_ckpt("fsdp2_4ranks"), dst, hf_config,
              ExportOptions(arch="raw", max_shard_size=150, dtype=torch.bfloat16, name_check=False))
    return dst


@pytest.mark.parametrize("nproc", [pytest.param(n, marks=pytest.mark.full) for n in (2, 3)])  # reshard's run covers
def test_torchrun_export_hf_equals_the_single_process_run(fixture_ckpt, hf_config, single_export, tmp_path, nproc):
    dst = tmp_path / "out"
    result = launch_local(nproc, ["export-hf", fixture_ckpt("fsdp2_4ranks"), dst, "--hf-config", hf_config,
                                  *EXPORT_ARGS, "--json", "--device", "cpu", "--workers", "1"], timeout=120)
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["processes"] == nproc and doc["files"] == 4
    same_export(single_export, dst)
    assert leftovers(dst) == []


def test_output_on_another_filesystem_copies_bytes_entries_by_hand(fixture_ckpt, single, tmp_path, monkeypatch):
    """copy_file_range fails across filesystems (EXDEV) on many kernels: the copy falls back to read/write."""
    import errno

    def cross_device(*args):
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr("ckptctl.storage.local_disk.os.copy_file_range", cross_device)
    dst = tmp_path / "out"
    reshard(fixture_ckpt("fsdp2_4ranks"), dst, ReshardOptions(world_size=5, dtype=torch.bfloat16, device="cpu"))
    same_output(single, dst)
