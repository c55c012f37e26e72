"""A Redis that comes back empty is reported, not taken for an idle queue (issue 30, item 5).

The issue's stall, as found with a task dump of the stalled daemon: the primary under
Sentinel is killed and comes back (a supervisor's restart) before the sentinels call it
down, without persistence, so there is no failover: the replica resyncs from the empty
primary, every queued request is gone, and every poller probes an empty queue, with no
error and no progress. Nothing can bring those requests back; these tests hold the daemon
to saying so (``redis_dataset_lost``, ``redis_dataset_lost_total``) and going on.
"""

from __future__ import annotations

import anyio
import pytest
from redis.asyncio import Redis, RedisCluster
from structlog.testing import capture_logs

from async_processor.client.redis_sortedset import SortedSetClient
from async_processor.config.redis import RedisConnection
from async_processor.metrics import Metrics
from async_processor.transports.redis_sortedset.dataset import DatasetWatch, marker_keys
from tests.fixtures.inprocess import metric, numbered_requests, running, sortedset_config
from tests.fixtures.redis_cluster import RedisClusterNodes
from tests.fixtures.redis_modes import MASTER_NAME, SentinelGroup
from tests.fixtures.servers import RedisServer
from tests.fixtures.simulator import SimulatorProcess

pytestmark = pytest.mark.anyio
LOST = "llm_d_async_async_redis_dataset_lost_total"


async def _answered(conn: RedisConnection, queue: str, prefix: str, n: int) -> set[str]:
    """Submit ``n`` requests and read their results (give up after 20 s)."""
    async with SortedSetClient(conn, queue, f"{queue}:results") as client:
        await client.submit_many(numbered_requests(prefix, n))
        seen: set[str] = set()
        with anyio.move_on_after(20):
            while len(seen) < n:
                seen |= {r.id for r in await client.drain_results(n, 0.5)}
    return seen


async def test_a_primary_back_empty_before_the_sentinels_notice_is_reported(
    sentinel_group: SentinelGroup, simulator: SimulatorProcess, unique: str
) -> None:
    fields = {"mode": "sentinel", "sentinels": sentinel_group.sentinels}
    fields |= {"sentinel_master": MASTER_NAME, "lease_seconds": 3}
    config = sortedset_config("redis://x:1/0", simulator.url, unique, transport_extra=fields)
    conn = config.transport_config.redis_connection()  # type: ignore[union-attr]
    assert sentinel_group.primary is not None
    with capture_logs() as logs:
        async with running(config) as processor:
            assert len(await _answered(conn, unique, "before", 5)) == 5
            await anyio.sleep(1.5)  # a data-set check has read the marker
            sentinel_group.primary.kill()
            sentinel_group.primary.start()  # empty, same port, well within down-after
            with anyio.move_on_after(10):
                while not metric(processor, LOST):
                    await anyio.sleep(0.1)
            assert metric(processor, LOST) == 1
            # The daemon goes on with what is submitted now.
            assert len(await _answered(conn, unique, "after", 5)) == 5
    lost = [e for e in logs if e["event"] == "redis_dataset_lost"]
    assert len(lost) == 1 and lost[0]["log_level"] == "error"
    assert "resubmit" in lost[0]["advice"]


async def test_every_process_reports_a_flush_whoever_sets_the_new_token(
    private_redis: RedisServer,
) -> None:
    """Two daemons share the marker: after a flush the first check sets a new token, and
    the other process, which reads that one, reports the loss too; nothing is reported
    while the data set stays."""
    client = Redis.from_url(private_redis.url)
    first, second = Metrics(), Metrics()
    watches = [DatasetWatch(client, first), DatasetWatch(client, second)]
    try:
        for _ in range(2):
            for watch in watches:
                await watch.check()
        assert first.redis_dataset_lost_total._value.get() == 0
        await client.flushall()
        for watch in watches:
            await watch.check()
            await watch.check()
    finally:
        await client.aclose()
    assert first.redis_dataset_lost_total._value.get() == 1
    assert second.redis_dataset_lost_total._value.get() == 1


async def test_a_cluster_node_losing_its_data_set_is_reported_whichever_node(
    redis_cluster: RedisClusterNodes,
) -> None:
    """One token per primary, read in one round trip per node: the marker of each node
    in turn goes (as a restart without persistence takes it), and each loss is reported,
    not only the one on the node of the single key."""
    client = RedisCluster.from_url(redis_cluster.url)
    nodes = [Redis(port=port) for port in redis_cluster.ports]
    metrics = Metrics()
    watch = DatasetWatch(client, metrics)
    try:
        await watch.check()
        keys = marker_keys(client)
        assert {client.get_node_from_key(k).port for k in keys} == set(redis_cluster.ports)
        for node in nodes:
            await node.config_resetstat()
        await watch.check()
        for node in nodes:  # batched: one SET NX and one GET on each node
            stats = await node.info("commandstats")
            assert (stats["cmdstat_set"]["calls"], stats["cmdstat_get"]["calls"]) == (1, 1)
        assert metrics.redis_dataset_lost_total._value.get() == 0
        for lost, key in enumerate(keys, start=1):
            await client.delete(key)
            await watch.check()
            assert metrics.redis_dataset_lost_total._value.get() == lost, key
    finally:
        await client.aclose()
        for node in nodes:
            await node.aclose()
