"""Run the daemon with its wall clock ahead: ``python -m bench.skew <seconds> run …``.

Stage: bench support (chaos). Input: an offset in seconds and the daemon's arguments.
Output: the daemon running with ``time.time()`` and ``time.time_ns()`` that many seconds
ahead (its monotonic clock, which times and timeouts use, is left alone: a skewed host
clock does not move it either). The patch is made before the daemon is imported, so
every reading goes through it; no libfaketime is needed (none is installed here).
"""

from __future__ import annotations

import runpy
import sys
import time


def main() -> None:
    offset = float(sys.argv[1])
    wall, wall_ns = time.time, time.time_ns
    time.time = lambda: wall() + offset
    time.time_ns = lambda: wall_ns() + int(offset * 1e9)
    sys.argv = ["async_processor", *sys.argv[2:]]
    runpy.run_module("async_processor", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
