"""Result retention on redis-sortedset against a real redis-server: results nobody
consumed within ``result_ttl_seconds`` are trimmed (counted), consumed ones are not
miscounted, and ``status`` dates the oldest unconsumed result."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import anyio
import pytest
from redis.asyncio import Redis

from async_processor.client.redis_sortedset import SortedSetClient
from async_processor.config import SortedSetConfig
from async_processor.messages import Result
from async_processor.metrics import Metrics
from async_processor.ops.status import redis_status
from async_processor.transports.base import Completion, TransportContext
from async_processor.transports.redis_sortedset.transport import SortedSetTransport
from async_processor.transports.redis_sortedset.upkeep import RETAIN_GRACE

pytestmark = pytest.mark.anyio


def config(redis_url: str, unique: str, ttl: int) -> SortedSetConfig:
    return SortedSetConfig.model_validate(
        {"url": redis_url, "result_queue_name": f"{unique}:results", "result_ttl_seconds": ttl,
         "retry_queue_name": f"{unique}:retry",
         "queues": [{"queue_name": unique, "igw_base_url": "http://gw:1"}]}
    )  # fmt: skip


@pytest.fixture
async def client(redis_url: str, unique: str) -> AsyncIterator[SortedSetClient]:
    async with SortedSetClient(redis_url, unique, f"{unique}:results") as c:
        yield c


async def answer(transport: SortedSetTransport, client: SortedSetClient, ids: list[str]) -> None:
    deadline = int(time.time()) + 600
    await client.submit_many({"id": i, "deadline": deadline, "payload": {}} for i in ids)
    deliveries = await transport.fetch(transport.queues[0], len(ids), 0)
    done = [Completion(d, Result.http(transport.decode(d).id, 200, b"{}")) for d in deliveries]
    await transport.complete(done)


async def test_unconsumed_results_past_the_ttl_are_trimmed_and_counted(
    client: SortedSetClient, redis_url: str, unique: str
) -> None:
    metrics = Metrics()
    cfg = config(redis_url, unique, ttl=2)
    transport = SortedSetTransport(cfg, TransportContext(metrics=metrics))
    try:
        await answer(transport, client, [f"old-{i}" for i in range(5)])
        await transport.retain()  # dates them: a mark (now, 5 pushed)
        consumed = await client.drain_results(2, 5)
        await anyio.sleep(2.2)
        await answer(transport, client, ["new-0", "new-1"])
        before = await redis_status("redis-sortedset", cfg, transport._redis)
        await transport.retain()
        after = await redis_status("redis-sortedset", cfg, transport._redis)
        left = await client.drain_results(10, 1)
    finally:
        await transport.aclose()
    assert [r.id for r in consumed] == ["old-0", "old-1"]
    # The three old results nobody read went; the two new ones stay, in order.
    trimmed = metrics.registry.get_sample_value(
        "llm_d_async_async_results_trimmed_total", {"result_list": f"{unique}:results"}
    )
    assert trimmed == 3
    assert [r.id for r in left] == ["new-0", "new-1"]
    assert before.result_lists[f"{unique}:results"] == 5
    assert before.oldest_results[f"{unique}:results"] >= 2.0
    assert after.result_lists[f"{unique}:results"] == 2
    assert after.oldest_results[f"{unique}:results"] < 1.0


async def test_without_a_ttl_nothing_is_trimmed_but_results_are_dated(
    client: SortedSetClient, redis_url: str, unique: str
) -> None:
    cfg = config(redis_url, unique, ttl=0)
    transport = SortedSetTransport(cfg, TransportContext())
    try:
        await answer(transport, client, ["a", "b"])
        await transport.retain()
        await anyio.sleep(1.1)
        await transport.retain()
        status = await redis_status("redis-sortedset", cfg, transport._redis)
    finally:
        await transport.aclose()
    assert status.result_lists[f"{unique}:results"] == 2
    assert status.oldest_results[f"{unique}:results"] >= 1.0
    assert len(await client.drain_results(5, 1)) == 2


async def test_a_message_naming_the_counter_cannot_break_retention(
    client: SortedSetClient, redis_url: str, unique: str
) -> None:
    """A message may route its result to any list name, even the counter's: the counter
    then stops counting, but results are still written and retention still runs."""
    cfg = config(redis_url, unique, ttl=1)
    transport = SortedSetTransport(cfg, TransportContext())
    counter = "{" + f"{unique}:results" + "}:pushed"
    try:
        await transport._redis.lpush(counter, b"squatted")
        await answer(transport, client, ["x"])
        await transport.retain()
    finally:
        await transport.aclose()
    assert [r.id for r in await client.drain_results(5, 1)] == ["x"]


async def test_only_retained_lists_count_their_results(
    client: SortedSetClient, redis_url: str, unique: str
) -> None:
    """The counter belongs to retention, which runs for the configured lists only: a list
    a message names gets no ``{list}:pushed`` key (one per name would pile up)."""
    cfg = config(redis_url, unique, ttl=0)
    transport = SortedSetTransport(cfg, TransportContext())
    named, configured = f"{unique}:named", f"{unique}:results"
    deadline = int(time.time()) + 600
    try:
        await transport.retain()  # a round has run: the configured list's counter is at 0
        await client.submit({"id": "to-named", "deadline": deadline, "payload": {}},
                            result_queue=named)  # fmt: skip
        await client.submit_many({"id": f"to-configured-{i}", "deadline": deadline,
                                  "payload": {}} for i in range(2))  # fmt: skip
        deliveries = await transport.fetch(transport.queues[0], 3, 0)
        await transport.complete(
            [Completion(d, Result.http(transport.decode(d).id, 200, b"{}")) for d in deliveries]
        )
        r = transport._redis
        assert await r.exists("{" + named + "}:pushed") == 0
        assert await r.get("{" + configured + "}:pushed") == b"2"
    finally:
        await transport.aclose()
    assert [x.id for x in await client.drain_results(2, 1, result_queue=named)] == ["to-named"]
    assert len(await client.drain_results(3, 1)) == 2


async def test_each_discovered_queues_own_result_list_is_retained_and_expires_once_let_go(
    redis_url: str, unique: str
) -> None:
    """With ``<queue>`` in the template's result list every tenant has its own list: each
    is trimmed (counted under its name) like the configured one, and its keys expire once
    no round renews them (its queue left upkeep), so tenant churn leaves nothing for ever."""
    listed, queue = f"{unique}:tenants", f"{unique}-t1"
    own = f"{queue}:out"
    cfg = SortedSetConfig.model_validate(
        {"url": redis_url, "result_ttl_seconds": 1, "retry_queue_name": f"{unique}:retry",
         "lease_seconds": 1,
         "queue_discovery": {"set_key": listed, "refresh_seconds": 0.2, "template": {
             "igw_base_url": "http://gw:1", "result_queue_name": "<queue>:out"}}}
    )  # fmt: skip
    metrics = Metrics()
    transport = SortedSetTransport(cfg, TransportContext(metrics=metrics))
    r = transport._redis
    try:
        await r.sadd(listed, queue)
        [spec] = await transport.discover()
        async with SortedSetClient(redis_url, queue, own) as client:
            deadline = int(time.time()) + 600
            await client.submit_many({"id": f"r{i}", "deadline": deadline, "payload": {}}
                                     for i in range(3))  # fmt: skip
        deliveries = await transport.fetch(spec, 3, 0)
        await transport.complete(
            [Completion(d, Result.http(transport.decode(d).id, 200, b"{}")) for d in deliveries]
        )
        await transport.retain()  # dates them
        trimmed = {"result_list": own}
        assert metrics.registry.get_sample_value(SERIES, trimmed) == 0
        await anyio.sleep(1.2)
        await transport.retain()
        assert await r.llen(own) == 0
        assert metrics.registry.get_sample_value(SERIES, trimmed) == 3
        ttls = [await r.ttl(k) for k in ("{" + own + "}:pushed", "{" + own + "}:marks")]
        assert all(0 < t <= 24 * 3600 + RETAIN_GRACE for t in ttls)  # bookkeeping expires
        await r.lpush(own, b"late")  # written after the round, as complete.lua does
        await r.incr("{" + own + "}:pushed")
        await transport.retain()
        assert 0 < await r.ttl(own) <= 1 + RETAIN_GRACE
        await r.srem(listed, queue)
        with anyio.fail_after(10):  # drained: it leaves upkeep after its grace (1.4 s)
            while queue in [q.name for q in transport.queues]:
                await transport.discover()
                await anyio.sleep(0.2)
        await transport.retain()  # and its series goes with it
        assert queue not in [q.name for q in transport.queues]
        assert metrics.registry.get_sample_value(SERIES, trimmed) is None
    finally:
        await transport.aclose()


SERIES = "llm_d_async_async_results_trimmed_total"


async def test_a_ttl_turned_to_0_removes_the_expiry_its_rounds_left(
    client: SortedSetClient, redis_url: str, unique: str
) -> None:
    """Why a round without a TTL removes a result list's expiry (PERSIST) rather than
    leaving the list alone: the rounds of an earlier TTL (this daemon before a restart, or
    a replica still on the old config mid-rollout) set one, and left there it would delete
    the whole list, with every result written after the change, when it ran out."""
    results, r = f"{unique}:results", Redis.from_url(redis_url)
    before = SortedSetTransport(config(redis_url, unique, ttl=60), TransportContext())
    try:
        await answer(before, client, ["a"])
        await before.retain()
    finally:
        await before.aclose()
    assert 60 < await r.ttl(results) <= 60 + RETAIN_GRACE
    after = SortedSetTransport(config(redis_url, unique, ttl=0), TransportContext())
    try:
        await answer(after, client, ["b"])
        await after.retain()
    finally:
        await after.aclose()
    ttl = await r.ttl(results)
    await r.aclose()
    assert ttl == -1  # kept: 0 means never trimmed
    assert [res.id for res in await client.drain_results(5, 1)] == ["a", "b"]
