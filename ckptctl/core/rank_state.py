"""Training state a job saves per data-parallel rank, which a reshard to another DP size cannot carry.

torchtitan's dataloader saves one bytes entry per DP rank, `dataloader.dp_rank_<i>` (the pickled
position of that rank's stream), beside `dataloader.world_size`; on loading, a rank finds its own
entry and asserts that the DP size is the one saved ("dataloader resharding is not supported").
A reshard that keeps those entries for another DP size therefore writes a checkpoint the next
job stops on, and keeping only the ranks both sizes have would stop it the same way. So a DP
change refuses by default, naming the entries, and the user drops them on purpose
(`--exclude 'dataloader.*'`: the next job starts its data order afresh).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ckptctl.util.errors import UsageError

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
