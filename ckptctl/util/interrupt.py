"""Ctrl-C outside a command's body: one line and exit 130, whenever it lands.

A KeyboardInterrupt raised while the interpreter imports modules, parses options or draws
the final table can surface anywhere (inside an import, during shutdown) and end in a
traceback or a silent death by signal. Outside a command's body there is nothing to clean
up, so the handler ends the process at once; `during_body` hands Ctrl-C back to Python as
KeyboardInterrupt while work that must clean up (temporary output, worker threads) runs.

The console script imports `ckptctl.cli`, whose first statement installs the handler; this
module imports little beyond what the interpreter's start-up has loaded (`signal`; no typing,
no threading), so the handler is in place about a millisecond after that start-up (`site`)
ends. A SIGINT before that is the interpreter's: death by signal before it installs its own
handler, then its start-up error or a KeyboardInterrupt traceback.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys

TYPE_CHECKING = False  # typing (and threading) would delay the handler by milliseconds of imports
if TYPE_CHECKING:
    from typing import Iterator, NoReturn

MESSAGE = b"ckptctl: interrupted\n"
EXIT_INTERRUPTED = 130


def _exit_at_once(signum: int, frame: object) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C while the line is written adds none
    os.write(2, MESSAGE)
    os._exit(EXIT_INTERRUPTED)


_ELSEWHERE = object()
"""What `_set_handler` returns outside the main thread."""


def _set_handler(handler: object) -> object:
    """Install `handler` for SIGINT and return the previous one; `_ELSEWHERE`, changing nothing, outside
    the main thread (as when a program calls `ckptctl.cli.main` from a thread: its own handling stays)."""
    try:
        return signal.signal(signal.SIGINT, handler)
    except ValueError:  # "signal only works in main thread of the main interpreter"
        return _ELSEWHERE


def exit_on_interrupt() -> None:
    """From now on Ctrl-C prints one line and exits 130 (in the main thread)."""
    _set_handler(_exit_at_once)


def finish(code: object) -> NoReturn:
    """End the program with `code` (a SystemExit's) once the command has returned.

    Shut-down restores SIGINT's default action, so a Ctrl-C landing then would kill the process
    by signal: it is ignored instead (the command is done). After an interrupted command the
    process ends at once: a KeyboardInterrupt that passed through C code running Python source
    (some extension imports do) would make CPython's shut-down end it by SIGINT, not 130. So does
    a command that failed (its temporary output already removed): a daemon thread still inside
    torch (the output check's source reads) would make the shut-down abort (134), not exit 2."""
    if isinstance(code, int) and code != 0:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
        os._exit(code)
    _set_handler(signal.SIG_IGN)
    raise SystemExit(code)


@contextlib.contextmanager
def during_body() -> Iterator[None]:
    """Ctrl-C raises KeyboardInterrupt inside the block (so `finally` clauses clean up), and ends
    the process at once again after it.

    A KeyboardInterrupt raised while Python runs a callback it cannot propagate from (a weakref
    callback of the import system, a `__del__`) is printed as "Exception ignored" and lost, and
    the command would go on to exit 0 with that stray text; such an interrupt is kept instead and
    raised when the block ends."""
    previous = _set_handler(signal.default_int_handler)
    if previous is _ELSEWHERE:
        yield
        return
    previous_hook = sys.unraisablehook
    lost: list[object] = []

    def keep_interrupts(unraisable: object) -> None:
        if isinstance(getattr(unraisable, "exc_value", None), KeyboardInterrupt):
            lost.append(unraisable)
        else:
            previous_hook(unraisable)

    sys.unraisablehook = keep_interrupts
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        sys.unraisablehook = previous_hook
    if lost:
        raise KeyboardInterrupt
