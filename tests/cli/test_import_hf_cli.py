"""import-hf's wait on transformers as a person sees it: a line saying so on a terminal, at 80
and 120 columns, gone once transformers answers; nothing in a pipe or with --json.

Each run has an empty names cache of its own (`CKPTCTL_CACHE_DIR`), so transformers is
imported and its model built during the run, as on a first import of a config.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import tiny_llama_folder
from tests.terminal import assert_no_traceback, run_in_terminal, unfolded

NAMES_CHECK = "checking tensor names against transformers' LlamaForCausalLM"
WAIT_BAR = {80: 15, 120: 40}
"""Width of the bar drawn beside `NAMES_CHECK` (what is left of the line at 80 columns)."""
WROTE = "wrote out (21 tensors, 61.6 kB in 2 data files + .metadata; names checked against LlamaForCausalLM) in "


@pytest.fixture(scope="module")
def hf(tmp_path_factory) -> Path:
    return tiny_llama_folder(tmp_path_factory.mktemp("import_cli") / "hf", layers=2)


def cold(tmp_path: Path) -> dict[str, str]:
    """An empty names cache: transformers is imported and its model built during the run."""
    return {"CKPTCTL_CACHE_DIR": str(tmp_path / "names-cache")}


@pytest.mark.parametrize("columns", [80, 120])
def test_the_wait_on_transformers_is_a_line_saying_so_then_gone(hf, tmp_path, columns):
    run = run_in_terminal("import-hf", hf, "out", "--world-size", 2, env=cold(tmp_path), columns=columns,
                          cwd=tmp_path)
    assert run.returncode == 0, run.screen
    assert_no_traceback(run.raw)
    assert f"{NAMES_CHECK} " + "━" * WAIT_BAR[columns] in [frame.rstrip() for frame in run.frames]
    lines = run.screen.splitlines()
    assert lines[0].startswith("writing    ━")
    final, = unfolded(lines[1:])
    assert final.startswith(WROTE), final
    assert "checking" not in run.screen


@pytest.mark.parametrize("columns", [80, 120])
def test_a_dry_run_waiting_on_transformers_ends_on_the_screen_of_one_that_does_not(hf, tmp_path, columns):
    args = ("import-hf", hf, "out", "--world-size", 2, "--dry-run")
    first = run_in_terminal(*args, env=cold(tmp_path), columns=columns, cwd=tmp_path)
    again = run_in_terminal(*args, env=cold(tmp_path), columns=columns, cwd=tmp_path)  # names from the cache now
    assert (first.returncode, again.returncode) == (0, 0)
    assert f"{NAMES_CHECK} " + "━" * WAIT_BAR[columns] in [frame.rstrip() for frame in first.frames]
    assert "checking" not in again.raw
    # the predicted peak counts the process's memory so far: transformers' when it was asked
    assert without_peak(first.screen) == without_peak(again.screen)
    assert without_peak(first.screen)[:4] == ["Dry run      nothing written to out", f"Source       {hf}",
                                              "As           fsdp2", "World size   2"]
    assert first.screen.splitlines()[-1] == "Names        names checked against LlamaForCausalLM"


def without_peak(screen: str) -> list[str]:
    return [line for line in screen.splitlines() if not line.startswith("Peak memory")]


def test_the_wait_on_transformers_is_not_announced_in_a_pipe(hf, tmp_path):
    res = subprocess.run([sys.executable, "-m", "ckptctl", "import-hf", str(hf), "out", "--world-size", "2"],
                         capture_output=True, text=True, cwd=tmp_path, env={**os.environ, **cold(tmp_path)},
                         timeout=300)
    assert res.returncode == 0, res.stderr
    assert res.stdout == ""
    final, = res.stderr.splitlines()
    assert re.fullmatch(re.escape(WROTE) + r"\d+\.\d\ds \(writing .*/s\), peak RSS .*", final), final


def test_the_wait_on_transformers_is_not_announced_with_json(hf, tmp_path):
    run = run_in_terminal("import-hf", hf, "out", "--world-size", 2, "--json", env=cold(tmp_path), columns=80,
                          cwd=tmp_path)
    assert run.returncode == 0, run.screen
    assert "checking" not in run.raw
    assert json.loads(run.plain)["model_class"] == "LlamaForCausalLM"
