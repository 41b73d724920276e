"""Every command as a person sees it at a terminal, and as a script sees it in a pipe.

Terminal runs go through a real pseudo-terminal (`tests/terminal.py`, 120 × 40) and read
the screen a terminal emulator is left with: tables, bars, the final line, no traceback.
Pipe runs must stay quiet (one summary line on stderr) and `--json` pure JSON.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from tests.conftest import ROOT, run_cli
from tests.terminal import assert_no_traceback, run_in_terminal

ESCAPE = re.compile(r"\x1b\[")
COLOUR = re.compile(r"\x1b\[[0-9;]*(?:3[0-9]|9[0-7]|38;5;\d+)m")
RATE = r"\d+(?:\.\d+)? (?:B|kB|MB|GB)/s"


@pytest.fixture(scope="module")
def src(fixture_ckpt):
    return fixture_ckpt("fsdp2_4ranks")


WIDE = 250
"""Columns for runs whose final line names a temporary path: one line on screen."""


def final_line(screen: str) -> str:
    return screen.strip().splitlines()[-1]


def test_inspect_at_a_terminal_draws_the_summary_and_the_tensor_table(src):
    run = run_in_terminal("inspect", src)
    assert run.returncode == 0
    assert_no_traceback(run.plain)
    screen = run.screen
    assert re.search(r"^Checkpoint\s+.*fixtures/data/fsdp2_4ranks\s*$", screen, re.M)
    assert re.search(r"^Saved world size\s+4$", screen, re.M)
    assert re.search(r"^Files\s+4 data files, 172\.8 kB$", screen, re.M)
    assert "32 tensors" in screen
    assert re.search(r"^model\.mlp\.fc1\.weight {20}\[12, 8\] {3}float32 {3}384 B {3}shard0-even {3}complete$", screen,
                     re.M)
    assert final_line(screen) == "No coverage or consistency problems."
    assert COLOUR.search(run.raw)  # a person at a colour terminal gets colour


def test_inspect_chunks_at_a_terminal_lists_every_chunk(src):
    run = run_in_terminal("inspect", src, "--chunks", "--filter", "model.head.weight")
    assert run.returncode == 0
    assert_no_traceback(run.plain)
    lines = run.screen.splitlines()
    at = lines.index("model.head.weight")
    chunk_lines = [line for line in lines[at + 1:] if line.startswith("  __")]
    assert [re.sub(r"bytes \d+\+\d+", "bytes N", line) for line in chunk_lines] == [
        "  __0_0.distcp  bytes N  offsets [0, 0]  sizes [1, 8]",
        "  __1_0.distcp  bytes N  offsets [1, 0]  sizes [1, 8]",
        "  __3_0.distcp  bytes N  offsets [2, 0]  sizes [0, 8]",  # FSDP2's zero-size chunk past the end
    ]


def test_inspect_check_at_a_terminal_prints_the_problem_and_exits_1(fixture_ckpt):
    run = run_in_terminal("inspect", fixture_ckpt("broken_plain_optim"), "--check")
    assert run.returncode == 1
    assert_no_traceback(run.plain)
    assert "saved [2, 8] (16 elements) but param model.w is [4, 8] (32 elements)" in run.screen.replace("\n", "")


def test_reshard_at_a_terminal_draws_writing_then_verifying_bars_and_one_rate(src, tmp_path):
    run = run_in_terminal("reshard", src, tmp_path / "o", "-n", "3", "--verify", columns=WIDE)
    assert run.returncode == 0
    assert_no_traceback(run.plain)
    screen = run.screen.splitlines()
    writing = [line for line in screen if line.startswith("writing")]
    verifying = [line for line in screen if line.startswith("verifying")]
    assert len(writing) == 1 and len(verifying) == 1  # one bar per phase, each left at its end state
    assert re.search(rf"━ 116\.5/116\.5 kB {RATE}\s+\d:\d\d:\d\d$", writing[0])
    assert re.search(r"━ 7\.7/7\.7 kB", verifying[0])  # the tensors' 3.8 kB twice: hashed, then decoded and compared
    assert any(re.match(r"writing\s+━+ 0\.0/116\.5 kB", f) for f in run.frames)  # the bar was drawn from 0
    last = final_line(run.screen)
    assert re.fullmatch(rf"wrote \S+/o \(32 tensors, 116\.5 kB in 3 data files \+ \.metadata\) in \d+\.\d\ds "
                        rf"\(writing ({RATE}), "
                        rf"verifying \d+\.\d\ds\), peak RSS \d+\.\d MB, verified", last), last
    bar_rate = re.search(RATE, writing[0]).group(0)
    assert re.search(r"\(writing (" + RATE + ")", last).group(1) == bar_rate  # the same bytes over the same clock


def test_reshard_with_a_helper_process_at_a_terminal_looks_the_same(src, tmp_path):
    """The helper (forked here from one record up) adds its bytes to the one bar and prints nothing."""
    run = run_in_terminal("reshard", src, tmp_path / "o", "-n", "3", env={"CKPTCTL_HELPER_MIN_RECORDS": "1"},
                          columns=WIDE)
    assert run.returncode == 0
    assert_no_traceback(run.plain)
    writing = [line for line in run.screen.splitlines() if line.startswith("writing")]
    assert len(writing) == 1 and re.search(rf"━ 116\.5/116\.5 kB {RATE}\s+\d:\d\d:\d\d$", writing[0])
    assert re.fullmatch(rf"wrote \S+/o \(32 tensors, 116\.5 kB in 3 data files \+ \.metadata\) in \d+\.\d\ds "
                        rf"\(writing {RATE}\), "
                        r"peak RSS \d+\.\d MB", final_line(run.screen)), final_line(run.screen)
    assert len(run.screen.strip().splitlines()) == 2  # the bar and the final line, nothing from the helper


@pytest.mark.parametrize("columns", [80, 120])
def test_reshard_dry_run_at_a_terminal_prints_the_plan_and_writes_nothing(src, tmp_path, columns):
    run = run_in_terminal("reshard", src, tmp_path / "o", "-n", "3", "--dry-run", columns=columns)
    assert run.returncode == 0
    lines = [line for line in run.screen.splitlines() if not line.startswith(" ")]  # a long path wraps at 80
    assert [line.split("  ")[0] for line in lines] == ["Dry run", "Source", "World size", "Dtype", "Entries", "Files",
                                                       "Read", "Peak memory"]
    assert [re.sub(r"[\d.]+ kB", "N kB", line) for line in run.screen.splitlines() if "distcp" in line] == [
        f"             __{r}_0.distcp  N kB" for r in range(3)]
    assert lines[5] == "Files        3 data files + .metadata, 116.5 kB"
    assert not (tmp_path / "o").exists()
    (tmp_path / "o").mkdir()
    for force, says in (((), "exists: a run stops unless --force, which replaces it"),
                        (("--force",), "exists: --force replaces it")):
        run = run_in_terminal("reshard", src, tmp_path / "o", "-n", "3", "--dry-run", *force, columns=columns)
        assert run.returncode == 0 and f"Destination  {says}" in run.screen.splitlines()
        assert "\x1b[33m" + says in run.raw  # in yellow


@pytest.mark.parametrize("how", [["-q"], ["--quiet"], "env"])
def test_quiet_and_the_environment_switch_turn_the_bars_off(src, tmp_path, how):
    args, env = (how, None) if how != "env" else ([], {"CKPTCTL_NO_PROGRESS": "1"})
    run = run_in_terminal("reshard", src, tmp_path / "o", "-n", "2", *args, env=env, columns=WIDE)
    assert run.returncode == 0
    assert "━" not in run.raw and "writing" not in run.screen.split("\n")[0][:8]
    assert final_line(run.screen).startswith(f"wrote {tmp_path / 'o'} (32 tensors")


def test_no_color_keeps_the_layout_without_colour(src, tmp_path):
    run = run_in_terminal("reshard", src, tmp_path / "o", "-n", "2", env={"NO_COLOR": "1"})
    assert run.returncode == 0 and not COLOUR.search(run.raw)
    assert "writing" in run.screen
    inspect = run_in_terminal("inspect", src, env={"NO_COLOR": "1"})
    assert inspect.returncode == 0 and not COLOUR.search(inspect.raw) and "32 tensors" in inspect.screen


def test_a_dumb_terminal_gets_no_escape_sequences_and_no_bar(src, tmp_path):
    run = run_in_terminal("reshard", src, tmp_path / "o", "-n", "2", "--verify", env={"TERM": "dumb"}, columns=WIDE)
    assert run.returncode == 0 and not ESCAPE.search(run.raw)
    assert run.screen.splitlines()[0].startswith(f"wrote {tmp_path / 'o'} (32 tensors")
    inspect = run_in_terminal("inspect", src, env={"TERM": "dumb"})
    assert inspect.returncode == 0 and not ESCAPE.search(inspect.raw) and "32 tensors" in inspect.screen


@pytest.mark.parametrize("args, line", [
    (["inspect", "/nonexistent/ckpt"], "ckptctl: error: /nonexistent/ckpt: no such file or directory"),
    (["reshard", "{src}", "{tmp}/o", "-n", "2", "--include", "nothing*"],
     "ckptctl: error: --include 'nothing*' selects none of the 45 entries"),
    (["inspect", "{src}", "--filter", "decoder.*"],
     "ckptctl: error: --filter 'decoder.*' matches none of the 45 entries"),
    (["reshard", "{src}", "{tmp}/o", "-n", "0"], "ckptctl: error: --world-size must be at least 1 (got 0)"),
])
def test_errors_at_a_terminal_are_one_line_with_status_2(src, tmp_path, args, line):
    args = [a.format(src=src, tmp=tmp_path) for a in args]
    run = run_in_terminal(*args, columns=WIDE)
    assert run.returncode == 2
    assert run.screen == line
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("command", [[], ["inspect"], ["reshard"], ["export-hf"], ["import-hf"], ["diff"],
                                     ["export-torch"]])
def test_help_at_a_terminal(command):
    run = run_in_terminal(*command, "--help")
    assert run.returncode == 0
    assert_no_traceback(run.plain)
    assert run.screen.lstrip().startswith(f"Usage: ckptctl {' '.join(command)}".rstrip())
    if not command:
        for name in ("inspect", "reshard", "export-hf", "import-hf", "diff", "export-torch", "--version", "--quiet",
                     "--install-completion"):
            assert name in run.screen
        assert "Exit status: 0 done" in run.screen


def test_version_from_the_script_and_from_python_m():
    from ckptctl import __version__

    run = run_in_terminal("--version")
    assert (run.returncode, run.screen) == (0, f"ckptctl {__version__}")
    module = subprocess.run([sys.executable, "-m", "ckptctl", "--version"], capture_output=True, text=True, cwd=ROOT)
    assert (module.returncode, module.stdout, module.stderr) == (0, f"ckptctl {__version__}\n", "")


NAMED_SHELL = {"_TYPER_COMPLETE_TEST_DISABLE_SHELL_DETECTION": "1"}
"""typer's switch that makes the completion options take the shell's name instead of detecting it."""


@pytest.mark.parametrize("shell, marker", [("bash", "complete -o default -F _ckptctl_completion ckptctl"),
                                           ("zsh", "#compdef ckptctl")])
def test_shell_completion_script_is_shown(shell, marker):
    result = subprocess.run([sys.executable, "-m", "ckptctl", "--show-completion", shell],
                            capture_output=True, text=True, cwd=ROOT, env={**os.environ, **NAMED_SHELL})
    assert result.returncode == 0 and marker in result.stdout


def test_install_completion_writes_the_script_and_sources_it_from_bashrc(tmp_path):
    env = {**os.environ, **NAMED_SHELL, "HOME": str(tmp_path)}
    result = subprocess.run([sys.executable, "-m", "ckptctl", "--install-completion", "bash"],
                            capture_output=True, text=True, cwd=ROOT, env=env)
    assert result.returncode == 0, result.stderr
    script = tmp_path / ".bash_completions" / "ckptctl.sh"
    assert "_ckptctl_completion" in script.read_text()
    assert f"source '{script}'" in (tmp_path / ".bashrc").read_text()


def test_completion_completes_command_names():
    env = {"_CKPTCTL_COMPLETE": "complete_bash", "COMP_WORDS": "ckptctl re", "COMP_CWORD": "1"}
    result = subprocess.run([sys.executable, "-m", "ckptctl"], capture_output=True, text=True, cwd=ROOT,
                            env={**os.environ, **env})
    assert result.stdout.split() == ["reshard"]


def test_in_a_pipe_a_run_is_one_summary_line_on_stderr(src, tmp_path):
    result = run_cli("reshard", src, tmp_path / "o", "-n", "2", "--verify")
    assert result.returncode == 0 and result.stdout == ""
    assert len(result.stderr.splitlines()) == 1 and result.stderr.startswith(f"wrote {tmp_path / 'o'} (32 tensors")
    assert not ESCAPE.search(result.stderr)


@pytest.mark.parametrize("args", [["inspect", "{src}", "--json"],
                                  ["reshard", "{src}", "{tmp}/o", "-n", "2", "--json", "--verify"]])
def test_json_at_a_terminal_is_pure_json(src, tmp_path, args):
    run = run_in_terminal(*[a.format(src=src, tmp=tmp_path) for a in args])
    assert run.returncode == 0
    assert not ESCAPE.search(run.raw)  # no bar, no colour: the terminal gets the document only
    json.loads(run.plain)
