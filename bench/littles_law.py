"""(a) Little's-law efficiency: with a 1 s gateway, 1,024 workers should move 1,024 msg/s.

20,000 messages on a private Redis, the simulator answering in 1 s, the daemon with
``--concurrency 1024``: efficiency = the time-averaged number of requests in flight at the
gateway over the steady window ÷ workers, which by Little's law at the gateway (each
request spends the fixed latency there) is throughput ÷ (workers ÷ latency), without the
steps a count of results in waves has (``bench.harness``). The result-count figures are
printed beside it, labelled: whole rounds of the workers, and 10 %..90 %.
Target ≥ 0.97 in at least 4 of 5 runs. The minimal loop (``bench.baseline``) runs the
same setting after each as a reference: when it falls short too, the machine (CPU
share), not the daemon, is the limit. Run alone: ``python -m bench.littles_law [--quick]``.
"""

from __future__ import annotations

import argparse
import math
from contextlib import ExitStack

import anyio

from bench.common import redis, simulator, table, verdict
from bench.harness import Run, drain
from bench.overhead import describe

TARGET = 0.97


async def measure(messages: int, workers: int, latency: float, runs: int) -> list[tuple[str, str]]:
    """``runs`` paired runs (daemon, then baseline) on one Redis and simulator; the target
    is met when at least ``ceil(0.8 × runs)`` of the daemon's runs reach it (4 of 5)."""
    ideal = workers / latency
    rows = [("setup", f"{messages} messages, {workers} workers, gateway latency {latency:g} s, "
                      f"{runs} paired run(s)")]  # fmt: skip
    efficiencies = []
    with ExitStack() as stack:
        url, sim = redis(stack).url, simulator(stack, "--latency", str(latency))
        for n in range(1, runs + 1):
            run, seen = await drain(url, sim, "littles-law", workers, messages)
            base, _ = await drain(url, sim, "littles-law-base", workers, messages, baseline=True)
            efficiencies.append(run.occupancy or 0.0)
            rows += [
                (f"run {n} daemon", f"{describe(run)}; {figures(run, ideal)}, "
                                    f"max {seen['max_concurrent_seen']} in flight at the gateway"),
                (f"run {n} baseline", f"{describe(base)}; {figures(base, ideal)}"),
            ]  # fmt: skip
    passed = sum(e >= TARGET for e in efficiencies)
    needed = math.ceil(0.8 * runs)
    low, high = min(efficiencies), max(efficiencies)
    summary = f"{passed} of {runs} runs ≥ {TARGET} (range {low:.3f}–{high:.3f})"
    rows.append(
        ("efficiency", verdict(summary, passed >= needed, f"≥ {TARGET} in {needed} of {runs}"))
    )
    return rows


def figures(run: Run, ideal: float) -> str:
    """The in-flight efficiency, then the result-count windows' figures (before it)."""
    occupancy = "n/a (run too short)" if run.occupancy is None else f"{run.occupancy:.3f}"
    return (f"efficiency {occupancy} (in flight at the gateway; results over whole rounds "
            f"{run.rate / ideal:.3f}, 10-90 % {run.rate_10_90 / ideal:.3f}), "
            f"gateway time {run.gateway_seconds or 0.0:.3f} s")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.littles_law")
    p.add_argument("--messages", type=int, default=20000)
    p.add_argument("--workers", type=int, default=1024)
    p.add_argument("--latency", type=float, default=1.0)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="5,000 messages, one run")
    args = p.parse_args(argv)
    messages, runs = (5000, 1) if args.quick else (args.messages, args.runs)
    rows = anyio.run(measure, messages, args.workers, args.latency, runs)
    table("(a) Little's-law efficiency", rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
