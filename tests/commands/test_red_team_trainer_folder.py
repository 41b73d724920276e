"""Red team: HF Trainer / accelerate `checkpoint-N/` folders with hostile entries.

A symlink loop beside the parts (`ln -s loop loop`) ended every command that looks at the folder
(inspect, reshard, export-hf) in an `OSError: [Errno 40] Too many levels of symbolic links`
traceback, exit 1: `DirEntry.is_file()` follows the link and raises.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.conftest import run_cli


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """A Trainer-named folder (`pytorch_model_fsdp_0/` a DCP checkpoint, `trainer_state.json`) and
    a symlink loop beside them."""
    import torch.distributed.checkpoint as dcp

    root = tmp_path_factory.mktemp("rt-trainer") / "checkpoint-1"
    dcp.save({"model": {"w": torch.arange(12.0).reshape(4, 3)}}, checkpoint_id=root / "pytorch_model_fsdp_0",
             no_dist=True)
    (root / "trainer_state.json").write_text("{}")
    os.symlink("loop", root / "loop")
    return root


def test_a_symlink_loop_is_refused_by_reshard_in_one_line(folder, tmp_path):
    res = run_cli("reshard", folder, tmp_path / "out", "--world-size", "2")
    assert (res.returncode, res.stderr) == (2, f"ckptctl: error: {folder / 'loop'}: neither a DCP part of the Trainer "
                                               "checkpoint folder nor a file: no rule carries it to another world "
                                               "size\n")
    assert not (tmp_path / "out").exists()


def test_inspect_names_the_loop_and_does_not_crash(folder):
    res = run_cli("inspect", folder)
    assert res.returncode == 0, res.stderr
    assert "loop: neither a DCP part nor a file, not resharded" in " ".join(res.stdout.split())


def test_export_hf_reads_the_model_part_beside_a_loop(folder, tmp_path):
    res = run_cli("export-hf", folder, tmp_path / "hf", "--no-name-check", "--hf-config", _config(tmp_path))
    assert res.returncode == 0, res.stderr


def _config(tmp_path: Path) -> Path:
    import json

    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    return path


def test_export_hf_refuses_a_dst_inside_the_trainer_folder(tmp_path):
    """`export-hf checkpoint-1 checkpoint-1/hf` wrote the HF folder inside the Trainer folder (its
    model part, not the folder, was taken as the source), exit 0: the folder then holds an entry a
    reshard of it refuses ('neither a DCP part … nor a file')."""
    import torch.distributed.checkpoint as dcp

    folder = tmp_path / "checkpoint-1"
    dcp.save({"model": {"w": torch.arange(12.0).reshape(4, 3)}}, checkpoint_id=folder / "pytorch_model_fsdp_0",
             no_dist=True)
    for dst in (folder / "hf", folder):
        res = run_cli("export-hf", folder, dst, "--no-name-check", "--hf-config", _config(tmp_path), "--force")
        assert (res.returncode, res.stderr) == (2, f"ckptctl: error: {dst}: destination overlaps the source {folder}; "
                                                   "the source is never modified\n")
    assert sorted(p.name for p in folder.iterdir()) == ["pytorch_model_fsdp_0"]


def test_a_folder_that_is_both_a_dcp_checkpoint_and_a_trainer_folder_is_refused(tmp_path):
    """A `.metadata` of its own beside `pytorch_model_fsdp_0/`: reshard took the folder as that DCP
    checkpoint and wrote it alone, the Trainer parts and files silently left out (exit 0); which
    one the user means is not known, so every command refuses, naming both."""
    import torch.distributed.checkpoint as dcp

    folder = tmp_path / "checkpoint-1"
    dcp.save({"model": {"w": torch.arange(12.0).reshape(4, 3)}}, checkpoint_id=folder / "pytorch_model_fsdp_0",
             no_dist=True)
    dcp.save({"other": torch.arange(3.0)}, checkpoint_id=folder, no_dist=True)
    line = (f"ckptctl: error: {folder}: both a DCP checkpoint (its own .metadata) and an HF Trainer / accelerate "
            "checkpoint folder (pytorch_model_fsdp_0/): which one is meant is not known; move one of them to a "
            "folder of its own\n")
    for args in (("reshard", folder, tmp_path / "out", "-n", "2"), ("inspect", folder),
                 ("export-hf", folder, tmp_path / "out", "--no-name-check", "--hf-config", _config(tmp_path))):
        res = run_cli(*args)
        assert (res.returncode, res.stderr) == (2, line), args
    assert not (tmp_path / "out").exists()
