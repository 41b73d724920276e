"""What a newcomer sees: inspect's tables at 80 and 120 columns and in a pipe, a reader that
closes the pipe early, and --help.

Screens come from a real pseudo-terminal (`tests/terminal.py`) played through pyte; pipe runs
compare stdout exactly.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.conftest import ROOT, run_cli
from tests.terminal import run_in_terminal

RED_TEXT = "\x1b[31m"
BOLD_RED = "\x1b[1;31m"
GREEN = "\x1b[32m"


def table(screen: str) -> list[str]:
    """The tensor table's lines: from its header to the line before the problems' verdict."""
    lines = screen.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("fqn "))
    end = next(i for i, line in enumerate(lines) if i > start and not line.startswith(("─", " ")) and
               re.match(r"^(No coverage|\d+ problems?:)", line))
    return lines[start:end]


def test_long_names_fold_after_dots_at_120_columns(fixture_ckpt):
    run = run_in_terminal("inspect", fixture_ckpt("megatron_torch_dist"), columns=120)
    assert run.returncode == 0
    rows = table(run.screen)
    assert rows[0].split() == ["fqn", "shape", "dtype", "size", "layout", "coverage"]
    assert "decoder.layers.self_attention.linear_qkv.layer_norm_weight   [2, 32]       float32     256 B   " \
           "layer-stacked   complete" in rows
    assert max(map(len, rows)) <= 120


def test_long_names_fold_after_dots_never_inside_a_word_at_80_columns(fixture_ckpt):
    run = run_in_terminal("inspect", fixture_ckpt("megatron_torch_dist"), columns=80)
    assert run.returncode == 0
    rows = table(run.screen)
    at = next(i for i, line in enumerate(rows) if line.startswith("decoder.layers.       [2, 32]  "))
    assert rows[at:at + 4] == ["decoder.layers.       [2, 32]       float32     256 B   layer-stacked   complete",
                               "self_attention.", "linear_qkv.", "layer_norm_weight"]
    assert "output_layer.weight   [256, 32]     float32   32.8 kB   shard0-even     complete" in rows
    names = [line.split("  ")[0] for line in rows[2:]]
    assert all(name.endswith(".") or name.endswith(("weight", "_weight")) for name in names), names
    assert max(map(len, run.screen.splitlines())) <= 80


def test_a_tensor_with_a_problem_shows_it_in_red_not_a_green_complete(fixture_ckpt):
    for columns in (80, 120):
        run = run_in_terminal("inspect", fixture_ckpt("broken_plain_optim"), columns=columns)
        assert run.returncode == 0
        rows = table(run.screen)
        assert rows[2:] == ["model.w                    [4, 8]   float32   128 B   shard0-even   complete",
                            "optim.state.w.step         []       float32     4 B   scalar        complete",
                            "optim.state.w.exp_avg      [2, 8]   float32    64 B   single        data-loss",
                            "optim.state.w.exp_avg_sq   [2, 8]   float32    64 B   single        data-loss"]
        assert f"{BOLD_RED}data-loss" in run.raw and f"{RED_TEXT}optim.state.w.exp_avg_sq" in run.raw
        assert run.raw.count(f"{GREEN}complete") == 2  # the two healthy tensors only


def test_in_a_pipe_inspect_prints_plain_aligned_lines_without_padding(fixture_ckpt):
    result = run_cli("inspect", fixture_ckpt("broken_plain_optim"))
    assert result.returncode == 0 and result.stderr == ""
    lines = result.stdout.splitlines()
    assert lines[:11] == [
        f"Checkpoint        {fixture_ckpt('broken_plain_optim')}",
        "DCP version       1.0.0 (.metadata)",
        "Saved world size  2",
        "Files             2 data files, 14.4 kB",
        "                  __0_0.distcp  4.5 kB",
        "                  __1_0.distcp  10.0 kB",
        "Entries           model 1, optimizer 8, other 0",
        "Dtypes            float32 4",
        "Layouts           scalar 1, shard0-even 1, single 2",
        "Prefixes          model 'model.'; optimizer 'optim.state.'",
        "4 tensors",
    ]
    assert lines[11:17] == [
        "fqn                       shape   dtype     size  layout       coverage",
        "model.w                   [4, 8]  float32  128 B  shard0-even  complete",
        "optim.state.w.step        []      float32    4 B  scalar       complete",
        "optim.state.w.exp_avg     [2, 8]  float32   64 B  single       data-loss",
        "optim.state.w.exp_avg_sq  [2, 8]  float32   64 B  single       data-loss",
        "2 problems:",
    ]
    assert not [line for line in lines if line != line.rstrip()]
    assert "\x1b" not in result.stdout and "│" not in result.stdout


@pytest.mark.parametrize("args", [
    ["inspect", "{fixtures}/megatron_torch_dist"],
    ["inspect", "{fixtures}/megatron_torch_dist", "--json"],
    ["inspect", "{fixtures}/megatron_torch_dist", "--chunks"],
    ["diff", "{fixtures}/fsdp2_4ranks", "{fixtures}/megatron_torch_dist"],
    ["inspect", "{fixtures}/broken_plain_optim", "--check"],
    ["--version"],
    ["--help"],
    ["inspect", "-h"],
])
def test_a_reader_that_closes_the_pipe_early_is_no_error(args):
    """`ckptctl … | head -1`: the reader is gone before ckptctl writes; the command's own status, no traceback."""
    argv = [a.format(fixtures=ROOT / "fixtures" / "data") for a in args]
    proc = subprocess.Popen([sys.executable, "-m", "ckptctl", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, cwd=ROOT)
    proc.stdout.close()  # long before the interpreter has started: every write meets a closed pipe
    stderr = proc.stderr.read().decode()
    want = 1 if args[0] == "diff" or "--check" in args else 0  # "they differ", "problems found", as with an open pipe
    assert (proc.wait(timeout=300), stderr) == (want, "")


# --- --help -----------------------------------------------------------------------------------

COMMANDS = {"inspect": "CKPT", "reshard": "SRC DST", "export-hf": "SRC DST", "import-hf": "SRC DST", "diff": "A B",
            "export-torch": "SRC OUT"}


@pytest.mark.parametrize("command", COMMANDS)
def test_help_at_80_columns_names_arguments_and_shows_examples_each_on_one_line(command):
    run = run_in_terminal(command, "-h", columns=80)
    assert run.returncode == 0
    lines = [line.strip() for line in run.screen.splitlines()]
    assert f"Usage: ckptctl {command} [OPTIONS] {COMMANDS[command]}" in lines
    at = lines.index("Examples:")
    examples = lines[at + 1:lines.index("", at)]
    assert len(examples) >= 2 and all(line.startswith(f"ckptctl {command} ") for line in examples), examples
    assert run.screen == run_in_terminal(command, "--help", columns=80).screen


def test_help_prose_flows_to_the_width_instead_of_the_source_line_breaks():
    run = run_in_terminal("-h", columns=80)
    lines = [line.strip() for line in run.screen.splitlines()]
    at = lines.index("Inspect, reshard and export PyTorch Distributed Checkpoints offline.")
    assert lines[at + 2:at + 5] == [
        "Exit status: 0 done (diff: equal), 1 problems found (inspect --check) or",
        "differences (diff), 2 bad input or unwritable output (one line names the",
        "file), 130 interrupted."]
    assert "-V" in run.screen and "-h" in run.screen


def test_arch_choices_are_listed_whole_and_match_the_families():
    from ckptctl.cli.help import ARCHES, LAYOUTS, TARGETS
    from ckptctl.families.registry import ARCHES as REGISTERED
    from ckptctl.commands.import_hf import TARGETS as IMPORT_TARGETS
    from ckptctl.planners.megatron_fsdp import LAYOUTS as MEGATRON_LAYOUTS

    assert (ARCHES, TARGETS, LAYOUTS) == (REGISTERED, IMPORT_TARGETS, (*MEGATRON_LAYOUTS, "torch-dist"))
    run = run_in_terminal("export-hf", "-h", columns=80)
    assert "…" not in run.screen
    text = " ".join(re.sub(r"[│╭╰─╮╯]", " ", run.screen).split())
    assert "The model family: " + ", ".join(ARCHES) + ". auto:" in text


def test_short_flags_for_version_and_help():
    from ckptctl import __version__

    assert run_cli("-V").stdout == f"ckptctl {__version__}\n"
    assert run_cli("-h").stdout == run_cli("--help").stdout


@pytest.mark.parametrize("long, short", [("bfloat16", "bf16"), ("float16", "fp16"), ("float32", "fp32")])
def test_dtype_takes_torch_names_as_well_as_short_ones(fixture_ckpt, tmp_path, long, short):
    import json

    plans = [run_cli("reshard", fixture_ckpt("fsdp2_4ranks"), tmp_path / "o", "-n", "2", "--dtype", name,
                     "--dry-run", "--json") for name in (long, short)]
    assert [p.returncode for p in plans] == [0, 0], plans[0].stderr
    written = [json.loads(p.stdout)["bytes_written"] for p in plans]
    assert written[0] == written[1]


@pytest.mark.parametrize("words, offered", [
    ("ckptctl export-hf a b --arch qwen3", ["qwen3", "qwen3-moe", "qwen3-next", "qwen3.5"]),
    ("ckptctl import-hf a b --arch torch", ["torchtitan-llama3", "torchtitan-qwen3", "torchtitan-deepseek-v3"]),
    ("ckptctl reshard a b --dtype b", ["bf16", "bfloat16"]),
    ("ckptctl export-torch a b --dtype f", ["fp16", "fp32", "float16", "float32"]),
    ("ckptctl reshard a b --layout ", ["fsdp2", "megatron-fsdp", "torch-dist"]),
    ("ckptctl import-hf a b --to ", ["fsdp2", "torchtitan", "megatron-fsdp"]),
])
def test_shell_completion_offers_the_choices(words, offered):
    env = {**__import__("os").environ, "_CKPTCTL_COMPLETE": "complete_bash", "COMP_WORDS": words,
           "COMP_CWORD": str(len(words.split()) - (0 if words.endswith(" ") else 1))}
    result = subprocess.run([sys.executable, "-m", "ckptctl"], capture_output=True, text=True, cwd=ROOT, env=env)
    assert result.stdout.split() == offered


HEAVY = ("torch", "ckptctl.commands.reshard", "ckptctl.formats.dcp.metadata", "ckptctl.commands.export_hf", "ckptctl.families.registry",
         "ckptctl.core.analysis", "ckptctl.engine.dist")


@pytest.mark.parametrize("args", [["--version"], ["--help"], ["inspect", "--help"], ["export-hf", "--help"]])
def test_version_and_help_import_no_library_module(args):
    """What keeps `ckptctl --version` and `--help` quick (~0.15 s, from 0.4-1.0 s): no planner, no format, no torch."""
    code = ("import sys\nfrom ckptctl.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
            f"print([m for m in {HEAVY!r} if m in sys.modules])")
    result = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=ROOT)
    assert result.stdout.splitlines()[-1] == "[]"


# --- consistency ------------------------------------------------------------------------------


def test_reshard_and_inspect_count_the_same_data_files(fixture_ckpt, tmp_path):
    result = run_cli("reshard", fixture_ckpt("fsdp2_4ranks"), tmp_path / "o", "-n", "3")
    assert re.match(rf"wrote {tmp_path / 'o'} \(32 tensors, 116\.5 kB in 3 data files \+ \.metadata\) in ",
                    result.stderr), result.stderr
    assert re.search(r"^Files             3 data files, ", run_cli("inspect", tmp_path / "o").stdout, re.M)


def test_a_cast_says_it_starts_torch_before_its_writing_bar(fixture_ckpt, tmp_path):
    run = run_in_terminal("reshard", fixture_ckpt("fsdp2_4ranks"), tmp_path / "o", "-n", "2", "--dtype", "bf16",
                          columns=120)
    assert run.returncode == 0
    frames = run.frames
    starting = [i for i, f in enumerate(frames) if f.startswith("starting torch for the bf16 cast ━")]
    writing = [i for i, f in enumerate(frames) if f.startswith("writing ")]
    assert starting and writing and max(starting) < min(writing), frames
    assert "bytes" not in frames[starting[0]] and "B/s" not in frames[starting[0]]
    assert "starting torch" not in run.screen  # gone once torch is up: the bar and the final line stay
    assert run.screen.splitlines()[0].startswith("writing ")


def _styles(raw: str, columns: int, text: str) -> set[tuple[str, bool]]:
    """The colour and boldness of each character of `text` where the screen shows it."""
    import pyte

    screen = pyte.Screen(columns, 100)
    pyte.Stream(screen).feed(raw.replace("\r\n", "\n").replace("\n", "\r\n"))
    for y, line in enumerate(screen.display):
        x = line.find(text)
        if x >= 0:
            return {(screen.buffer[y][x + i].fg, screen.buffer[y][x + i].bold) for i in range(len(text))}
    raise AssertionError(f"{text!r} not on screen")


def test_the_final_line_colours_each_figure_whole(fixture_ckpt, tmp_path):
    run = run_in_terminal("export-torch", fixture_ckpt("fsdp2_4ranks"), tmp_path / "m.pt", columns=250)
    assert run.returncode == 0
    line = run.screen.splitlines()[-1]
    seconds = re.search(r" in (\d+\.\d\ds) ", line).group(1)
    size = re.search(r"\d+\.\d kB", line).group(0)
    rate = re.search(r"writing (\d+(?:\.\d+)? [kMG]?B/s)", line).group(1)
    for figure in (seconds, size, rate):
        styles = _styles(run.raw, 250, figure)
        assert len(styles) == 1 and styles != {("default", False)}, (figure, styles)


def test_export_torch_dry_run_says_what_it_would_write_and_writes_nothing(fixture_ckpt, tmp_path):
    src, out = fixture_ckpt("fsdp2_4ranks"), tmp_path / "m.pt"
    piped = run_cli("export-torch", src, out, "--dry-run", "--dtype", "bfloat16")
    assert piped.returncode == 0 and not out.exists()
    assert piped.stdout.splitlines() == [f"Dry run  nothing written to {out}", f"Source   {src}", "Dtype    bfloat16",
                                         "Entries  32 tensors, 13 other entries",
                                         re.search(r"File     one torch.save file, \S+ kB", piped.stdout).group(0)]
    out.write_bytes(b"")
    for columns in (80, 120):
        run = run_in_terminal("export-torch", src, out, "--dry-run", columns=columns)
        assert run.returncode == 0 and out.read_bytes() == b""
        assert "Destination  exists: a run stops unless --force, which replaces it" in run.screen.splitlines()
    doc = __import__("json").loads(run_cli("export-torch", src, out, "--dry-run", "--json").stdout)
    assert doc["dry_run"] is True and doc["bytes"] > 0
