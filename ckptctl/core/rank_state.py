"""Training state a job saves per data-parallel rank, which a reshard to another DP size cannot carry.

torchtitan's dataloader saves one bytes entry per DP rank, `dataloader.dp_rank_<i>` (the pickled
position of that rank's stream), beside `dataloader.world_size`; on loading, a rank finds its own
entry and asserts that the DP size is the one saved ("dataloader resharding is not supported").
A reshard that keeps those entries for another DP size therefore writes a checkpoint the next
job stops on, and keeping only the ranks both sizes have would stop it the same way. So a DP
change refuses by default, naming the entries, and the user drops them on purpose
(`--exclude 'dataloader.*'`: the next job starts its data order afresh).

Megatron-LM saves its RNG state once per (PP, TP) rank (`megatron/training/checkpointing.py`,
`get_rng_state`): a list of the DP ranks' states (all-gathered over the DP group with
`--data-parallel-random-init` at DP > 1, else the rank's own state alone). torch_dist keeps it in
a ShardedObject `rng_state` of global shape (PP, TP) at offset (pp, tp), replicated over DP × CP:
the entry `rng_state/shard_<pp>.<tp>_<PP>.<TP>`, one pickled list (how many states it holds is
known from the saved args only). fsdp_dtensor keeps `{'(pp, tp)': list}`, which DCP flattens to
`rng_state.(<pp>, <tp>).<i>.<field>` (tensors and bytes entries). Its loader (`load_checkpoint`)
takes entry `dp_rank` with `--data-parallel-random-init`, else entry 0; torch_dist's ignores the
RNG state at another TP or PP ("(TP, PP) mismatch after resume … RNG state will be ignored");
fsdp_dtensor's loads with DCP's partial load (unless `--strict-fsdp-dtensor-load`), so an entry the
job asks for and the checkpoint lacks leaves the job's own fresh state. One entry shared by every
DP rank follows any DP size; per-DP entries do not (`MegatronRng`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ckptctl.util.errors import UsageError
from ckptctl.util.wording import counted

_RANK = r"0|[1-9][0-9]{0,5}"
_TORCH_DIST_RNG = re.compile(rf"^(?P<root>[^/]*rng_state)/shard_(?P<pp>{_RANK})\.(?P<tp>{_RANK})_"
                             rf"(?P<pps>{_RANK})\.(?P<tps>{_RANK})$")
_FSDP_DTENSOR_RNG = re.compile(rf"^rng_state\.\((?P<pp>{_RANK}), (?P<tp>{_RANK})\)\.(?P<dp>{_RANK})(?:\.|$)")
_TORCHTITAN_DATALOADER = re.compile(r"^(?P<root>dataloader)\.dp_rank_(?P<rank>0|[1-9][0-9]{0,5})$")


@dataclass(frozen=True)
class RankState:
    """Entries of one kind of per-rank state, for DP ranks 0 … `ranks` - 1."""

    kind: str
    root: str
    fqns: tuple[str, ...]
    ranks: int

    @property
    def shown(self) -> str:
        """The entries in a few words: `dataloader.dp_rank_{0..3}`."""
        if len(self.fqns) == 1:
            return self.fqns[0]
        return f"{self.root}.dp_rank_{{0..{self.ranks - 1}}}" if len(self.fqns) == self.ranks else \
            f"{len(self.fqns)} {self.root}.dp_rank_<i> entries"


def rank_states(fqns: Iterable[str]) -> list[RankState]:
    """The per-rank state among a checkpoint's entry names."""
    ranks: dict[str, int] = {}
    for fqn in fqns:
        match = _TORCHTITAN_DATALOADER.match(fqn)
        if match is not None:
            ranks[fqn] = int(match["rank"])
    if not ranks:
        return []
    return [RankState("torchtitan's dataloader state", "dataloader", tuple(sorted(ranks, key=ranks.__getitem__)),
                      max(ranks.values()) + 1)]


def refuse_dp_change(fqns: Iterable[str], kept: Callable[[str], bool], dp: int) -> None:
    """Refuse a reshard to DP `dp` that keeps per-rank state saved at another DP size."""
    for state in rank_states(fqns):
        if state.ranks != dp and any(kept(f) for f in state.fqns):
            raise UsageError(f"{state.shown}: {state.kind} of DP {state.ranks} cannot follow a reshard to DP {dp} "
                             f"(its loader refuses another DP size); pass --exclude '{state.root}.*' to drop it "
                             "(the next job starts its data order afresh)")


_RANK_FILES = (
    (re.compile(r"^rng_state(?:_(?P<rank>0|[1-9][0-9]{0,5}))?\.pth$"), "the Trainer's RNG state", "rng_state*.pth",
     "rng_state_{{{}}}.pth", "rng_state.pth"),
    (re.compile(r"^random_states_(?P<rank>0|[1-9][0-9]{0,5})\.pkl$"), "accelerate's RNG state", "random_states_*.pkl",
     "random_states_{{{}}}.pkl", None),
)
"""Per-rank files of an HF Trainer / accelerate checkpoint folder: (name, kind, the glob that drops
them, their names in a few words, the name a job of one process reads instead). Trainer's
`_save_rng_state` writes `rng_state_<process>.pth` at several processes and `rng_state.pth` at one;
accelerate's `save_state` writes `random_states_<process>.pkl`. Each process loads its own file
only, and goes on without when there is none (both log it): after a change of world size a
process finds another's random streams or none."""
_DATALOADER_FILES = re.compile(r"^dl_state_dict(?:_(?P<index>[1-9][0-9]{0,3}))?\.bin$")
"""accelerate's dataloader state (`save_accelerator_state` with `use_stateful_dataloader`):
`dl_state_dict.bin` for the first dataloader, `dl_state_dict_<i>.bin` for dataloader i, each a
`torch.save` of the StatefulDataLoader's `state_dict()` that every process writes to the same name
and every process loads. Not per rank by name, but bound to the world size all the same: the
batches yielded are counted per process (and corrected by `num_processes - 1` for prefetching),
each process's share of the sampler follows the process count, so at another world size the
position is another one. Never unpickled here: only named and copied."""
DATALOADER_KIND = "accelerate's dataloader state"
DATALOADER_GLOB = "dl_state_dict*.bin"


@dataclass(frozen=True)
class RankFiles:
    """Files of one kind of per-rank state in a checkpoint folder, for ranks 0 … `ranks` - 1."""

    kind: str
    glob: str
    names: tuple[str, ...]
    numbers: tuple[int, ...]
    """Each file's rank."""
    template: str
    one_process: str | None
    """The file a job of one process reads (none but its own file at any other size)."""
    shared: bool = False
    """One file every process writes and loads, bound to the world size it was saved at
    (`_DATALOADER_FILES`): `numbers` are not ranks, `saved_world` is that size."""
    saved_world: int | None = None
    """A shared file's world size, from the rest of its folder (None: not known)."""

    @property
    def ranks(self) -> int:
        if self.shared:
            return self.saved_world or 0
        return max(self.numbers) + 1

    @property
    def shown(self) -> str:
        """The files in a few words: `rng_state_{0..3}.pth`."""
        if len(self.names) == 1 or self.shared:
            return ", ".join(self.names)
        return self.template.format(f"0..{self.ranks - 1}") if len(self.names) == self.ranks else \
            f"{len(self.names)} {self.glob} files"


def rank_files(names: Iterable[str], saved_world: Callable[[], int | None] = lambda: None) -> list[RankFiles]:
    """The per-rank files among a checkpoint folder's file names, by kind, and the files every
    process loads that are bound to the world size (accelerate's dataloader state), of the world
    size the per-rank files say, else `saved_world()`'s."""
    found: list[RankFiles] = []
    names = sorted(names)
    for pattern, kind, glob, template, one_process in _RANK_FILES:
        ranks = {n: int(m["rank"] or 0) for n in names if (m := pattern.match(n)) is not None}
        if ranks:
            ordered = tuple(sorted(ranks, key=ranks.__getitem__))
            found.append(RankFiles(kind, glob, ordered, tuple(ranks[n] for n in ordered), template, one_process))
    loaders = {n: int(m["index"] or 0) for n in names if (m := _DATALOADER_FILES.match(n)) is not None}
    if loaders:
        ordered = tuple(sorted(loaders, key=loaders.__getitem__))
        world = {state.ranks for state in found}
        found.append(RankFiles(DATALOADER_KIND, DATALOADER_GLOB, ordered, tuple(loaders[n] for n in ordered), "",
                               None, shared=True, saved_world=world.pop() if len(world) == 1 else saved_world()))
    return found


def refuse_world_size_change(files: Iterable[RankFiles], kept: Callable[[str], bool], world_size: int) -> None:
    """Refuse a reshard to `world_size` ranks that keeps per-rank files saved at another world size."""
    for state in files:
        if state.shared and state.ranks != world_size and any(kept(n) for n in state.names):
            saved = f"of {state.ranks} ranks" if state.ranks else "of a world size not known"
            raise UsageError(f"{state.shown}: {state.kind} {saved} cannot follow a reshard to {world_size} (one "
                             "file every process loads, its data position counted per process); pass --exclude "
                             f"'{state.glob}' to drop it (the resumed job starts its data order afresh)")
        if state.ranks != world_size and any(kept(n) for n in state.names):
            raise UsageError(f"{state.shown}: {state.kind} of {state.ranks} ranks cannot follow a reshard to "
                             f"{world_size} (each process loads its own file); pass --exclude '{state.glob}' to "
                             "drop it (the resumed job keeps the random streams it seeds itself) or "
                             "--keep-common-ranks to keep the files of the ranks both sizes have")


def common_ranks(state: RankFiles, world_size: int) -> tuple[str, ...]:
    """The files of the ranks a job of `world_size` processes shares with the saved one: each of its
    processes below the saved size resumes its own random streams, the others start theirs afresh.
    Refused where the loader reads another name at one of the sizes (the Trainer's one process),
    and for a file every process loads (no rank's share in it to keep)."""
    if state.shared:
        raise UsageError(f"{state.shown}: {state.kind} is one file every process loads, its data position counted "
                         f"per process at the saved world size: no rank's share in it to keep; pass --exclude "
                         f"'{state.glob}' to drop it")
    if state.one_process is not None and (world_size == 1) != (state.names == (state.one_process,)):
        raise UsageError(f"{state.shown}: a job of {counted(world_size, 'process', 'processes')} reads none of these files ("
                         f"{state.one_process} at one process, one file per process at several); pass --exclude "
                         f"'{state.glob}' to drop them")
    return tuple(n for n, rank in zip(state.names, state.numbers) if rank < world_size)


MEGATRON_RNG = "Megatron's RNG state"
KEEP_COMMON_APPLIES = ("--keep-common-ranks keeps per-rank files of an HF Trainer / accelerate checkpoint folder, or "
                       "a Megatron-FSDP checkpoint's per-DP RNG state; this checkpoint's per-rank entries are dropped "
                       "with --exclude")


@dataclass(frozen=True)
class MegatronRng:
    """Megatron-LM's RNG state in a torch_dist or fsdp_dtensor checkpoint (see the module docstring)."""

    backend: str
    """`torch_dist` or `fsdp_dtensor`."""
    fqns: tuple[str, ...]
    grid: tuple[tuple[int, int], ...]
    """The (pp, tp) ranks whose state is saved."""
    dp: int | None
    """How many DP ranks' states each (pp, tp) rank saved: 1 when every DP rank shares one; None
    where that is not known (a torch_dist checkpoint without args)."""
    entry_of: tuple[tuple[str, int], ...] = ()
    """fsdp_dtensor: each entry's DP rank."""

    @property
    def per_dp(self) -> bool:
        return self.dp is None or self.dp > 1

    @property
    def shown(self) -> str:
        if self.backend == "torch_dist":
            return self.fqns[0] if len(self.fqns) == 1 else f"{self.fqns[0]} … {self.fqns[-1]}"
        ranks = "0" if self.dp == 1 else f"{{0..{self.dp - 1}}}"
        (pp, tp), = self.grid if len(self.grid) == 1 else ((None, None),)
        return f"rng_state.({pp}, {tp}).{ranks}.*" if pp is not None else \
            f"rng_state.(pp, tp).{ranks}.* of {len(self.grid)} (PP, TP) ranks"

    @property
    def loader(self) -> str:
        """What Megatron-LM's `load_checkpoint` does with it at another DP, TP or PP size."""
        other = ("Megatron-LM ignores it at another TP or PP" if self.backend == "torch_dist" else
                 "at a (pp, tp) not saved Megatron-LM's partial load leaves the job's fresh state")
        if self.dp is None:
            return f"states per DP rank not known (no args saved); {other}"
        if self.dp == 1:
            return f"one state every DP rank resumes: follows any DP size; {other}"
        larger = ("fail (IndexError in load_checkpoint)" if self.backend == "torch_dist" else
                  "start afresh (partial load; --strict-fsdp-dtensor-load fails)")
        return (f"one state per DP rank of {self.dp} (--data-parallel-random-init): DP rank i resumes state i, "
                f"at a larger DP ranks ≥ {self.dp} {larger}; {other}")


def megatron_rng(names: Iterable[str], args: Callable[[str], object] | None = None) -> MegatronRng | None:
    """Megatron-LM's RNG state among a checkpoint's entry names (tensors and bytes entries); `args`
    reads a saved arg (torch_dist: how many DP states each entry holds)."""
    torch_dist: dict[str, tuple[int, int]] = {}
    fsdp: dict[str, tuple[int, int, int]] = {}
    for fqn in names:
        if (m := _TORCH_DIST_RNG.match(fqn)) is not None:
            torch_dist[fqn] = (int(m["pp"]), int(m["tp"]))
        elif (m := _FSDP_DTENSOR_RNG.match(fqn)) is not None:
            fsdp[fqn] = (int(m["pp"]), int(m["tp"]), int(m["dp"]))
    if torch_dist:
        fqns = tuple(sorted(torch_dist, key=torch_dist.__getitem__))
        random_init = args("data_parallel_random_init") if args is not None else None
        size = args("data_parallel_size") if args is not None else None
        dp = (size if random_init and isinstance(size, int) and size > 1 else 1) \
            if isinstance(random_init, bool) else None
        return MegatronRng("torch_dist", fqns, tuple(sorted(set(torch_dist.values()))), dp)
    if fsdp:
        fqns = tuple(sorted(fsdp, key=lambda f: (fsdp[f], f)))
        return MegatronRng("fsdp_dtensor", fqns, tuple(sorted({(pp, tp) for pp, tp, _ in fsdp.values()})),
                           max(d for _, _, d in fsdp.values()) + 1, tuple((f, fsdp[f][2]) for f in fqns))
    return None


def plain_reshard_rng_selection(state: MegatronRng | None, kept: Callable[[str], bool], world_size: int,
                                keep_common: bool, cp: Callable[[], int], tp: int | None = None) -> Callable[[str], bool]:
    """`megatron_rng_selection` of a reshard to `world_size` ranks of FSDP2 rows: a plain one keeps
    an fsdp_dtensor checkpoint's TP-blocked tensors as they are, a Megatron-aware one blocks them
    for `tp`, so the job that loads it runs at that TP (None: the saved one, its RNG state's
    (PP, TP) grid), the saved PP and CP (`cp()`, the saved args'), and Megatron's world is
    TP × PP × CP × DP: DP = world_size / (TP × PP × CP). Where per-DP state is kept, a world size
    they do not divide is refused, naming it."""
    if state is not None and state.per_dp and any(kept(f) for f in state.fqns):
        context = cp()
        pipeline = len({pp for pp, _ in state.grid})
        model = pipeline * (tp or len({t for _, t in state.grid}))
        ranks = model * context
        if world_size % ranks:
            grid = (counted(model, "(PP, TP) rank") if tp is None else f"PP {pipeline} × TP {tp}") + \
                (f" × CP {context}" if context > 1 else "")
            raise UsageError(f"{state.shown}: {MEGATRON_RNG} of DP {state.dp} cannot follow a reshard to "
                             f"{counted(world_size, 'rank')}, which are no multiple of its {grid}; pass --exclude "
                             "'rng_state.*' to drop it (every rank starts afresh)")
        world_size //= ranks
    return megatron_rng_selection(state, kept, world_size, keep_common)


def megatron_rng_selection(state: MegatronRng | None, kept: Callable[[str], bool], dp: int,
                           keep_common: bool) -> Callable[[str], bool]:
    """The selection of an fsdp_dtensor reshard to DP `dp`: per-DP RNG state saved at another DP
    size is refused, unless dropped (`--exclude`) or cut to the DP ranks both sizes have
    (`keep_common`: entry i is DP rank i's, so those kept need no renumbering)."""
    if keep_common and (state is None or state.backend != "fsdp_dtensor" or not state.per_dp):
        raise UsageError(KEEP_COMMON_APPLIES)
    if state is None or not state.per_dp or state.dp == dp or not any(kept(f) for f in state.fqns):
        return kept
    if not keep_common:
        raise UsageError(f"{state.shown}: {MEGATRON_RNG} of DP {state.dp} (one state per DP rank, "
                         f"--data-parallel-random-init) cannot follow a reshard to DP {dp} (DP rank i resumes "
                         "state i); pass --exclude 'rng_state.*' to drop it (every rank starts afresh) or "
                         "--keep-common-ranks to keep the states of the DP ranks both sizes have")
    rank = dict(state.entry_of)
    return lambda fqn: kept(fqn) and rank.get(fqn, 0) < dp
