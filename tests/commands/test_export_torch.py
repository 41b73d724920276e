"""`ckptctl export-torch`: one torch.save file equal to torch's own `dcp_to_torch_save`, streamed.

The oracle is torch itself: every committed fixture is converted by `dcp_to_torch_save` and
both files are read back with `torch.load(weights_only=True)` and compared entry by entry
(same nested keys in the same order, tensors bit-identical with the same dtype, shape and
strides, equal non-tensor values); `data.pkl` is even byte-identical. Megatron's `args` is an
argparse.Namespace, which torch's weights_only loader refuses unless allowed: both files are
read with `safe_globals([argparse.Namespace])`, and `--exclude args` gives a file the plain
loader reads.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
import warnings
import zipfile
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from ckptctl.formats.torch_save.writer import LOAD_SAFE_GLOBALS
from fixtures.make_fixtures import zstd_available
from tests.conftest import ROOT, run_cli
from tests.terminal import assert_no_traceback, run_in_terminal

FIXTURES = ["fsdp2_4ranks", "flat_optim", "megatron_tp2_dp2", "zstd"]
RATE = r"\d+(?:\.\d+)? (?:B|kB|MB|GB)/s"


def load(path: Path, *allowed: object) -> dict:
    with torch.serialization.safe_globals(list(allowed)):
        return torch.load(path, map_location="cpu", weights_only=True)


def assert_same_state(got: object, want: object, where: str = "") -> None:
    """Entry by entry: same keys in the same order, tensors bit for bit (NaNs included), equal values."""
    assert type(got) is type(want), (where, type(got), type(want))
    if isinstance(want, dict):
        assert list(got) == list(want), where
        for key in want:
            assert_same_state(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, list):
        assert len(got) == len(want), where
        for i, (a, b) in enumerate(zip(got, want)):
            assert_same_state(a, b, f"{where}.{i}")
    elif isinstance(want, torch.Tensor):
        assert (got.dtype, got.shape, got.stride()) == (want.dtype, want.shape, want.stride()), where
        assert torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)), where
    elif isinstance(want, float) and math.isnan(want):
        assert math.isnan(got), where
    else:
        assert got == want, (where, got, want)


def data_pkl(path: Path) -> bytes:
    with zipfile.ZipFile(path) as archive:
        assert archive.testzip() is None
        return archive.read(archive.namelist()[0])


@pytest.fixture(scope="module")
def torch_out(tmp_path_factory, fixture_ckpt):
    """torch's own `dcp_to_torch_save` file of a fixture (made once per module)."""
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name == "zstd" and not zstd_available():
            pytest.skip("ZStandard stream transform unavailable")
        if name not in made:
            made[name] = tmp_path_factory.mktemp("torch") / f"{name}.pt"
            dcp_to_torch_save(fixture_ckpt(name), made[name])
        return made[name]

    return get


def save_dcp(state: dict, path: Path) -> Path:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.save(state, checkpoint_id=path, no_dist=True)
    return path


@pytest.fixture(scope="module")
def odd(tmp_path_factory) -> Path:
    """A single-process DCP save of every dtype family, NaN payloads, zero-size and 0-d tensors,
    tensors in lists and under numeric-looking keys, and non-tensor values of every allowed kind."""
    gen = torch.Generator().manual_seed(0)
    special = torch.tensor([float("nan"), -float("inf"), -0.0, 1.0]).view(torch.int32)
    special[0] = 0x7FC00123  # a NaN with a payload: a copy keeps every bit
    state = {
        "w": torch.randn(6, 5, generator=gen), "special": special.view(torch.float32),
        "empty": torch.zeros(0, 4), "empty_mid": torch.zeros(4, 0, 3), "scalar": torch.tensor(5),
        "mask": torch.rand(7, generator=gen) > 0.5, "ids": torch.arange(9, dtype=torch.int64),
        "u16": torch.arange(6).to(torch.uint16), "f8": torch.randn(3, 3, generator=gen).to(torch.float8_e4m3fn),
        "z": torch.randn(2, 2, dtype=torch.complex64, generator=gen), "h": torch.randn(3, generator=gen).half(),
        "list": [torch.ones(2), {"x": torch.zeros(1), "lr": 0.5}],
        "meta": {"0": {"b": b"\x00\xff", "e": b"", "s": {1, 2}, "fs": frozenset([3]), "c": 1 + 2j,
                       "ba": bytearray(b"xy"), "nan": float("nan"), "dt": torch.bfloat16, "sz": torch.Size([2, 3]),
                       "t": (0.9, 0.999), "n": None, "ns": argparse.Namespace(tp=2, dtype=torch.float16)}},
    }
    return save_dcp(state, tmp_path_factory.mktemp("odd") / "ckpt")


@pytest.mark.parametrize("name", FIXTURES)
def test_output_equals_torchs_dcp_to_torch_save_entry_by_entry(name, fixture_ckpt, torch_out, tmp_path):
    out = tmp_path / f"{name}.pt"
    result = run_cli("export-torch", fixture_ckpt(name), out)
    assert result.returncode == 0, result.stderr
    assert_same_state(load(out, argparse.Namespace), load(torch_out(name), argparse.Namespace))
    assert data_pkl(out) == data_pkl(torch_out(name))  # the pickle itself is the one torch writes
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_every_dtype_value_kind_and_nesting_equals_torchs(odd, tmp_path):
    dcp_to_torch_save(odd, tmp_path / "torch.pt")
    result = run_cli("export-torch", odd, tmp_path / "ours.pt", "--verify")
    assert result.returncode == 0, result.stderr
    ours, theirs = load(tmp_path / "ours.pt", *LOAD_SAFE_GLOBALS), load(tmp_path / "torch.pt", *LOAD_SAFE_GLOBALS)
    assert_same_state(ours, theirs)
    assert ours["empty_mid"].stride() == (3, 3, 1) and ours["meta"]["0"]["ns"] == argparse.Namespace(
        tp=2, dtype=torch.float16)
    assert data_pkl(tmp_path / "ours.pt") == data_pkl(tmp_path / "torch.pt")


def test_megatron_args_is_kept_and_exclude_args_gives_a_plain_weights_only_file(fixture_ckpt, torch_out, tmp_path):
    src = fixture_ckpt("megatron_tp2_dp2")
    with pytest.raises(Exception, match="argparse.Namespace"):
        torch.load(torch_out("megatron_tp2_dp2"), weights_only=True)  # torch's own file needs the allowance too
    assert run_cli("export-torch", src, tmp_path / "plain.pt", "--exclude", "args").returncode == 0
    plain = torch.load(tmp_path / "plain.pt", weights_only=True)
    want = load(torch_out("megatron_tp2_dp2"), argparse.Namespace)
    assert want.pop("args").tensor_model_parallel_size == 2
    assert_same_state(plain, want)


def test_dtype_bf16_equals_torchs_output_cast(fixture_ckpt, torch_out, tmp_path):
    result = run_cli("export-torch", fixture_ckpt("fsdp2_4ranks"), tmp_path / "bf16.pt", "--dtype", "bf16")
    assert result.returncode == 0, result.stderr

    def cast(node: object) -> object:
        if isinstance(node, dict):
            return {k: cast(v) for k, v in node.items()}
        if isinstance(node, list):
            return [cast(v) for v in node]
        return node.to(torch.bfloat16) if isinstance(node, torch.Tensor) and node.is_floating_point() else node

    assert_same_state(load(tmp_path / "bf16.pt"), cast(load(torch_out("fsdp2_4ranks"))))


def test_dtype_casts_floating_tensors_only(odd, tmp_path):
    dcp_to_torch_save(odd, tmp_path / "torch.pt")
    assert run_cli("export-torch", odd, tmp_path / "o.pt", "--dtype", "fp16", "--exclude", "meta.*").returncode == 0
    ours, theirs = load(tmp_path / "o.pt"), load(tmp_path / "torch.pt", *LOAD_SAFE_GLOBALS)
    for name in ("w", "special", "empty", "empty_mid", "scalar", "mask", "ids", "u16", "f8", "z", "h"):
        want = theirs[name].to(torch.float16) if theirs[name].is_floating_point() else theirs[name]
        assert ours[name].dtype == want.dtype, name  # bool, integer and complex tensors keep theirs
        torch.testing.assert_close(ours[name], want, rtol=0, atol=0, equal_nan=True)  # NaN bits: canonical, see cast.py


def test_include_and_exclude_keep_the_nesting_of_what_they_select(fixture_ckpt, torch_out, tmp_path):
    src = fixture_ckpt("fsdp2_4ranks")
    want = load(torch_out("fsdp2_4ranks"))
    assert run_cli("export-torch", src, tmp_path / "m.pt", "--include", "model.*").returncode == 0
    assert_same_state(load(tmp_path / "m.pt"), {"model": want["model"]})
    assert run_cli("export-torch", src, tmp_path / "x.pt", "--exclude", "optim.*", "--exclude", "*.bias").returncode == 0
    model = {k: v for k, v in want["model"].items() if not k.endswith(".bias")}
    assert_same_state(load(tmp_path / "x.pt"), {"model": model, "extra": want["extra"]})


def test_flat_optimizer_buffers_stay_flat_as_torch_keeps_them(fixture_ckpt, tmp_path):
    assert run_cli("export-torch", fixture_ckpt("flat_optim"), tmp_path / "f.pt").returncode == 0
    state = load(tmp_path / "f.pt")["optimizer"]["state"]["module.decoder.layers.0.mlp.linear_fc2.weight"]
    assert state["exp_avg"].shape == (30,)  # the param is [5, 6]


def test_include_selecting_nothing_is_an_error_naming_the_pattern(fixture_ckpt, tmp_path):
    result = run_cli("export-torch", fixture_ckpt("fsdp2_4ranks"), tmp_path / "o.pt", "--include", "nothing*")
    assert (result.returncode, result.stderr) == (2, "ckptctl: error: --include 'nothing*' selects none of the 45 entries\n")
    assert list(tmp_path.iterdir()) == []


def test_existing_output_needs_force(fixture_ckpt, tmp_path):
    src, out = fixture_ckpt("flat_optim"), tmp_path / "o.pt"
    out.write_bytes(b"keep me")
    result = run_cli("export-torch", src, out)
    assert (result.returncode, result.stderr) == (2, f"ckptctl: error: {out}: output exists (pass --force to replace it)\n")
    assert out.read_bytes() == b"keep me"
    assert run_cli("export-torch", src, out, "--force").returncode == 0
    assert "iteration" in load(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o.pt"]


def test_output_inside_the_source_or_a_directory_is_refused(fixture_ckpt, tmp_path):
    src = fixture_ckpt("flat_optim")
    result = run_cli("export-torch", src, src / "x.pt")
    assert (result.returncode, result.stderr) == (
        2, f"ckptctl: error: {src / 'x.pt'}: output is inside the source {src}; the source is never modified\n")
    result = run_cli("export-torch", src, tmp_path, "--force")
    assert (result.returncode, result.stderr) == (2, f"ckptctl: error: {tmp_path}: is a directory (export-torch "
                                                     f"writes one file)\n")


class RunsACommand:
    """A value whose pickle calls `os.system`: what a hostile checkpoint would carry."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_values_that_would_run_code_are_refused_by_name_and_never_run(tmp_path):
    marker = tmp_path / "ran"
    src = save_dcp({"w": torch.ones(3), "when": datetime.date(2024, 1, 1), "pair": (torch.ones(2), 1),
                    "hook": RunsACommand(marker)}, tmp_path / "ckpt")
    result = run_cli("export-torch", src, tmp_path / "o.pt")
    assert (result.returncode, result.stderr) == (2, (
        f"ckptctl: error: {src}: 3 non-tensor entries cannot be decoded without running code from the checkpoint: "
        f"when (refuses global datetime.date), pair (holds a tensor), hook (refuses global posix.system); "
        f"leave them out with --exclude 'when' --exclude 'pair' --exclude 'hook'\n"))
    assert not marker.exists() and not (tmp_path / "o.pt").exists()
    result = run_cli("export-torch", src, tmp_path / "o.pt", "--exclude", "when", "--exclude", "pair",
                     "--exclude", "hook")
    assert result.returncode == 0, result.stderr
    assert list(load(tmp_path / "o.pt")) == ["w"] and not marker.exists()


def test_a_plain_export_never_imports_torch(fixture_ckpt, tmp_path):
    from tests.formats.test_torch_free import modules_after

    assert modules_after("export-torch", fixture_ckpt("megatron_tp2_dp2"), tmp_path / "o.pt") == {"code": 0, "torch": []}


def test_json_is_pure_json_and_stderr_stays_empty(fixture_ckpt, tmp_path):
    out = tmp_path / "o.pt"
    result = run_cli("export-torch", fixture_ckpt("fsdp2_4ranks"), out, "--json")
    assert result.returncode == 0 and result.stderr == ""
    doc = json.loads(result.stdout)
    assert (doc["tensors"], doc["values"], doc["bytes"], doc["verified"]) == (32, 13, out.stat().st_size, False)
    assert doc["out"] == str(out) and doc["seconds"] > 0 and doc["peak_rss_bytes"] > 0


@pytest.fixture(scope="module")
def big(tmp_path_factory) -> Path:
    """A 64 MiB tensor (and a small one): far more than a plain export's memory may grow by."""
    gen = torch.Generator().manual_seed(0)
    return save_dcp({"big": torch.randn(4096, 4096, generator=gen), "small": torch.ones(3)},
                    tmp_path_factory.mktemp("big") / "ckpt")


def test_peak_memory_does_not_hold_the_tensor(big, tmp_path):
    result = run_cli("export-torch", big, tmp_path / "o.pt", "--json")
    doc = json.loads(result.stdout)
    assert doc["bytes"] > 64 << 20
    assert doc["peak_rss_bytes"] < 48 << 20  # measured 27 MB: no torch, a 256 KB block per worker
    assert torch.equal(load(tmp_path / "o.pt")["big"], torch.randn(4096, 4096, generator=torch.Generator().manual_seed(0)))


def test_sigkill_mid_run_leaves_no_output_and_the_next_run_cleans_up(big, tmp_path):
    out = tmp_path / "o.pt"
    proc = subprocess.Popen([sys.executable, "-m", "ckptctl", "export-torch", str(big), str(out), "--verify"],
                            cwd=ROOT, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while proc.poll() is None and time.monotonic() < deadline and not any(
            p.name.startswith(".o.pt.ckptctl-tmp-") for p in tmp_path.iterdir()):
        time.sleep(0.001)
    proc.send_signal(signal.SIGKILL)  # the temporary file exists; --verify's torch import keeps the run going
    proc.wait()
    assert proc.returncode == -signal.SIGKILL and not out.exists()
    left = sorted(p.name for p in tmp_path.iterdir())  # the temporary folder and its owner marker beside it
    assert [name.split(f"-{proc.pid}-")[0] for name in left] == [".o.pt.ckptctl-owner", ".o.pt.ckptctl-tmp"]
    assert run_cli("export-torch", big, out, "--no-sync").returncode == 0
    assert [p.name for p in tmp_path.iterdir()] == ["o.pt"]


def test_verify_catches_one_flipped_bit(fixture_ckpt, tmp_path):
    from ckptctl.engine.cpu import ChunkSource
    from ckptctl.util.errors import CheckpointError
    from ckptctl.commands.export_torch import ExportTorchOptions, plan_export_torch, read_values, verify_torch_save
    from ckptctl.formats.dcp.metadata import open_checkpoint

    out = tmp_path / "o.pt"
    assert run_cli("export-torch", fixture_ckpt("fsdp2_4ranks"), out).returncode == 0
    ckpt = open_checkpoint(fixture_ckpt("fsdp2_4ranks"))
    chunks = ChunkSource(ckpt)
    plan = plan_export_torch(ckpt, ExportTorchOptions(), read_values(ckpt, chunks, list(ckpt.bytes_entries)),
                             out.name, "o")
    verify_torch_save(out, out, plan, chunks)
    index = next(i for i, t in enumerate(plan.targets) if t.fqn == "optim.state.mlp.fc1.weight.exp_avg")
    with open(out, "r+b") as fh:
        fh.seek(plan.file.data_offset(index) + 37)
        byte = fh.read(1)[0]
        fh.seek(-1, os.SEEK_CUR)
        fh.write(bytes([byte ^ 0x10]))
    with pytest.raises(CheckpointError, match=r"optim\.state\.mlp\.fc1\.weight\.exp_avg: verification failed"):
        verify_torch_save(out, out, plan, chunks)
    chunks.close()


def test_zip64_archives_load_in_torch(fixture_ckpt, torch_out, tmp_path):
    """Files past 4 GiB need zip64 records; forced here on a small file, torch and zipfile must read it."""
    from ckptctl.engine.cpu import ChunkSource, OutputFiles, execute
    from ckptctl.commands.export_torch import ExportTorchOptions, plan_export_torch, read_values
    from ckptctl.core.plan import planned_batches
    from ckptctl.formats.dcp.metadata import open_checkpoint

    out = tmp_path / "z.pt"
    ckpt = open_checkpoint(fixture_ckpt("megatron_tp2_dp2"))
    chunks = ChunkSource(ckpt)
    values = read_values(ckpt, chunks, list(ckpt.bytes_entries))
    plan = plan_export_torch(ckpt, ExportTorchOptions(), values, out.name, "z", force_zip64=True)
    files = OutputFiles(tmp_path, {out.name: plan.file.size})
    files.write(out.name, plan.file.head, 0)
    for batch in planned_batches(plan.file.items, plan.sources, max_runs=50):  # many small batches
        execute(batch, [], chunks, files, 2, lambda n: None)
    files.write(out.name, plan.file.trailer(), plan.file.trailer_at)
    files.close()
    chunks.close()
    assert out.stat().st_size == plan.file.size
    assert_same_state(load(out, argparse.Namespace), load(torch_out("megatron_tp2_dp2"), argparse.Namespace))


def test_batched_planning_covers_every_record_once(fixture_ckpt):
    from ckptctl.commands.export_torch import ExportTorchOptions, plan_export_torch
    from ckptctl.core.plan import planned_batches
    from ckptctl.formats.dcp.metadata import open_checkpoint

    ckpt = open_checkpoint(fixture_ckpt("megatron_tp2_dp2"))
    plan = plan_export_torch(ckpt, ExportTorchOptions(), {}, "o.pt", "o")
    whole = next(planned_batches(plan.file.items, plan.sources, max_runs=1 << 30))
    batches = list(planned_batches(plan.file.items, plan.sources, max_runs=20))
    assert len(batches) > 5 and [i for b in batches for i in b] == whole
    assert all(sum(len(r.runs) for i in b[:-1] for r in i.reads) < 20 for b in batches)


@pytest.mark.parametrize("path, planner_data", [
    ("opt.groups.0.lr", ("opt", "groups", 0, "lr")),
    ("opt.groups.2.lr", ("opt", "groups", 2, "lr")),  # a list with holes, padded with None as torch pads it
    ("flat.name", None),
    ("t.1", ("t", 1)),
])
def test_nesting_follows_torchs_set_element(path, planner_data):
    from ckptctl.formats.torch_save.writer import nest

    entries = [("opt.groups.1.params", ("opt", "groups", 1, "params")), ("x", ("x",)), (path, planner_data)]
    data = {fqn: p for fqn, p in entries if p is not None}
    want: dict = {}
    for fqn, _ in entries:
        if fqn in data:
            set_element(want, data[fqn], fqn)
        else:
            want[fqn] = fqn
    assert nest([(fqn, fqn) for fqn, _ in entries], data, 10, "ckpt") == want


@pytest.mark.parametrize("planner_data, reason", [
    ({"a": ("a", 10**9)}, "planner_data path of a is malformed"),
    ({"a": ("a", "b"), "c": ("a", "b", "c")}, "planner_data puts c inside another entry"),
    ({"a": ("a", 0), "c": ("a", "x")}, "planner_data indexes a list with 'x' on the way to c"),
    ({"a": ("a", "b"), "c": ("a", "b")}, "planner_data puts c where another entry is"),
    ({"a": ("a", 1.5)}, "planner_data path of a is malformed"),
])
def test_hostile_planner_data_is_refused(planner_data, reason):
    from ckptctl.util.errors import CheckpointError
    from ckptctl.formats.torch_save.writer import nest

    with pytest.raises(CheckpointError, match=re.escape(reason)):
        nest([(fqn, fqn) for fqn in planner_data], planner_data, 10, "ckpt")


def test_at_a_terminal_a_writing_bar_then_the_final_line(fixture_ckpt, tmp_path):
    run = run_in_terminal("export-torch", fixture_ckpt("fsdp2_4ranks"), tmp_path / "o.pt", "--verify", columns=250)
    assert run.returncode == 0
    assert_no_traceback(run.plain)
    screen = run.screen.splitlines()
    assert len([line for line in screen if line.startswith("writing")]) == 1
    assert len([line for line in screen if line.startswith("verifying")]) == 1
    assert re.fullmatch(rf"wrote \S+/o\.pt \(32 tensors, 13 other entries, 11\.7 kB\) in \d+\.\d\ds \(writing "
                        rf"{RATE}, verifying \d+\.\d\ds\), peak RSS \d+\.\d MB, verified", screen[-1]), screen[-1]


def test_in_a_pipe_one_summary_line_on_stderr(fixture_ckpt, tmp_path):
    result = run_cli("export-torch", fixture_ckpt("flat_optim"), tmp_path / "o.pt")
    assert result.returncode == 0 and result.stdout == ""
    assert re.fullmatch(rf"wrote {re.escape(str(tmp_path / 'o.pt'))} \(16 tensors, 1 other entry, 5\.\d kB\) in "
                        rf"\d+\.\d\ds \(writing {RATE}\), peak RSS \d+\.\d MB\n", result.stderr), result.stderr


def _small_file_limit() -> None:
    import resource

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))


def test_a_full_disk_fails_with_one_line_naming_the_output_and_leaves_nothing(fixture_ckpt, tmp_path):
    out = tmp_path / "o.pt"
    result = subprocess.run([sys.executable, "-m", "ckptctl", "export-torch", str(fixture_ckpt("fsdp2_4ranks")),
                             str(out)], capture_output=True, text=True, cwd=ROOT, preexec_fn=_small_file_limit)
    assert (result.returncode, result.stderr) == (2, f"ckptctl: error: {out}: cannot write: File too large\n")
    assert list(tmp_path.iterdir()) == []


def torch_save_archive(pickled: bytes, compress: int = zipfile.ZIP_STORED) -> bytes:
    """A `torch.save`-shaped archive around hand-written pickle bytes (what a hostile file may hold)."""
    import io

    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=compress) as archive:
        archive.writestr("archive/data.pkl", pickled)
    return buf.getvalue()


@pytest.mark.parametrize("pickled, compress, reason", [
    (b"\x80\x02cposix\nsystem\nX\x04\x00\x00\x00trueq\x00\x85R.", zipfile.ZIP_STORED, "refuses global posix.system"),
    (b"\x80\x02ctorch\nfloat32\n}X\x08\x00\x00\x00itemsizeK\x01sb.", zipfile.ZIP_STORED,
     "refuses to set the state of a DType"),  # would corrupt ckptctl's shared dtype table
    (b"\x80\x02c__builtin__\nbytes\nJ\x00\x00\x00@\x85R.", zipfile.ZIP_STORED,
     "refuses builtins.bytes with arguments"),  # bytes(2**30): a gigabyte on the pickle's say-so
    (b"\x80\x02K\x01.", zipfile.ZIP_DEFLATED, "not a torch.save archive"),
    (b"\x80\x02X\x10\x00\x00\x00ab.", zipfile.ZIP_STORED,
     "corrupt pickle: pickle data truncated (needs 16 bytes, 3 left)"),  # truncated
])
def test_hostile_values_are_refused_without_running_anything(pickled, compress, reason):
    from ckptctl.core.dtypes import DTYPES
    from ckptctl.formats.torch_save.writer import decode_value
    from ckptctl.formats.pickle.unpickle import UnsafePickleError

    with pytest.raises(UnsafePickleError, match=re.escape(reason)):
        decode_value(torch_save_archive(pickled, compress))
    assert DTYPES["float32"].itemsize == 4
