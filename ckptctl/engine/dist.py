"""Run a command on several workers (`torchrun`), each writing a share of the output files.

A plain run is a world of one. Under `torchrun` (WORLD_SIZE/RANK/LOCAL_RANK/MASTER_ADDR in
the environment) every worker opens the same checkpoint, builds the same pure plan, and
executes only the items of the output files assigned to it (whole files, balanced by
size, largest first onto the least-loaded worker). Workers never exchange tensor data:
they read the source byte ranges they need and write their files on a shared filesystem.
The process group carries only control messages, always over gloo.

The output stays atomic across workers: rank 0 creates the temporary directory and
broadcasts its name, every worker writes (and fsyncs) its files, the workers gather each
other's status, and only when all succeeded does rank 0 write `.metadata`/`index.json` and
rename the directory into place. A failure anywhere fails every worker with its message
and leaves no DST; a source file changed since a worker opened it is such a failure.
"""

from __future__ import annotations

import contextlib
import datetime
import heapq
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence, TypeVar

from ckptctl.storage.atomic import changed_reads_first, refuse_changed_reads
from ckptctl.storage.store import store_for
from ckptctl.util.errors import CkptctlError, UsageError
from ckptctl.util.gc_pause import gc_paused
from ckptctl.core.analysis import analyze_shares, shared_findings
from ckptctl.core.checkpoint import Checkpoint

T = TypeVar("T")

BACKENDS = ("gloo", "nccl")
DEFAULT_TIMEOUT_S = 12 * 3600
"""Workers wait at the status gather for the slowest one; multi-terabyte shares take hours."""

_TORCHRUN_ENV = ("WORLD_SIZE", "RANK")


class WorkerFailedError(CkptctlError):
    """Another worker failed; this one stops without output. `quiet` when the failing worker reports it itself."""

    def __init__(self, rank: int, message: str, quiet: bool = False) -> None:
        self.rank = rank
        self.message = message
        self.quiet = quiet
        super().__init__(f"worker {rank} failed: {message}")


@dataclass(frozen=True)
class Comm:
    """This process's place in the run: `rank` of `world_size` workers (a world of one without torchrun)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    group: Any = None

    @property
    def is_lead(self) -> bool:
        return self.rank == 0

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's `obj`, on every worker."""
        if self.world_size == 1:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def all_gather(self, obj: Any) -> list[Any]:
        """Every worker's `obj`, indexed by rank."""
        if self.world_size == 1:
            return [obj]
        import torch.distributed as dist

        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def barrier(self) -> None:
        if self.world_size > 1:
            import torch.distributed as dist

            dist.barrier(group=self.group)


LOCAL = Comm()


def torchrun_env() -> bool:
    """Whether this process was started by torchrun (or another launcher setting the same variables)."""
    return all(k in os.environ for k in _TORCHRUN_ENV)


def comm_from_group() -> Comm:
    """The already-initialized default process group as a Comm (control messages over gloo)."""
    import torch.distributed as dist

    group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
    return Comm(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", 0)), group)


@contextlib.contextmanager
def distributed_from_env(backend: str = "gloo", timeout_s: float | None = None) -> Iterator[Comm]:
    """The run's Comm: joins torchrun's process group when launched by it, else a world of one.

    The group is created here (and destroyed on exit) unless the caller already made one.
    `nccl` is accepted for clusters that want it; control messages still go over gloo.
    """
    if backend not in BACKENDS:
        raise UsageError(f"--dist-backend must be one of {', '.join(BACKENDS)} (got {backend!r})")
    if not torchrun_env() or int(os.environ["WORLD_SIZE"]) <= 1:
        yield Comm(local_rank=int(os.environ.get("LOCAL_RANK", 0)))
        return
    import torch
    import torch.distributed as dist

    owned = not dist.is_initialized()
    if owned:
        if timeout_s is None:
            timeout_s = float(os.environ.get("CKPTCTL_DIST_TIMEOUT_S", DEFAULT_TIMEOUT_S))
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)) % max(1, torch.cuda.device_count()))
        dist.init_process_group(backend, init_method="env://", timeout=datetime.timedelta(seconds=timeout_s))
    try:
        yield comm_from_group()
    finally:
        if owned and dist.is_initialized():
            dist.destroy_process_group()


def assign_files(sizes: Mapping[str, int], world_size: int, lead_load: int = 0) -> list[frozenset[str]]:
    """Whole files per worker, balanced by bytes: largest first onto the least-loaded worker.
    Rank 0 starts loaded with `lead_load` bytes (the work it does besides: writing `.metadata`).

    Deterministic: ties in size break by name, ties in load by rank, so every worker
    computes the same assignment from the same plan.
    """
    if world_size < 1:
        raise ValueError("world_size must be at least 1")
    heap = [(lead_load if rank == 0 else 0, rank) for rank in range(world_size)]
    heapq.heapify(heap)
    shares: list[set[str]] = [set() for _ in range(world_size)]
    for name, size in sorted(sizes.items(), key=lambda kv: (-kv[1], kv[0])):
        load, rank = heapq.heappop(heap)
        shares[rank].add(name)
        heapq.heappush(heap, (load + size, rank))
    return [frozenset(s) for s in shares]


def shared_analysis(ckpt: Checkpoint, comm: Comm) -> None:
    """Analyse `ckpt` once across the workers: each its share of the tensors (every K-th), all of
    them gathered by every worker and kept with the checkpoint, where `analysis.analysis` finds it.
    Collective; a worker's failure fails every worker with its message."""
    if comm.world_size == 1 or "analysis" in ckpt.derived:
        return
    with gc_paused():
        shares = _gathered(comm, lambda: shared_findings(ckpt, comm.rank, comm.world_size))
        ckpt.derived["analysis"] = analyze_shares(ckpt, shares)


def _status(exc: BaseException) -> str:
    return str(exc) if isinstance(exc, CkptctlError) else f"{type(exc).__name__}: {exc}"


def _gathered(comm: Comm, fn: Callable[[], T]) -> list[T]:
    """`fn()` on every worker, every worker's result gathered by all, indexed by rank. If any worker
    failed, every worker raises: its own error where it failed, else the first failure."""
    try:
        mine, error = ("ok", fn()), None
    except Exception as exc:  # noqa: BLE001 - reported to every worker, then re-raised
        mine, error = ("error", _status(exc)), exc
    results = comm.all_gather(mine)
    if error is not None:
        raise error
    failed = [(rank, payload) for rank, (state, payload) in enumerate(results) if state != "ok"]
    if failed:
        rank, message = failed[0]
        raise WorkerFailedError(rank, message, quiet=not comm.is_lead)
    return [payload for _, payload in results]


def write_atomically(
    dst: Path,
    force: bool,
    sizes: Mapping[str, int],
    write_share: Callable[[Path, frozenset[str]], None],
    finish: Callable[[Path], None],
    comm: Comm = LOCAL,
    sync: bool = True,
    lead_load: int = 0,
) -> frozenset[str]:
    """Fill DST atomically: each worker writes its share of `sizes`' files, then rank 0 runs `finish`.

    `write_share(tmp, names)` writes (and fsyncs) the named files into the shared temporary
    directory; `finish(tmp)` runs on rank 0 once every worker succeeded, to write what must
    come last (`.metadata`, `index.json`) or verify; with `sync` rank 0 fsyncs the whole tree
    before the rename. Returns this worker's share (`assign_files`, rank 0 loaded with `lead_load`).
    Collective: every worker calls it with the same `sizes`.
    """
    shares = assign_files(sizes, comm.world_size, lead_load)
    mine = shares[comm.rank]
    if comm.world_size == 1:
        with store_for(dst).atomic_folder(dst, force, sync=sync) as tmp:
            write_share(tmp, mine)
            finish(tmp)
        return mine
    if comm.is_lead:
        _lead(dst, force, mine, write_share, finish, comm, sync)
    else:
        _follow(mine, write_share, comm)
    return mine


def _lead(dst: Path, force: bool, mine: frozenset[str], write_share: Callable[[Path, frozenset[str]], None],
          finish: Callable[[Path], None], comm: Comm, sync: bool) -> None:
    phase = "create"
    try:
        with store_for(dst).atomic_folder(dst, force, tag="dist", sync=sync) as tmp:
            comm.broadcast(("ok", str(tmp)))
            phase = "write"
            _gathered(comm, lambda: write_share(tmp, mine))
            phase = "finish"
            finish(tmp)
    except Exception as exc:
        if phase == "create":
            comm.broadcast(("error", _status(exc)))
        elif phase == "write":
            comm.barrier()  # the temporary directory is gone: now every worker may exit
        else:
            comm.broadcast(("error", _status(exc)))
        raise
    comm.broadcast(("ok", None))


def _follow(mine: frozenset[str], write_share: Callable[[Path, frozenset[str]], None], comm: Comm) -> None:
    state, payload = comm.broadcast(None)
    if state != "ok":
        raise WorkerFailedError(0, payload, quiet=True)
    tmp = Path(payload)

    def share() -> None:  # what this worker read is checked too; rank 0 checks its own before the rename
        with changed_reads_first(tmp):
            write_share(tmp, mine)
        refuse_changed_reads(tmp)

    try:
        _gathered(comm, share)
    except Exception:
        comm.barrier()  # wait until rank 0 removed the temporary directory
        raise
    state, payload = comm.broadcast(None)
    if state != "ok":
        raise WorkerFailedError(0, payload, quiet=True)


def torchrun_command(nproc: int, args: Sequence[str], *, nnodes: int = 1) -> list[str]:
    """`python -m torch.distributed.run ... -m ckptctl ARGS` for `nproc` workers on this machine."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nnodes={nnodes}",
            f"--nproc-per-node={nproc}", "-m", "ckptctl", *map(str, args)]


def launch_local(nproc: int, args: Sequence[str], *, timeout: float | None = None,
                 env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run `ckptctl ARGS` on `nproc` gloo workers of this machine and wait (tests, `make bench`).

    Workers talk over loopback and run single-threaded math; stdout carries rank 0's
    output (its `--json` report), stderr every worker's messages.
    """
    full = dict(os.environ)
    if "GLOO_SOCKET_IFNAME" not in full and os.path.exists("/sys/class/net/lo"):
        full["GLOO_SOCKET_IFNAME"] = "lo"
    full.setdefault("OMP_NUM_THREADS", "1")
    full.update(env or {})
    return subprocess.run(torchrun_command(nproc, args), capture_output=True, text=True, timeout=timeout, env=full)
