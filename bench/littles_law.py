"""(a) Little's-law efficiency: with a 1 s gateway, 1,024 workers should move 1,024 msg/s.

20,000 messages on a private Redis, the simulator answering in 1 s, the daemon with
``--concurrency 1024``: efficiency = steady-state throughput ÷ (workers ÷ latency).
Target ≥ 0.97. The minimal loop (``bench.baseline``) runs the same setting afterwards as
a reference: when it falls short too, the machine (CPU share), not the daemon, is the
limit. Run alone: ``python -m bench.littles_law [--quick]``.
"""

from __future__ import annotations

import argparse
from contextlib import ExitStack

import anyio

from bench.common import redis, simulator, table
from bench.harness import drain
from bench.overhead import describe

TARGET = 0.97


async def measure(messages: int, workers: int, latency: float) -> list[tuple[str, str]]:
    with ExitStack() as stack:
        url, sim = redis(stack).url, simulator(stack, "--latency", str(latency))
        run, seen = await drain(url, sim, "littles-law", workers, messages)
        base, _ = await drain(url, sim, "littles-law-base", workers, messages, baseline=True)
    ideal = workers / latency
    efficiency = run.rate / ideal
    verdict = "ok" if efficiency >= TARGET else f"BELOW the {TARGET} target"
    return [
        ("setup", f"{messages} messages, {workers} workers, gateway latency {latency:g} s"),
        ("throughput", f"{run.rate:,.1f} msg/s steady state (ideal {ideal:,.0f})"),
        ("efficiency", f"{efficiency:.3f} ({verdict})"),
        ("max in flight at gateway", str(seen["max_concurrent_seen"])),
        ("gateway calls", f"{seen['total']} for {messages} messages, {seen['by_status']}"),
        ("wall time", f"{run.seconds:.1f} s"),
        ("daemon", describe(run)),
        ("baseline, same setting", f"{describe(base)}; efficiency {base.rate / ideal:.3f}"),
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.littles_law")
    p.add_argument("--messages", type=int, default=20000)
    p.add_argument("--workers", type=int, default=1024)
    p.add_argument("--latency", type=float, default=1.0)
    p.add_argument("--quick", action="store_true", help="5,000 messages")
    args = p.parse_args(argv)
    messages = 5000 if args.quick else args.messages
    table("(a) Little's-law efficiency", anyio.run(measure, messages, args.workers, args.latency))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
