"""The tree is the architecture: one folder per layer, nothing loose at the top of the package but
its face, and the import contract of `pyproject.toml` ([tool.importlinter]) — each layer imports
only from its own folder and those below it (util → core → storage → families and megatron →
formats → engine → planners and checks → commands → cli) — checked by import-linter itself."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

LINT = Path(sys.executable).parent / "lint-imports"


@pytest.mark.skipif(not LINT.exists() and shutil.which("lint-imports") is None, reason="import-linter not installed")
def test_every_module_imports_only_from_its_layer_and_below():
    lint = str(LINT) if LINT.exists() else shutil.which("lint-imports")
    run = subprocess.run([lint, "--no-cache"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:]
    assert "Contracts: 1 kept, 0 broken." in run.stdout


def test_the_package_top_holds_only_its_face_and_one_folder_per_layer():
    package = ROOT / "ckptctl"
    assert sorted(p.name for p in package.glob("*.py")) == ["__init__.py", "__main__.py"]
    assert sorted(p.name for p in package.iterdir() if p.is_dir() and p.name != "__pycache__") == [
        "checks", "cli", "commands", "core", "engine", "families", "formats", "megatron", "planners", "storage", "util"]
