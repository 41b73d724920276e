"""What a person reads of the one-line notes, final lines, warnings and errors at 80 and 120
columns: folded at spaces, each next line indented by two, never a word (a path, a tensor
name, a figure) cut at the terminal's edge; one line each in a pipe.

The inputs sit in one folder and are named relative to it (each pty runs there), so that each
line's length, and so its folding, is the same on every machine. A final line's timings vary:
it is matched whole once its folds are joined at the spaces they replaced.
"""

from __future__ import annotations

import io
import re
import shutil
from pathlib import Path

import pytest

from tests.conftest import FIXTURES, run_cli, tiny_llama_folder
from tests.terminal import assert_no_traceback, run_in_terminal, unfolded

TIMING = r" in \d+\.\d\ds \(writing (\d+ B|\d+\.\d [kMG]B|\d+\.\d\d GB)/s\), peak RSS \d+\.\d [kMG]B"
"""The tail of every writing command's final line (`timing_summary`), without --verify."""


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """A DCP checkpoint, a tiny Llama folder and its Megatron-FSDP import, side by side."""
    root = tmp_path_factory.mktemp("folded")
    shutil.copytree(FIXTURES / "fsdp2_4ranks", root / "ckpt")
    shutil.copytree(FIXTURES / "broken_plain_optim", root / "broken")
    tiny_llama_folder(root / "hf", layers=2)
    res = run_cli("import-hf", root / "hf", root / "megatron", "--to", "megatron-fsdp", "--tp", "1", "--dp", "2")
    assert res.returncode == 0, res.stderr
    return root


@pytest.fixture
def here(root, tmp_path) -> Path:
    """A folder of this test's own to write into, the shared inputs linked in under their names."""
    for name in ("ckpt", "broken", "hf", "megatron"):
        (tmp_path / name).symlink_to(root / name)
    return tmp_path


def lines_of(here: Path, columns: int, *args: object, status: int = 0) -> list[str]:
    """The screen `ckptctl ARGS` leaves at `columns`, run in `here`, as lines; none is wider."""
    run = run_in_terminal(*args, columns=columns, cwd=here)
    assert run.returncode == status, run.screen
    assert_no_traceback(run.raw)
    lines = run.screen.splitlines()
    assert max(map(len, lines)) <= columns
    return lines


IMPORT = ("import-hf", "hf", "imported-as-megatron-fsdp", "--to", "megatron-fsdp", "--tp", "1", "--dp", "2")
IMPORT_WROTE = (r"wrote imported-as-megatron-fsdp \(15 tensors, 52\.1 kB in 2 data files \+ \.metadata; "
                r"names checked against LlamaForCausalLM\)")
EXCLUDED = "model.layers.*.self_attn.rotary_emb.inv_freq_of_older_releases"
EXPORT = ("export-hf", "megatron", "exported-to-hugging-face", "--hf-config", "hf", "--tp", "1", "--exclude", EXCLUDED)
EXPORT_WROTE = r"wrote exported-to-hugging-face \(llama, 21 tensors in 1 safetensors file, 8\.8 kB\)"


@pytest.mark.parametrize("args, columns, note, wrote", [
    (IMPORT, 80, ["note: vocab padded from 32 to 128 rows with zeros (a multiple of 128 × TP 1, as",
                  "  Megatron pads it)"], IMPORT_WROTE),
    (IMPORT, 120, ["note: vocab padded from 32 to 128 rows with zeros (a multiple of 128 × TP 1, as Megatron pads it)"],
     IMPORT_WROTE),
    (EXPORT, 80, [f"note: --exclude '{EXCLUDED}'", "  matches no tensor"], EXPORT_WROTE),
    (EXPORT, 120, [f"note: --exclude '{EXCLUDED}' matches no tensor"], EXPORT_WROTE),
], ids=["import-hf-80", "import-hf-120", "export-hf-80", "export-hf-120"])
def test_a_note_and_the_final_line_fold_at_spaces(here, args, columns, note, wrote):
    lines = lines_of(here, columns, *args)
    assert lines[0].startswith("writing    ━")
    assert lines[1:1 + len(note)] == note
    final, = unfolded(lines[1 + len(note):])
    assert re.fullmatch(wrote + TIMING, final), final


@pytest.mark.parametrize("columns", [80, 120])
def test_reshard_final_line_folds_at_spaces(here, columns):
    lines = lines_of(here, columns, "reshard", "ckpt", "ckpt-resharded-to-three-ranks", "--world-size", "3")
    assert lines[0].startswith("writing    ━")
    final, = unfolded(lines[1:])
    assert re.fullmatch(r"wrote ckpt-resharded-to-three-ranks \(32 tensors, 116\.5 kB in 3 data files \+ "
                        r"\.metadata\)" + TIMING, final), final


@pytest.mark.parametrize("columns", [80, 120])
def test_export_torch_final_line_folds_at_spaces(here, columns):
    lines = lines_of(here, columns, "export-torch", "ckpt", "ckpt-as-one-torch-save-file.pt")
    assert lines[0].startswith("writing    ━")
    final, = unfolded(lines[1:])
    assert re.fullmatch(r"wrote ckpt-as-one-torch-save-file\.pt \(32 tensors, 13 other entries, 14\.4 kB\)"
                        + TIMING, final), final


CHECKED = {
    80: ["optim.state.w.exp_avg: saved [2, 8] (16 elements) but param model.w is [4, 8]",
         "  (32 elements): optimizer state was saved as a plain per-rank tensor and DCP",
         "  kept one rank's copy (data loss)",
         "optim.state.w.exp_avg_sq: saved [2, 8] (16 elements) but param model.w is [4, 8]",
         "  (32 elements): optimizer state was saved as a plain per-rank tensor and DCP",
         "  kept one rank's copy (data loss)"],
    120: ["optim.state.w.exp_avg: saved [2, 8] (16 elements) but param model.w is [4, 8] (32 elements): optimizer "
          "state was saved",
          "  as a plain per-rank tensor and DCP kept one rank's copy (data loss)",
          "optim.state.w.exp_avg_sq: saved [2, 8] (16 elements) but param model.w is [4, 8] (32 elements): optimizer "
          "state was",
          "  saved as a plain per-rank tensor and DCP kept one rank's copy (data loss)"],
}


@pytest.mark.parametrize("columns", [80, 120])
def test_inspect_check_problems_fold_at_spaces(here, columns):
    assert lines_of(here, columns, "inspect", "broken", "--check", status=1) == CHECKED[columns]


def test_inspect_check_problems_are_one_line_each_in_a_pipe(fixture_ckpt):
    res = run_cli("inspect", fixture_ckpt("broken_plain_optim"), "--check")
    assert (res.returncode, res.stderr) == (1, "")
    assert res.stdout.splitlines() == [" ".join(line.strip() for line in CHECKED[80][at:at + 3]) for at in (0, 3)]


@pytest.mark.parametrize("columns, error", [
    (80, ["ckptctl: error: megatron: cannot tell the training TP size (no args entry, no",
          "  RowParallel chunks split on dim 1); pass --tp"]),
    (120, ["ckptctl: error: megatron: cannot tell the training TP size (no args entry, no RowParallel chunks split on "
           "dim 1); pass",
           "  --tp"]),
])
def test_an_error_folds_at_spaces(here, columns, error):
    assert lines_of(here, columns, "export-hf", "megatron", "out", "--hf-config", "hf", status=2) == error
    assert not (here / "out").exists()


@pytest.mark.parametrize("width, lines", [
    (31, ["wrote out in 6.73s (writing", "  6.8 MB/s), peak RSS 366.2 MB"]),
    (54, ["wrote out in 6.73s (writing 6.8 MB/s), peak RSS", "  366.2 MB"]),
])
def test_a_figure_keeps_its_unit_on_its_line(width, lines):
    from rich.console import Console

    from ckptctl.cli.common import folded

    console = Console(file=io.StringIO(), width=width, force_terminal=True)
    assert folded("wrote out in 6.73s (writing 6.8 MB/s), peak RSS 366.2 MB", console).splitlines() == lines


def test_only_a_unit_is_held_to_its_figure():
    from rich.console import Console

    from ckptctl.cli.common import folded

    console = Console(file=io.StringIO(), width=11, force_terminal=True)
    assert folded("read 12 B of 7 Bananas", console).splitlines() == ["read 12 B", "  of 7", "  Bananas"]
