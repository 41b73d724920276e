"""Run the CLI as a person does: in a pseudo-terminal of fixed size, reading what it draws.

`run_in_terminal` gives stdin, stdout and stderr all to one pty (as a shell does), so
rich sees a terminal, draws tables, colours and live progress bars. `TerminalRun.raw`
keeps every byte (escape sequences included); `TerminalRun.screen` is the text a person
is left looking at (played through a terminal emulator); `TerminalRun.frames` are the
distinct states a live bar was drawn in.
"""

from __future__ import annotations

import errno
import fcntl
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import time
from dataclasses import dataclass
from pathlib import Path

from tests.conftest import ROOT

COLUMNS, ROWS = 120, 40
SCREEN_HISTORY = 3000
"""Rows of the emulated screen: more than any test's output, so nothing scrolls away."""
_ESCAPE = re.compile(r"\x1b(?:\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b]*(?:\x07|\x1b\\)|[@-Z\\-_])")


@dataclass
class TerminalRun:
    returncode: int
    raw: str
    columns: int = COLUMNS

    @property
    def plain(self) -> str:
        """Every byte drawn, escape sequences removed (bar redraws stay, separated by \\r)."""
        return _ESCAPE.sub("", self.raw).replace("\r\n", "\n")

    @property
    def screen(self) -> str:
        """What a person is left looking at: the output played through a terminal emulator
        (pyte) as wide as the pty, tall enough to keep every line; trailing blanks dropped."""
        import pyte

        screen = pyte.Screen(self.columns, SCREEN_HISTORY)
        stream = pyte.Stream(screen)
        stream.feed(self.raw.replace("\r\n", "\n").replace("\n", "\r\n"))
        lines = [line.rstrip() for line in screen.display]
        while lines and not lines[-1]:
            lines.pop()
        return "\n".join(lines)

    @property
    def frames(self) -> list[str]:
        """Every distinct line state drawn (each redraw of a live bar is one)."""
        parts = re.split(r"[\r\n]", self.plain)
        return [p for p in parts if p.strip()]


def run_in_terminal(*args: object, env: dict[str, str] | None = None, columns: int = COLUMNS, rows: int = ROWS,
                    timeout: float = 300, cwd: Path = ROOT) -> TerminalRun:
    """`python -m ckptctl ARGS` on a fresh pty of `columns` × `rows`; returns all it drew and its exit status."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))
    full_env = {k: v for k, v in os.environ.items()
                if k not in ("NO_COLOR", "CKPTCTL_NO_PROGRESS", "COLUMNS", "LINES", "FORCE_COLOR")}
    full_env.update({"TERM": "xterm-256color", **(env or {})})
    proc = subprocess.Popen([sys.executable, "-m", "ckptctl", *map(str, args)], stdin=slave, stdout=slave,
                            stderr=slave, cwd=cwd, env=full_env, start_new_session=True)
    os.close(slave)
    chunks: list[bytes] = []
    deadline = time.monotonic() + timeout
    try:
        while True:
            if time.monotonic() > deadline:
                proc.kill()
                raise TimeoutError(f"ckptctl {' '.join(map(str, args))} still running after {timeout}s")
            ready, _, _ = select.select([master], [], [], 0.1)
            if not ready:
                if proc.poll() is not None and not select.select([master], [], [], 0.2)[0]:
                    break
                continue
            try:
                data = os.read(master, 65536)
            except OSError as exc:  # EIO: the child side closed
                if exc.errno != errno.EIO:
                    raise
                break
            if not data:
                break
            chunks.append(data)
    finally:
        os.close(master)
    return TerminalRun(proc.wait(timeout=30), b"".join(chunks).decode("utf-8", "replace"), columns)


def assert_no_traceback(text: str) -> None:
    assert "Traceback" not in text and 'File "' not in text, text


def unfolded(lines: list[str]) -> list[str]:
    """The lines ckptctl wrote, each line of a fold (`cli.common.folded`) after the first joined
    back to it at the space it replaced: it starts with two spaces, where a terminal's own wrap of
    a long line would start anywhere, mid-word."""
    whole: list[str] = []
    for line in lines:
        if line.startswith("  ") and whole:
            assert not line.startswith("   "), line
            whole[-1] += " " + line[2:]
        else:
            whole.append(line)
    return whole
