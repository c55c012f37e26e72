"""Soak: start and stop the daemon again and again with requests in flight, to catch crashes
at exit (pyreqwest once aborted there with a ``PyGILState_Release`` fatal error).

Each cycle starts ``python -m async_processor run --http-client <client>`` on a private
Redis and a simulator with a 0.5 s latency, queues more than it can answer, lets it work
1-4 s, then stops it: SIGTERM with a drain long enough to finish, or with a drain cut
short (requests aborted in flight), or SIGINT. Every exit code and every log line that
looks like a crash (fatal error, panic, traceback, core dump) is counted. Not part of
``make bench``: ``python -m bench.soak --minutes 30 --client pyreqwest``.
"""

from __future__ import annotations

import argparse
import random
import re
import signal
import subprocess
import time
from collections import Counter
from contextlib import ExitStack

import anyio
from redis.asyncio import Redis

from bench.common import redis, simulator, table
from bench.harness import LOG_DIR, Lane, start_daemon, submit
from tests.fixtures.simulator import SimulatorProcess

CRASH = re.compile(rb"Fatal Python error|PyGILState|panicked|Traceback|core dumped|Segmentation")
# (signal, drain timeout): a drain that finishes, one that cuts requests in flight, SIGINT.
STOPS = [(signal.SIGTERM, "30s"), (signal.SIGTERM, "0.2s"), (signal.SIGINT, "30s")]


async def answered(lane: Lane) -> int:
    client = Redis.from_url(lane.redis_url)
    try:
        return int(await client.llen(lane.results))
    finally:
        await client.aclose()


async def cycle(url: str, sim: SimulatorProcess, client: str, n: int, rng: random.Random) -> str:
    lane = Lane.fresh(url, f"soak{n}")
    await submit(lane, 400)
    sig, drain = STOPS[n % len(STOPS)]
    flags = ["--http-client", client, "--drain-timeout", drain]
    with ExitStack() as stack:
        try:
            proc = start_daemon(stack, lane, sim, 64, flags=flags)
        except RuntimeError as exc:
            return f"failed to start: {exc} ({lane.queue}.log)"
        await anyio.sleep(rng.uniform(1, 4))
        proc.send_signal(sig)
        try:
            code = proc.wait(60)
        except subprocess.TimeoutExpired:
            return "hung at exit"
    text = (LOG_DIR / f"{lane.queue}.log").read_bytes()
    crash = CRASH.search(text)
    if crash:
        return f"crash: {crash.group().decode()} ({lane.queue}.log)"
    if not await answered(lane):
        return "no results (did it reach the gateway?)"
    return f"exit {code} after {sig.name} drain {drain}"


async def soak(client: str, minutes: float, seed: int) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    outcomes: Counter[str] = Counter()
    deadline = time.monotonic() + minutes * 60
    with ExitStack() as stack:
        url, sim = redis(stack).url, simulator(stack, "--latency", "0.5")
        n = 0
        while time.monotonic() < deadline:
            outcome = await cycle(url, sim, client, n, rng)
            outcomes[outcome] += 1
            if not outcome.startswith("exit 0"):
                print(f"cycle {n}: {outcome}", flush=True)
            n += 1
    rows = [("setup", f"{client}, {n} start/stop cycles in {minutes:g} min, 64 workers, "
                      "400 queued per cycle, 0.5 s gateway")]  # fmt: skip
    rows += [(outcome, str(count)) for outcome, count in outcomes.most_common()]
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.soak")
    p.add_argument("--client", default="pyreqwest")
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--seed", type=int, default=13)
    args = p.parse_args(argv)
    table(f"soak: start/stop cycles ({args.client})", anyio.run(soak, args.client, args.minutes,
                                                                 args.seed))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
