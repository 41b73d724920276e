"""The source is never modified, whatever DST is.

DST over a file source (its own file, the folder holding it, a folder above) or over a file the
run reads (`--hf-config`'s config.json) is refused by every writing command before anything is
moved, the source files byte-identical after; DST beside a file source is fine.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tests.conftest import FIXTURES, run_cli
from tests.test_hostile_input import copy_fixture, snapshot

OVERLAP = "destination overlaps the source {src}; the source is never modified"


def hf_folder(root: Path) -> Path:
    """A one-file Hugging Face folder: model.safetensors, config.json and generation_config.json."""
    folder = root / "HF"
    folder.mkdir()
    save_file({"model.embed_tokens.weight": torch.arange(12.0).reshape(4, 3), "lm_head.weight": torch.ones(4, 3)},
              folder / "model.safetensors")
    (folder / "config.json").write_text('{"model_type": "llama"}')
    (folder / "generation_config.json").write_text('{"bos_token_id": 1}')
    return folder


def import_args(src: Path, dst: Path) -> list:
    return ["import-hf", src, dst, "-n", "2", "--no-name-check", "--force"]


@pytest.mark.parametrize("where", ["its-folder", "the-file", "a-folder-above"])
def test_import_hf_over_a_file_source_is_refused_and_the_folder_stays_as_it_was(tmp_path: Path, where: str) -> None:
    folder = hf_folder(tmp_path)
    src = folder / "model.safetensors"
    dst = {"its-folder": folder, "the-file": src, "a-folder-above": tmp_path}[where]
    before = snapshot(folder)
    result = run_cli(*import_args(src, dst))
    assert (result.returncode, result.stderr) == (2, f"ckptctl: error: {dst}: {OVERLAP.format(src=src)}\n")
    assert snapshot(folder) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["HF"]  # no temporary sibling either


def test_import_hf_over_a_file_source_reached_relatively_is_refused(tmp_path: Path) -> None:
    folder = hf_folder(tmp_path)
    before = snapshot(folder)
    result = subprocess.run([sys.executable, "-m", "ckptctl", *import_args(Path("model.safetensors"), Path("."))],
                            capture_output=True, text=True, cwd=folder, timeout=120)
    assert (result.returncode, result.stderr) == (
        2, f"ckptctl: error: .: {OVERLAP.format(src='model.safetensors')}\n")
    assert snapshot(folder) == before


def test_import_hf_writes_beside_a_file_source_and_leaves_it_as_it_was(tmp_path: Path) -> None:
    """The folder holding a file source is not the source: `import-hf model.safetensors out` in
    the model's folder is the common way to call it."""
    folder = hf_folder(tmp_path)
    before = snapshot(folder)
    result = run_cli(*import_args(folder / "model.safetensors", folder / "out"))
    assert result.returncode == 0, result.stderr
    after = snapshot(folder)
    assert {name: after[name] for name in before} == before
    assert (folder / "out" / ".metadata").is_file()


@pytest.mark.parametrize("where", ["the-source", "a-folder-above"])
def test_reshard_and_export_hf_over_the_source_are_refused(tmp_path: Path, where: str) -> None:
    src = copy_fixture(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "raw"}')
    dst = src if where == "the-source" else tmp_path
    before, config = snapshot(src), (tmp_path / "config.json").read_bytes()
    for args in (["reshard", src, dst, "-n", "2", "--force"],
                 ["export-hf", src, dst, "--hf-config", tmp_path / "config.json", "--arch", "raw", "--no-name-check",
                  "--force"]):
        result = run_cli(*args)
        assert (result.returncode, result.stderr) == (2, f"ckptctl: error: {dst}: {OVERLAP.format(src=src)}\n"), args
    assert snapshot(src) == before and (tmp_path / "config.json").read_bytes() == config


@pytest.mark.parametrize("where", ["the-config-folder", "the-config-file"])
def test_export_hf_over_its_hf_config_is_refused(tmp_path: Path, where: str) -> None:
    ref = tmp_path / "ref"
    ref.mkdir()
    (ref / "config.json").write_text('{"model_type": "raw"}')
    (ref / "tokenizer.json").write_text('{"model": {}}')
    dst = ref if where == "the-config-folder" else ref / "config.json"
    before = snapshot(ref)
    result = run_cli("export-hf", FIXTURES / "fsdp2_4ranks", dst, "--hf-config", ref, "--arch", "raw",
                     "--no-name-check", "--force")
    assert (result.returncode, result.stderr) == (
        2, f"ckptctl: error: {dst}: destination overlaps {ref / 'config.json'}, which this run reads; "
           "the source is never modified\n")
    assert snapshot(ref) == before


@pytest.mark.parametrize("name", [".metadata", "__0_0.distcp"])
def test_export_torch_over_a_source_file_is_refused(tmp_path: Path, name: str) -> None:
    src = copy_fixture(tmp_path)
    before = snapshot(src)
    result = run_cli("export-torch", src, src / name, "--force")
    assert (result.returncode, result.stderr) == (
        2, f"ckptctl: error: {src / name}: output is inside the source {src}; the source is never modified\n")
    assert snapshot(src) == before
