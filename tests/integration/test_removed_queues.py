"""A removed discovered queue's claims and retries survive a kill or restart of the daemon
that was draining it: the restarted daemon (discovery on, or turned off) reaps the claim
and moves the retry home, then forgets the queue (real redis-server)."""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator

import anyio
import pytest
from redis.asyncio import Redis
from structlog.testing import capture_logs

from async_processor.config import SortedSetConfig
from async_processor.metrics import Metrics
from async_processor.ops.status import redis_status
from async_processor.redis.keys import EMPTY_SINCE_KEY, REMOVED_QUEUES_KEY
from async_processor.transports.base import Deferral, TransportContext
from async_processor.transports.redis_sortedset.transport import SortedSetTransport
from tests.fixtures.inprocess import running
from tests.fixtures.servers import RedisServer
from tests.fixtures.simulator import SimulatorProcess
from tests.integration.test_queue_discovery import (
    GW,
    daemon_config,
    results,
    submit,
    transport_config,
)

pytestmark = pytest.mark.anyio


@pytest.fixture
async def r(redis_url: str) -> AsyncIterator[Redis]:
    client = Redis.from_url(redis_url)
    yield client
    await client.aclose()


async def removed_while_draining(redis_url: str, unique: str, r: Redis) -> str:
    """A queue with one claim in flight and one retry out is removed from the discovery
    set; its daemon sees that, then dies without settling either."""
    listed, queue = f"{unique}:tenants", f"{unique}-a"
    await r.sadd(listed, queue)
    await submit(redis_url, unique, queue, "m1", "m2")
    config = transport_config(redis_url, unique, set_key=listed)
    transport = SortedSetTransport(
        config.model_copy(update={"lease_seconds": 1}), TransportContext()
    )
    try:
        [spec] = await transport.discover()
        claimed = await transport.fetch(spec, 2, 0)
        await r.srem(listed, queue)
        assert await transport.discover() == []
        transport.decode(claimed[1])
        await transport.defer([Deferral(claimed[1], 0.05)])  # m2: a retry; m1: in flight
    finally:
        await transport.aclose()  # killed: no heartbeat, no hand-back
    assert await r.zcard(f"{queue}:claims-idx") == 1 and await r.zcard(f"{queue}:retry") == 1
    return queue


def restarted(
    redis_url: str, unique: str, discovery: bool, ctx: TransportContext | None = None
) -> SortedSetTransport:
    config = transport_config(redis_url, unique, set_key=f"{unique}:tenants")
    if not discovery:  # turned off: the daemon serves a configured queue only
        other = {"queues": [{"queue_name": f"{unique}-static", "igw_base_url": GW}]}
        queues = SortedSetConfig.model_validate(other).queues
        config = config.model_copy(update={"queue_discovery": None, "queues": queues})
    return SortedSetTransport(config, ctx or TransportContext())


@pytest.mark.parametrize("discovery", [True, False], ids=["discovery", "no-discovery"])
async def test_a_removed_queue_left_draining_by_a_killed_daemon_is_drained_after_restart(
    redis_url: str, unique: str, r: Redis, discovery: bool
) -> None:
    queue = await removed_while_draining(redis_url, unique, r)
    assert queue.encode() in await r.smembers(REMOVED_QUEUES_KEY)
    transport = restarted(redis_url, unique, discovery)
    try:
        if discovery:
            assert await transport.discover() == []
        await transport.settle_removed()
        assert queue in [q.name for q in transport.queues]
        await anyio.sleep(1.2)  # the dead daemon's lease runs out
        await transport.reap()
        await transport.move_due()
        assert await r.zcard(queue) == 2  # back home
        assert await r.zcard(f"{queue}:claims-idx") == 0 == await r.zcard(f"{queue}:retry")
        with anyio.fail_after(30):  # then forgotten, here and in Redis, after its grace
            while queue in [q.name for q in transport.queues]:
                await (transport.discover() if discovery else transport.settle_removed())
                await anyio.sleep(0.2)
        assert queue.encode() not in await r.smembers(REMOVED_QUEUES_KEY)
    finally:
        await transport.aclose()


async def test_tenant_churn_leaves_no_gate_metric_series_or_claim_entry_behind(
    redis_url: str, unique: str, r: Redis, simulator: SimulatorProcess
) -> None:
    """Queues added, served and removed in cycles: once each has drained, nothing kept
    for it remains (memory stays flat however many tenants come and go)."""
    listed = f"{unique}:tenants"
    config = daemon_config(transport_config(redis_url, unique, set_key=listed), simulator.url)
    gone = [f"{unique}-{n}" for n in range(4)]
    async with running(config) as processor:
        transport = processor.transport
        assert isinstance(transport, SortedSetTransport)
        for queue in gone:
            await r.sadd(listed, queue)
            await submit(redis_url, unique, queue, f"id-{queue}")
            assert await results(r, unique, 1) == [f"id-{queue}"]
            await r.srem(listed, queue)
        with anyio.fail_after(20):  # each kept through its grace (2 x 0.2 + 5 s)
            while set(gone) & {q.name for q in transport.queues}:
                await anyio.sleep(0.1)
            await anyio.sleep(0.5)  # one more refresh
        labelled = {
            sample.labels.get("queue_name")
            for family in processor.metrics.registry.collect()
            for sample in family.samples
        }
        assert not set(gone) & labelled
        assert not set(gone) & set(processor.queue_gates._by_queue)
        assert not set(gone) & set(transport._claims.held)
        assert processor.metrics._bound.keys() <= {("", "", "p")}


async def test_a_lagging_replicas_last_claim_on_a_removed_queue_is_not_stranded(
    redis_url: str, unique: str, r: Redis
) -> None:
    """Replica A sees the queue removed and empty; replica B, one refresh behind, claims
    from it once more and dies. A keeps the queue named through its grace period, so the
    claim is seen and reaped home (before: A forgot the queue at its second check, and
    nobody reaped B's claim while the queue stayed unlisted)."""
    listed, queue = f"{unique}:tenants", f"{unique}-a"
    await r.sadd(listed, queue)
    await submit(redis_url, unique, queue, "m1", "m2")
    config = transport_config(redis_url, unique, set_key=listed)
    config = config.model_copy(update={"lease_seconds": 1})  # grace: 2 x 0.2 + 1 s
    a = SortedSetTransport(config, TransportContext())
    b = SortedSetTransport(config, TransportContext())
    try:
        [spec] = await a.discover()
        await b.discover()
        await r.srem(listed, queue)
        for _ in range(3):  # A: removed, and empty at every check
            assert await a.discover() == []
        assert await r.zscore(EMPTY_SINCE_KEY, queue) is not None
        assert len(await b.fetch(spec, 1, 0)) == 1  # B's last claim; B dies holding it
        await b.aclose()
        await anyio.sleep(1.2)  # B's lease runs out
        await a.discover()
        await a.reap()
        assert await r.zcard(f"{queue}:claims-idx") == 0
        assert await r.zcard(queue) == 2  # both home
        with anyio.fail_after(10):  # and then forgotten
            while queue in [q.name for q in a.queues]:
                await a.discover()
                await anyio.sleep(0.2)
        assert queue.encode() not in await r.smembers(REMOVED_QUEUES_KEY)
        assert await r.zscore(EMPTY_SINCE_KEY, queue) is None
    finally:
        await a.aclose()
        await b.aclose()


async def test_a_queue_named_by_an_older_daemon_is_kept_through_its_grace(
    redis_url: str, unique: str, r: Redis
) -> None:
    """An upgrade: the set names a queue and no time was recorded for it. It is drained
    and its grace counted from the first check, not forgotten at once."""
    queue = f"{unique}-old"
    await r.sadd(REMOVED_QUEUES_KEY, queue)
    transport = restarted(redis_url, unique, discovery=False)
    try:
        await transport.settle_removed()
        await transport.settle_removed()
        assert queue in [q.name for q in transport.queues]  # empty, but within its grace
        assert await r.zscore(EMPTY_SINCE_KEY, queue) is not None
    finally:
        await r.srem(REMOVED_QUEUES_KEY, queue)
        await r.zrem(EMPTY_SINCE_KEY, queue)
        await transport.aclose()


async def test_claim_rounds_wait_only_while_more_than_one_queue_is_polled(
    redis_url: str, unique: str, r: Redis
) -> None:
    """``claim_gather_ms`` delays each claim of a lone queue for nothing: a removed queue
    still draining (in upkeep for its grace) is not polled, so it does not count."""
    listed = f"{unique}:tenants"
    await r.sadd(listed, f"{unique}-a", f"{unique}-b")
    config = transport_config(redis_url, unique, set_key=listed)
    transport = SortedSetTransport(config, TransportContext())
    try:
        assert len(await transport.discover()) == 2
        assert transport._fetcher.gather == config.claim_gather_ms / 1000 > 0
        await r.srem(listed, f"{unique}-b")
        assert len(await transport.discover()) == 1
        assert f"{unique}-b" in [q.name for q in transport.queues]  # draining: its grace
        assert transport._fetcher.gather == 0
    finally:
        await transport.aclose()
        await r.srem(REMOVED_QUEUES_KEY, f"{unique}-b")
        await r.zrem(EMPTY_SINCE_KEY, f"{unique}-b")


@pytest.mark.parametrize("discovery", [True, False], ids=["discovery", "no-discovery"])
async def test_hostile_names_in_the_removed_set_are_refused_as_discovered_ones_are(
    redis_url: str, unique: str, r: Redis, discovery: bool
) -> None:
    """The removed-queue set is read back from Redis: a name written into it is checked
    as a listed one is (a daemon key, a bad name, a key that is no sorted set), counted,
    and not served; a removed queue's name still is."""
    results_list, not_a_queue = f"{unique}:results", f"{unique}-list"
    await r.lpush(results_list, "a result")
    await r.lpush(not_a_queue, "x")
    hostile = {
        results_list: "daemon_key",
        f"{unique}-a:inflight": "daemon_key",
        f"{unique}\nbad": "bad_name",
        not_a_queue: "wrong_type",
    }
    legit = f"{unique}-gone"
    await r.sadd(REMOVED_QUEUES_KEY, legit, *hostile)
    metrics = Metrics()
    transport = restarted(redis_url, unique, discovery, TransportContext(metrics=metrics))
    try:
        await transport.settle_removed()
        served = {q.name for q in transport.queues}
    finally:
        await transport.aclose()
        await r.srem(REMOVED_QUEUES_KEY, legit, *hostile)
        await r.delete(results_list, not_a_queue)
    assert legit in served
    assert not served & set(hostile)
    refused = Counter(hostile.values())
    for reason, count in refused.items():
        sample = "llm_d_async_async_queue_discovery_refused_total"
        assert metrics.registry.get_sample_value(sample, {"reason": reason}) == count


async def test_an_oversized_removed_set_is_read_up_to_the_discovery_cap(
    private_redis: RedisServer, unique: str
) -> None:
    """Anyone who can write to Redis can fill the removed-queue set: a start reads at most
    2 × max_queues of it (SSCAN), one TYPE each, as a refresh reads its source, and
    counts and logs the rest instead of checking a million names in one pipeline;
    ``status`` (and the exporter polling it) reads as many, not the whole set."""
    r = Redis.from_url(private_redis.url)
    await r.sadd(REMOVED_QUEUES_KEY, *(f"{unique}-gone-{i}" for i in range(25)))
    metrics = Metrics()
    config = transport_config(private_redis.url, unique, set_key=f"{unique}:tenants", max_queues=5)
    transport = SortedSetTransport(config, TransportContext(metrics=metrics))
    try:
        with capture_logs() as logs:
            await transport.settle_removed()
        restored = [q.name for q in transport.queues]
        status = await redis_status("redis-sortedset", config, r)
    finally:
        await transport.aclose()
        await r.aclose()
    assert len(restored) == 10
    sample = "llm_d_async_async_queue_discovery_refused_total"
    assert metrics.registry.get_sample_value(sample, {"reason": "over_cap"}) == 1
    [over] = [e for e in logs if e["event"] == "removed_queues_over_cap"]
    assert over["read"] == 10
    assert len([q for q in status.queues if q.origin == "removed"]) == 10
