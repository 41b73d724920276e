"""`ckptctl inspect` run as a user would: exact JSON on real fixtures, --check, and bad input.

Every CLI run costs an interpreter start with torch, so each group of runs is prepared once
per session and executed in parallel; the tests then assert on the finished results.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ckptctl.cli.common import human_bytes
from ckptctl.util.errors import CheckpointError
from ckptctl.formats.dcp.metadata import open_checkpoint
from tests.conftest import run_cli
from tests.formats.test_unpickle import hostile

HEALTHY = ["fsdp2_4ranks", "megatron_tp2_dp2", "flat_optim", "zstd"]
PLAIN_BUG = ("optim.state.w.{state}: saved [2, 8] (16 elements) but param model.w is [4, 8] (32 elements): "
             "optimizer state was saved as a plain per-rank tensor and DCP kept one rank's copy (data loss)")


def run_all(cases: dict[str, tuple[Any, ...]]) -> dict[str, subprocess.CompletedProcess]:
    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 1)) as pool:
        futures = {key: pool.submit(run_cli, *args) for key, args in cases.items()}
        return {key: future.result() for key, future in futures.items()}


@pytest.fixture(scope="session")
def runs(fixture_ckpt) -> dict[str, subprocess.CompletedProcess]:
    cases: dict[str, tuple[Any, ...]] = {
        f"json:{name}": ("inspect", fixture_ckpt(name), "--json", "--check")
        for name in [*HEALTHY, "broken_plain_optim"]}
    cases.update({
        "check:broken": ("inspect", fixture_ckpt("broken_plain_optim"), "--check"),
        "check:fsdp2": ("inspect", fixture_ckpt("fsdp2_4ranks"), "--check"),
        "text:fsdp2": ("inspect", fixture_ckpt("fsdp2_4ranks"), "--chunks"),
        "text:broken": ("inspect", fixture_ckpt("broken_plain_optim")),
        "text:megatron": ("inspect", fixture_ckpt("megatron_tp2_dp2")),
        "filter:json": ("inspect", fixture_ckpt("megatron_tp2_dp2"), "--json", "--filter", "*.linear_proj.weight*"),
        "filter:check": ("inspect", fixture_ckpt("broken_plain_optim"), "--check", "--filter", "model.*"),
    })
    return run_all(cases)


def doc(runs: dict, name: str) -> dict[str, Any]:
    return json.loads(runs[f"json:{name}"].stdout)


# --- JSON on the real fixtures -------------------------------------------------------------


@pytest.mark.parametrize("name", HEALTHY)
def test_healthy_fixtures_pass_check_with_json(runs, name: str) -> None:
    result = runs[f"json:{name}"]
    assert (result.returncode, result.stderr) == (0, "")
    assert json.loads(result.stdout)["problems"] == []


@pytest.mark.parametrize("name", [*HEALTHY, "broken_plain_optim"])
def test_files_and_chunks_point_at_real_items(runs, fixture_ckpt, name: str) -> None:
    d = doc(runs, name)
    root = fixture_ckpt(name)
    assert d["files"] == {f: (root / f).stat().st_size for f in sorted(os.listdir(root)) if f.endswith(".distcp")}
    assert d["total_bytes"] == sum(d["files"].values())
    for fqn, t in d["tensors"].items():
        for c in t["chunks"]:
            assert c["offset"] + c["length"] <= d["files"][c["file"]], fqn
            with open(root / c["file"], "rb") as f:
                f.seek(c["offset"])
                assert f.read(4) == b"PK\x03\x04" or c["transforms"], fqn   # a torch.save zip archive


def test_fsdp2_summary_values(runs) -> None:
    d = doc(runs, "fsdp2_4ranks")
    keys = ("version", "world_size", "metadata_files", "groups", "dtypes", "layouts", "prefixes")
    assert {k: d[k] for k in keys} == {
        "version": "1.0.0",
        "world_size": 4,
        "metadata_files": [".metadata"],
        "groups": {"model": 8, "optimizer": 36, "other": 1},
        "dtypes": {"float32": 32},
        "layouts": {"scalar": 8, "shard0-even": 24},
        "prefixes": {"model": ["model."], "optimizer": ["optim.state."]},
    }
    assert len(d["tensors"]) == 32 and len(d["bytes_entries"]) == 13
    assert d["bytes_entries"]["extra.iteration"]["file"] == "__3_0.distcp"


def test_fsdp2_tensor_values(runs) -> None:
    d = doc(runs, "fsdp2_4ranks")
    embed = d["tensors"]["model.embed.weight"]
    assert {k: v for k, v in embed.items() if k != "chunks"} == {
        "shape": [10, 8], "dtype": "float32", "nbytes": 320, "group": "model", "layout": "shard0-even",
        "dim1_parts": None, "tp_degree": None, "param": None,
        "coverage": {"status": "complete", "covered": 80, "gaps": 0, "overlaps": 0},
    }
    assert [(c["file"], c["offsets"], c["sizes"]) for c in embed["chunks"]] == [
        ("__0_0.distcp", [0, 0], [3, 8]), ("__1_0.distcp", [3, 0], [3, 8]),
        ("__2_0.distcp", [6, 0], [3, 8]), ("__3_0.distcp", [9, 0], [1, 8]),
    ]
    head = d["tensors"]["model.head.weight"]
    assert [(c["offsets"], c["sizes"]) for c in head["chunks"]] == [
        ([0, 0], [1, 8]), ([1, 0], [1, 8]), ([2, 0], [0, 8])]
    assert head["layout"] == "shard0-even" and head["coverage"]["covered"] == 16
    step = d["tensors"]["optim.state.embed.weight.step"]
    assert (step["shape"], step["layout"], step["param"], step["nbytes"]) == ([], "scalar", "model.embed.weight", 4)


def test_megatron_values(runs) -> None:
    d = doc(runs, "megatron_tp2_dp2")
    assert d["prefixes"] == {"model": ["model.module."], "optimizer": ["optimizer.state.module."]}
    assert d["groups"] == {"model": 16, "optimizer": 80, "other": 3}
    assert d["layouts"] == {"rows-uneven": 24, "scalar": 16, "shard0-even": 9, "single": 3, "tp-dp-grid": 12}
    proj = d["tensors"]["model.module.decoder.layers.0.self_attention.linear_proj.weight"]
    assert (proj["layout"], proj["tp_degree"], proj["dim1_parts"]) == ("tp-dp-grid", 2, 2)
    assert [(c["offsets"], c["sizes"]) for c in proj["chunks"]] == [
        ([0, 0], [7, 4]), ([0, 4], [7, 4]), ([7, 0], [1, 4]), ([7, 4], [1, 4])]
    qkv = d["tensors"]["model.module.decoder.layers.1.self_attention.linear_qkv.weight"]
    assert (qkv["layout"], qkv["shape"], [c["sizes"][0] for c in qkv["chunks"]]) == ("rows-uneven", [16, 8], [8, 2, 6])
    state = d["tensors"]["optimizer.state.module.decoder.layers.0.mlp.linear_fc1.weight_w.exp_avg"]
    assert (state["group"], state["param"]) == ("optimizer", "model.module.decoder.layers.0.mlp.linear_fc1.weight_w")
    assert {"args", "iteration", "checkpoint_version"} <= d["bytes_entries"].keys()


def test_the_format_is_named_by_what_the_checkpoint_says(runs) -> None:
    """Megatron-FSDP's by the `ckpt_format` of its saved args; one without Megatron args is plain DCP."""
    assert (doc(runs, "megatron_tp2_dp2")["format"], doc(runs, "fsdp2_4ranks")["format"]) == (
        "megatron-fsdp fsdp_dtensor", "dcp")
    assert doc(runs, "megatron_tp2_dp2")["megatron_core"] is None
    lines = [line.rstrip() for line in runs["text:megatron"].stdout.splitlines()]
    assert "Format            Megatron-FSDP fsdp_dtensor (args.ckpt_format): per-layer keys, SwiGLU fc1 as " \
           "weight_w/weight_v (or fused, TP-blocked)" in lines
    assert not any(line.startswith("Format") for line in runs["text:fsdp2"].stdout.splitlines())


def test_flat_optimizer_states(runs) -> None:
    d = doc(runs, "flat_optim")
    t = d["tensors"]["optimizer.state.module.output_layer.weight.exp_avg"]
    assert (t["shape"], t["layout"], t["param"]) == ([12], "flat", "model.module.output_layer.weight")
    assert [(c["offsets"], c["sizes"]) for c in t["chunks"]] == [([0], [2]), ([9], [3]), ([2], [7])]
    assert d["tensors"]["model.module.output_layer.weight"]["shape"] == [4, 3]
    assert d["layouts"]["flat"] == 6


def test_zstd_chunks_name_their_transform(runs) -> None:
    d = doc(runs, "zstd")
    assert {tuple(c["transforms"]) for t in d["tensors"].values() for c in t["chunks"]} == {("stream.zstd/1",)}


# --- --check -------------------------------------------------------------------------------


def test_check_fails_on_plain_per_rank_optimizer_state(runs) -> None:
    result = runs["check:broken"]
    assert result.returncode == 1
    assert result.stdout.splitlines() == [PLAIN_BUG.format(state="exp_avg"), PLAIN_BUG.format(state="exp_avg_sq")]


def test_check_with_json_reports_problems_and_fails(runs) -> None:
    result = runs["json:broken_plain_optim"]
    assert result.returncode == 1
    problems = json.loads(result.stdout)["problems"]
    assert problems == [
        {"fqn": f"optim.state.w.{s}", "kind": "data-loss", "message": PLAIN_BUG.format(state=s)}
        for s in ("exp_avg", "exp_avg_sq")]
    saved = json.loads(result.stdout)["tensors"]["optim.state.w.exp_avg"]
    assert (saved["shape"], saved["param"], saved["coverage"]["status"]) == ([2, 8], "model.w", "complete")


def test_check_passes_a_healthy_checkpoint(runs) -> None:
    result = runs["check:fsdp2"]
    assert (result.returncode, result.stdout, result.stderr) == (0, "ok: 32 tensors complete and consistent\n", "")


def test_check_only_judges_filtered_entries(runs) -> None:
    result = runs["filter:check"]
    assert (result.returncode, result.stdout) == (0, "ok: 1 tensor complete and consistent\n")


# --- human output, --filter, --chunks ------------------------------------------------------


def test_default_output_has_summary_and_table(runs) -> None:
    result = runs["text:fsdp2"]
    assert result.returncode == 0
    out = result.stdout
    for line in ("Saved world size  4", "Entries           model 8, optimizer 36, other 1",
                 "Layouts           scalar 8, shard0-even 24", "__3_0.distcp  49.8 kB", "32 tensors",
                 "No coverage or consistency problems."):
        assert line in out
    row = next(line for line in out.splitlines() if line.startswith("model.embed.weight "))
    assert row.split("  ") and [cell.strip() for cell in row.split("  ") if cell] == [
        "model.embed.weight", "[10, 8]", "float32", "320 B", "shard0-even", "complete"]


def test_chunks_lists_every_chunk(runs) -> None:
    lines = runs["text:fsdp2"].stdout.splitlines()
    chunk = doc(runs, "fsdp2_4ranks")["tensors"]["model.embed.weight"]["chunks"][3]
    start = lines.index("model.embed.weight")
    assert lines[start + 4] == (
        f"  __3_0.distcp  bytes {chunk['offset']}+{chunk['length']}  offsets [9, 0]  sizes [1, 8]")


def test_default_output_lists_problems(runs) -> None:
    result = runs["text:broken"]
    assert result.returncode == 0
    assert "2 problems:" in result.stdout
    assert "  " + PLAIN_BUG.format(state="exp_avg_sq") in result.stdout.splitlines()


def test_filter_restricts_tensors_and_bytes_entries(runs) -> None:
    d = json.loads(runs["filter:json"].stdout)
    assert sorted(d["tensors"]) == [
        "model.module.decoder.layers.0.self_attention.linear_proj.weight",
        "model.module.decoder.layers.1.self_attention.linear_proj.weight",
        *(f"optimizer.state.module.decoder.layers.{i}.self_attention.linear_proj.weight.{s}"
          for i in (0, 1) for s in ("exp_avg", "exp_avg_sq", "step")),
    ]
    assert sorted(d["bytes_entries"]) == [
        f"optimizer.param_to_group_meta.module.decoder.layers.{i}.self_attention.linear_proj.weight.{k}"
        for i in (0, 1) for k in ("lr", "weight_decay")]
    assert d["groups"] == {"model": 16, "optimizer": 80, "other": 3}   # the summary still covers everything


# --- bad input -----------------------------------------------------------------------------


def _copy(fixture: Path, dst: Path) -> Path:
    shutil.copytree(fixture, dst)
    return dst


def _rewrite_metadata(root: Path, change: Callable[[Any], None]) -> None:
    md = pickle.loads((root / ".metadata").read_bytes())   # our own copy of a trusted fixture
    change(md)
    (root / ".metadata").write_bytes(pickle.dumps(md))


def _last_item(root: Path, file: str) -> tuple[str, int, int]:
    """(fqn, offset, end) of the item that ends last in `file`, from the trusted fixture metadata."""
    md = pickle.loads((root / ".metadata").read_bytes())
    return max(((i.fqn, s.offset, s.offset + s.length) for i, s in md.storage_data.items()
                if s.relative_path == file), key=lambda t: t[2])


def _drop_version(md: Any) -> None:
    del md.version


def _move_outside(md: Any) -> None:
    for info in md.storage_data.values():
        if info.relative_path == "__1_0.distcp":
            info.relative_path = "../outside.distcp"


def _grow_chunk(md: Any) -> None:
    md.state_dict_metadata["model.w"].chunks[1].sizes = torch.Size([3, 8])


def _per_rank(root: Path) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.ones(3, 2), "epoch": 1}, checkpoint_id=root, no_dist=True, use_collectives=False)
    return root


def _zero_items(root: Path) -> Path:
    for f in root.glob("*.distcp"):
        f.write_bytes(b"\0" * f.stat().st_size)
    return root


@pytest.fixture(scope="session")
def bad(tmp_path_factory, fixture_ckpt) -> dict[str, tuple[Path, subprocess.CompletedProcess]]:
    """Every broken or unusual checkpoint, built in a temp dir and inspected once (in parallel)."""
    base = tmp_path_factory.mktemp("bad")
    broken, fsdp2 = fixture_ckpt("broken_plain_optim"), fixture_ckpt("fsdp2_4ranks")
    paths: dict[str, Path] = {}

    paths["file"] = base / "plain.txt"
    paths["file"].write_text("not a checkpoint")
    paths["empty"] = base / "empty"
    paths["empty"].mkdir()
    for key, content in {"hostile": hostile(base / "pwned"), "corrupt": b"\x00garbage"}.items():
        paths[key] = _copy(broken, base / key)
        (paths[key] / ".metadata").write_bytes(content)
    paths["missing_distcp"] = _copy(broken, base / "missing_distcp")
    (paths["missing_distcp"] / "__1_0.distcp").unlink()
    paths["truncated_distcp"] = _copy(fsdp2, base / "truncated_distcp")
    with open(paths["truncated_distcp"] / "__3_0.distcp", "r+b") as f:
        f.truncate(f.seek(0, 2) - 1)
    paths["per_rank"] = _per_rank(base / "per_rank")
    paths["zeroed"] = _zero_items(_copy(fsdp2, base / "zeroed"))

    results = run_all({key: ("inspect", path, "--json") for key, path in paths.items()})
    return {key: (paths[key], results[key]) for key in paths}


def assert_refused(case: tuple[Path, subprocess.CompletedProcess], message: str) -> None:
    _, result = case
    assert (result.returncode, result.stdout, result.stderr) == (2, "", f"ckptctl: error: {message}\n")


def test_not_a_directory(bad) -> None:
    assert_refused(bad["file"], f"{bad['file'][0]}: not a directory (a DCP checkpoint is a directory)")


def test_directory_without_metadata(bad) -> None:
    assert_refused(bad["empty"], f"{bad['empty'][0]}: no .metadata file (not a DCP checkpoint?)")


def test_hostile_metadata_is_refused_and_not_executed(bad) -> None:
    path, _ = bad["hostile"]
    assert_refused(bad["hostile"], f"{path}/.metadata: hostile or foreign pickle: refuses to load global posix.system")
    assert not (path.parent / "pwned").exists()


def test_corrupt_metadata(bad) -> None:
    path, _ = bad["corrupt"]
    assert_refused(bad["corrupt"],
                   f"{path}/.metadata: corrupt metadata pickle: invalid pickle opcode b'\\x00' at byte 0")


def test_missing_data_file(bad) -> None:
    path, _ = bad["missing_distcp"]
    assert_refused(bad["missing_distcp"], f"{path}/__1_0.distcp: data file referenced by .metadata is missing")


def test_truncated_data_file(bad, fixture_ckpt) -> None:
    path, _ = bad["truncated_distcp"]
    fqn, offset, end = _last_item(fixture_ckpt("fsdp2_4ranks"), "__3_0.distcp")
    size = (path / "__3_0.distcp").stat().st_size
    assert end == size + 1
    assert_refused(bad["truncated_distcp"],
                   f"{path}/__3_0.distcp: file is {size} bytes but {fqn} needs bytes {offset}..{end} (truncated?)")


def test_per_rank_metadata_without_collectives(bad) -> None:
    path, result = bad["per_rank"]
    assert sorted(p.name for p in path.iterdir()) == ["__0.metadata", "__0_0.distcp"]
    assert result.returncode == 0
    d = json.loads(result.stdout)
    assert d["metadata_files"] == ["__0.metadata"]
    w = d["tensors"]["w"]
    assert (w["shape"], w["layout"], w["coverage"]["status"]) == ([3, 2], "single", "complete")
    assert list(d["bytes_entries"]) == ["epoch"]


def test_inspect_never_reads_item_bytes(bad, runs) -> None:
    """Zeroing every data file (same sizes) changes nothing but the path: only .metadata and sizes are read."""
    _, result = bad["zeroed"]
    assert result.returncode == 0
    got, want = json.loads(result.stdout), doc(runs, "fsdp2_4ranks")
    assert {**got, "path": None} == {**want, "path": None}


# --- bad input caught while opening (the CLI prints these through the same one-line path) --


def _refusal(path: Path) -> str:
    with pytest.raises(CheckpointError) as err:
        open_checkpoint(path)
    return str(err.value)


def test_truncated_metadata(tmp_path: Path, fixture_ckpt) -> None:
    root = _copy(fixture_ckpt("broken_plain_optim"), tmp_path / "ckpt")
    (root / ".metadata").write_bytes((root / ".metadata").read_bytes()[:100])
    assert _refusal(root).startswith(f"{root}/.metadata: corrupt metadata pickle: ")


def test_pickle_that_is_not_dcp_metadata(tmp_path: Path, fixture_ckpt) -> None:
    root = _copy(fixture_ckpt("broken_plain_optim"), tmp_path / "ckpt")
    (root / ".metadata").write_bytes(pickle.dumps({"state_dict_metadata": {}}))
    assert _refusal(root) == f"{root}/.metadata: corrupt metadata pickle: pickle holds a dict, not a DCP Metadata"


def test_data_file_path_leaving_the_checkpoint(tmp_path: Path, fixture_ckpt) -> None:
    root = _copy(fixture_ckpt("broken_plain_optim"), tmp_path / "ckpt")
    _rewrite_metadata(root, _move_outside)
    assert _refusal(root) == f"{root}/.metadata: data file '../outside.distcp' points outside the checkpoint directory"


def test_data_file_symlink_leaving_the_checkpoint(tmp_path: Path, fixture_ckpt) -> None:
    root = _copy(fixture_ckpt("broken_plain_optim"), tmp_path / "ckpt")
    shutil.move(root / "__1_0.distcp", tmp_path / "elsewhere.distcp")
    (root / "__1_0.distcp").symlink_to(tmp_path / "elsewhere.distcp")
    assert _refusal(root) == f"{root}/__1_0.distcp: data file is a link that leaves the checkpoint directory"


def test_chunk_outside_its_tensor(tmp_path: Path, fixture_ckpt) -> None:
    root = _copy(fixture_ckpt("broken_plain_optim"), tmp_path / "ckpt")
    _rewrite_metadata(root, _grow_chunk)
    assert _refusal(root) == f"{root}/.metadata: model.w: chunk at [2, 0] of size [3, 8] lies outside shape [4, 8]"


def test_missing_path(tmp_path: Path) -> None:
    assert _refusal(tmp_path / "nowhere") == f"{tmp_path}/nowhere: no such file or directory"


def test_metadata_without_version_is_accepted(tmp_path: Path, fixture_ckpt) -> None:
    """Older torch wrote no `version`; such metadata opens, with version unknown."""
    root = _copy(fixture_ckpt("broken_plain_optim"), tmp_path / "ckpt")
    _rewrite_metadata(root, _drop_version)
    assert b"version" not in (root / ".metadata").read_bytes()
    ckpt = open_checkpoint(root)
    assert ckpt.version is None and ckpt.tensors["model.w"].shape == (4, 8)


@pytest.mark.parametrize("n, text", [(0, "0 B"), (999, "999 B"), (1000, "1.0 kB"), (38424, "38.4 kB"),
                                     (10**6, "1.0 MB"), (5 * 10**12, "5.0 TB"), (3 * 10**15, "3.0 PB")])
def test_human_bytes(n: int, text: str) -> None:
    assert human_bytes(n) == text


def test_one_file_per_rank_at_scale_is_listed_by_rank_and_summarised(fixture_ckpt, tmp_path):
    ten = tmp_path / "twelve"
    assert run_cli("reshard", fixture_ckpt("fsdp2_4ranks"), ten, "-n", "12").returncode == 0
    names = [f"__{rank}_0.distcp" for rank in range(12)]
    sizes = {name: (ten / name).stat().st_size for name in names}
    doc = json.loads(run_cli("inspect", ten, "--json").stdout)
    assert list(doc["files"]) == names  # rank order: __2 before __10, which name order would not give
    small, large = min(names, key=sizes.__getitem__), max(names, key=sizes.__getitem__)
    text = run_cli("inspect", ten).stdout
    assert (f"__0_0.distcp … __11_0.distcp  {human_bytes(sizes[small])} ({small}) to "
            f"{human_bytes(sizes[large])} ({large})") in text
    assert "__3_0.distcp  " not in text  # not one line per file


def test_data_files_left_by_another_save_are_a_warning_not_a_problem(fixture_ckpt, tmp_path):
    """Saving at 4 ranks into a directory that held an 8-rank save leaves __4_0 … __7_0 behind."""
    eight = tmp_path / "eight"
    assert run_cli("reshard", fixture_ckpt("fsdp2_4ranks"), eight, "-n", "8").returncode == 0
    mixed = tmp_path / "mixed"
    shutil.copytree(fixture_ckpt("fsdp2_4ranks"), mixed)
    for rank in (7, 5):
        shutil.copy(eight / f"__{rank}_0.distcp", mixed)
    doc = json.loads(run_cli("inspect", mixed, "--json").stdout)
    assert doc["unreferenced_files"] == ["__5_0.distcp", "__7_0.distcp"]
    assert doc["world_size"] == 4 and doc["problems"] == []
    assert len(doc["files"]) == 6
    check = run_cli("inspect", mixed, "--check")
    assert check.returncode == 0
    assert check.stdout.splitlines() == [
        "ok: 32 tensors complete and consistent",
        "warning: 2 data files that no entry points to (__5_0.distcp, __7_0.distcp): left by another save? "
        "Loading ignores them"]
    assert run_cli("reshard", mixed, tmp_path / "out", "-n", "2").returncode == 0
    assert json.loads(run_cli("inspect", fixture_ckpt("fsdp2_4ranks"), "--json").stdout)["unreferenced_files"] == []


def test_streamed_json_is_json_dumps_text_made_entry_by_entry(capsys) -> None:
    """`--json` writes `Streamed` parts as they are made: the same text as json.dumps(indent=2),
    and each entry is produced only while it is written (none are made beforehand)."""
    import json

    from ckptctl.cli.common import Streamed, emit_json

    made: list[str] = []

    def entries():
        for name in ("a.weight", "b.bias"):
            made.append(name)
            yield name, {"shape": [2, 3], "chunks": [{"file": "__0_0.distcp", "offsets": [0, 0]}]}

    doc = {"path": "/ckpt", "tensors": Streamed(2, entries), "empty": Streamed(0, lambda: iter(())), "n": 1.5}
    plain = {"path": "/ckpt", "tensors": dict(entries()), "empty": {}, "n": 1.5}
    made.clear()
    emit_json(doc)
    assert capsys.readouterr().out == json.dumps(plain, indent=2) + "\n"
    assert made == ["a.weight", "b.bias"]


def test_the_indented_encoder_writes_json_dumps_text_for_any_document() -> None:
    """`--json`'s encoder (flat containers as one piece) writes exactly `json.dumps(indent=2)`'s
    text: nested dicts and lists, empty ones, scalar and non-str keys, unicode, NaN and the
    infinities."""
    import json

    from hypothesis import given, settings
    from hypothesis import strategies as st

    from ckptctl.cli.common import indented_json

    scalars = st.none() | st.booleans() | st.integers() | st.floats() | st.text()
    keys = st.text() | st.integers() | st.booleans() | st.none() | st.floats(allow_nan=False)
    values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.tuples(inner, inner)
                          | st.dictionaries(keys, inner, max_size=4), max_leaves=30)

    @settings(max_examples=300, deadline=None)
    @given(values)
    def same(value) -> None:
        assert "".join(indented_json(value)) == json.dumps(value, indent=2)

    same()


def _save_dim1_splits(rank: int, world_size: int, out: str) -> None:
    """Real DTensors cut on dim 1: FSDP2-style `Shard(1)` on 4 ranks, experts [E, F, D] under
    expert parallelism (dim 0) with FSDP `Shard(1)` on a 2 × 2 mesh, and a Megatron RowParallel
    name cut the same way."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    flat, grid = init_device_mesh("cpu", (4,)), init_device_mesh("cpu", (2, 2))
    full = torch.arange(4 * 8 * 8, dtype=torch.float32)
    state = {"w": distribute_tensor(full[:32].reshape(4, 8), flat, [Shard(1)]),
             "layers.0.moe.experts.w1": distribute_tensor(full[:256].reshape(4, 8, 8), grid, [Shard(0), Shard(1)]),
             "decoder.layers.0.self_attention.linear_proj.weight":
                 distribute_tensor(full[:64].reshape(8, 8), grid, [Shard(0), Shard(1)])}
    dcp.save(state, checkpoint_id=out)


def test_dim1_splits_are_tp_only_where_the_megatron_rules_say_row_parallel(tmp_path) -> None:
    from fixtures.gloo import run_ranks

    run_ranks(_save_dim1_splits, 4, str(tmp_path / "ckpt"))
    run = run_cli("inspect", tmp_path / "ckpt", "--json")
    assert run.returncode == 0, run.stderr
    tensors = json.loads(run.stdout)["tensors"]
    assert {n: (t["layout"], t["dim1_parts"], t["tp_degree"]) for n, t in tensors.items()} == {
        "w": ("shard1", 4, None),
        "layers.0.moe.experts.w1": ("grid", 2, None),
        "decoder.layers.0.self_attention.linear_proj.weight": ("tp-dp-grid", 2, 2),
    }
    table = run_cli("inspect", tmp_path / "ckpt").stdout
    assert "shard1 (dim 1 in 4)" in table and "grid (dim 1 in 2)" in table and "tp-dp-grid (tp 2)" in table


def test_chunk_records_are_written_as_json_dumps_writes_them():
    """`--json` writes chunk records with a formatter of its own (millions of them make most of a
    large document): the text is `json.dumps(indent=2)`'s at any depth, for 0-d chunks, shared
    boxes, names that need escaping and transforms, and the table's records are the same values."""
    from ckptctl.cli.common import indented_json
    from ckptctl.cli.inspect_cmd import _Chunks
    from ckptctl.core.checkpoint import Chunk

    chunks = [Chunk("__0_0.distcp", 0, 1705, (), ()), Chunk('dir "ü"/__1_0.distcp', 17, 9, (0, 4), (3, 4)),
              Chunk("__1_0.distcp", 26, 9, (3, 4), (3, 4), ("zstd",)), Chunk("__1_0.distcp", 35, 9, (6, 4), (3, 4))]
    records = [{"file": c.file, "offset": c.offset, "length": c.length, "offsets": list(c.offsets),
                "sizes": list(c.sizes), "transforms": list(c.transforms)} for c in chunks]
    for doc, want in (({"t": {"a": {"chunks": _Chunks(chunks)}}}, {"t": {"a": {"chunks": records}}}),
                      (_Chunks(chunks), records), ({"chunks": _Chunks(())}, {"chunks": []})):
        assert "".join(indented_json(doc)) == json.dumps(want, indent=2)
    assert list(_Chunks(chunks)) == records
