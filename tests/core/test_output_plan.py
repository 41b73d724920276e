"""Every writing command hands the engine one kind of plan (`OutputPlan`): its copies and records
tile each file exactly (every byte written once, in the file's order), up to where `finish`
writes, whatever made the plan."""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import replace

import pytest

from ckptctl.engine.cpu import ChunkSource
from ckptctl.util.errors import IncompleteCheckpointError
from ckptctl.commands.export_hf import ExportOptions, plan_export
from ckptctl.commands.export_torch import ExportTorchOptions, plan_export_torch, read_values
from ckptctl.formats.dcp.metadata import open_checkpoint
from ckptctl.families.base import load_hf_config
from ckptctl.core.output_plan import OutputPlan
from ckptctl.core.plan import Piece, planned_batches
from ckptctl.commands.reshard import ReshardOptions, plan_reshard


def _spans(plan: OutputPlan) -> dict[str, list[tuple[int, int]]]:
    spans: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for copy in plan.copies:
        spans[copy.file].append((copy.offset, copy.offset + copy.length))
    records = list(plan.records(plan.files))
    assert len(records) == plan.record_count
    for record in records:
        assert record.reads == ()  # planned only when written
        spans[record.file].append((record.offset, record.offset + record.length))
    return spans


def _assert_tiles(plan: OutputPlan, ends: dict[str, int]) -> None:
    spans = _spans(plan)
    assert spans.keys() == plan.files.keys()
    for name, pieces in spans.items():
        at = 0
        for start, end in sorted(pieces):
            assert start == at, (name, start, at)
            at = end
        assert at == ends[name]


def test_a_reshards_plan_tiles_each_rank_file_and_leaves_metadata_last(fixture_ckpt):
    out = plan_reshard(open_checkpoint(fixture_ckpt("fsdp2_4ranks")), ReshardOptions(world_size=3))
    plan = out.output_plan()
    assert sorted(plan.files) == ["__0_0.distcp", "__1_0.distcp", "__2_0.distcp"]
    _assert_tiles(plan, dict(plan.files))
    assert plan.finish is not None and not plan.finish_reads_records and not plan.whole_records
    theirs = {r.file for r in plan.records({"__1_0.distcp"})}
    assert theirs == {"__1_0.distcp"}  # a worker's share makes its own records only


def test_an_exports_plan_tiles_each_safetensors_file_from_its_header(fixture_ckpt, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "raw", "architectures": ["Sequential"]}))
    ckpt = open_checkpoint(fixture_ckpt("fsdp2_4ranks"))
    export = plan_export(ckpt, load_hf_config(tmp_path), ExportOptions(arch="raw", name_check=False))
    plan = export.output_plan()
    _assert_tiles(plan, {f.name: f.size for f in export.files})
    assert [c.data for c in plan.copies] == [f.header for f in export.files]
    assert plan.whole_records and not plan.finish_reads_records


def test_an_archives_plan_tiles_up_to_its_trailer(fixture_ckpt):
    ckpt = open_checkpoint(fixture_ckpt("megatron_tp2_dp2"))
    chunks = ChunkSource(ckpt)
    try:
        export = plan_export_torch(ckpt, ExportTorchOptions(), read_values(ckpt, chunks, list(ckpt.bytes_entries)),
                                   "o.pt", "o")
    finally:
        chunks.close()
    plan = export.output_plan(sync=False)
    _assert_tiles(plan, {"o.pt": export.file.trailer_at})
    assert plan.files == {"o.pt": export.file.size} and plan.finish_reads_records


def test_whole_records_refuses_a_record_its_runs_leave_short(fixture_ckpt, tmp_path):
    """A mapping whose pieces do not cover a target is refused as its record is planned, naming the rows."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "raw", "architectures": ["Sequential"]}))
    ckpt = open_checkpoint(fixture_ckpt("fsdp2_4ranks"))
    export = plan_export(ckpt, load_hf_config(tmp_path), ExportOptions(arch="raw", name_check=False))
    target = export.targets["mlp.fc1.weight"]  # [12, 8]: its one piece now fills rows 0..5 only
    (piece,) = target.pieces
    export.targets[target.fqn] = replace(target, pieces=(Piece(piece.src, (0, 0), (0, 0), (6, 8)),))
    plan = export.output_plan()
    with pytest.raises(IncompleteCheckpointError) as err:
        for _ in planned_batches(plan.records(plan.files), plan.sources, plan.whole_records):
            pass
    assert str(err.value) == ("model.mlp.fc1.weight: refusing incomplete checkpoint: mlp.fc1.weight: 48 elements "
                              "of rows (0,)+(12,) are in no saved chunk")
