"""Ctrl-C outside a command's body: one line and exit 130, whenever it lands.

A KeyboardInterrupt raised while the interpreter imports modules, parses options or draws
the final table can surface anywhere (inside an import, during shutdown) and end in a
traceback or a silent death by signal. Outside a command's body there is nothing to clean
up, so the handler ends the process at once; `during_body` hands Ctrl-C back to Python as
KeyboardInterrupt while work that must clean up (temporary output, worker threads) runs.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from typing import Iterator

MESSAGE = b"ckptctl: interrupted\n"
EXIT_INTERRUPTED = 130


def _exit_at_once(signum: int, frame: object) -> None:
    os.write(2, MESSAGE)
    os._exit(EXIT_INTERRUPTED)


def exit_on_interrupt() -> None:
    """From now on Ctrl-C prints one line and exits 130 (in the main thread; elsewhere, as when
    a program calls `ckptctl.cli.main` from a thread, its own handling stays)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, _exit_at_once)


@contextlib.contextmanager
def during_body() -> Iterator[None]:
    """Ctrl-C raises KeyboardInterrupt inside the block (so `finally` clauses clean up), and ends
    the process at once again after it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
