"""Per-data-parallel-rank training state: torchtitan's dataloader, saved by torchtitan itself.

torchtitan's `ParallelAwareDataloader` saves `dataloader.dp_rank_<i>` per DP rank and refuses to
load at another DP size. `inspect` names the entries; a reshard to another DP size refuses by
default, naming them, and drops them only when asked; a reshard at the same DP size keeps them,
and torchtitan's manager resumes the stream where it stopped.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fixtures import torchtitan_models as titan
from fixtures.gloo import run_ranks
from tests.conftest import run_cli

pytestmark = pytest.mark.skipif(not titan.available(), reason="torchtitan is not installed")


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    """torchtitan's llama3 saved at DP 2 with its dataloader three batches in: each rank's next
    batch, and the model's full state."""
    root = tmp_path_factory.mktemp("titan-dataloader")
    return root / titan.SAVED, run_ranks(titan.save_with_dataloader, 2, str(root), timeout=240)


def test_inspect_names_the_per_rank_state(saved) -> None:
    ckpt, _ = saved
    result = run_cli("inspect", ckpt, "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["rank_state"] == [
        {"kind": "torchtitan's dataloader state", "entries": ["dataloader.dp_rank_0", "dataloader.dp_rank_1"],
         "dp": 2}]
    shown = " ".join(run_cli("inspect", ckpt).stdout.split())  # the summary's rows, however wrapped
    assert "Per-rank state dataloader.dp_rank_0 … dataloader.dp_rank_1: torchtitan's dataloader state of DP 2, " \
           "kept by a reshard to DP 2 only" in shown


def test_a_reshard_to_another_dp_size_is_refused_by_default(saved, tmp_path: Path) -> None:
    ckpt, _ = saved
    result = run_cli("reshard", ckpt, tmp_path / "ws3", "-n", 3)
    assert result.returncode == 2
    assert result.stderr == (
        "ckptctl: error: dataloader.dp_rank_{0..1}: torchtitan's dataloader state of DP 2 cannot follow a reshard "
        "to DP 3 (its loader refuses another DP size); pass --exclude 'dataloader.*' to drop it (the next job "
        "starts its data order afresh)\n")
    assert not (tmp_path / "ws3").exists()


@pytest.mark.full
def test_dropped_on_purpose_the_reshard_resumes_in_torchtitan(saved, tmp_path: Path) -> None:
    """Dropped with `--exclude`, the output has no dataloader entries, and torchtitan resumes the
    model at DP 3 with `exclude_from_loading = ['dataloader']`, its stream started afresh."""
    ckpt, _ = saved
    result = run_cli("reshard", ckpt, tmp_path / "ws3", "-n", 3, "--exclude", "dataloader.*", "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(run_cli("inspect", tmp_path / "ws3", "--json").stdout)["rank_state"] == []
    resumed = run_ranks(titan.resume_with_dataloader, 3, str(tmp_path / "ws3"), False, timeout=240)[0]
    assert resumed["next"] == [[0, 3], [1, 4], [2, 5]]


def test_at_the_same_dp_size_the_stream_resumes_where_it_stopped(saved, tmp_path: Path) -> None:
    ckpt, ranks = saved
    result = run_cli("reshard", ckpt, tmp_path / "ws2", "-n", 2)
    assert result.returncode == 0, result.stderr
    resumed = run_ranks(titan.resume_with_dataloader, 2, str(tmp_path / "ws2"), True, timeout=240)[0]
    assert [r["next"] for r in ranks] == [[12, 14], [13, 15]]  # rank r reads r, r + 2, …: three batches read
    assert resumed["next"] == [r["next"] for r in ranks]
    want = ranks[0]["model"]
    assert sorted(resumed["model"]) == sorted(want)
    assert [k for k, v in want.items() if not torch.equal(resumed["model"][k], v)] == []
