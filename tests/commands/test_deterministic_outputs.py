"""The same input and options give byte-identical output, run after run, for every writing command.

Each run is a fresh process, so anything that depends on where objects land in memory (a
memo keyed by `id()`), on hash seeds or on thread timing shows as a difference between runs.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import FIXTURES, run_cli

RUNS = 2
"""Runs compared in the default suite; `make test-full` adds a third of each."""


def _bytes_of(path: Path) -> dict[str, bytes]:
    if path.is_file():
        return {path.name: path.read_bytes()}
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def _runs(tmp_path: Path, command: str, src: Path, *options: str, suffix: str = "",
          runs: int = RUNS) -> list[dict[str, bytes]]:
    outputs = []
    for k in range(runs):
        out = tmp_path / f"run{k}" / f"out{suffix}"  # one name: a torch.save archive is named after its file
        out.parent.mkdir(exist_ok=True)
        result = run_cli(command, src, out, *options, "--no-sync")
        assert result.returncode == 0, result.stderr
        outputs.append(_bytes_of(out))
    return outputs


@pytest.fixture(scope="module")
def raw_config(tmp_path_factory) -> Path:
    config = tmp_path_factory.mktemp("config") / "config.json"
    config.write_text('{"model_type": "fsdp2-fixture"}')
    return config


@pytest.mark.parametrize("command, src, options, suffix, runs", [
    ("reshard", "fsdp2_4ranks", ("-n", "3", "--dtype", "bf16"), "", RUNS),
    ("export-torch", "fsdp2_4ranks", (), ".pt", RUNS),
    pytest.param("reshard", "fsdp2_4ranks", ("-n", "3", "--dtype", "bf16"), "", 3, marks=pytest.mark.full),
    pytest.param("reshard", "megatron_tp2_dp2", ("-n", "3", "--split-fused"), "", 3, marks=pytest.mark.full),
    pytest.param("reshard", "megatron_tp2_dp2", ("--layout", "megatron-fsdp", "--tp", "1", "--dp", "3"), "", 3,
                 marks=pytest.mark.full),
    pytest.param("reshard", "zstd", ("-n", "2"), "", 3, marks=pytest.mark.full),
    pytest.param("export-torch", "fsdp2_4ranks", (), ".pt", 3, marks=pytest.mark.full),
], ids=["reshard-bf16", "export-torch", "reshard-bf16-3", "reshard-megatron-split-3", "reshard-megatron-fsdp-3",
        "reshard-zstd-3", "export-torch-3"])
def test_a_command_run_again_writes_the_same_bytes(tmp_path: Path, command: str, src: str, options: tuple,
                                                   suffix: str, runs: int) -> None:
    first, *others = _runs(tmp_path, command, FIXTURES / src, *options, suffix=suffix, runs=runs)
    assert len(first) > 1 or suffix
    assert all(other == first for other in others)


def test_export_hf_and_import_hf_run_again_write_the_same_bytes(tmp_path: Path, raw_config: Path) -> None:
    exported = _runs(tmp_path, "export-hf", FIXTURES / "fsdp2_4ranks", "--hf-config", str(raw_config), "--arch",
                     "raw", "--no-name-check", suffix="-hf")
    assert all(other == exported[0] for other in exported[1:])
    imported = _runs(tmp_path, "import-hf", tmp_path / "run0" / "out-hf", "-n", "3", "--no-name-check", suffix="-dcp")
    assert all(other == imported[0] for other in imported[1:])
