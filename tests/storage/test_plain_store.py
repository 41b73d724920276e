"""Every command runs through a store that has no descriptors (`plain_store.PlainStore`: bytes
read and written at offsets, as an object store's client reaches them) and writes the same bytes
as through the local store: nothing in the formats, engine, checks or commands depends on a
local file beyond the `Store` interface. Run as a user would, with `--verify`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.commands.test_golden_outputs import CASES, GOLDEN, digests
from tests.conftest import FIXTURES, ROOT, run_cli, tiny_llama_folder


def run_plain(*args: object) -> subprocess.CompletedProcess:
    """`ckptctl ARGS` with the plain store in place of the local one."""
    return subprocess.run([sys.executable, "-m", "tests.storage.plain_store", *map(str, args)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)


@pytest.mark.parametrize("case", ["fsdp2_4ranks-n3", "fsdp2_4ranks-torch"])
def test_a_reshard_and_an_export_through_it_write_the_recorded_bytes(case: str, tmp_path: Path) -> None:
    command, src, *rest = CASES[case]
    out = tmp_path / (case + (".pt" if command == "export-torch" else ""))
    result = run_plain(command, FIXTURES / src, out, *rest, "--no-sync", "--verify")
    assert result.returncode == 0, result.stderr
    assert digests(out) == json.loads(GOLDEN.read_text())[case]


def test_an_hf_folder_imported_and_exported_through_it_is_the_local_stores_to_the_byte(tmp_path: Path) -> None:
    model = tiny_llama_folder(tmp_path / "model", layers=2)
    outputs = {}
    for name, run in (("plain", run_plain), ("local", run_cli)):
        dcp, hf = tmp_path / name / "dcp", tmp_path / name / "hf"
        imported = run("import-hf", model, dcp, "-n", "2", "--no-sync", "--verify")
        assert imported.returncode == 0, imported.stderr
        exported = run("export-hf", dcp, hf, "--hf-config", model, "--no-sync", "--verify")
        assert exported.returncode == 0, exported.stderr
        outputs[name] = (digests(dcp), digests(hf))
    assert outputs["plain"] == outputs["local"]
    compared = run_plain("diff", model, tmp_path / "plain" / "hf")
    assert compared.returncode == 0, compared.stdout + compared.stderr
