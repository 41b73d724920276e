"""The check every output passes before it takes its name (`output_check`), run by default.

Each case writes a real output, damages it as a faulty writer or a faulty source read would,
and asserts the exact line the check refuses it with; and a run whose copy reads the wrong
bytes exits with that line and leaves no output.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

import ckptctl
from ckptctl.util.errors import CheckpointError
from ckptctl.engine.cpu import ChunkSource
from ckptctl.commands.export_hf import ExportOptions, plan_export
from ckptctl.commands.export_torch import ExportTorchOptions, archive_name, plan_export_torch, read_values
from ckptctl.formats.dcp.metadata import open_checkpoint
from ckptctl.families.base import load_hf_config
from ckptctl.checks.output_check import DcpCheck, check_dcp, check_safetensors, check_tiling, check_torch_save
from ckptctl.commands.reshard import ReshardOptions, plan_reshard
from tests.conftest import FIXTURES, run_cli

SRC = FIXTURES / "fsdp2_4ranks"


def _flip(path: Path, at: int) -> None:
    with open(path, "r+b") as handle:
        handle.seek(at)
        byte = handle.read(1)
        handle.seek(at)
        handle.write(bytes([byte[0] ^ 0x01]))


@pytest.fixture
def resharded(tmp_path: Path):
    """The fixture resharded to 3 ranks, the plan it was written from, and its source."""
    src = open_checkpoint(SRC)
    out = plan_reshard(src, ReshardOptions(world_size=3))
    dst = tmp_path / "out"
    assert run_cli("reshard", SRC, dst, "-n", 3, "--no-sync").returncode == 0
    return src, out, dst


def _first_element_byte(dst: Path, fqn: str) -> tuple[str, int]:
    """Where the output's first element of `fqn` lies, as the project's reader finds it."""
    ckpt = open_checkpoint(dst)
    entry = ckpt.tensors[fqn]
    chunk = entry.chunks[0]
    sources = ChunkSource(ckpt)
    try:
        return chunk.file, sources.reader.locate(entry, chunk).byte_offset
    finally:
        sources.close()


def test_a_written_reshard_passes(resharded) -> None:
    check_dcp(*resharded)


def test_a_wrong_element_is_named_with_its_file(resharded) -> None:
    src, out, dst = resharded
    file, at = _first_element_byte(dst, "model.mlp.fc1.weight")
    _flip(dst / file, at)
    with pytest.raises(CheckpointError) as caught:
        check_dcp(src, out, dst)
    assert str(caught.value) == f"{dst / file}: model.mlp.fc1.weight: element [0, 0] of [12, 8] differs from the source's"


def test_a_shard_written_at_another_shards_place_is_named(tmp_path: Path) -> None:
    """Two middle shards of a tensor exchanged (records written at each other's places): a
    well-formed output whose ends are right, caught at the first element of each output chunk."""
    src = open_checkpoint(SRC)
    out = plan_reshard(src, ReshardOptions(world_size=6))
    dst = tmp_path / "out"
    assert run_cli("reshard", SRC, dst, "-n", 6, "--no-sync").returncode == 0
    entry = open_checkpoint(dst).tensors["model.mlp.fc1.weight"]  # 12 rows: 2 a rank
    first, second = entry.chunks[2], entry.chunks[3]
    assert first.length == second.length and first.file != second.file
    a = (dst / first.file).read_bytes()[first.offset:first.offset + first.length]
    b = (dst / second.file).read_bytes()[second.offset:second.offset + second.length]
    for chunk, data in ((first, b), (second, a)):
        with open(dst / chunk.file, "r+b") as handle:
            handle.seek(chunk.offset)
            handle.write(data)
    with pytest.raises(CheckpointError) as caught:
        check_dcp(src, out, dst)
    assert str(caught.value) == f"{dst / first.file}: model.mlp.fc1.weight: element [4, 0] of [12, 8] differs from " \
                                "the source's"


def test_source_samples_read_ahead_in_a_thread_are_compared_the_same(resharded) -> None:
    """A run starts the check's source reads while it writes: the samples it took then are what
    the written output is compared with, and a wrong element is named as without the thread."""
    src, out, dst = resharded
    check = DcpCheck(src, out)
    check.start()
    check._thread.join()
    assert len(check._wants) == len(check.samples) > 2 * len(out.targets)
    file, at = _first_element_byte(dst, "model.mlp.fc1.weight")
    _flip(dst / file, at)
    with pytest.raises(CheckpointError) as caught:
        check(dst)
    assert str(caught.value) == f"{dst / file}: model.mlp.fc1.weight: element [0, 0] of [12, 8] differs from the source's"
    assert check._closed


def test_a_source_item_the_thread_cannot_read_fails_the_check(resharded, tmp_path: Path) -> None:
    """The thread's error is the check's: raised when the run calls it, naming the source item."""
    _, out, dst = resharded
    broken = tmp_path / "src"
    shutil.copytree(SRC, broken)
    with open(broken / "__0_0.distcp", "r+b") as handle:
        handle.write(b"XX")  # the first item's local header signature
    check = DcpCheck(open_checkpoint(broken), out)
    check.start()
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp: item at byte 0: .*: cannot be read back"):
        check(dst)


def test_closing_a_started_check_does_not_wait_for_its_thread(resharded) -> None:
    """A run stopped while writing (Ctrl-C, an error) closes the check at once: the thread stops
    at its next sample and closes the source files itself."""
    src, out, _ = resharded
    check = DcpCheck(src, out)
    check.start()
    check.close()
    check._thread.join(5)
    assert not check._thread.is_alive() and check._closed and not check._source._handles


def test_a_truncated_file_is_refused_by_the_reader(resharded) -> None:
    src, out, dst = resharded
    size = (dst / "__2_0.distcp").stat().st_size
    os.truncate(dst / "__2_0.distcp", size - 1)
    with pytest.raises(CheckpointError, match=r"__2_0\.distcp: file is \d+ bytes but .* needs bytes \d+\.\.\d+ "
                                              r"\(truncated\?\)$"):
        check_dcp(src, out, dst)


def test_bytes_past_the_last_entry_are_refused(resharded) -> None:
    src, out, dst = resharded
    size = (dst / "__1_0.distcp").stat().st_size
    with open(dst / "__1_0.distcp", "ab") as handle:
        handle.write(b"\0" * 8)
    with pytest.raises(CheckpointError) as caught:
        check_dcp(src, out, dst)
    assert str(caught.value) == f"{dst / '__1_0.distcp'}: is {size + 8} bytes but its entries end at byte {size}"


def test_a_file_no_entry_names_is_refused(resharded) -> None:
    src, out, dst = resharded
    shutil.copyfile(dst / "__0_0.distcp", dst / "__7_0.distcp")
    with pytest.raises(CheckpointError) as caught:
        check_dcp(src, out, dst)
    assert str(caught.value) == f"{dst / '__7_0.distcp'}: no entry lies in it"


def test_entries_that_overlap_or_leave_a_gap_are_named() -> None:
    folder = Path("/out")
    with pytest.raises(CheckpointError) as caught:
        check_tiling(folder, {"f": 30}, {"f": [(0, 10, "a"), (8, 30, "b")]})
    assert str(caught.value) == "/out/f: b at bytes 8..30 overlaps the entry before it"
    with pytest.raises(CheckpointError) as caught:
        check_tiling(folder, {"f": 30}, {"f": [(0, 10, "a"), (12, 30, "b")]})
    assert str(caught.value) == "/out/f: b at bytes 12..30 leaves bytes 10..12 unused"


def test_a_copy_that_reads_the_wrong_bytes_exits_2_and_leaves_no_output(tmp_path: Path, monkeypatch) -> None:
    """As a SAFETENSORS-format source read at its blob's start did: well-formed files of wrong bytes."""
    real = ChunkSource.read_into

    def reversed_bytes(self, fqn, chunk, byte_start, out):
        real(self, fqn, chunk, byte_start, out)
        if fqn == "model.mlp.fc1.bias":
            out[:] = bytes(out)[::-1]

    monkeypatch.setattr(ChunkSource, "read_into", reversed_bytes)
    dst = tmp_path / "out"
    with pytest.raises(CheckpointError) as caught:
        ckptctl.reshard(SRC, dst, ReshardOptions(world_size=2, sync=False))
    assert str(caught.value) == f"{dst / '__0_0.distcp'}: model.mlp.fc1.bias: element [0] of [12] differs from the source's"
    assert sorted(os.listdir(tmp_path)) == []


def test_an_export_whose_element_or_index_is_wrong_is_refused(tmp_path: Path) -> None:
    config = tmp_path / "config.json"
    config.write_text('{"model_type": "fsdp2-fixture"}')
    dst = tmp_path / "hf"
    assert run_cli("export-hf", SRC, dst, "--hf-config", config, "--arch", "raw", "--no-name-check",
                   "--no-sync").returncode == 0
    src = open_checkpoint(SRC)
    plan = plan_export(src, load_hf_config(config), ExportOptions(arch="raw", name_check=False))
    files = {f.name: [plan.targets[n] for n in plan.file_targets[f.name]] for f in plan.files}
    check_safetensors(src, dst, files, plan.sources, plan.weight_map, "model.safetensors.index.json")
    (name,) = files
    header = json.loads((dst / name).read_bytes()[8:8 + int.from_bytes((dst / name).read_bytes()[:8], "little")])
    data = 8 + int.from_bytes((dst / name).read_bytes()[:8], "little")
    end = data + header["mlp.fc2.weight"]["data_offsets"][1]
    _flip(dst / name, end - 1)
    with pytest.raises(CheckpointError) as caught:
        check_safetensors(src, dst, files, plan.sources, plan.weight_map, "model.safetensors.index.json")
    assert str(caught.value) == f"{dst / name}: mlp.fc2.weight: element [7, 11] of [8, 12] differs from the source's"
    _flip(dst / name, end - 1)
    with pytest.raises(CheckpointError) as caught:
        check_safetensors(src, dst, files, plan.sources, {"embed.weight": "other.safetensors"},
                          "model.safetensors.index.json")
    assert str(caught.value).startswith(f"{dst / 'model.safetensors.index.json'}: cannot be read back")


def test_a_torch_save_export_whose_record_or_directory_is_wrong_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "out.pt"
    assert run_cli("export-torch", SRC, out, "--no-sync").returncode == 0
    src = open_checkpoint(SRC)
    chunks = ChunkSource(src)
    try:
        values = read_values(src, chunks, list(src.bytes_entries))
    finally:
        chunks.close()
    plan = plan_export_torch(src, ExportTorchOptions(), values, out.name, archive_name(out))
    records = {f"{plan.file.archive}/data/{i}": t for i, t in enumerate(plan.targets)}
    check_torch_save(src, out, out, records, plan.sources)
    at = plan.file.data_offset(0)
    _flip(out, at)
    first = plan.targets[0]
    with pytest.raises(CheckpointError) as caught:
        check_torch_save(src, out, out, records, plan.sources)
    zeros = [0] * len(first.shape)
    assert str(caught.value) == f"{out}: {first.fqn}: element {zeros} of {list(first.shape)} differs from the source's"
    _flip(out, at)
    os.truncate(out, out.stat().st_size - 3)
    with pytest.raises(CheckpointError, match=rf"^{out}: cannot be read back \("):
        check_torch_save(src, out, out, records, plan.sources)


def test_an_output_element_is_read_at_its_row_major_place_in_the_chunk_that_holds_it(tmp_path: Path) -> None:
    """The check reads an output sample from the chunk the re-read `.metadata` says holds it, at
    its row-major place there: every element of every chunk of a 3-rank reshard reads as torch's
    own `dcp.load` of the output reads it."""
    import torch
    import torch.distributed.checkpoint as dcp

    from ckptctl.checks.output_check import _written_element

    ckptctl.reshard(SRC, tmp_path / "out", ReshardOptions(world_size=3, sync=False))
    out = open_checkpoint(tmp_path / "out")
    loaded = {fqn: torch.empty(e.shape, dtype=e.dtype.torch) for fqn, e in out.tensors.items()}
    dcp.load(loaded, checkpoint_id=tmp_path / "out", no_dist=True)
    output = ChunkSource(out)
    compared = 0
    try:
        for fqn, entry in out.tensors.items():
            for chunk in entry.chunks:
                for point in torch.cartesian_prod(*(torch.arange(o, o + n) for o, n in zip(chunk.offsets, chunk.sizes))
                                                  ).reshape(-1, len(chunk.sizes)).tolist() if chunk.sizes else [[]]:
                    want = loaded[fqn][tuple(point)].reshape(1).view(torch.uint8).numpy().tobytes()
                    assert _written_element(output, entry, chunk, tuple(point)) == want, (fqn, point)
                    compared += 1
    finally:
        output.close()
    assert compared == sum(e.numel for e in out.tensors.values())
