"""``python -m bench [--quick]`` (``make bench``): every benchmark, one after the other.

Figures only, never asserted. Each runs alone too: ``python -m bench.<name> [--quick]``.
The machine's load average is printed first: other work on the CPUs skews throughput
figures (CPU ms per message much less so).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from bench import (
    common,
    docs,
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
    p.add_argument("--docs", type=Path, metavar="FILE",
                   help="write the tables into FILE between its bench markers "
                   "(make bench: docs/performance.md)")  # fmt: skip
    args = p.parse_args()
    unknown = set(args.names) - set(BENCHES)
    if unknown:
        p.error(f"unknown benchmark {', '.join(sorted(unknown))}; known: {', '.join(BENCHES)}")
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"{os.cpu_count()} CPUs, load average {load} before the benchmarks")
    if args.docs:  # refused now, not after minutes of benchmarks
        docs.replace_section(args.docs.read_text(), "")
    started = time.monotonic()
    for name in args.names or BENCHES:
        BENCHES[name](["--quick"] if args.quick else [])
    print(f"\nall benchmarks: {time.monotonic() - started:.0f} s")
    if args.docs:
        day = time.strftime("%Y-%m-%d", time.gmtime())
        run = docs.Run(docs.commit(), day, os.cpu_count() or 0, load, args.quick,
                       tuple(args.names))  # fmt: skip
        docs.write(args.docs, run, common.TABLES)
        print(f"tables written into {args.docs}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
