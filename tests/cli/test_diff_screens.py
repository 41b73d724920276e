"""What a person sees of `ckptctl diff` at 80 and 120 columns: an fp32 checkpoint against its
bf16 export, with and without `--compare-as`, and a torchtitan import against a changed copy
of its Hugging Face source.

Inputs are real: the 4-rank FSDP2 fixture and its bf16 export by export-hf, a tiny Llama
folder transformers saved and its `import-hf --to torchtitan`. They sit in one folder and
are named relative to it (the pty runs there), so that every note's length, and so its
folding, is the same on every machine. Screens come from a real pseudo-terminal played
through pyte (`tests/terminal.py`).
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from tests.conftest import FIXTURES, run_cli, tiny_llama_folder
from tests.terminal import assert_no_traceback, run_in_terminal

BAR = re.compile(r"^comparing  ━{20,} (?P<size>\S+) kB \S+ [kM]?B/s 0:00:00$")
"""The comparing bar as it stays, at its total."""
TABLE_80 = [
    "8 not equal",
    "┏━━━━━━━━━━━━━━━━┳━━━━━━━━━━━━━━━┳━━━━━━━━━━━━━━━━━━━━━━━┓",
    "┃ name           ┃ status        ┃ detail                ┃",
    "┡━━━━━━━━━━━━━━━━╇━━━━━━━━━━━━━━━╇━━━━━━━━━━━━━━━━━━━━━━━┩",
    *(f"│ {name:<14} │ dtype differs │ A float32, B bfloat16 │" for name in (
        "embed.weight", "head.bias", "head.weight", "mlp.fc1.bias", "mlp.fc1.weight", "mlp.fc2.bias",
        "mlp.fc2.weight", "norm.weight")),
    "└────────────────┴───────────────┴───────────────────────┘",
    "8 tensors: 0 equal, 0 close, 0 differs, 8 dtype differs",
]


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    import torch
    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("diff-screens")
    shutil.copytree(FIXTURES / "fsdp2_4ranks", root / "ckpt")
    (root / "raw.json").write_text('{"model_type": "raw"}')
    tiny_llama_folder(root / "hf", layers=2)
    for args in (("export-hf", root / "ckpt", root / "hf-bf16", "--hf-config", root / "raw.json", "--arch", "raw",
                  "--no-name-check", "--dtype", "bf16"),
                 ("import-hf", root / "hf", root / "titan", "--to", "torchtitan", "--world-size", "2")):
        res = run_cli(*args)
        assert res.returncode == 0, res.stderr
    shutil.copytree(root / "hf", root / "hf-changed")
    state = load_file(root / "hf" / "model.safetensors")
    with torch.no_grad():
        state["model.layers.1.self_attn.q_proj.weight"][5, 3] += 0.5
    save_file(state, str(root / "hf-changed" / "model.safetensors"), metadata={"format": "pt"})
    return root


def screen_lines(root: Path, columns: int, *args: str, starting: str | None = None) -> tuple[int, list[str]]:
    """Exit status and screen lines of `diff ARGS`; `starting`: the bar torch starts under, gone once
    it has (the comparing bar counts only bytes compared)."""
    run = run_in_terminal("diff", *args, columns=columns, cwd=root)
    assert_no_traceback(run.screen)
    lines = run.screen.splitlines()
    assert max(map(len, lines)) <= columns
    shown = [f for f in run.frames if f.startswith("starting torch")]
    assert {f.split(" ━")[0] for f in shown} == ({starting} if starting else set())
    assert starting is None or starting not in run.screen
    return run.returncode, lines


def test_dtype_differences_show_no_empty_bar_and_say_how_to_compare_at_80_columns(root):
    code, lines = screen_lines(root, 80, "ckpt", "hf-bf16")
    assert code == 1 and lines == [
        "note: ckpt: model tensors only, prefix 'model.' stripped; 37 optimizer and other",
        "  entries left out (only model weights are in a safetensors folder)",
        "note: 8 floating-point tensors differ in dtype only: --compare-as bf16 compares",
        "  their values as bfloat16",
        *TABLE_80,
    ]


def test_dtype_differences_show_no_empty_bar_and_say_how_to_compare_at_120_columns(root):
    code, lines = screen_lines(root, 120, "ckpt", "hf-bf16")
    assert code == 1 and lines == [
        "note: ckpt: model tensors only, prefix 'model.' stripped; 37 optimizer and other entries left out (only model "
        "weights",
        "  are in a safetensors folder)",
        "note: 8 floating-point tensors differ in dtype only: --compare-as bf16 compares their values as bfloat16",
        *TABLE_80,  # narrow enough to be the same table
    ]


@pytest.mark.parametrize("columns, notes", [
    (80, ["note: ckpt: model tensors only, prefix 'model.' stripped; 37 optimizer and other",
          "  entries left out (only model weights are in a safetensors folder)",
          "note: values compared as bfloat16: A's 8 float32 tensors cast to it, rounding to",
          "  nearest even (as export-hf --dtype casts)"]),
    (120, ["note: ckpt: model tensors only, prefix 'model.' stripped; 37 optimizer and other entries left out (only "
           "model weights",
           "  are in a safetensors folder)",
           "note: values compared as bfloat16: A's 8 float32 tensors cast to it, rounding to nearest even (as "
           "export-hf --dtype",
           "  casts)"]),
])
def test_compared_as_bf16_the_export_is_equal_under_a_full_bar(root, columns, notes):
    code, lines = screen_lines(root, columns, "ckpt", "hf-bf16", "--compare-as", "bf16",
                               starting="starting torch for the bfloat16 cast")
    assert code == 0
    bar = BAR.match(lines[0])
    assert bar is not None and bar["size"] == "1.3/1.3", lines[0]
    assert lines[1:] == [*notes, "8 tensors: 8 equal, 0 close, 0 differs"]


def test_a_torchtitan_import_against_a_changed_hf_source_at_80_columns(root):
    code, lines = screen_lines(root, 80, "titan", "hf-changed", starting="starting torch to reorder rows")
    assert code == 1
    assert BAR.match(lines[0]) is not None and BAR.match(lines[0])["size"] == "6.8/6.8", lines[0]
    assert lines[1:] == [
        "note: titan: 21 model tensors mapped to 21 Hugging Face tensors by export-hf's",
        "  torchtitan-llama3 rules (hf-changed/config.json)",
        "1 not equal",
        "┏━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━┳━━━━━━━━━┳━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━┓",
        "┃ name                             ┃ status  ┃ detail                          ┃",
        "┡━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━╇━━━━━━━━━╇━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━┩",
        "│ model.layers.1.self_attn.q_proj. │ differs │ first at [5, 3], max |a-b| 0.5, │",
        "│ weight                           │         │ 1 of 64 elements                │",
        "└──────────────────────────────────┴─────────┴─────────────────────────────────┘",
        "21 tensors: 20 equal, 0 close, 1 differs",
    ]


def test_a_torchtitan_import_against_a_changed_hf_source_at_120_columns(root):
    code, lines = screen_lines(root, 120, "titan", "hf-changed", starting="starting torch to reorder rows")
    assert code == 1
    assert BAR.match(lines[0]) is not None, lines[0]
    assert lines[1:] == [
        "note: titan: 21 model tensors mapped to 21 Hugging Face tensors by export-hf's torchtitan-llama3 rules",
        "  (hf-changed/config.json)",
        "1 not equal",
        "┏━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━┳━━━━━━━━━┳━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━┓",
        "┃ name                                   ┃ status  ┃ detail                                           ┃",
        "┡━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━╇━━━━━━━━━╇━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━┩",
        "│ model.layers.1.self_attn.q_proj.weight │ differs │ first at [5, 3], max |a-b| 0.5, 1 of 64 elements │",
        "└────────────────────────────────────────┴─────────┴──────────────────────────────────────────────────┘",
        "21 tensors: 20 equal, 0 close, 1 differs",
    ]


def test_in_a_pipe_the_same_compare_is_plain_lines_and_notes_unfolded(root):
    res = run_cli("diff", root / "titan", root / "hf-changed")
    assert res.returncode == 1 and "\x1b" not in res.stdout + res.stderr
    assert res.stdout == ("model.layers.1.self_attn.q_proj.weight: differs: first at [5, 3], max |a-b| 0.5, "
                          "1 of 64 elements\n21 tensors: 20 equal, 0 close, 1 differs\n")
    assert res.stderr == (f"note: {root / 'titan'}: 21 model tensors mapped to 21 Hugging Face tensors by export-hf's "
                          f"torchtitan-llama3 rules ({root / 'hf-changed' / 'config.json'})\n")


LONG_NAMES = ("model.layers.0.self_attn.q_proj.weight", "optim.state.model.layers.0.self_attn.q_proj.weight.exp_avg_sq")


@pytest.fixture(scope="module")
def long_names(tmp_path_factory) -> Path:
    """Two dcp.save checkpoints whose weight and optimizer state under long dotted names differ."""
    import torch
    import torch.distributed.checkpoint as dcp

    root = tmp_path_factory.mktemp("diff-long-names")
    for side, value in (("a", 0.0), ("b", 0.25)):
        state = {name: torch.zeros(4, 4) for name in LONG_NAMES}
        for tensor in state.values():
            tensor[1, 2] = value
        dcp.save(state, checkpoint_id=root / side, no_dist=True)
    return root


@pytest.mark.parametrize("columns, table", [
    (80, ["┏━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━┳━━━━━━━━━┳━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━┓",
          "┃ name                            ┃ status  ┃ detail                           ┃",
          "┡━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━╇━━━━━━━━━╇━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━┩",
          "│ model.layers.0.self_attn.       │ differs │ first at [1, 2], max |a-b| 0.25, │",
          "│ q_proj.weight                   │         │ 1 of 16 elements                 │",
          "│ optim.state.model.layers.0.     │ differs │ first at [1, 2], max |a-b| 0.25, │",
          "│ self_attn.q_proj.weight.        │         │ 1 of 16 elements                 │",
          "│ exp_avg_sq                      │         │                                  │",
          "└─────────────────────────────────┴─────────┴──────────────────────────────────┘"]),
    (120, ["┏━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━┳━━━━━━━━━┳" + "━" * 51 + "┓",
           "┃ name                                                   ┃ status  ┃ detail" + " " * 44 + "┃",
           "┡━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━╇━━━━━━━━━╇" + "━" * 51 + "┩",
           "│ model.layers.0.self_attn.q_proj.weight                 │ differs │ first at [1, 2], max |a-b| 0.25, 1 of "
           "16 elements │",
           "│ optim.state.model.layers.0.self_attn.q_proj.weight.    │ differs │ first at [1, 2], max |a-b| 0.25, 1 of "
           "16 elements │",
           "│ exp_avg_sq                                             │         │" + " " * 51 + "│",
           "└────────────────────────────────────────────────────────┴─────────┴" + "─" * 51 + "┘"]),
])
def test_long_names_in_the_not_equal_table_break_after_dots(long_names, columns, table):
    code, lines = screen_lines(long_names, columns, "a", "b")
    assert code == 1
    assert lines[0].startswith("comparing  ━") and " 128/128 bytes " in lines[0], lines[0]
    assert lines[1:] == ["2 not equal", *table, "2 tensors: 0 equal, 0 close, 2 differs"]
