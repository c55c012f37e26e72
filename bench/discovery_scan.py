"""What one queue-discovery refresh costs with a key prefix, beside many unrelated keys.

A private redis-server holds ``--keys`` unrelated keys (default 100,000) and 200 tenant
queues under the prefix. Per refresh, read from Redis itself (``INFO commandstats``):
round trips (SCAN calls), Redis CPU spent in SCAN, the longest single SCAN (how long one
call blocks Redis), and the refresh's wall time; then how many refreshes a whole cycle
takes. Three readers:

- ``whole walk``: ``SCAN MATCH <prefix>* TYPE zset COUNT 500`` to the end every refresh,
  what the lister did before it spread the walk (its read, without the checks);
- ``spread``: the lister now (``PrefixScan``: at most ``PREFIX_SCAN_CALLS`` SCANs of
  ``PREFIX_SCAN_COUNT`` per refresh);
- ``set_key``: the same 200 names in a Redis set (SSCAN), for comparison.

Run: ``flock /tmp/bench.lock python -m bench.discovery_scan [--keys N] [--refreshes N]``.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Awaitable, Callable
from contextlib import ExitStack

import anyio
from redis.asyncio import Redis

from async_processor.config.transports import QueueDiscovery
from async_processor.redis.keys import OwnKeys
from async_processor.transports.redis_sortedset.discovery import (
    PREFIX_SCAN_CALLS,
    PREFIX_SCAN_COUNT,
    QueueLister,
)
from bench.common import redis as standalone_redis
from bench.common import table

PREFIX = "tenant:"
SET_KEY = "tenants"
QUEUES = 200
OLD_COUNT = 500  # the whole walk's COUNT before the spread scan


async def fill(r: Redis, keys: int) -> None:
    for start in range(0, keys, 5000):
        await r.mset({f"unrelated:{n}": 1 for n in range(start, min(keys, start + 5000))})
    for n in range(QUEUES):
        await r.zadd(f"{PREFIX}{n}", {"m": 1})
    await r.sadd(SET_KEY, *(f"{PREFIX}{n}" for n in range(QUEUES)))


def lister(r: Redis, **source: str) -> QueueLister:
    template = {"igw_base_url": "http://gw:1"}
    discovery = QueueDiscovery.model_validate({**source, "template": template})
    own = OwnKeys(frozenset(), ())
    return QueueLister(r, discovery, cluster=False, own=own, static=frozenset(),
                       result_list="results", metrics=None)  # fmt: skip


async def scan_stats(r: Redis) -> tuple[int, int]:
    """(SCAN and SSCAN calls, their usec) so far."""
    stats = await r.info("commandstats")
    calls = usec = 0
    for name in ("cmdstat_scan", "cmdstat_sscan"):
        calls += stats.get(name, {}).get("calls", 0)
        usec += stats.get(name, {}).get("usec", 0)
    return calls, usec


async def measure(r: Redis, refresh: Callable[[], Awaitable[int]], refreshes: int) -> list[str]:
    """Per refresh: round trips, Redis usec, longest call, wall ms; names found at the end."""
    trips, usecs, walls, longest = [], [], [], 0.0
    found = 0
    for _ in range(refreshes):
        await r.config_resetstat()
        calls, usec = await scan_stats(r)
        started = time.perf_counter()
        found = await refresh()
        walls.append((time.perf_counter() - started) * 1000)
        after_calls, after_usec = await scan_stats(r)
        trips.append(after_calls - calls)
        usecs.append(after_usec - usec)
        longest = max(longest, await slowest_call(r))
    return [
        f"{min(trips)}-{max(trips)}",
        f"{statistics.median(usecs) / 1000:.1f} ms (max {max(usecs) / 1000:.1f})",
        f"{longest / 1000:.2f} ms",
        f"{statistics.median(walls):.1f} ms (max {max(walls):.1f})",
        str(found),
    ]


async def slowest_call(r: Redis) -> float:
    """The longest SCAN/SSCAN since the last reset (usec), from the slow log at 0 us."""
    entries = await r.slowlog_get(1000)
    await r.slowlog_reset()
    scans = [e["duration"] for e in entries if e["command"].split(b" ")[0].lower()
             in (b"scan", b"sscan")]  # fmt: skip
    return float(max(scans, default=0))


async def run(url: str, keys: int, refreshes: int) -> None:
    r = Redis.from_url(url)
    await r.config_set("slowlog-log-slower-than", 0)
    await r.config_set("slowlog-max-len", 10000)
    await fill(r, keys)

    async def whole_walk() -> int:
        names = r.scan_iter(match=f"{PREFIX}*", count=OLD_COUNT, _type="zset")
        return len([n async for n in names])

    spread = lister(r, key_prefix=PREFIX)
    by_set = lister(r, set_key=SET_KEY)

    async def spread_refresh() -> int:
        return len(await spread.names())

    async def set_refresh() -> int:
        return len(await by_set.names())

    header = ("round trips", "Redis CPU", "longest call", "wall", "names")
    rows = []
    for name, refresh in (("whole walk (before)", whole_walk), ("spread (now)", spread_refresh),
                          ("set_key", set_refresh)):  # fmt: skip
        await r.slowlog_reset()
        cells = await measure(r, refresh, refreshes)
        rows.append((name, ", ".join(f"{h} {c}" for h, c in zip(header, cells, strict=True))))
    per_refresh = PREFIX_SCAN_COUNT * PREFIX_SCAN_CALLS
    cycle = f"{spread.scan.cycles} whole cycles in {refreshes} refreshes"
    rows.append(("spread cycle", f"{cycle} (about {math.ceil(keys / per_refresh)} refreshes "
                 f"a cycle at COUNT {PREFIX_SCAN_COUNT} x {PREFIX_SCAN_CALLS} calls)"))  # fmt: skip
    table(f"queue discovery refresh, {keys:,} unrelated keys + {QUEUES} queues", rows)
    await r.aclose()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.discovery_scan")
    parser.add_argument("--keys", type=int, default=100_000)
    parser.add_argument("--refreshes", type=int, default=12)
    args = parser.parse_args(argv)
    with ExitStack() as stack:
        server = standalone_redis(stack)
        anyio.run(run, server.url, args.keys, args.refreshes)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
