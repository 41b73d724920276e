"""What the output check costs a reshard's wall time: the run with its check, and without it, alternated.

    python bench/check_ab.py SRC OUT -n N [--reps 3]

`check_seconds` (`--json`) is only what a run waits for after writing; a run with a helper
process does most of the check meanwhile, on the core the writing shares. This runs the same
command with the check and with `DcpCheck` replaced by one that checks nothing (this script
only: no run can skip the check), one after the other, and gives each run's seconds, its
`check_seconds`, and the difference of the medians, with the load average before each run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys

NO_CHECK = """
from ckptctl.commands import dcp_write, reshard


class NoCheck:
    early_load = 0
    within_seconds = 0.0

    def __init__(self, *args, **kwargs):
        pass

    def start(self):
        pass

    def close(self):
        pass

    def early(self, written):
        return b""

    def within(self, written, early, names):
        return b""

    def __call__(self, written, early=None, within=()):
        pass


class NoLocating:
    def __init__(self, *args):
        pass

    def result(self):
        return None

    def stop(self):
        pass


dcp_write.DcpCheck = NoCheck
reshard.LocatingAhead = NoLocating  # nor does it fork a process to locate the check's source items
"""
RUN = "import runpy, sys; sys.argv = ['ckptctl', *sys.argv[1:]]; runpy.run_module('ckptctl', run_name='__main__')"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("src")
    parser.add_argument("out")
    parser.add_argument("-n", "--world-size", type=int, required=True)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    seconds: dict[str, list[float]] = {"with the check": [], "without": []}
    for rep in range(args.reps):
        for name, prelude in (("with the check", ""), ("without", NO_CHECK)):
            shutil.rmtree(args.out, ignore_errors=True)
            load = os.getloadavg()[0]
            done = subprocess.run([sys.executable, "-c", prelude + RUN, "reshard", args.src, args.out,
                                   "-n", str(args.world_size), "--json"], capture_output=True, text=True, check=True)
            report = json.loads(done.stdout)
            seconds[name].append(report["seconds"])
            print(f"rep {rep + 1} {name}: {report['seconds']:.2f} s (check_seconds {report['check_seconds']:.2f}), "
                  f"load average before {load:.2f}", flush=True)
    shutil.rmtree(args.out, ignore_errors=True)
    on, off = statistics.median(seconds["with the check"]), statistics.median(seconds["without"])
    print(f"medians: {on:.2f} s with the check, {off:.2f} s without: the check costs {on - off:.2f} s "
          f"({(on - off) / on:.1%} of the run)")


if __name__ == "__main__":
    main()
