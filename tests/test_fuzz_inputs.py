"""The structured fuzzer (tests/fuzz_inputs.py) in a fresh process, so its peak RSS means something:
a short campaign by default, a long one under `full`."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests import fuzz_inputs

SHORT = int(os.environ.get("CKPTCTL_FUZZ_EXAMPLES", "15"))


def campaign(examples: int) -> None:
    fuzz_inputs.CANARY.unlink(missing_ok=True)
    proc = subprocess.run([sys.executable, "-m", "tests.fuzz_inputs", str(examples)], capture_output=True, text=True,
                          cwd=fuzz_inputs.ROOT, timeout=3600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert re.fullmatch(rf"fuzz: {4 * examples} examples \(.metadata, item zips, pickled values, HF folders\), only ckptctl "
                        r"errors, canary untouched, peak RSS \d+ MB \(baseline \d+ MB\), \d+ s\n", proc.stdout), proc.stdout
    assert not fuzz_inputs.CANARY.exists()


def test_mutated_pickles_item_zips_pickled_values_and_hf_folders_end_in_ckptctl_errors_only() -> None:
    campaign(SHORT)


@pytest.mark.full
def test_long_fuzz_campaign() -> None:
    campaign(2000)
