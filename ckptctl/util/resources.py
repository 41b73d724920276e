"""Peak memory of this process, as reported in every command's summary."""

from __future__ import annotations

import resource
import sys


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far.

    On Linux this is `VmHWM` of /proc/self/status: `getrusage`'s ru_maxrss survives fork and
    exec, so a ckptctl started by a big process (a training script, pytest with torch loaded)
    would report its parent's size. Elsewhere ru_maxrss (KiB on Linux, bytes on macOS).
    """
    try:
        with open("/proc/self/status", "rb") as fh:
            for line in fh:
                if line.startswith(b"VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024
