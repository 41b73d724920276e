"""The output check's parts timed on a written reshard: what a run pays after writing, what meanwhile.

    python bench/check_cost.py SRC OUT -n N [--reps 3]

OUT is `ckptctl reshard SRC OUT -n N`'s output. A run with a helper process (a plain run of
20,000 records or more on two cores) first forks, while it plans, a process that locates the
items holding each tensor's ends (`located_ends`: off the writing's two busy cores); then splits
the check: the helper reads the samples' source
elements, re-reads `.metadata` and checks its structure while the run writes the data files
(`DcpCheck.early`); each process compares the files it wrote with their planned sizes, and the
samples they hold, once written (`within`: timed here for all the files), and the run's last
call checks the directory (`check(out, result, withins)`; the two make `check_seconds`). A run without a helper reads the source's elements in a thread
while it writes and does the rest after writing (`check(out)`). Each part's wall and CPU seconds,
median of the repetitions, with the machine's load average.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

from ckptctl.checks.output_check import DcpCheck, located_ends
from ckptctl.commands.reshard import ReshardOptions, plan_reshard
from ckptctl.formats.dcp.metadata import open_checkpoint


def timed(work) -> tuple[float, float, object]:
    wall, cpu = time.perf_counter(), time.process_time()
    result = work()
    return time.perf_counter() - wall, time.process_time() - cpu, result


LOCATING = "a fork while the run plans: the items that hold each tensor's ends located"
EARLY = "helper, while the run writes: source samples, re-read .metadata, structure"
AFTER = "run and helper, each after its files: their sizes, samples; the run's last call"
READ_AHEAD = "run without a helper, a thread while writing: the source samples"
ALONE = "run without a helper, after writing: the rest"


def read_ahead(check: DcpCheck) -> None:
    """The source reads a run's check makes in a thread while the output is written."""
    check.start()
    check._thread.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("src", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("-n", "--world-size", type=int, required=True)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    src = open_checkpoint(args.src)
    plan = plan_reshard(src, ReshardOptions(world_size=args.world_size))
    rows: dict[str, list[tuple[float, float]]] = {name: [] for name in (LOCATING, EARLY, AFTER, READ_AHEAD, ALONE)}
    read_ahead(DcpCheck(src, plan))  # the source views' row indexes: the copy builds them (and shares them) anyway
    for _ in range(args.reps):
        wall, cpu, located = timed(lambda: located_ends(src))
        rows[LOCATING].append((wall, cpu))
        check = DcpCheck(src, plan, located=located)
        wall, cpu, early = timed(lambda: check.early(args.out))
        rows[EARLY].append((wall, cpu))
        rows[AFTER].append(timed(lambda: check(args.out, early, [check.within(args.out, early, frozenset(plan.files))]))[:2])
        check = DcpCheck(src, plan, located=located)
        rows[READ_AHEAD].append(timed(lambda: read_ahead(check))[:2])
        rows[ALONE].append(timed(lambda: check(args.out))[:2])
    print(f"{len(plan.records):,} records, {args.reps} reps, load average {os.getloadavg()[0]:.2f}")
    print("| part | wall s (median) | CPU s (median) |\n|---|---:|---:|")
    for name, times in rows.items():
        wall, cpu = statistics.median(w for w, _ in times), statistics.median(c for _, c in times)
        print(f"| {name} | {wall:.2f} | {cpu:.2f} |")


if __name__ == "__main__":
    main()
