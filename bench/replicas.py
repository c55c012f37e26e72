"""(e) Replicas: 3 daemons on one Redis move ≥ 2.9× what one moves at latency-bound load.

One daemon, then three sharing one queue, each with the same workers in front of a 1 s
gateway: throughput is bound by workers ÷ latency, so three should move three times as
much unless they get in each other's way (claims, leases, the result list). The daemons
are up before the messages are loaded, so none gets a head start. Target ≥ 2.9×.
Run alone: ``python -m bench.replicas [--quick]``.
"""

from __future__ import annotations

import argparse
from contextlib import ExitStack

import anyio

from bench.common import redis, simulator, table, verdict
from bench.harness import Lane, Run, bulk_load, start_daemon, watch
from tests.fixtures.simulator import SimulatorProcess

TARGET = 2.9
LATENCY = 1.0


async def replicated(
    url: str, sim: SimulatorProcess, replicas: int, workers: int, seconds: int
) -> Run:
    """``replicas`` daemons draining one queue of about ``seconds`` of their ideal work."""
    messages = replicas * workers * seconds
    lane = Lane.fresh(url, f"replicas-{replicas}")
    with ExitStack() as stack:
        procs = [start_daemon(stack, lane, sim, workers) for _ in range(replicas)]
        async with anyio.create_task_group() as tg:
            tg.start_soon(bulk_load, lane, messages)
            run = await watch(lane, procs[0], messages, timeout=seconds * 4 + 60)
    return run


async def measure(workers: int, seconds: int) -> list[tuple[str, str]]:
    with ExitStack() as stack:
        url, sim = redis(stack).url, simulator(stack, "--latency", str(LATENCY))
        one = await replicated(url, sim, 1, workers, seconds)
        three = await replicated(url, sim, 3, workers, seconds)
    ratio = three.rate / one.rate
    return [
        ("setup", f"{workers} workers per daemon, gateway latency {LATENCY:g} s, "
                  f"about {seconds} s of work per daemon"),
        ("1 daemon", f"{one.rate:,.1f} msg/s (ideal {workers / LATENCY:,.0f})"),
        ("3 daemons", f"{three.rate:,.1f} msg/s (ideal {3 * workers / LATENCY:,.0f})"),
        ("3 ÷ 1", verdict(f"× {ratio:.2f}", ratio >= TARGET, f"≥ {TARGET}×")),
    ]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.replicas")
    p.add_argument("--workers", type=int, default=128)
    p.add_argument("--seconds", type=int, default=40, help="work per daemon, at its ideal rate")
    p.add_argument("--quick", action="store_true", help="15 s of work")
    args = p.parse_args(argv)
    seconds = 15 if args.quick else args.seconds
    table("(e) replicas on one Redis", anyio.run(measure, args.workers, seconds))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
