"""Shared test fixtures: the committed real checkpoints and the CLI runner."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

FIXTURES = ROOT / "fixtures" / "data"

COSTLIEST_FIRST = ("tests/planners/test_torch_dist_optimizer.py", "tests/commands/test_import_hf.py",
                   "tests/commands/test_diff.py", "tests/cli/test_export_hf_cli.py",
                   "tests/formats/test_hostile_pickles.py")
"""The files `make test` spends longest in (CI's `--durations`), run first: `--dist loadfile`
hands files to the two workers in collection order, and a long one taken last leaves the other
core idle at the end."""


def pytest_collection_modifyitems(items: list) -> None:
    rank = {path: i for i, path in enumerate(COSTLIEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))


@pytest.fixture(scope="session", autouse=True)
def private_cache(tmp_path_factory):
    """ckptctl's cache of expected HF names lives in the test session, not in the user's home;
    CLI children inherit it through the environment."""
    os.environ["CKPTCTL_CACHE_DIR"] = str(tmp_path_factory.mktemp("ckptctl-cache"))


@pytest.fixture(scope="session")
def fixture_ckpt():
    """Path of a committed fixture checkpoint by name (see fixtures/README.md)."""

    def get(name: str) -> Path:
        path = FIXTURES / name
        if not path.is_dir():
            pytest.fail(f"fixture {name} missing: run `python fixtures/make_fixtures.py`")
        return path

    return get


@pytest.fixture
def forks(monkeypatch):
    """Runs in this process fork the second-core helper (torch is imported here, so `wanted` would
    say no), and its early check is taken to cost nothing (the sample reads of a tiny output would
    leave the helper no file); the helpers' pids are recorded."""
    from ckptctl.checks import output_check
    from ckptctl.engine import helper

    started: list[int] = []
    real_start = helper.start

    def start(work, progress):
        running = real_start(work, progress)
        started.append(running.pid)
        return running

    monkeypatch.setattr(helper, "wanted", lambda records: True)
    monkeypatch.setattr(output_check, "READ_BACK_RECORD_SECONDS", 0.0)
    monkeypatch.setattr(output_check, "SOURCE_SAMPLE_SECONDS", 0.0)
    monkeypatch.setattr(output_check, "LOCATED_SAMPLE_SECONDS", 0.0)
    monkeypatch.setattr(helper, "start", start)
    return started


def run_cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run `python -m ckptctl ARGS` as a user would, capturing stdout/stderr as text."""
    return subprocess.run(
        [sys.executable, "-m", "ckptctl", *map(str, args)],
        capture_output=True, text=True, timeout=timeout, cwd=ROOT,
    )


def tiny_llama_folder(out: Path, layers: int, **save: Any) -> Path:
    """A tiny Llama (hidden 8, vocab 32, seed 0) as transformers' `save_pretrained(out, **save)`
    writes it: the Hugging Face folder hostile-input tests damage."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=32, hidden_size=8, intermediate_size=16, num_hidden_layers=layers,
                                      num_attention_heads=2, num_key_value_heads=1)
    transformers.LlamaForCausalLM(config).save_pretrained(out, **save)
    return out
