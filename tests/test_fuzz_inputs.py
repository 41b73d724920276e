"""The structured fuzzer (tests/fuzz_inputs.py): a short campaign by default, a long one under `full`."""

from __future__ import annotations

import os

import pytest

from tests import fuzz_inputs

SHORT = int(os.environ.get("CKPTCTL_FUZZ_EXAMPLES", "15"))


@pytest.fixture(autouse=True)
def no_canary():
    fuzz_inputs.CANARY.unlink(missing_ok=True)
    yield
    assert not fuzz_inputs.CANARY.exists()


def test_mutated_metadata_pickles_end_in_ckptctl_errors_only() -> None:
    fuzz_inputs.fuzz_metadata(SHORT)


def test_mutated_item_zips_end_in_ckptctl_errors_only() -> None:
    fuzz_inputs.fuzz_items(SHORT)


@pytest.mark.full
def test_long_fuzz_campaign() -> None:
    fuzz_inputs.fuzz_metadata(2000)
    fuzz_inputs.fuzz_items(2000)
