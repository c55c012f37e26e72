"""Sentinel failover under load: the daemon as a process against primary + replica +
3 sentinels; the primary is killed with SIGKILL while 1,000 requests are queued and in
flight. After the promotion every id must have a result; duplicates (a result the
consumer popped from the old primary, whose pop and completion never reached the
replica, so the request ran again) are counted and reported, with and without
``wait_replicas: 1``. docs/transports.md carries the figures.
"""

from __future__ import annotations

import collections
import time
from typing import Any

import anyio
import pytest
import redis

from async_processor.client.redis_sortedset import SortedSetClient
from async_processor.config.redis import RedisConnection
from async_processor.errors import TransportError
from tests.fixtures.daemon import DaemonFactory, sortedset_config
from tests.fixtures.redis_modes import MASTER_NAME, SentinelGroup
from tests.fixtures.simulator import SimulatorProcess

TOTAL = 1000
KILL_AFTER = 250  # results consumed before the primary dies
GIVE_UP = 120.0  # seconds for every id to get its result


@pytest.mark.parametrize("wait_replicas", [0, 1])
def test_every_id_has_a_result_after_the_primary_is_killed(
    sentinel_group: SentinelGroup,
    simulator: SimulatorProcess,
    daemon_factory: DaemonFactory,
    wait_replicas: int,
    record_property: Any,
) -> None:
    simulator.configure(latency=0.1)
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
        wait_replicas=wait_replicas,
        wait_timeout_ms=500,
        **sentinel,
    )
    anyio.run(_submit, conn)
    _replicated(sentinel_group)
    daemon_factory.start(config, "--concurrency", "64")
    seen, stalled = anyio.run(_consume, conn, sentinel_group)
    assert sentinel_group.replica is not None
    assert sentinel_group.master_port() == sentinel_group.replica.port  # it was promoted
    duplicates = sum(n - 1 for n in seen.values())
    lost = TOTAL - len(seen)
    print(
        f"\nfailover wait_replicas={wait_replicas}: lost={lost} duplicates={duplicates} "
        f"no results for {stalled:.1f}s after the kill"
    )
    record_property("lost", lost)
    record_property("duplicates", duplicates)
    assert lost == 0


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
) -> tuple[collections.Counter[str], float]:
    """Results by id until every id has one, and how long none came after the primary was
    killed (it is killed after ``KILL_AFTER``)."""
    seen: collections.Counter[str] = collections.Counter()
    give_up = time.monotonic() + GIVE_UP
    killed, stalled = 0.0, 0.0
    async with SortedSetClient(conn, "failover", "failover:results") as client:
        while len(seen) < TOTAL and time.monotonic() < give_up:
            try:
                results = await client.drain_results(TOTAL, 0.5)
            except TransportError:  # the old primary is gone: ask the sentinels again
                await anyio.sleep(0.2)
                continue
            seen.update(r.id for r in results)
            if killed and results and not stalled:
                stalled = time.monotonic() - killed
            if not killed and sum(seen.values()) >= KILL_AFTER:
                group.kill_primary()
                killed = time.monotonic()
    assert killed, "the run ended before the primary could be killed"
    return seen, stalled
