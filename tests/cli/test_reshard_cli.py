"""`ckptctl reshard` as a user runs it: options, errors, atomicity and the untouched source."""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tests.conftest import ROOT, run_cli


def tree_digest(path: Path) -> dict[str, str]:
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


def flat_state(ckpt: Path, tmp: Path) -> dict:
    target = tmp / f"{ckpt.name}.pt"
    dcp_to_torch_save(ckpt, target)
    out = {}

    def walk(d, prefix=""):
        for k, v in d.items():
            if isinstance(v, dict):
                walk(v, f"{prefix}{k}.")
            else:
                out[f"{prefix}{k}"] = v
    walk(torch.load(target, weights_only=False))
    return out


@pytest.fixture(scope="module")
def src(fixture_ckpt) -> Path:
    return fixture_ckpt("fsdp2_4ranks")


def test_json_summary_reports_the_run(src, tmp_path):
    result = run_cli("reshard", src, tmp_path / "o", "--world-size", "2", "--json", "--verify")
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["world_size"] == 2 and doc["tensors"] == 32 and doc["bytes_entries"] == 13
    assert doc["verified"] is True and doc["dry_run"] is False
    assert doc["bytes_written"] == sum(p.stat().st_size for p in (tmp_path / "o").iterdir() if p.name != ".metadata")
    assert doc["peak_rss_bytes"] > 0 and doc["seconds"] > 0
    assert result.stderr == ""


def test_reported_peak_memory_is_the_commands_own_not_its_parents(src, tmp_path):
    assert "torch" in sys.modules  # this pytest process is a few hundred MB; its children start as copies of it
    doc = json.loads(run_cli("reshard", src, tmp_path / "o", "-n", "2", "--json").stdout)
    assert 10 << 20 < doc["peak_rss_bytes"] < 100 << 20  # a plain copy never imports torch


def test_verify_catches_one_flipped_bit_in_any_tensor(src, tmp_path):
    from ckptctl.engine.cpu import ChunkSource
    from ckptctl.util.errors import CheckpointError
    from ckptctl.formats.dcp.items import ItemReader
    from ckptctl.formats.dcp.metadata import open_checkpoint
    from ckptctl.commands.reshard import ReshardOptions, plan_reshard
    from ckptctl.checks.verify import verify_dcp

    out_dir = tmp_path / "o"
    assert run_cli("reshard", src, out_dir, "-n", "3").returncode == 0
    ckpt, written = open_checkpoint(src), open_checkpoint(out_dir)
    plan = plan_reshard(ckpt, ReshardOptions(world_size=3))
    fqn = "optim.state.mlp.fc1.weight.exp_avg"
    entry = written.tensors[fqn]
    with ItemReader(written) as reader:
        record = reader.locate(entry, entry.chunks[-1])
    with open(record.path, "r+b") as fh:  # the last element's lowest mantissa bit
        fh.seek(record.byte_offset + record.nbytes - 4)
        byte = fh.read(1)
        fh.seek(-1, 1)
        fh.write(bytes([byte[0] ^ 1]))
    sources = ChunkSource(ckpt)
    with pytest.raises(CheckpointError) as err:
        verify_dcp(ckpt, sources, plan, out_dir, workers=2)
    assert str(err.value) == f"{out_dir}: {fqn}: verification failed (output differs from the source)"
    sources.close()


def test_source_is_never_modified(src, tmp_path):
    before = tree_digest(src)
    assert run_cli("reshard", src, tmp_path / "o", "--world-size", "3").returncode == 0
    assert tree_digest(src) == before


def test_no_sync_writes_the_same_bytes(src, tmp_path):
    """--no-sync only skips fsync: reshard and export output are byte-identical to a synced run."""
    config = tmp_path / "config.json"
    config.write_text('{"model_type": "raw"}')
    for name, extra in (("sync", []), ("nosync", ["--no-sync"])):
        assert run_cli("reshard", src, tmp_path / name, "-n", "3", *extra).returncode == 0
        assert run_cli("export-hf", src, tmp_path / f"hf-{name}", "--hf-config", config, "--arch", "raw",
                       "--no-name-check", *extra).returncode == 0
    assert tree_digest(tmp_path / "nosync") == tree_digest(tmp_path / "sync")
    assert tree_digest(tmp_path / "hf-nosync") == tree_digest(tmp_path / "hf-sync")
    assert not [p for p in tmp_path.iterdir() if ".ckptctl-tmp-" in p.name]


def test_dry_run_writes_nothing(src, tmp_path):
    result = run_cli("reshard", src, tmp_path / "o", "--world-size", "3", "--dry-run")
    assert result.returncode == 0, result.stderr
    assert not (tmp_path / "o").exists()
    lines = result.stdout.splitlines()
    assert lines[:6] == [f"Dry run      nothing written to {tmp_path / 'o'}", f"Source       {src}", "World size   3",
                         "Dtype        kept", "Entries      32 tensors, 13 bytes entries",
                         "Files        3 data files + .metadata, 116.5 kB"]
    assert [re.sub(r"[\d.]+ kB", "N kB", line) for line in lines[6:9]] == [f"             __{r}_0.distcp  N kB" for r in range(3)]
    assert re.fullmatch(r"Read         [\d.]+ kB", lines[9]) and re.fullmatch(r"Peak memory  [\d.]+ MB \(predicted\)",
                                                                         lines[10]) and len(lines) == 11
    doc = json.loads(run_cli("reshard", src, tmp_path / "o", "-n", "3", "--dry-run", "--json").stdout)
    assert doc["dry_run"] is True and doc["predicted_peak_bytes"] > 0 and doc["bytes_read"] > 0


@pytest.mark.parametrize("extra", [[], ["--dtype", "bf16"]], ids=["copy", "cast"])
def test_dry_run_predicts_the_runs_peak_memory(src, tmp_path, extra):
    """Measured planning state plus the copy's buffers, plus torch when the run casts: a bound, and a close one."""
    plan = json.loads(run_cli("reshard", src, tmp_path / "o", "-n", "3", "--dry-run", "--json", *extra).stdout)
    run = json.loads(run_cli("reshard", src, tmp_path / "o", "-n", "3", "--json", *extra).stdout)
    assert run["peak_rss_bytes"] <= plan["predicted_peak_bytes"] <= 1.15 * run["peak_rss_bytes"] + (2 << 20)


def test_dtype_casts_floating_tensors_only(src, tmp_path):
    assert run_cli("reshard", src, tmp_path / "o", "-n", "2", "--dtype", "bf16").returncode == 0
    before, after = flat_state(src, tmp_path), flat_state(tmp_path / "o", tmp_path)
    assert before.keys() == after.keys()
    for key, value in before.items():
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            assert after[key].dtype == torch.bfloat16, key
            assert torch.equal(after[key], value.to(torch.bfloat16)), key
        elif isinstance(value, torch.Tensor):
            assert after[key].dtype == value.dtype and torch.equal(after[key], value), key
        else:
            assert after[key] == value, key


def test_include_exclude_filter_by_fqn(src, tmp_path):
    assert run_cli("reshard", src, tmp_path / "w", "-n", "2", "--exclude", "optim.*").returncode == 0
    keys = flat_state(tmp_path / "w", tmp_path).keys()
    assert keys and all(not k.startswith("optim.") for k in keys)
    assert "model.embed.weight" in keys and "extra.iteration" in keys
    assert run_cli("reshard", src, tmp_path / "i", "-n", "2", "--include", "model.mlp.*").returncode == 0
    assert sorted(flat_state(tmp_path / "i", tmp_path)) == [
        "model.mlp.fc1.bias", "model.mlp.fc1.weight", "model.mlp.fc2.bias", "model.mlp.fc2.weight"]


def test_existing_destination_needs_force(src, tmp_path):
    dst = tmp_path / "o"
    dst.mkdir()
    (dst / "keep").write_text("x")
    result = run_cli("reshard", src, dst, "-n", "2")
    assert result.returncode == 2
    assert result.stderr == f"ckptctl: error: {dst}: destination exists (pass --force to replace it)\n"
    assert (dst / "keep").exists()
    assert run_cli("reshard", src, dst, "-n", "2", "--force").returncode == 0
    assert not (dst / "keep").exists() and (dst / ".metadata").exists()


def test_incomplete_source_is_refused_with_the_diagnosis(fixture_ckpt, tmp_path):
    broken = fixture_ckpt("broken_plain_optim")
    result = run_cli("reshard", broken, tmp_path / "o", "-n", "2")
    assert result.returncode == 2
    assert result.stderr.startswith(f"ckptctl: error: {broken}: refusing incomplete checkpoint: optim.state.w.exp_avg")
    assert result.stderr.rstrip().endswith("pass --allow-incomplete to go on")
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "o").exists()
    assert run_cli("reshard", broken, tmp_path / "o", "-n", "2", "--allow-incomplete").returncode == 0


@pytest.mark.parametrize("argv,message", [
    (["reshard", "/nonexistent/ckpt", "OUT", "-n", "2"], "ckptctl: error: /nonexistent/ckpt: no such file or directory\n"),
    (["reshard", "SRC", "OUT", "-n", "0"], "ckptctl: error: --world-size must be at least 1 (got 0)\n"),
    (["reshard", "SRC", "OUT", "-n", "2", "--dtype", "int8"],
     "ckptctl: error: --dtype must be one of keep, bf16, fp16, fp32, bfloat16, float16, float32 (got 'int8')\n"),
])
def test_bad_invocations_fail_with_one_line(src, tmp_path, argv, message):
    argv = [str(src) if a == "SRC" else str(tmp_path / "o") if a == "OUT" else a for a in argv]
    result = run_cli(*argv)
    assert (result.returncode, result.stderr) == (2, message)


def test_destination_inside_source_is_refused(src, tmp_path):
    copy = tmp_path / "src"
    subprocess.run(["cp", "-r", str(src), str(copy)], check=True)
    result = run_cli("reshard", copy, copy / "out", "-n", "2")
    assert result.returncode == 2
    assert result.stderr == (f"ckptctl: error: {copy / 'out'}: destination overlaps the source {copy}; "
                             "the source is never modified\n")


def _small_file_limit() -> None:
    """In the child: files may not grow past 4 kB (a full disk, as seen by write calls), and no SIGXFSZ."""
    import resource

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))


def test_a_full_disk_fails_with_one_line_naming_the_file_and_leaves_nothing(src, tmp_path):
    result = subprocess.run([sys.executable, "-m", "ckptctl", "reshard", str(src), str(tmp_path / "o"), "-n", "2"],
                            capture_output=True, text=True, cwd=ROOT, preexec_fn=_small_file_limit)
    assert result.returncode == 2
    assert re.fullmatch(rf"ckptctl: error: {re.escape(str(tmp_path / 'o'))}/__[01]_0\.distcp: cannot write: "
                        r"File too large\n", result.stderr), result.stderr
    assert list(tmp_path.iterdir()) == []  # neither DST nor its temporary sibling


def test_a_destination_that_cannot_be_created_fails_with_one_line(src, tmp_path):
    (tmp_path / "plain-file").write_text("x")
    result = run_cli("reshard", src, tmp_path / "plain-file" / "o", "-n", "2")
    assert (result.returncode, result.stderr) == (
        2, f"ckptctl: error: {tmp_path / 'plain-file'}: cannot create: File exists\n")


@pytest.fixture(scope="module")
def big_source(tmp_path_factory) -> Path:
    """A ~96 MB two-file checkpoint, big enough that a kill lands mid-write."""
    path = tmp_path_factory.mktemp("big") / "ckpt"
    gen = torch.Generator().manual_seed(0)
    state = {f"layer{i}.weight": torch.randn(1024, 1024 * 3, generator=gen) for i in range(8)}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.save(state, checkpoint_id=path, no_dist=True)
    return path


@pytest.mark.parametrize("extra", [[], ["--dtype", "bf16"]], ids=["copy", "cast"])
def test_every_written_record_is_a_sound_zip_whose_crc_spans_all_its_blocks(big_source, tmp_path, extra):
    """Records of several MB are streamed in many blocks: each archive's CRC-32 must cover them all."""
    import io
    import zipfile

    from ckptctl.formats.dcp.metadata import open_checkpoint

    assert run_cli("reshard", big_source, tmp_path / "o", "-n", "3", *extra).returncode == 0
    written = open_checkpoint(tmp_path / "o")
    checked = 0
    for entry in written.tensors.values():
        for chunk in entry.chunks:
            with open(tmp_path / "o" / chunk.file, "rb") as fh:
                fh.seek(chunk.offset)
                archive = zipfile.ZipFile(io.BytesIO(fh.read(chunk.length)))
            assert archive.testzip() is None
            checked += 1
    assert checked == 8 * 3


def wait_for_temporary(parent: Path, proc: subprocess.Popen, timeout: float = 60) -> bool:
    """Poll until the run's temporary sibling exists (True), or the process ended first (False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if any(p.name.startswith(".out.ckptctl-tmp-") for p in parent.iterdir()):
            return True
        time.sleep(0.001)
    return False


@pytest.mark.parametrize("moment", ["at-start", "temporary-created", "mid-copy", "late"])
def test_sigkill_leaves_destination_absent_or_complete(big_source, tmp_path, moment):
    """Killed at any moment, a run leaves DST absent or complete; kills while the temporary
    directory is being filled must find DST absent (the cast and --verify make that window long)."""
    dst = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "ckptctl", "reshard", str(big_source), str(dst),
                             "-n", "3", "--workers", "1", "--dtype", "bf16", "--verify"],
                            cwd=ROOT, stderr=subprocess.DEVNULL)
    if moment in ("temporary-created", "mid-copy"):
        assert wait_for_temporary(tmp_path, proc), "the run ended before its temporary directory was seen"
        time.sleep(0.1 if moment == "mid-copy" else 0)
    elif moment == "late":
        time.sleep(3.0)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith(".out.ckptctl-tmp-")]
    if moment in ("temporary-created", "mid-copy"):
        assert proc.returncode == -signal.SIGKILL and not dst.exists() and leftovers  # killed mid-write
    if dst.exists():
        assert flat_state(dst, tmp_path).keys() == flat_state(big_source, tmp_path).keys()
        result = run_cli("reshard", dst, tmp_path / "again", "-n", "1", "--verify")
        assert result.returncode == 0, result.stderr
    if leftovers:  # a later run cleans what a killed run left behind
        assert run_cli("reshard", big_source, dst, "-n", "3", "--force").returncode == 0
        assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.ckptctl-tmp-")]
    assert os.listdir(big_source)
