"""The import contract of `pyproject.toml` ([tool.importlinter]): each layer of the code imports
only from its own layer and those below it (utilities → planning → families and Megatron rules →
formats → engine → commands → cli), and reshard's planners and verification never import
reshard (no cycle through it), checked by import-linter itself."""

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
    assert "Contracts: 2 kept, 0 broken." in run.stdout
