"""Redis refusing writes while PING answers (docs/architecture.md G11): nothing stays leased
for nothing.

A private redis-server refuses writes with NOREPLICAS (``min-replicas-to-write 1`` with
no replica) for 8 s while a request is in flight. Whatever the daemon then gives up on
(a result write, a hand-back) stops being renewed at once, and a result it already holds
is written later: the producer gets its 200 within 3 x lease_seconds of the refusal
ending, not at deadline + 300 s.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import anyio
import pytest
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from structlog.testing import capture_logs

from async_processor.config import AppConfig
from async_processor.redis import keys as redis_keys
from async_processor.redis.conn import warn_if_evicting
from async_processor.transports.base import TransportContext
from async_processor.transports.redis_sortedset.transport import SortedSetTransport
from tests.fixtures.inprocess import metric, running, sortedset_config, submit
from tests.fixtures.servers import RedisServer, free_port
from tests.fixtures.simulator import SimulatorProcess

pytestmark = pytest.mark.anyio
LEASE = 10.0  # long enough that no lease expires during the refusal by itself
REFUSAL = 8.0


@pytest.fixture
async def admin(private_redis: RedisServer) -> AsyncIterator[Redis]:
    client = Redis.from_url(private_redis.url)
    yield client
    await client.aclose()


def leased_config(redis_url: str, gateway: str, queue: str, **runtime: str) -> AppConfig:
    config = sortedset_config(redis_url, gateway, queue, **runtime)
    transport = config.transport_config.model_copy(update={"lease_seconds": LEASE})
    return config.model_copy(update={"transport_config": transport})


async def refuse_writes_while_in_flight(admin: Redis, processor_metric: object) -> float:
    """Refuse writes for REFUSAL s; the time the refusal ended."""
    await admin.config_set("min-replicas-to-write", 1)
    try:
        with pytest.raises(Exception, match="NOREPLICAS"):
            await admin.set("probe", "x")
        await anyio.sleep(REFUSAL)
    finally:
        await admin.config_set("min-replicas-to-write", 0)
    return time.monotonic()


async def in_flight(processor: object) -> None:
    with anyio.fail_after(5):
        while not metric(processor, "llm_d_async_async_inflight_requests"):  # type: ignore[arg-type]
            await anyio.sleep(0.05)


async def test_a_result_refused_by_redis_is_kept_and_written_after_the_refusal(
    private_redis: RedisServer, admin: Redis, unique: str, simulator: SimulatorProcess
) -> None:
    simulator.configure(latency=2.0)  # the answer comes back while writes are refused
    config = leased_config(private_redis.url, simulator.url, unique)
    async with running(config) as processor:
        request = {"id": "kept", "deadline": int(time.time()) + 3600, "payload": {"p": 1}}
        client = await submit(private_redis.url, unique, request)
        await in_flight(processor)
        ended = await refuse_writes_while_in_flight(admin, processor)
        [result] = await client.drain_results(1, 3 * LEASE)
        took = time.monotonic() - ended
        assert result.status_code == 200
        assert took < 3 * LEASE
        abandoned = metric(processor, "llm_d_async_async_abandoned_claims_total")
        assert abandoned >= 1
        await client.aclose()
    assert await admin.zcard(redis_keys.claims_idx_key(unique)) == 0
    print(f"200 result {took:.1f} s after the refusal ended (lease {LEASE} s)")


async def test_a_hand_back_refused_by_redis_is_not_renewed_and_comes_back(
    private_redis: RedisServer, admin: Redis, unique: str, simulator: SimulatorProcess
) -> None:
    # The attempt times out (a retry) while writes are refused: the hand-back fails and is
    # given up. Its claim used to be renewed until deadline + 300 s.
    simulator.configure(latency=60.0)
    config = leased_config(private_redis.url, simulator.url, unique, request_timeout="2s")
    async with running(config) as processor:
        request = {"id": "back", "deadline": int(time.time()) + 3600, "payload": {"p": 1}}
        client = await submit(private_redis.url, unique, request)
        await in_flight(processor)
        ended = await refuse_writes_while_in_flight(admin, processor)
        simulator.configure(latency=0.0)
        [result] = await client.drain_results(1, 3 * LEASE)
        took = time.monotonic() - ended
        assert result.status_code == 200
        assert took < 3 * LEASE
        await client.aclose()
    print(f"200 result {took:.1f} s after the refusal ended (lease {LEASE} s)")


async def test_an_abandoned_claim_is_not_renewed(private_redis: RedisServer, admin: Redis) -> None:
    config = leased_config(private_redis.url, "http://gw.test", "q").transport_config
    await admin.zadd("q", {b'{"no": "id"}': 1})
    transport = SortedSetTransport(config, TransportContext())  # type: ignore[arg-type]
    try:
        [delivery] = await transport.fetch(transport.queues[0], 1, 0)
        [(claim, expiry)] = await admin.zrange("q:claims-idx", 0, -1, withscores=True)
        transport.abandon(delivery, "dead_letter_failed")
        await anyio.sleep(0.05)
        await transport.heartbeat()
        assert await admin.zscore("q:claims-idx", claim) == expiry
    finally:
        await transport.aclose()


async def test_a_redis_that_may_evict_keys_is_reported_at_start(
    private_redis: RedisServer, admin: Redis
) -> None:
    # An evicting Redis (volatile-lru is a managed default) deletes dedup markers and
    # retained result lists at its maxmemory, allkeys-* queues too: answers lost unseen.
    await admin.config_set("maxmemory-policy", "volatile-lru")
    await admin.config_set("maxmemory", "1gb")
    config = leased_config(private_redis.url, "http://gw.test", "q").transport_config
    transport = SortedSetTransport(config, TransportContext())  # type: ignore[arg-type]
    with capture_logs() as logs:
        async with anyio.create_task_group() as tg:
            await tg.start(transport.run)
            with anyio.fail_after(10):
                while not any(e["event"] == "redis_may_evict" for e in logs):
                    await anyio.sleep(0.05)
            tg.cancel_scope.cancel()
        await transport.aclose()
        await admin.config_set("maxmemory-policy", "noeviction")
        await warn_if_evicting(admin)
    warned = [e["maxmemory_policy"] for e in logs if e["event"] == "redis_may_evict"]
    assert warned == ["volatile-lru"]  # and nothing once it is noeviction


async def test_an_evicting_policy_without_a_maxmemory_is_not_reported(admin: Redis) -> None:
    # maxmemory 0 is no limit: Redis never evicts, whatever the policy (volatile-lru is
    # a common default left in place); the error line there was a false alarm.
    await admin.config_set("maxmemory-policy", "allkeys-lru")
    await admin.config_set("maxmemory", "0")
    with capture_logs() as logs:
        await warn_if_evicting(admin)
    await admin.config_set("maxmemory", "1gb")
    with capture_logs() as limited:
        await warn_if_evicting(admin)
    assert [e["event"] for e in logs] == []
    assert [e["maxmemory_policy"] for e in limited] == ["allkeys-lru"]


async def test_the_eviction_check_survives_a_cluster_unreachable_at_start() -> None:
    # The cluster client raises its own RedisClusterException (not a RedisError) when no
    # node answers; escaping the transport's task group, it stopped the daemon at every
    # start while the cluster was away, where the claims and upkeep wait for it.
    client = RedisCluster.from_url(f"redis://127.0.0.1:{free_port()}")
    with capture_logs() as logs:
        await warn_if_evicting(client)
    await client.aclose()
    assert [e["event"] for e in logs] == ["eviction_policy_unknown"]
