"""SIGINT at any moment of the real `ckptctl` console script: exit 130 and the one line.

Every command is interrupted at a spread of delays from its start, through the interpreter's
start-up, imports, option parsing and the work. ckptctl's handler is installed by the first
statement of `ckptctl.cli`, the module the console script imports; before that the signal is
the interpreter's, and only these outcomes are allowed for it: death by SIGINT with nothing
written (before the interpreter installed its own handler), the interpreter's own start-up
failure (while `site` runs, or the standard streams are set up before it), a KeyboardInterrupt the
import system's callback swallowed (printed as ignored; the command then runs), or a KeyboardInterrupt whose traceback stops short of ckptctl's
handler (in ckptctl's package `__init__`, in `ckptctl.util.interrupt`'s imports, in `ckptctl.cli`
at its import of `ckptctl.util.interrupt` or the call that installs the handler). A traceback
anywhere else fails, as a stray line on stderr does.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import ckptctl
from tests.conftest import FIXTURES

LINE = "ckptctl: interrupted\n"
CONSOLE_SCRIPT = Path(sys.executable).parent / "ckptctl"
PACKAGE = Path(ckptctl.__file__).resolve().parent
CLI = PACKAGE / "cli" / "__init__.py"
CLI_LINES = CLI.read_text().splitlines()
IMPORTED_AT = next(n for n, line in enumerate(CLI_LINES, 1) if line.startswith("from ckptctl.util.interrupt import"))
INSTALLED_AT = next(n for n, line in enumerate(CLI_LINES, 1) if line.startswith("exit_on_interrupt()"))
"""A KeyboardInterrupt in `ckptctl.cli` may come from its lines up to the import of `ckptctl.util.interrupt`
(docstring, `__future__`) and from the call that installs the handler: nowhere else."""
DELAYS = (0, 0.02, 0.05, 0.08, 0.12, 0.16, 0.2, 0.25, 0.3)
LOST_IN_IMPORTLIB = re.compile(r"Exception ignored in: <function _get_module_lock\.<locals>\.cb at 0x[0-9a-f]+>\n"
                               r"Traceback \(most recent call last\):\n"
                               r'  File "<frozen importlib\._bootstrap>", line \d+, in cb\n'
                               r"KeyboardInterrupt: \n")
"""The interpreter's KeyboardInterrupt raised in a weakref callback of the import system before
ckptctl's handler is in place: CPython prints it as ignored and the program goes on. After that
moment, ckptctl's handler raises nothing (it exits), and inside a command's body such a lost
interrupt ends the command as one (`test_an_interrupt_lost_in_a_callback_…`)."""


def before_the_handler(returncode: int, err: str) -> bool:
    """Whether the outcome is the interpreter's, the signal having landed before ckptctl's handler."""
    if (returncode, err) == (-signal.SIGINT, ""):
        return True
    if returncode == 1 and re.match(r"Fatal Python error: init_\w+: ", err):  # site, or the streams before it
        return True
    if returncode == 0 and LOST_IN_IMPORTLIB.fullmatch(err):
        return True  # Python's own handler raised inside the import system's callback, which swallows it
    if returncode != -signal.SIGINT or not err.startswith("Traceback") or not err.endswith("KeyboardInterrupt\n"):
        return False
    for file, line in re.findall(r'File "([^"]+)", line (\d+)', err):
        path = Path(file).resolve()
        if PACKAGE not in path.parents:
            continue  # the console script itself, the standard library, importlib
        if path == PACKAGE / "__init__.py" or path == PACKAGE / "util" / "interrupt.py":
            continue
        if path == CLI and (int(line) <= IMPORTED_AT or int(line) == INSTALLED_AT):
            continue
        return False
    return True


def commands(root: Path) -> dict[str, list]:
    """Each command once, quiet and with --json (nothing on stderr when it ends well), DST by `{}`."""
    src = FIXTURES / "fsdp2_4ranks"
    (root / "config.json").write_text('{"model_type": "raw"}')
    hf = root / "hf"
    hf.mkdir()
    save_file({"model.embed_tokens.weight": torch.arange(12.0).reshape(4, 3)}, hf / "model.safetensors")
    return {
        "inspect": ["inspect", src],
        "reshard": ["reshard", src, "{}", "-n", "2"],
        "export-hf": ["export-hf", src, "{}", "--hf-config", root / "config.json", "--arch", "raw", "--no-name-check"],
        "import-hf": ["import-hf", hf, "{}", "-n", "2", "--no-name-check"],
        "export-torch": ["export-torch", src, "{}"],
        "diff": ["diff", src, src],
    }


def test_sigint_at_any_moment_is_130_and_one_line_for_every_command(tmp_path: Path) -> None:
    seen: dict[str, set[str]] = {}
    for name, args in commands(tmp_path).items():
        for i, delay in enumerate(DELAYS):
            dst = tmp_path / f"{name}-{i}"
            argv = [str(CONSOLE_SCRIPT), "-q", *(str(dst) if a == "{}" else str(a) for a in args), "--json"]
            proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            time.sleep(delay)
            proc.send_signal(signal.SIGINT)
            _, err = proc.communicate(timeout=60)
            if (proc.returncode, err) == (130, LINE):
                outcome = "interrupted"  # DST absent or complete (a signal after the rename), nothing else left
                assert not any(p.name.startswith(f".{dst.name}.ckptctl-") for p in tmp_path.iterdir()), (name, delay)
            elif (proc.returncode, err) == (0, ""):
                outcome = "finished"  # the signal landed after the command's end
            else:
                assert before_the_handler(proc.returncode, err), (name, delay, proc.returncode, err)
                outcome = "before ckptctl"
            seen.setdefault(name, set()).add(outcome)
    assert all("interrupted" in outcomes for outcomes in seen.values()), seen


def test_an_interrupt_lost_in_a_callback_still_ends_the_command_as_one(capsys) -> None:
    """Python prints a KeyboardInterrupt raised inside a weakref callback as "Exception ignored" and
    goes on; the command body would then exit 0 with that text on stderr. It ends as an interrupt."""
    import weakref

    from ckptctl.cli.common import run_guarded

    class Resource:
        pass

    def interrupted(_ref: object) -> None:
        raise KeyboardInterrupt

    def body() -> str:
        resource = Resource()
        keep = weakref.ref(resource, interrupted)
        del resource  # the callback runs here; its KeyboardInterrupt cannot propagate
        assert keep() is None
        return "finished"

    try:
        run_guarded(body)
    except SystemExit as stop:
        assert stop.code == 130
    else:
        raise AssertionError("the body's lost interrupt was not kept")
    assert capsys.readouterr().err == LINE


def test_an_interrupt_python_wraps_still_ends_the_command_as_one(capsys) -> None:
    """Found by the any-moment test in CI: Ctrl-C while a module imported during the command
    creates a dataclass (its fields' `__set_name__`) came out of Python 3.11 as "RuntimeError:
    Error calling __set_name__", a traceback and exit 1. It ends the command as an interrupt."""
    from ckptctl.cli.common import run_guarded

    class Interrupting:
        def __set_name__(self, owner: type, name: str) -> None:
            raise KeyboardInterrupt

    def body() -> None:
        class Holder:  # noqa: F841 - made for its __set_name__ call
            field = Interrupting()

    with pytest.raises(SystemExit) as caught:
        run_guarded(body)
    assert (caught.value.code, capsys.readouterr().err) == (130, "ckptctl: interrupted\n")


def test_an_error_that_is_no_interrupt_still_propagates() -> None:
    from ckptctl.cli.common import run_guarded

    def body() -> None:
        try:
            raise ValueError("first")
        except ValueError as exc:
            raise RuntimeError("second") from exc

    with pytest.raises(RuntimeError, match="^second$"):
        run_guarded(body)
