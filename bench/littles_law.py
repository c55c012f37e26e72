"""(a) Little's-law efficiency: with a 1 s gateway, 1,024 workers should move 1,024 msg/s.

20,000 messages on a private Redis, the simulator answering in 1 s, the daemon with
``--concurrency 1024``: efficiency = steady-state throughput ÷ (workers ÷ latency).
Target ≥ 0.97. Run alone: ``python -m bench.littles_law [--quick]``.
"""

from __future__ import annotations

import argparse
from contextlib import ExitStack

import anyio

from bench.common import mib, redis, simulator, table
from bench.harness import Lane, start_daemon, submit, watch

TARGET = 0.97


async def measure(messages: int, workers: int, latency: float) -> list[tuple[str, str]]:
    with ExitStack() as stack:
        server = redis(stack)
        sim = simulator(stack, "--latency", str(latency))
        lane = Lane.fresh(server.url, "littles-law")
        await submit(lane, messages)
        proc = start_daemon(stack, lane, sim, workers)
        run = await watch(lane, proc, messages, timeout=messages / workers * latency * 4 + 60)
        seen = sim.stats()
    ideal = workers / latency
    efficiency = run.rate / ideal
    verdict = "ok" if efficiency >= TARGET else f"BELOW the {TARGET} target"
    return [
        ("setup", f"{messages} messages, {workers} workers, gateway latency {latency:g} s"),
        ("throughput", f"{run.rate:,.1f} msg/s steady state (ideal {ideal:,.0f})"),
        ("efficiency", f"{efficiency:.3f} ({verdict})"),
        ("max in flight at gateway", str(seen["max_concurrent_seen"])),
        (
            "gateway calls",
            f"{seen['total']} for {messages} messages, by status {seen['by_status']}",
        ),
        ("wall time", f"{run.seconds:.1f} s"),
        ("daemon CPU", f"{run.cpu_ms:.3f} ms/msg, {run.core_share:.2f} of a core"),
        ("daemon peak RSS", mib(run.peak_rss)),
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
