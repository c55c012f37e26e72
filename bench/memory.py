"""(c) Memory: peak RSS with 2,048 requests in flight, and RSS against broker backlog.

1. 2,048 workers, 4 KiB prompts, a 5 s gateway: every worker holds a request in flight
   (the simulator's max concurrency seen confirms it); the daemon's peak RSS (VmHWM)
   should stay ≤ 150 MB.
2. 64 workers and a 1 s gateway in front of a backlog of 1k, then 1M messages (100k with
   ``--quick``): the daemon's RSS after a few seconds of work should not follow the
   backlog, since it fetches only what its workers can take.
Run alone: ``python -m bench.memory [--quick]``.
"""

from __future__ import annotations

import argparse
import time
from contextlib import ExitStack

import anyio

from bench.common import mib, redis, rss_bytes, simulator, table, verdict
from bench.harness import Lane, bulk_load, drain, start_daemon

TARGET_PEAK = 150 * 10**6
IN_FLIGHT = 2048
PROMPT_BYTES = 4096
SETTLE_SECONDS = 5.0
LATENCY = 5.0  # long enough for the daemon to fill every worker even on a busy machine


async def peak_in_flight(rounds: int) -> list[tuple[str, str]]:
    with ExitStack() as stack:
        url, sim = redis(stack).url, simulator(stack, "--latency", str(LATENCY))
        messages = IN_FLIGHT * rounds
        run, seen = await drain(
            url, sim, "memory-inflight", IN_FLIGHT, messages, prompt_bytes=PROMPT_BYTES
        )
    return [
        ("in flight", f"{IN_FLIGHT} workers, {seen['max_concurrent_seen']} concurrent seen at "
                      f"the gateway, {PROMPT_BYTES // 1024} KiB prompts, {messages} messages"),
        ("daemon peak RSS", verdict(f"{mib(run.peak_rss)} = {run.peak_rss / 1e6:.0f} MB",
                                    run.peak_rss <= TARGET_PEAK, "≤ 150 MB")),
        ("throughput", f"{run.rate:,.0f} msg/s (ideal {IN_FLIGHT / LATENCY:,.0f})"),
    ]  # fmt: skip


async def rss_with_backlog(backlog: int) -> int:
    with ExitStack() as stack:
        server = redis(stack)
        sim = simulator(stack, "--latency", "1")
        lane = Lane.fresh(server.url, "memory-backlog")
        await bulk_load(lane, backlog)
        proc = start_daemon(stack, lane, sim, 64)
        await anyio.sleep(SETTLE_SECONDS)
        if proc.poll() is not None:
            raise RuntimeError(f"daemon exited with {proc.returncode}")
        return rss_bytes(proc.pid)


async def measure(quick: bool) -> list[tuple[str, str]]:
    rows = await peak_in_flight(rounds=1 if quick else 3)
    deep = 100_000 if quick else 1_000_000
    started = time.monotonic()
    small, large = await rss_with_backlog(1000), await rss_with_backlog(deep)
    rows += [
        ("RSS, backlog 1k", mib(small)),
        (f"RSS, backlog {deep:,}", f"{mib(large)} (× {large / small:.2f}; "
                                   f"{time.monotonic() - started:.0f} s incl. loading)"),
    ]  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.memory")
    p.add_argument("--quick", action="store_true", help="fewer rounds, a 100k backlog")
    args = p.parse_args(argv)
    table("(c) memory", anyio.run(measure, args.quick))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
