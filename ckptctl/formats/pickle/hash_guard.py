"""Refuse a pickle whose dict keys or set members would make CPython's own hashing crash or hang.

CPython hashes a tuple by hashing its items, recursively, in C. A key nested 200,000 tuples
deep overflows the C stack (the interpreter dies with a segfault), and a key built from
memo references to one tuple (t1 = (t0, t0), t2 = (t1, t1), ...) costs 2^depth to hash
from a few hundred bytes of pickle. C's unpickler hashes every key it inserts inside one C
call that nothing can interrupt, so the restricted unpicklers run this guard first:

* a small pickle (every item's `data.pkl`, a small `.metadata`) is scanned opcode by
  opcode: the stack is simulated with each value's size as a tree of tuples (memo
  references included), and a key or set member over `MAX_KEY_NODES`, or keys together
  over a budget proportional to the pickle, is refused;
* a larger one (a big `.metadata`, where a scan in Python would cost more than the load) is
  first unpickled by C's unpickler in a forked child with inert stand-ins for the globals
  (it hashes the same keys the real load would): a child that dies by a signal or misses
  a deadline proportional to the pickle's size means the pickle is refused. A pickle the
  child cannot finish for other reasons is left to the real load to diagnose. The child may
  allocate `probe_allowance(size)` bytes beyond what the process holds, and its stack may have
  held `MAX_STACK` values at most: a pickle that needs more (millions of empty lists or memo
  references in a few megabytes, a bytearray of a terabyte) is never handed to the real load
  (`PickleTooCostly`), which would build the same values.

The interpreters (`pickle.vm`) build their values themselves, so they check each key before
hashing it (`KeyGuard`) against the same limits.
"""

from __future__ import annotations

import faulthandler
import gc
import os
import pickle
import pickletools
import resource
import select
import signal
import sys
from typing import Any, Callable

from ckptctl.formats.pickle.vm import MAX_STACK, Constructor, MalformedPickleError

SCAN_LIMIT = 1 << 16
"""Pickles up to this size are scanned in process; larger ones are probed in a child."""
MAX_KEY_NODES = 4096
"""Tuples (and their items) one dict key or set member may consist of: DCP's are a name or a
handful of integers, and a C stack holds this many nested tuples with room to spare."""
PROBE_SECONDS = 2.0
PROBE_SECONDS_PER_MB = 0.5
"""The child's deadline: C's unpickler reads a real `.metadata` at more than 20 MB/s (ten
times the deadline's rate), a small one in milliseconds."""

PROBE_BASE_BYTES = 64 << 20
PROBE_BYTES_PER_BYTE = 12
"""What the child may allocate: real `.metadata` costs C's unpickler 4 to 7 bytes a byte (measured
on one-chunk-per-tensor saves of 4.7 MB), a pickle of empty lists 72."""

MAX_STACK_BYTES = 2 * MAX_STACK * 8
"""The most C's unpickler may have allocated for its stack: `pickle.vm.MAX_STACK` pointers, twice
over for its growth by halves."""

_TUPLE_OPS = {"EMPTY_TUPLE": 0, "TUPLE1": 1, "TUPLE2": 2, "TUPLE3": 3}
_GET_OPS = frozenset({"GET", "BINGET", "LONG_BINGET"})
_PUT_OPS = frozenset({"PUT", "BINPUT", "LONG_BINPUT"})


def _refuse(why: str) -> MalformedPickleError:
    return MalformedPickleError(f"{why}: tuples nested or shared so that hashing a dict key would crash or hang")


class PickleTooCostly(Exception):
    """The probe child ran out of its allowance: C's unpickler would build more than the pickle's
    size allows (or ask for a buffer no file holds). The caller lets the interpreter name the fault."""


def probe_allowance(size: int) -> int:
    """Bytes the probe child may allocate for a pickle of `size` bytes."""
    return PROBE_BASE_BYTES + PROBE_BYTES_PER_BYTE * size


class KeyGuard:
    """Checks, before an interpreter hashes it, that a dict key or set member is of bounded hashing
    cost: at most `MAX_KEY_NODES` tuples, frozensets and their items, and all keys of one load
    together within a budget proportional to the pickle's size (as `_scan` counts them)."""

    __slots__ = ("left", "inside")

    def __init__(self, size: int, inside: Callable[[Any], Any] | None = None) -> None:
        self.left = 4 * size + MAX_KEY_NODES
        self.inside = inside
        """Items a hashable value other than a tuple or frozenset hashes (an inert opaque call's arguments)."""

    def check(self, key: Any) -> None:
        kind = type(key)
        if kind is str or kind is int:
            return
        nodes, todo = 0, [key]
        while todo:
            item = todo.pop()
            nodes += 1
            if nodes > MAX_KEY_NODES:
                raise _refuse(f"a dict key or set member made of more than {MAX_KEY_NODES} tuples")
            if isinstance(item, (tuple, frozenset)):
                todo.extend(item)
            elif self.inside is not None and type(item) is not str:
                more = self.inside(item)
                if more is not None:
                    todo.append(more)
        self.left -= nodes
        if self.left < 0:
            raise _refuse("dict keys that together hash more tuples than the pickle's size allows")


class _Unscanned(Exception):
    """The scan stopped at something pickletools cannot parse; C's unpickler may read further."""


def check_key_hashing(data: Any, globals_: dict[tuple[str, str], Any], source: Callable[[Any], Any]) -> None:
    """Raise MalformedPickleError when unpickling `data` would hash a hazardous key; `source`
    makes the file C's unpickler reads `data` through (the restricted unpickler's own)."""
    if len(data) <= SCAN_LIMIT or not hasattr(os, "fork"):  # no fork (Windows): every pickle is scanned
        try:
            _scan(bytes(data))
            return
        except _Unscanned:
            if not hasattr(os, "fork"):
                raise MalformedPickleError("pickle cannot be read opcode by opcode") from None
    _probe(data, globals_, source)


def _scan(data: bytes) -> None:
    stack: list[int] = []  # each value's node count as a tuple tree (1 for anything else)
    marks: list[int] = []
    memo: dict[Any, int] = {}
    budget = 4 * len(data) + MAX_KEY_NODES

    def keys(nodes: list[int]) -> None:
        nonlocal budget
        for n in nodes:
            if n > MAX_KEY_NODES:
                raise _refuse(f"a dict key or set member made of {n} tuples")
            budget -= n
        if budget < 0:
            raise _refuse("dict keys that together hash more tuples than the pickle's size allows")

    def to_mark() -> list[int]:
        at = marks.pop() if marks else 0
        items = stack[at:]
        del stack[at:]
        return items

    try:
        for op, arg, _ in pickletools.genops(data):
            name = op.name
            if name == "MARK":
                marks.append(len(stack))
            elif name in _TUPLE_OPS:
                n = _TUPLE_OPS[name]
                items = stack[len(stack) - n:] if n else []
                del stack[len(stack) - n:]
                stack.append(1 + sum(items))
            elif name == "TUPLE":
                stack.append(1 + sum(to_mark()))
            elif name in _GET_OPS:
                stack.append(memo.get(arg, 1))
            elif name in _PUT_OPS:
                memo[arg] = stack[-1] if stack else 1
            elif name == "DUP":
                stack.append(stack[-1] if stack else 1)
            elif name == "MEMOIZE":
                memo[len(memo)] = stack[-1] if stack else 1
            elif name == "SETITEM":
                keys(stack[-2:-1])
                del stack[-2:]
            elif name in ("SETITEMS", "DICT"):
                items = to_mark()
                keys(items[0::2])
                if name == "DICT":
                    stack.append(1)
            elif name in ("ADDITEMS", "FROZENSET"):
                keys(to_mark())
                if name == "FROZENSET":
                    stack.append(1)
            else:
                before, after = op.stack_before, op.stack_after
                if pickletools.markobject in before:
                    to_mark()
                    before = before[:before.index(pickletools.markobject)]
                if before:
                    del stack[len(stack) - len(before):]
                stack.extend([1] * len(after))
    except MalformedPickleError:
        raise
    except Exception:  # noqa: BLE001 - genops's complaint about a malformed pickle: the rest goes unscanned,
        raise _Unscanned from None  # so the child probes it whole


class _Record:
    """Stands in for a record class in the probe: NEWOBJ makes one, BUILD fills its __dict__ in C."""


class _TupleStateRecord:
    """A record whose pickled state is a tuple (TensorProperties): BUILD needs a __setstate__."""

    def __setstate__(self, state: Any) -> None:
        pass


def _call(*args: Any) -> tuple:
    return args


_CONSTANT = object()


class _Probe(pickle.Unpickler):
    """C's unpickler with inert stand-ins: the same keys reach the same dicts as in the real load."""

    def __init__(self, file: Any, globals_: dict[tuple[str, str], Any]) -> None:
        super().__init__(file, fix_imports=False)
        self._globals = globals_

    def find_class(self, module: str, name: str) -> Any:
        found = self._globals.get((module, name))
        if found is None:
            raise pickle.UnpicklingError(f"{module}.{name}")
        if type(found) is not Constructor:
            return _CONSTANT
        if found.call is not None:
            return tuple if found.name == "torch.Size" else _call
        return _TupleStateRecord if found.name.endswith(".TensorProperties") else _Record

    def persistent_load(self, pid: Any) -> Any:
        return pid


def _probe(data: Any, globals_: dict[tuple[str, str], Any], source: Callable[[Any], Any]) -> None:
    deadline = PROBE_SECONDS + PROBE_SECONDS_PER_MB * len(data) / (1 << 20)
    held = _address_space()
    limit = held + probe_allowance(len(data)) if held else 0
    probe = _Probe(source(data), globals_)  # made before the fork: the child imports and allocates nothing new
    done_r, done_w = os.pipe()  # closes when the child exits, however it exits
    pid = os.fork()
    if pid == 0:  # the child: never returns, never writes, never flushes the parent's buffers
        os.close(done_r)
        code = 0
        try:
            faulthandler.disable()  # a crash is the answer here, not something to report on stderr
            quiet = os.open(os.devnull, os.O_WRONLY)
            os.dup2(quiet, 2)
            gc.disable()
            hard = resource.getrlimit(resource.RLIMIT_AS)[1]
            if limit and (hard == resource.RLIM_INFINITY or limit < hard):
                resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
            probe.load()
            if _stack_bytes(probe) > MAX_STACK_BYTES:
                code = _OVER_ALLOWANCE
        except MemoryError:
            code = _OVER_ALLOWANCE
        except BaseException:  # noqa: BLE001 - any other failure is the real load's to report
            code = 1
        os._exit(code)
    os.close(done_w)
    status = None
    try:
        if select.select([done_r], [], [], deadline)[0]:
            status = os.waitpid(pid, 0)[1]
        else:
            raise _refuse(f"unpickling does not finish in {deadline:g} s")
    finally:
        os.close(done_r)
        if status is None:  # a deadline missed, or Ctrl-C: the child goes too
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        raise _refuse(f"unpickling kills the interpreter (signal {os.WTERMSIG(status)})")
    if os.WIFEXITED(status) and os.WEXITSTATUS(status) == _OVER_ALLOWANCE:
        raise PickleTooCostly


_OVER_ALLOWANCE = 3


def _stack_bytes(unpickler: pickle.Unpickler) -> int:
    """Bytes C's unpickler allocated for its stack, which it keeps at the most it held (0 where the
    interpreter does not tell): a real pickle holds one batch of items there."""
    for held in gc.get_referents(unpickler):
        if type(held).__name__ == "Pdata":
            return sys.getsizeof(held)
    return 0


def _address_space() -> int:
    """This process's virtual size in bytes (0 where /proc cannot tell: the child then runs unlimited)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0
