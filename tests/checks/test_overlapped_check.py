"""The output check split across a run with a helper process: the helper re-reads `.metadata` and
checks its structure while the run writes the data files; the run then compares the files on
disk with the planned ones and reads the samples where the re-read `.metadata` places them.

Each case damages the output while it is written — a `.metadata` that misplaces entries, a data
file cut after the helper's check — and asserts the exact line it is refused with, and no output.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import os
import pickle
import shutil
from array import array
from pathlib import Path

import pytest

from ckptctl.checks.output_check import DcpCheck, _ends, located_ends
from ckptctl.commands.reshard import ReshardOptions, plan_reshard
from ckptctl.engine.cpu import ChunkSource
from ckptctl.engine.output import write_output
from ckptctl.formats.dcp.metadata import open_checkpoint
from ckptctl.formats.dcp.writer import DcpOutput, write_metadata
from ckptctl.util.errors import CheckpointError
from ckptctl.util.progress import Phases
from tests.conftest import FIXTURES

SRC = FIXTURES / "fsdp2_4ranks"


def _misplaced(out: DcpOutput, moves: dict[int, int]) -> DcpOutput:
    """`out` whose records `moves` names are placed elsewhere (record index → its new offset): what a
    faulty `.metadata` writer would record, the data files written as planned."""
    records = copy.copy(out.records)
    records._offsets = array("q", out.records._offsets)
    for index, offset in moves.items():
        records._offsets[index] = offset
    return dataclasses.replace(out, records=records)


def _write(src_path: Path, out: DcpOutput, dst: Path, metadata_of: DcpOutput | None = None,
           before_check=None, checked_against: Path | None = None) -> tuple[list[int], DcpCheck]:
    """Write `out` as a run with a helper does (its `.metadata` from `metadata_of`, default `out`;
    the check reading its source samples from `checked_against`, default the source),
    `before_check(tmp)` run before the check; returns how many arguments each check call got, and
    the check."""
    src = open_checkpoint(src_path)
    check, calls = DcpCheck(open_checkpoint(checked_against) if checked_against else src, out), []

    def checked(tmp: Path, *found: object) -> None:
        calls.append(len(found))
        if before_check is not None:
            before_check(tmp)
        check(tmp, *found)

    plan = dataclasses.replace(out.output_plan(), finish=functools.partial(write_metadata, metadata_of or out))
    sources = ChunkSource(src)
    try:
        write_output(plan, dst, sources, Phases(), device="cpu", workers=1, force=False, sync=False, check=checked,
                     overlapped=check)
    finally:
        check.close()
        sources.close()
    return calls, check


def test_a_run_with_a_helper_checks_the_structure_early_and_passes(tmp_path: Path, forks) -> None:
    out = plan_reshard(open_checkpoint(SRC), ReshardOptions(world_size=3))
    calls, check = _write(SRC, out, tmp_path / "out")
    assert len(forks) == 1 and calls == [2]  # the check got the helper's early result, and what each process compared
    assert check._thread is None and len(check._found.wants) == len(check.samples)  # the source read by the helper
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp",
                                                                   "__2_0.distcp"]


def test_a_storage_entry_misplaced_in_metadata_is_refused_by_the_helpers_check(tmp_path: Path, forks) -> None:
    out = plan_reshard(open_checkpoint(SRC), ReshardOptions(world_size=3))
    records = list(out.records.placed_records())
    in_file = sorted((r[4], i) for i, r in enumerate(records) if r[3] == "__1_0.distcp")  # by place
    (offset, index), (end, _) = in_file[1], in_file[2]
    target, file = records[index][0], records[index][3]
    with pytest.raises(CheckpointError) as caught:
        _write(SRC, out, tmp_path / "out", metadata_of=_misplaced(out, {index: offset + 1}))
    assert Path(caught.value.path).name == file and Path(caught.value.path).parent.parent == tmp_path
    assert caught.value.reason == f"{target.fqn} at bytes {offset + 1}..{end + 1} leaves bytes {offset}..{offset + 1} " \
                                  "unused"
    assert len(forks) == 1 and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("file", ["__0_0.distcp", "__1_0.distcp"])  # the run's file, the helper's
def test_samples_are_read_where_the_reread_metadata_places_them(tmp_path: Path, forks, file: str) -> None:
    """The middle chunks of two tensors of one dtype and shape at each other's places in `.metadata`:
    a structure without fault, caught because the process that wrote the file reads each sample at
    the place the helper read back, not at the one the plan gave its writer."""
    out = plan_reshard(open_checkpoint(SRC), ReshardOptions(world_size=3))
    records = list(out.records.placed_records())
    first, second = next((i, j) for i in range(len(records)) for j in range(i + 1, len(records))
                         if records[i][3] == records[j][3] == file and records[i][0] is not records[j][0]
                         and records[i][0].dtype == records[j][0].dtype
                         and records[i][2].box.sizes == records[j][2].box.sizes)
    target, _, placed, file, _ = records[first]
    with pytest.raises(CheckpointError) as caught:
        _write(SRC, out, tmp_path / "out", metadata_of=_misplaced(out, {first: records[second][4],
                                                                        second: records[first][4]}))
    assert Path(caught.value.path).name == file and Path(caught.value.path).parent.parent == tmp_path
    assert caught.value.reason == f"{target.fqn}: element {list(placed.box.offsets)} of {list(target.shape)} " \
                                  "differs from the source's"
    assert len(forks) == 1 and list(tmp_path.iterdir()) == []


def test_a_data_file_cut_after_the_helpers_check_is_refused_naming_its_entry(tmp_path: Path, forks) -> None:
    out = plan_reshard(open_checkpoint(SRC), ReshardOptions(world_size=3))
    last = [r for r in out.records.placed_records() if r[3] == "__2_0.distcp"][-1]
    size = out.files["__2_0.distcp"]

    def cut(tmp: Path) -> None:
        os.truncate(tmp / "__2_0.distcp", size - 1)

    with pytest.raises(CheckpointError) as caught:
        _write(SRC, out, tmp_path / "out", before_check=cut)
    assert Path(caught.value.path).name == "__2_0.distcp" and Path(caught.value.path).parent.parent == tmp_path
    assert caught.value.reason == f"file is {size - 1} bytes but {last[0].fqn} needs bytes {last[4]}..{size} " \
                                  "(truncated?)"
    assert len(forks) == 1 and list(tmp_path.iterdir()) == []


def test_a_source_item_the_helper_cannot_read_back_fails_the_run_naming_it(tmp_path: Path, forks) -> None:
    """The helper reads the samples' source elements by Python's own zipfile: an item it cannot
    read back (the copy's reader took it) fails the run with the line naming the item, no DST."""
    broken = tmp_path / "src"
    shutil.copytree(SRC, broken)
    with open(broken / "__0_0.distcp", "r+b") as handle:
        handle.write(b"XX")  # the first item's local header signature
    out = plan_reshard(open_checkpoint(SRC), ReshardOptions(world_size=3))
    with pytest.raises(CheckpointError) as caught:
        _write(SRC, out, tmp_path / "out", checked_against=broken)
    assert Path(caught.value.path) == broken / "__0_0.distcp"
    assert caught.value.reason == ("item at byte 0: model.embed.weight: cannot be read back (safetensors header of "
                                   "578712552184436824 bytes at byte 0)")  # no zip's signature: read as a blob
    assert len(forks) == 1 and sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_a_data_file_no_entry_names_added_after_the_helpers_check_is_refused(tmp_path: Path, forks) -> None:
    out = plan_reshard(open_checkpoint(SRC), ReshardOptions(world_size=3))

    def extra(tmp: Path) -> None:
        (tmp / "__7_0.distcp").write_bytes(b"\0" * 8)

    with pytest.raises(CheckpointError) as caught:
        _write(SRC, out, tmp_path / "out", before_check=extra)
    assert Path(caught.value.path).name == "__7_0.distcp" and caught.value.reason == "no entry lies in it"
    assert len(forks) == 1 and list(tmp_path.iterdir()) == []


def test_the_reader_takes_planned_sizes_for_files_still_being_written(tmp_path: Path) -> None:
    """`open_checkpoint(planned=…)` judges every entry against the planned sizes, not the files' on
    disk (the helper checks while they are written), and lists no file the plan does not name."""
    out = plan_reshard(open_checkpoint(SRC), ReshardOptions(world_size=3))
    dst = tmp_path / "out"
    dst.mkdir()
    write_metadata(out, dst)
    (dst / "__0_0.distcp").write_bytes(b"")  # begun, not yet written
    (dst / "__9_0.distcp").write_bytes(b"x")
    ckpt = open_checkpoint(dst, written_here=True, planned=out.files)
    assert ckpt.files == out.files and ckpt.unreferenced_files == ()
    with pytest.raises(CheckpointError) as caught:
        open_checkpoint(dst, written_here=True)
    assert str(caught.value) == f"{dst / '__0_0.distcp'}: file is 0 bytes but optim.param_groups.0.amsgrad needs " \
                                "bytes 0..1261 (truncated?)"


def test_the_ends_located_ahead_are_where_the_check_would_find_them(tmp_path: Path) -> None:
    """`located_ends` (run by a process forked while the run plans) finds each tensor's first and
    last elements' items where the check's own reads find them, and a check that takes those
    places reads the same source elements."""
    src = open_checkpoint(SRC)
    out = plan_reshard(src, ReshardOptions(world_size=3))
    located = pickle.loads(located_ends(src))
    plain = DcpCheck(src, out)
    plain._read_source()
    ends = {key: place for key, place in plain._source._places.items() if key in located}
    assert located == ends and len(located) == sum(len(_ends(e.shape)) for e in src.tensors.values()) == 56
    ahead = DcpCheck(src, out, located=pickle.dumps(located))
    assert ahead._source._places == located  # taken before a sample is read
    ahead._read_source()
    assert ahead._wants == plain._wants
    plain.close(), ahead.close()


def test_a_run_whose_locating_helper_fails_checks_without_it(fixture_ckpt, tmp_path: Path, forks,
                                                               monkeypatch) -> None:
    """The locating helper only spares the check work: one that fails (here: its work raises)
    leaves the run to locate the items itself, with the same output."""
    from ckptctl.commands import dcp_write
    from ckptctl.commands.reshard import reshard

    results: list[bytes | None] = []
    result = dcp_write.LocatingAhead.result
    monkeypatch.setattr(dcp_write.LocatingAhead, "result", lambda self: results.append(result(self)) or results[-1])

    def failing(ckpt):
        raise OSError("out of file descriptors")

    src = fixture_ckpt("fsdp2_4ranks")
    reshard(src, tmp_path / "ahead", ReshardOptions(world_size=3, sync=False))
    monkeypatch.setattr(dcp_write, "located_ends", failing)
    reshard(src, tmp_path / "without", ReshardOptions(world_size=3, sync=False))
    assert len(forks) == 4 and results[0] == located_ends(open_checkpoint(src))  # what the first run took
    assert results[1] is None  # failed: the check located the items itself
    assert {p.name: p.read_bytes() for p in (tmp_path / "ahead").iterdir()} == {
        p.name: p.read_bytes() for p in (tmp_path / "without").iterdir()}
