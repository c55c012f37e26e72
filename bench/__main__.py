"""``python -m bench [--quick]`` (``make bench``): every benchmark, one after the other.

Figures only, never asserted. Each runs alone too: ``python -m bench.<name> [--quick]``.
The machine's load average is printed first: other work on the CPUs skews throughput
figures (CPU ms per message much less so).
"""

from __future__ import annotations

import argparse
import os
import time

from bench import (
    held,
    in_flight,
    littles_law,
    memory,
    overhead,
    pipeline,
    pubsub,
    replicas,
    simulator_capacity,
)

BENCHES = {
    "simulator_capacity": simulator_capacity.main,
    "littles_law": littles_law.main,
    "overhead": overhead.main,
    "pipeline": pipeline.main,
    "held": held.main,
    "memory": memory.main,
    "in_flight": in_flight.main,
    "replicas": replicas.main,
    "pubsub": pubsub.main,
}


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smaller runs (about a minute each)")
    p.add_argument("names", nargs="*", help=f"run only these: {', '.join(BENCHES)}")
    args = p.parse_args()
    unknown = set(args.names) - set(BENCHES)
    if unknown:
        p.error(f"unknown benchmark {', '.join(sorted(unknown))}; known: {', '.join(BENCHES)}")
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"{os.cpu_count()} CPUs, load average {load} before the benchmarks")
    started = time.monotonic()
    for name in args.names or BENCHES:
        BENCHES[name](["--quick"] if args.quick else [])
    print(f"\nall benchmarks: {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
