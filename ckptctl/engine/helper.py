"""A helper process: a second core for the writing one thread would otherwise do alone.

Writing a million tiny records is Python on the calling thread (threads would only contend
for the interpreter lock). A plain run with enough records, on a machine of several cores,
forks one helper that writes some output files (and `.metadata`) while the run writes the
rest: no tensor data crosses between them, and the helper sends its progress, its one-line
error, what it delivers on the way and its work's result (a few kilobytes each: what it
checked) through a pipe. The helper never
returns into the caller's code: it ends with `os._exit`, so none of the run's `finally` clauses
(the atomic directory's clean-up) runs in it, nor are the run's unflushed output buffers
written twice. It ignores Ctrl-C (the run stops
it) and dies with the run. Forked only where that is safe: torch not imported (its thread
pools do not survive a fork), before the run starts its worker threads, Linux.
"""

from __future__ import annotations

import os
import signal
import struct
import sys
import threading
from typing import Callable, Mapping, NoReturn

from ckptctl.util.errors import CkptctlError, UsageError

MIN_RECORDS = 20_000
"""Records from which a run forks a helper: below, a run takes about a second at most (38,400
tiny records resharded: 2.3 s alone, 1.6 s with a helper)."""
MIN_RECORDS_ENV = "CKPTCTL_HELPER_MIN_RECORDS"
"""Overrides MIN_RECORDS (0: never fork a helper)."""
_PROGRESS_BYTES = 1 << 20
_PROGRESS, _ERROR, _DELIVERED, _RESULT = b"P", b"E", b"D", b"R"
_U64 = struct.Struct("<Q")


class HelperFailedError(CkptctlError):
    """The helper's own one-line error, raised in the run."""


def wanted(records: int) -> bool:
    """Whether a run writing `records` records forks a helper."""
    raw = os.environ.get(MIN_RECORDS_ENV, "")
    try:
        threshold = int(raw) if raw else MIN_RECORDS
    except ValueError:
        raise UsageError(f"{MIN_RECORDS_ENV} must be a whole number (got {raw!r})") from None
    return (0 < threshold <= records and hasattr(os, "fork") and sys.platform == "linux"
            and "torch" not in sys.modules and len(os.sched_getaffinity(0)) >= 2)


def share(sizes: Mapping[str, int], load: int = 0) -> frozenset[str]:
    """The helper's files: the last ones by name, never all of them, about half the bytes less
    `load` (what the work it does besides costs in bytes of files: `OutputPlan.finish_load`)."""
    names = sorted(sizes)
    target, taken, mine = (sum(sizes.values()) - load) / 2, 0, []
    for name in reversed(names[1:]):
        if taken >= target:
            break
        mine.append(name)
        taken += sizes[name]
    return frozenset(mine)


class Helper:
    """A running helper: `delivered` waits for what its work delivers on the way, `join` for its
    end (it raises its error and returns its work's result); `stop` kills it (once joined, a no-op)."""

    def __init__(self, pid: int, relay: _Relay) -> None:
        self.pid, self._relay = pid, relay
        self._status: int | None = None

    def delivered(self) -> bytes | None:
        """What the work delivered, once it has (None: it ended, or failed, without delivering)."""
        self._relay.delivery.wait()
        return self._relay.delivered

    def join(self) -> bytes | None:
        self._wait()
        if self._relay.errors:
            raise HelperFailedError(self._relay.errors[0])
        if self._status:
            code = os.waitstatus_to_exitcode(self._status)
            how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"
            raise HelperFailedError(f"the helper process ended by {how}")
        return self._relay.results[0] if self._relay.results else None

    def stop(self) -> None:
        if self._status is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self._wait()

    def _wait(self) -> None:
        if self._status is None:
            self._status = os.waitpid(self.pid, 0)[1]
        self._relay.join()


Work = Callable[[Callable[[int], None], Callable[[bytes], None]], "bytes | None"]
"""What a helper runs: `work(report, deliver)`."""


def start(work: Work, progress: Callable[[int], None]) -> Helper | None:
    """Fork a helper that runs `work(report, deliver)`; `report(nbytes)` reaches `progress` in this
    process, what it passes to `deliver` (once) `Helper.delivered`, and what it returns
    `Helper.join`. None when the system cannot fork now (out of processes or memory): the run does
    the work."""
    read_end, write_end = os.pipe()
    run = os.getpid()
    try:
        pid = os.fork()
    except OSError:
        os.close(read_end)
        os.close(write_end)
        return None
    if pid == 0:
        os.close(read_end)
        _run_helper(work, write_end, run)
    os.close(write_end)
    relay = _Relay(read_end, progress)
    relay.start()
    return Helper(pid, relay)


def _run_helper(work: Work, fd: int, run: int) -> NoReturn:
    status = 1
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the run's to handle: it stops the helper
        _die_with(run)
        pending = 0

        def report(nbytes: int) -> None:
            nonlocal pending
            pending += nbytes
            if pending >= _PROGRESS_BYTES:
                os.write(fd, _PROGRESS + _U64.pack(pending))
                pending = 0

        def deliver(data: bytes) -> None:
            _send(fd, _DELIVERED + _U64.pack(len(data)) + data)

        result = work(report, deliver)
        if pending:
            os.write(fd, _PROGRESS + _U64.pack(pending))
        if result is not None:
            _send(fd, _RESULT + _U64.pack(len(result)) + result)
        status = 0
    except BaseException as exc:  # noqa: BLE001 - sent to the run, which raises it
        message = str(exc) if isinstance(exc, CkptctlError) else f"{type(exc).__name__}: {exc}"
        data = message.encode("utf-8", "replace")
        try:
            os.write(fd, _ERROR + _U64.pack(len(data)) + data)
        except OSError:
            pass
    os._exit(status)


def _die_with(run: int) -> None:
    """Ask Linux to kill this process when the run (process `run`) ends, however it ends."""
    import ctypes  # here: only a helper needs it

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != run:  # the run ended before the request
        os._exit(1)


def _send(fd: int, data: bytes) -> None:
    """All of `data` into the pipe (a message over the pipe's buffer is written in parts)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


class _Relay(threading.Thread):
    """Passes the helper's progress on and keeps its error, what it delivered and its result,
    until it closes the pipe."""

    def __init__(self, fd: int, progress: Callable[[int], None]) -> None:
        super().__init__(name="ckptctl-helper", daemon=True)
        self.fd, self.progress = fd, progress
        self.errors: list[str] = []
        self.results: list[bytes] = []
        self.delivered: bytes | None = None
        self.delivery = threading.Event()
        """Set once the helper delivered, or closed the pipe without."""

    def run(self) -> None:
        try:
            with os.fdopen(self.fd, "rb") as pipe:
                while True:
                    head = pipe.read(1 + _U64.size)
                    if len(head) < 1 + _U64.size:  # closed (a helper killed mid-message says no more)
                        return
                    size = _U64.unpack_from(head, 1)[0]
                    if head[:1] == _PROGRESS:
                        try:
                            self.progress(size)
                        except Exception:  # noqa: BLE001 - a display; the pipe must still be drained or the helper blocks
                            self.progress = _no_progress
                    elif head[:1] == _DELIVERED:
                        self.delivered = pipe.read(size)
                        self.delivery.set()
                    elif head[:1] == _RESULT:
                        self.results.append(pipe.read(size))
                    else:
                        self.errors.append(pipe.read(size).decode("utf-8", "replace"))
        finally:
            self.delivery.set()


def _no_progress(nbytes: int) -> None:
    """What the relay reports to once the run's progress display failed."""
