"""A path that holds no checkpoint gets a line that says what to pass instead.

A newcomer points `inspect` at the folder above the checkpoints (`demo` for `demo/ckpt`), passes
an object store's URL, or gives import-hf a Hub model id (which only `--hf-config` downloads).
"""

from __future__ import annotations

from pathlib import Path

from tests.conftest import FIXTURES, run_cli


def _error(*args: object) -> tuple[int, str]:
    run = run_cli(*args)
    return run.returncode, run.stderr


def test_the_folder_above_checkpoints_names_the_ones_inside() -> None:
    inside = sorted(p for p in FIXTURES.iterdir() if (p / ".metadata").exists())
    assert len(inside) > 3
    shown = ", ".join(str(p) for p in inside[:3])
    assert _error("inspect", FIXTURES) == (2, f"ckptctl: error: {FIXTURES}: no .metadata file (not a DCP checkpoint?); "
                                              f"checkpoints inside: {shown} (+{len(inside) - 3} more)\n")


def test_a_folder_without_checkpoints_says_only_what_is_missing(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    assert _error("inspect", tmp_path) == (2, f"ckptctl: error: {tmp_path}: no .metadata file (not a DCP "
                                              "checkpoint?)\n")


def test_an_object_store_url_is_named_as_one(tmp_path: Path) -> None:
    line = "object stores are not supported yet: copy the checkpoint to a local folder first"
    assert _error("inspect", "s3://bucket/step-1000") == (2, f"ckptctl: error: s3://bucket/step-1000: {line}\n")
    assert _error("reshard", "gs://bucket/step-1000", tmp_path / "out", "-n", 2) == (
        2, f"ckptctl: error: gs://bucket/step-1000: {line}\n")
    assert _error("diff", "s3://bucket/a", FIXTURES / "fsdp2_4ranks") == (2, f"ckptctl: error: s3://bucket/a: {line}\n")


def test_import_hf_of_a_hub_id_says_how_to_get_the_folder(tmp_path: Path) -> None:
    assert _error("import-hf", "Qwen/Qwen3-0.6B", tmp_path / "out", "-n", 2) == (
        2, "ckptctl: error: Qwen/Qwen3-0.6B: no such file or directory; a Hub model id is read by --hf-config only: "
           "download the model first (`huggingface-cli download Qwen/Qwen3-0.6B --local-dir DIR`) and pass DIR\n")
    assert not (tmp_path / "out").exists()


def test_a_missing_local_path_of_one_slash_is_not_taken_for_a_hub_id(tmp_path: Path) -> None:
    run = run_cli("inspect", "out/ckpt-ws8")
    assert (run.returncode, run.stderr) == (2, "ckptctl: error: out/ckpt-ws8: no such file or directory\n")
