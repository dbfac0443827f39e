"""A search's start-up and wind-down, milestone by milestone (FLASHTUNE_TIMELINE=1): one stderr
line per milestone with the seconds since this process started and the wall clock, so that the
processes of a `--gpus` search line up and the runs of bench/search_scaling.py show where the
18-20 s before the first trial go (docs/benchmarks.md, session 14). Off, a mark costs one
environment read."""
from __future__ import annotations

import os
import sys
import time

from .env import timeline

_T0 = time.perf_counter()
_once: set = set()


def since_start() -> float:
    """Seconds since this process started (Linux: /proc; elsewhere: since this import)."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open("/proc/uptime") as f:
            up = float(f.read().split()[0])
        return up - int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22, starttime
    except (OSError, ValueError, IndexError):
        return time.perf_counter() - _T0


def mark(what: str, once: bool = False) -> None:
    """Print the milestone `what` (with once, only its first time in this process)."""
    if not timeline():
        return
    if once:
        if what in _once:
            return
        _once.add(what)
    # one write of the whole line: print() writes the text and its newline apart, and with
    # stderr unbuffered (PYTHONUNBUFFERED) two processes' marks ran together on one line
    sys.stderr.write(f"[timeline] pid {os.getpid()} +{since_start():.2f}s at {time.time():.3f}: "
                     f"{what}\n")
    sys.stderr.flush()
