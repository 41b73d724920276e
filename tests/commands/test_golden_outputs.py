"""Outputs stay byte-identical: every file each command writes for the committed fixtures has
the SHA-256 recorded in tests/golden_outputs.json.

Speed work on locating, planning and writing must not change a byte. The digests were taken
from the code before that work and agree with it on every file but one: the zstd reshard's
`.metadata`, which the old code pickled through torch's own pickler whenever the stream
transforms had imported torch.distributed (same content for torch, other bytes); it is now
always written as `torch_pickle` writes it. A change that means to alter outputs updates the
file with `python -m tests.commands.test_golden_outputs` and says why in its commit.
"""

from __future__ import annotations

import hashlib
import json
import sys
import tempfile
from pathlib import Path

import pytest

from tests.conftest import FIXTURES, run_cli

GOLDEN = Path(__file__).resolve().parents[1] / "golden_outputs.json"
CASES = {
    "fsdp2_4ranks-n3": ("reshard", "fsdp2_4ranks", "-n", "3"),
    "fsdp2_4ranks-n2-bf16": ("reshard", "fsdp2_4ranks", "-n", "2", "--dtype", "bf16"),
    "flat_optim-n3": ("reshard", "flat_optim", "-n", "3"),
    "zstd-n2": ("reshard", "zstd", "-n", "2"),
    "megatron-split-n3": ("reshard", "megatron_tp2_dp2", "-n", "3", "--split-fused"),
    "megatron-mfsdp-tp2-dp2": ("reshard", "megatron_tp2_dp2", "--layout", "megatron-fsdp", "--tp", "2", "--dp", "2"),
    "fsdp2_4ranks-torch": ("export-torch", "fsdp2_4ranks"),
}


def digests(path: Path) -> dict[str, str]:
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    return {(p.name if path.is_file() else str(p.relative_to(path))): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in files}


def written(case: str, tmp: Path) -> dict[str, str]:
    command, src, *rest = CASES[case]
    out = tmp / (case + (".pt" if command == "export-torch" else ""))
    result = run_cli(command, FIXTURES / src, out, *rest, "--no-sync")
    assert result.returncode == 0, result.stderr
    return digests(out)


@pytest.mark.parametrize("case", sorted(CASES))
def test_outputs_are_byte_identical_to_the_recorded_ones(case: str, tmp_path: Path) -> None:
    assert written(case, tmp_path) == json.loads(GOLDEN.read_text())[case]


if __name__ == "__main__":  # rewrite the recorded digests from what this checkout writes
    with tempfile.TemporaryDirectory() as tmp:
        GOLDEN.write_text(json.dumps({c: written(c, Path(tmp)) for c in CASES}, indent=1, sort_keys=True) + "\n")
    print(f"wrote {GOLDEN}", file=sys.stderr)
