"""Simulator capacity: it must never be a benchmark's bottleneck.

Hammers a simulator process (zero latency by default) from 256 aiohttp workers and prints
requests/s and the simulator's CPU milliseconds per request (from /proc), i.e. the rate
one simulator core could sustain. Run alone: ``python -m bench.simulator_capacity``.
"""

from __future__ import annotations

import argparse
import json
from contextlib import ExitStack

import anyio

from bench.common import cpu_seconds, hammer, simulator, table

BODY = json.dumps({"model": "bench", "prompt": "x" * 512, "max_tokens": 16}).encode()


async def measure(requests: int, concurrency: int, latency: float) -> list[tuple[str, str]]:
    with ExitStack() as stack:
        sim = simulator(stack, "--latency", str(latency))
        url = sim.url + "/v1/completions"
        await hammer(url, min(2000, requests), concurrency, BODY)  # warm up connections
        cpu_before = cpu_seconds(sim.proc.pid)
        result = await hammer(url, requests, concurrency, BODY)
        cpu_ms = (cpu_seconds(sim.proc.pid) - cpu_before) * 1000 / requests
    return [
        ("requests", f"{requests} at concurrency {concurrency}, latency {latency:g} s"),
        ("statuses", str(result.statuses)),
        ("throughput", f"{result.rate:,.0f} req/s (client and simulator share the CPUs)"),
        ("simulator CPU", f"{cpu_ms:.3f} ms/request"),
        ("one-core ceiling", f"{1000 / cpu_ms:,.0f} req/s" if cpu_ms else "n/a"),
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.simulator_capacity")
    p.add_argument("--requests", type=int, default=20000)
    p.add_argument("--concurrency", type=int, default=256)
    p.add_argument("--latency", type=float, default=0.0)
    p.add_argument("--quick", action="store_true", help="5,000 requests")
    args = p.parse_args(argv)
    requests = 5000 if args.quick else args.requests
    rows = anyio.run(measure, requests, args.concurrency, args.latency)
    table("simulator capacity", rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
