"""(d) Requests in flight: one replica holds 10,000 long requests (issue 13, target 1).

10,000 workers, a 10 s gateway, 4 KiB prompts: the ideal is 1,000 msg/s with every worker
holding a request at the gateway all the time. Target: efficiency ≥ 0.97 and the daemon's
peak RSS (VmHWM) ≤ 250 MB. The efficiency is the one ``bench.littles_law`` prints: the
time-averaged requests in flight at the gateway ÷ workers (``bench.harness``), for the
daemon and the baseline alike; the result-count figures (whole rounds, 10-90 %) beside it
are quantized by the waves (4 rounds: one wave more or less in the window moves them).
``bench.baseline`` runs the same setting after it, on the same Redis and simulator, as the
floor of what the libraries cost.
Run alone: ``python -m bench.in_flight [--quick] [--workers N --latency S]``.
"""

from __future__ import annotations

import argparse
from contextlib import ExitStack

import anyio

from bench.common import redis, simulator, table, verdict
from bench.harness import drain
from bench.littles_law import figures
from bench.overhead import describe

TARGET_EFFICIENCY = 0.97
TARGET_PEAK = 250 * 10**6
PROMPT_BYTES = 4096


async def measure(workers: int, latency: float, rounds: int) -> list[tuple[str, str]]:
    messages = workers * rounds
    with ExitStack() as stack:
        url, sim = redis(stack).url, simulator(stack, "--latency", str(latency))
        run, seen = await drain(url, sim, "in-flight", workers, messages, prompt_bytes=PROMPT_BYTES)
        base, _ = await drain(
            url, sim, "in-flight-base", workers, messages, baseline=True, prompt_bytes=PROMPT_BYTES
        )
    ideal = workers / latency
    efficiency = run.occupancy or 0.0
    return [
        ("setup", f"{messages} messages, {workers} workers, gateway latency {latency:g} s, "
                  f"{PROMPT_BYTES // 1024} KiB prompts"),
        ("max in flight at gateway", str(seen["max_concurrent_seen"])),
        ("efficiency", verdict(figures(run, ideal), efficiency >= TARGET_EFFICIENCY,
                               f"≥ {TARGET_EFFICIENCY}")),
        ("daemon peak RSS", verdict(f"{run.peak_rss / 1e6:.0f} MB "
                                    f"({run.peak_rss / workers / 1e3:.1f} KB per request)",
                                    run.peak_rss <= TARGET_PEAK, f"≤ {TARGET_PEAK // 10**6} MB")),
        ("daemon", describe(run)),
        ("baseline, same setting", f"{describe(base)}; {figures(base, ideal)}"),
    ]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.in_flight")
    p.add_argument("--workers", type=int, default=10_000)
    p.add_argument("--latency", type=float, default=10.0)
    p.add_argument("--rounds", type=int, default=4, help="messages = workers × rounds")
    p.add_argument("--quick", action="store_true", help="2 rounds")
    args = p.parse_args(argv)
    rounds = 2 if args.quick else args.rounds
    table("(d) requests in flight", anyio.run(measure, args.workers, args.latency, rounds))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
