"""A reshard's timeline in both of its processes: when each phase starts and ends, with the CPU
seconds the process had used by then (where the output check's time goes, and whether the helper
and the run end their writing together).

    python bench/check_timeline.py [--no-check] reshard SRC OUT -n N --json > /dev/null

Stamps go to `timeline.log` in the current directory (the run's stderr is the CLI's). With
`--no-check` the check is replaced by one that checks nothing, as `check_ab.py` does.
"""

from __future__ import annotations

import os
import resource
import runpy
import sys
import time

from check_ab import NO_CHECK  # this folder's: the script runs from it

LOG = "timeline.log"
T0 = time.perf_counter()


def stamp(what: str) -> None:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    with open(LOG, "a") as log:
        log.write(f"[{os.getpid()}] {time.perf_counter() - T0:6.2f} s, CPU {usage.ru_utime + usage.ru_stime:6.2f} s: "
                  f"{what}\n")


def wrapped(owner: object, name: str, label: str) -> None:
    """`owner.name` stamped as it starts and ends."""
    real = getattr(owner, name)

    def run(*args, **kwargs):
        stamp(f"{label} starts")
        try:
            return real(*args, **kwargs)
        finally:
            stamp(f"{label} ends")

    setattr(owner, name, run)


def main() -> None:
    import ckptctl.checks.output_check as check
    import ckptctl.engine.output as output
    import ckptctl.formats.dcp.writer as writer

    wrapped(output, "write_files", "writing files")
    wrapped(writer, "write_metadata", "writing .metadata")
    wrapped(check.DcpCheck, "_read_source", "source samples")
    wrapped(check.DcpCheck, "_read_back", "re-reading .metadata")
    wrapped(check.DcpCheck, "within", "comparing its files")
    wrapped(check.DcpCheck, "__call__", "last check")
    args = sys.argv[1:]
    if args[:1] == ["--no-check"]:
        args = args[1:]
        exec(NO_CHECK, {})  # noqa: S102 - check_ab's own text: the check replaced by one that checks nothing
    sys.argv = ["ckptctl", *args]
    stamp("start")
    runpy.run_module("ckptctl", run_name="__main__")


if __name__ == "__main__":
    main()
