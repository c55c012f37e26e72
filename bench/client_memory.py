"""What one request in flight costs the HTTP client alone: RSS per request, by client.

For each ``--http-client`` implementation (and its variants below), a fresh process opens
the client through the seam (``httpclients.build_http_client``), sends ``--in-flight``
POSTs of a 4 KiB body at once to a simulator answering in ``--latency`` seconds, and reads
its own RSS when all of them are at the gateway. Printed: RSS growth per request in
flight, against the process before the burst. No Redis, no daemon: the figure the
in-flight target's budget (250 MB at 10,000, issue 13) spends on HTTP. On the daemon's
loop (uvloop) unless ``--loop asyncio``: the transports are the loop's.
Run: ``python -m bench.client_memory [--in-flight 5000] [--latency 10] [--loop asyncio]``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from contextlib import ExitStack

import anyio

from async_processor.config import TLSConfig
from async_processor.httpclients import HTTP_CLIENTS, build_http_client
from bench.common import rss_bytes, simulator, table

BODY = json.dumps({"model": "bench", "prompt": "x" * 4096, "max_tokens": 16}).encode()


async def one_client(name: str, url: str, in_flight: int, latency: float) -> dict[str, float]:
    client = build_http_client(name, TLSConfig(), in_flight)
    headers = {"Content-Type": "application/json"}
    pid = os.getpid()
    try:
        await client.post(url, BODY, headers, timeout=60, limit=1 << 20)  # warm-up
        before = rss_bytes(pid)
        answered = 0

        async def post() -> None:
            nonlocal answered
            await client.post(url, memoryview(BODY), headers, timeout=latency * 6, limit=1 << 20)
            answered += 1

        async with anyio.create_task_group() as tg:
            for _ in range(in_flight):
                tg.start_soon(post)
            await anyio.sleep(latency * 0.8)  # all sent, none answered yet
            during = rss_bytes(pid)
            early = answered
    finally:
        await client.aclose()
    return {"before": before, "during": during, "answered_early": early}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.client_memory")
    p.add_argument("--in-flight", type=int, default=5000)
    p.add_argument("--latency", type=float, default=10.0)
    p.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop")
    p.add_argument("--one", help=argparse.SUPPRESS)  # child mode: one client, JSON out
    p.add_argument("--url", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one:
        options = {"use_uvloop": args.loop == "uvloop"}
        result = anyio.run(
            one_client, args.one, args.url, args.in_flight, args.latency, backend_options=options
        )
        print(json.dumps(result))
        return 0
    rows = [("setup", f"{args.in_flight} POSTs of 4 KiB in flight at once, gateway latency "
                      f"{args.latency:g} s, one process per client, on {args.loop}")]  # fmt: skip
    with ExitStack() as stack:
        sim = simulator(stack, "--latency", str(args.latency))
        for name in HTTP_CLIENTS:
            out = subprocess.run(
                [sys.executable, "-m", "bench.client_memory", "--one", name,
                 "--url", sim.url + "/v1/completions", "--in-flight", str(args.in_flight),
                 "--latency", str(args.latency), "--loop", args.loop],
                capture_output=True, check=True, text=True,
            )  # fmt: skip
            seen = sim.stats()["max_concurrent_seen"]
            sim.reset()
            r = json.loads(out.stdout.strip().splitlines()[-1])
            per = (r["during"] - r["before"]) / args.in_flight
            rows.append((name, f"{per / 1e3:.1f} KB per request in flight (RSS "
                               f"{r['before'] / 2**20:.0f} -> {r['during'] / 2**20:.0f} MiB; "
                               f"{seen} at the gateway at once)"))  # fmt: skip
    table("HTTP client memory per request in flight", rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
