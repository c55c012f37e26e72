"""(b) Overhead against a minimal loop: zero-latency gateway, 256 workers.

The daemon (``python -m async_processor run``) and ``bench.baseline`` (ZPOPMIN -> POST ->
LPUSH and nothing else, same libraries) each drain their own queue of the same messages
from the same Redis and simulator, one after the other in the same run. Printed: msg/s
and consumer CPU ms per message for both, and the daemon's cost relative to the
baseline. Run alone: ``python -m bench.overhead [--quick]``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from contextlib import ExitStack

import anyio

from bench.common import mib, redis, simulator, table
from bench.harness import Lane, Process, Run, start_baseline, start_daemon, submit, watch
from tests.fixtures.simulator import SimulatorProcess

Starter = Callable[[ExitStack, Lane, SimulatorProcess, int, int], Process]


def _daemon(stack: ExitStack, lane: Lane, sim: SimulatorProcess, workers: int, _: int) -> Process:
    return start_daemon(stack, lane, sim, workers)


async def _one(
    url: str, sim: SimulatorProcess, label: str, start: Starter, workers: int, messages: int
) -> Run:
    lane = Lane.fresh(url, label)
    await submit(lane, messages)
    sim.reset()
    with ExitStack() as stack:  # the consumer stops before the next one starts
        proc = start(stack, lane, sim, workers, messages)
        run = await watch(lane, proc, messages, timeout=messages / 100 + 60)
    calls = sim.stats()["total"]
    if calls != messages:
        print(f"  note: {label} made {calls} gateway calls for {messages} messages")
    return run


async def measure(messages: int, workers: int) -> list[tuple[str, str]]:
    with ExitStack() as stack:
        server = redis(stack)
        sim = simulator(stack)
        daemon = await _one(server.url, sim, "overhead-daemon", _daemon, workers, messages)
        base = await _one(server.url, sim, "overhead-baseline", start_baseline, workers, messages)
    return [
        ("setup", f"{messages} messages each, {workers} workers, zero-latency gateway"),
        ("daemon", _figures(daemon)),
        ("baseline", _figures(base)),
        ("daemon / baseline", f"throughput × {daemon.rate / base.rate:.2f}, "
                              f"CPU per message × {daemon.cpu_ms / base.cpu_ms:.2f}"),
    ]  # fmt: skip


def _figures(run: Run) -> str:
    return (f"{run.rate:,.0f} msg/s, {run.cpu_ms:.3f} CPU ms/msg ({run.core_share:.2f} of a core), "
            f"peak RSS {mib(run.peak_rss)}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.overhead")
    p.add_argument("--messages", type=int, default=20000)
    p.add_argument("--workers", type=int, default=256)
    p.add_argument("--quick", action="store_true", help="5,000 messages")
    args = p.parse_args(argv)
    messages = 5000 if args.quick else args.messages
    table("(b) overhead vs a minimal loop", anyio.run(measure, messages, args.workers))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
