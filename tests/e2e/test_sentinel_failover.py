"""Sentinel failovers under load: the daemon as a process against primary + replica +
3 sentinels, ``lease_seconds: 3`` (so leases lapse during each outage) and
``wait_replicas: 1``. 2,000 requests are queued; every 15 s the primary is killed with
SIGKILL, the replica promoted, and the killed node brought back as the new primary's
replica (as an operator's restart does, ``SentinelGroup.fail_over``), so the next kill
fails over again. Every id must be answered exactly once (issue 30, item 5).
docs/transports.md carries the figures.
"""

from __future__ import annotations

import collections
import time
from typing import Any

import anyio
import redis

from async_processor.client.redis_sortedset import SortedSetClient
from async_processor.config.redis import RedisConnection
from async_processor.errors import TransportError
from tests.fixtures.daemon import DaemonFactory, assert_answered_once, sortedset_config
from tests.fixtures.redis_modes import MASTER_NAME, SentinelGroup
from tests.fixtures.simulator import SimulatorProcess

TOTAL = 2000
WORKERS = 16
LATENCY = 0.3  # 16 workers at 0.3 s: ~53 results/s, a run of ~45 s, so 2 kills or more
KILL_EVERY = 15.0
GIVE_UP = 100.0  # seconds for every id to get its result


def test_every_id_is_answered_once_across_a_kill_every_15_s(
    sentinel_group: SentinelGroup,
    simulator: SimulatorProcess,
    daemon_factory: DaemonFactory,
    record_property: Any,
) -> None:
    simulator.configure(latency=LATENCY)
    sentinel = {
        "mode": "sentinel",
        "sentinels": sentinel_group.sentinels,
        "sentinel_master": MASTER_NAME,
    }
    conn = RedisConnection(url="redis://ignored:1/0", **sentinel)
    config = sortedset_config(
        conn.url,
        simulator.url,
        ["failover"],
        result_list="failover:results",
        lease_seconds=3,
        wait_replicas=1,
        wait_timeout_ms=500,
        **sentinel,
    )
    anyio.run(_submit, conn)
    _replicated(sentinel_group)
    daemon = daemon_factory.start(config, "--concurrency", str(WORKERS))
    seen, failovers = anyio.run(_consume, conn, sentinel_group)
    assert_answered_once(seen, TOTAL, failovers, daemon, record_property)


async def _submit(conn: RedisConnection) -> None:
    deadline = int(time.time() + 600)
    requests = [{"id": f"f-{i}", "deadline": deadline, "payload": {"i": i}} for i in range(TOTAL)]
    async with SortedSetClient(conn, "failover", "failover:results") as client:
        await client.submit_many(requests)


def _replicated(group: SentinelGroup) -> None:
    """The queue is on the replica before anything can be lost (it is the test's input)."""
    assert group.primary is not None
    client = redis.Redis(host="127.0.0.1", port=group.primary.port)
    try:
        assert client.wait(1, 5000) == 1
    finally:
        client.close()


async def _consume(
    conn: RedisConnection, group: SentinelGroup
) -> tuple[collections.Counter[str], list[float]]:
    """Results by id until every id has one, failing the primary over every
    ``KILL_EVERY`` s meanwhile; and the seconds each promotion took."""
    seen: collections.Counter[str] = collections.Counter()
    failovers: list[float] = []
    started = time.monotonic()
    give_up, next_kill = started + GIVE_UP, started + KILL_EVERY
    async with SortedSetClient(conn, "failover", "failover:results") as client:
        while len(seen) < TOTAL and time.monotonic() < give_up:
            if time.monotonic() >= next_kill:
                failovers.append(await anyio.to_thread.run_sync(group.fail_over))
                next_kill = time.monotonic() + KILL_EVERY
            try:
                results = await client.drain_results(TOTAL, 0.5)
            except TransportError:  # the old primary is gone: ask the sentinels again
                await anyio.sleep(0.2)
                continue
            seen.update(r.id for r in results)
    return seen, failovers
