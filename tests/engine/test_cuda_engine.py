"""The CUDA engine executes the same plans as the CPU engine and writes the same bytes.

Without a GPU only `--device` resolution and the NaN bit-pattern rules run (on the CPU);
everything marked `cuda` runs where torch sees a CUDA device.
"""

from __future__ import annotations

import contextlib
import dataclasses
import filecmp
import importlib
import json
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ckptctl.cli import main as cli_main
from ckptctl.engine import cpu, cuda, executor, resolve_device
from ckptctl.engine.cast import add_into, canonical_nan_bits, cast_into
from ckptctl.engine.dist import launch_local
from ckptctl.util.errors import UsageError
from ckptctl.formats.dcp.metadata import open_checkpoint
from ckptctl.core.plan import planned_batches
from ckptctl.commands.reshard import ReshardOptions, plan_reshard, reshard
from fixtures.make_fixtures import zstd_available

HAS_CUDA = torch.cuda.is_available()

F32_NANS = [0x7FC00000, 0xFFC00000, 0x7F800001, 0x7FA12345, 0xFFB00001, 0x7FFFFFFF]


def f32_from_bits(bits: list[int]) -> torch.Tensor:
    return torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32)


def bits(t: torch.Tensor) -> list[int]:
    mask = (1 << (8 * t.dtype.itemsize)) - 1
    return [v & mask for v in t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.dtype.itemsize]).tolist()]


def same_files(a: Path, b: Path) -> None:
    names = sorted(p.name for p in a.iterdir())
    assert sorted(p.name for p in b.iterdir()) == names
    match, mismatch, errors = filecmp.cmpfiles(a, b, names, shallow=False)
    assert (mismatch, errors) == ([], []), mismatch


# ---------------------------------------------------------------- without a GPU


@pytest.mark.skipif(HAS_CUDA, reason="checks the machine without CUDA")
def test_auto_is_the_cpu_engine_without_cuda():
    assert resolve_device("auto") == "cpu"
    assert executor("auto") is cpu.execute and executor("cpu") is cpu.execute


@pytest.mark.skipif(HAS_CUDA, reason="checks the machine without CUDA")
def test_device_cuda_without_cuda_fails_in_one_line_before_writing(fixture_ckpt, tmp_path, capsys):
    dst = tmp_path / "out"
    with pytest.raises(SystemExit) as exc:
        cli_main(["reshard", str(fixture_ckpt("fsdp2_4ranks")), str(dst), "-n", "2", "--device", "cuda"])
    assert exc.value.code == 2
    assert capsys.readouterr().err == "ckptctl: error: --device cuda: torch sees no CUDA device (use --device cpu or auto)\n"
    assert not dst.exists()


def test_unknown_device_is_a_usage_error():
    with pytest.raises(UsageError, match="--device must be one of auto, cpu, cuda"):
        resolve_device("tpu")


@pytest.mark.parametrize("n", [1, 7, 33, 100, 70001])
@pytest.mark.parametrize("src_dtype,dtype", [(torch.float32, torch.bfloat16), (torch.float32, torch.float16),
                                             (torch.bfloat16, torch.float16), (torch.float16, torch.float32),
                                             (torch.float32, torch.float64)])
def test_cast_nans_are_canonical_whatever_the_run_length(n, src_dtype, dtype):
    """torch's own CPU casts give NaNs bits that depend on lane vs tail; both engines write one pattern."""
    x = f32_from_bits(F32_NANS * (n // len(F32_NANS) + 1))[:n].clone()
    x[3::5] = torch.linspace(-3, 3, len(x[3::5]))
    src = x.to(src_dtype)
    out = torch.empty(n, dtype=dtype)
    cast_into(out, src)
    nan = torch.isnan(src)
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[dtype.itemsize]
    want = torch.where(torch.signbit(src[nan]), canonical_nan_bits(dtype, True), canonical_nan_bits(dtype, False))
    assert nan.sum() > 0 and torch.equal(out[nan].view(ints), want.to(ints))
    assert torch.equal(out[~nan], src[~nan].to(dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_added_nans_are_canonical_and_keep_their_sign(dtype):
    x = f32_from_bits(F32_NANS + [0x3F800000, 0xBF800000]).to(dtype)
    out = x.clone()
    add_into(out, 1.0)
    assert bits(out[:6]) == [canonical_nan_bits(dtype, neg) & ((1 << (8 * dtype.itemsize)) - 1)
                             for neg in torch.signbit(x[:6]).tolist()]
    assert out[6:].tolist() == [2.0, 0.0]


def test_copies_without_a_cast_keep_nan_payloads():
    x = f32_from_bits(F32_NANS)
    out = torch.empty_like(x)
    cast_into(out, x)
    assert bits(out) == F32_NANS


# ---------------------------------------------------------------- the pipeline, on a host stand-in or a GPU


class _DoneEvent:
    def record(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass


class HostRuntime:
    """Stands in for CUDA so the pipeline (spans, slots, pipelined writes, running CRC) runs on any machine."""

    def stream(self, device):
        return None

    def event(self):
        return _DoneEvent()

    def use_stream(self, stream):
        return contextlib.nullcontext()

    def use_device(self, device):
        return contextlib.nullcontext()

    def pinned(self, nbytes):
        return torch.empty(nbytes, dtype=torch.uint8)


@pytest.fixture
def device(request, monkeypatch) -> str:
    """`cuda` on a GPU machine; elsewhere the CUDA engine on the host stand-in."""
    if HAS_CUDA:
        return "cuda"
    monkeypatch.setattr(cuda, "RUNTIME", HostRuntime())
    monkeypatch.setattr(cuda, "default_device", lambda local_rank=0: torch.device("cpu"))
    monkeypatch.setattr("ckptctl.engine.output.executor",
                        lambda dev, rank=0: cpu.execute if dev == "cpu" else cuda.execute)
    monkeypatch.setattr(importlib.import_module("ckptctl.commands.dcp_write"), "resolve_device", lambda dev: dev)
    return "cuda"


def special_values(n: int, seed: int, bound: float = 65504) -> torch.Tensor:
    """fp32 values that exercise rounding: NaN payloads, ±inf, subnormals, float16's largest finite
    value, halfway ties. Finite values stay within `bound` (float16's range; a bfloat16 tensor's
    bound is lower, as bfloat16 rounds 65504 up to 65536): a cast that would overflow a finite
    value to inf is refused (tests/commands/test_red_team_dtype.py), not written."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.logspace(-45, 38, n).pow(torch.rand(n, generator=g))
    finite = torch.isfinite(x)
    x[finite] = x[finite].clamp(-bound, bound)
    tricky = f32_from_bits(F32_NANS + [0x7F800000, 0xFF800000, 0x00000001, 0x80000001, 0x3F808000, 0x3F818000,
                                       0x477FE000, 0x477FD000, 0x33000000])
    tricky = tricky[~torch.isfinite(tricky) | (tricky.abs() <= bound)]
    x[: len(tricky)] = tricky
    return x[torch.randperm(n, generator=g)]


@pytest.fixture(scope="module")
def special_ckpt(tmp_path_factory) -> Path:
    """A single-file checkpoint (dcp.save without a process group) of awkward values in several dtypes."""
    path = tmp_path_factory.mktemp("special") / "ckpt"
    x = special_values(37 * 29, 0).reshape(37, 29)
    sd = {
        "model": {
            "w": x,
            "w_bf16": special_values(23 * 31, 1, bound=65280).reshape(23, 31).to(torch.bfloat16),
            "w_fp16": special_values(41 * 7, 2).reshape(41, 7).to(torch.float16),
            "col": special_values(64 * 5, 3).reshape(64, 5)[:, 1:4],  # a strided view: saved dense
            "ids": torch.arange(50, dtype=torch.int64).reshape(10, 5),
            "mask": torch.arange(12).reshape(4, 3) % 3 == 0,
            "scalar": torch.tensor(float("nan")),
        },
        "step": 3,
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "assuming the intent is to save in a single process"
        dcp.save(sd, checkpoint_id=path, no_dist=True)
    return path


def run_engine(ckpt: Path, world_size: int, dtype, device: str, dst: Path, **kw) -> Path:
    reshard(ckpt, dst, ReshardOptions(world_size=world_size, dtype=dtype, device=device, allow_incomplete=True, **kw))
    return dst


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("name", ["fsdp2_4ranks", "flat_optim", "megatron_tp2_dp2", "zstd"])
@pytest.mark.parametrize("dtype", [None, torch.bfloat16, torch.float16])
def test_cuda_reshard_is_byte_identical_to_cpu(fixture_ckpt, tmp_path, name, dtype):
    if name == "zstd" and not zstd_available():
        pytest.skip("ZStandard stream transform unavailable")
    src = fixture_ckpt(name)
    a = run_engine(src, 3, dtype, "cpu", tmp_path / "cpu")
    b = run_engine(src, 3, dtype, "cuda", tmp_path / "cuda")
    same_files(a, b)


@pytest.mark.parametrize("dtype", [None, torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("block,workers", [(None, 1), (96, 1), (200, 3)])
def test_cuda_casts_and_multi_block_pipelines_match_cpu(special_ckpt, tmp_path, monkeypatch, device, dtype, block,
                                                         workers):
    a = run_engine(special_ckpt, 3, dtype, "cpu", tmp_path / "cpu")
    if block is not None:  # many blocks per record: both slots, the pipelined writes and the running CRC
        monkeypatch.setattr(cuda, "BLOCK_BYTES", block)
    b = run_engine(special_ckpt, 3, dtype, device, tmp_path / "cuda", workers=workers)
    same_files(a, b)
    assert open_checkpoint(b).tensors.keys() == open_checkpoint(a).tensors.keys()


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_cuda_add_matches_cpu(special_ckpt, tmp_path, device, dtype):
    """A target's `add` (HF's GDN norm = gamma + 1) on the device gives the CPU's bytes, NaNs included."""
    ckpt = open_checkpoint(special_ckpt)
    out = plan_reshard(ckpt, ReshardOptions(world_size=2, dtype=dtype))
    planned = [i for batch in planned_batches(out.records.in_files(out.files), out.sources) for i in batch]
    items = [dataclasses.replace(i, target=dataclasses.replace(i.target, add=1.0))
             if i.target.dtype.is_floating_point else i for i in planned]
    for name, run in (("cpu", cpu.execute), ("cuda", cuda.execute)):
        (tmp_path / name).mkdir()
        sources = cpu.ChunkSource(ckpt)
        files = cpu.OutputFiles(tmp_path / name, out.files)
        try:
            run(items, out.copy_items, sources, files, 2, lambda n: None)
        finally:
            files.close()
            sources.close()
    same_files(tmp_path / "cpu", tmp_path / "cuda")


def test_identity_blocks_on_host_match_too(special_ckpt, tmp_path, monkeypatch, device):
    a = run_engine(special_ckpt, 3, torch.bfloat16, "cpu", tmp_path / "cpu")
    monkeypatch.setattr("ckptctl.engine.output.executor", lambda device, rank=0: lambda *a, **k: cuda.execute(
        *a, **k, identity_on_gpu=False))
    b = run_engine(special_ckpt, 3, torch.bfloat16, device, tmp_path / "cuda")
    same_files(a, b)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_torchrun_workers_on_cuda_match_a_single_cpu_run(fixture_ckpt, tmp_path):
    a = run_engine(fixture_ckpt("fsdp2_4ranks"), 5, torch.bfloat16, "cpu", tmp_path / "cpu")
    dst = tmp_path / "cuda"
    result = launch_local(2, ["reshard", fixture_ckpt("fsdp2_4ranks"), dst, "-n", "5", "--dtype", "bf16",
                              "--device", "cuda", "--json"], timeout=180)
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["device"] == "cuda" and doc["processes"] == 2
    same_files(a, dst)



def test_uncovered_elements_are_zero_in_both_engines(fixture_ckpt, tmp_path, monkeypatch, device):
    """With --allow-incomplete a gap is written as zeros, never as a previous block's bytes."""
    import pickle
    import shutil

    from ckptctl.formats.dcp.items import ItemReader

    src = tmp_path / "src"
    shutil.copytree(fixture_ckpt("fsdp2_4ranks"), src)
    with open(src / ".metadata", "rb") as fh:
        md = pickle.load(fh)
    fqn = "model.mlp.fc1.weight"
    chunks = md.state_dict_metadata[fqn].chunks
    del chunks[1]  # rows 3..5
    md.storage_data = {k: v for k, v in md.storage_data.items() if not (k.fqn == fqn and list(k.offset) == [3, 0])}
    with open(src / ".metadata", "wb") as fh:
        pickle.dump(md, fh)
    monkeypatch.setattr(cpu, "BLOCK_BYTES", 64)  # two rows per block
    monkeypatch.setattr(cuda, "BLOCK_BYTES", 64)
    a = run_engine(src, 1, None, "cpu", tmp_path / "cpu")
    b = run_engine(src, 1, None, device, tmp_path / "cuda")
    same_files(a, b)
    original = open_checkpoint(fixture_ckpt("fsdp2_4ranks"))
    written = open_checkpoint(a)
    with ItemReader(original) as ro, ItemReader(written) as rw:
        want = torch.cat([ro.read_chunk(original.tensors[fqn], c) for c in original.tensors[fqn].chunks])
        got = rw.read_chunk(written.tensors[fqn], written.tensors[fqn].chunks[0])
    want[3:6] = 0
    assert torch.equal(got, want)
