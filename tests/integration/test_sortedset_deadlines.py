"""Queued messages past their deadline are answered at their deadline (docs/architecture.md G7).

Against a real redis-server (and the simulator over real HTTP for the daemon test): the
deadline sweep answers a queued member with DEADLINE_EXCEEDED within about a second of
its deadline, while every worker is busy, once per member however many replicas sweep,
and a retry parked beyond its deadline comes back in time to be swept.
"""

from __future__ import annotations

import time

import anyio
import pytest
from redis.asyncio import Redis

from async_processor.config import PoolConfig, SortedSetConfig
from async_processor.messages import Envelope, ErrorCode, Request, Result, Routing
from async_processor.metrics import Metrics
from async_processor.transports.base import Deferral, TransportContext
from async_processor.transports.redis_sortedset.transport import SortedSetTransport
from tests.fixtures.inprocess import metric, running, sortedset_config, submit
from tests.fixtures.servers import RedisServer
from tests.fixtures.simulator import SimulatorProcess

pytestmark = pytest.mark.anyio


def config_for(redis_url: str, unique: str) -> SortedSetConfig:
    return SortedSetConfig.model_validate(
        {
            "url": redis_url,
            "retry_queue_name": f"{unique}-retry",
            "result_queue_name": f"{unique}-results",
            "queues": [{"queue_name": f"{unique}-q", "igw_base_url": "http://gw.test"}],
        }
    )


def member(request_id: str, deadline: int, token: str = "") -> bytes:
    routing = Routing(request_token=token)
    return Envelope(Request(id=request_id, deadline=deadline), routing, kind="redis").encode()


async def sweep(config: SortedSetConfig, metrics: Metrics, replicas: int = 1) -> None:
    """One deadline sweep by each of ``replicas`` transports, all at once."""
    ctx = TransportContext(metrics=metrics)
    transports = [SortedSetTransport(config, ctx) for _ in range(replicas)]
    try:
        async with anyio.create_task_group() as tg:
            for transport in transports:
                tg.start_soon(transport.expire_due)
    finally:
        for transport in transports:
            await transport.aclose()


async def wait_for_result(r: Redis, name: str, timeout: float) -> tuple[Result, float]:
    with anyio.fail_after(timeout):
        while not (raw := await r.rpop(name)):
            await anyio.sleep(0.02)
    return Result.decode(raw), time.time()


async def test_expired_message_is_answered_while_every_worker_is_busy(
    redis_url: str, unique: str, simulator: SimulatorProcess, redis_client: Redis
) -> None:
    r = redis_client
    # One worker, busy for 8 s: a message queued behind it used to get its result only
    # when the worker freed up, long after its deadline.
    simulator.configure(latency=8.0)
    config = sortedset_config(
        redis_url, simulator.url, unique, pools=[PoolConfig(id="p", workers=1)]
    )
    async with running(config) as processor:
        # The worker busy, its prefetch slots full, and more waiting in the queue.
        busy = [
            {"id": f"busy{i}", "deadline": int(time.time()) + 600, "payload": {"p": 1}}
            for i in range(5)
        ]
        client = await submit(redis_url, unique, *busy)
        with anyio.fail_after(5):
            while not metric(processor, "llm_d_async_async_inflight_requests"):
                await anyio.sleep(0.05)
        await anyio.sleep(0.3)
        assert await r.zcard(unique) > 0
        deadline = int(time.time()) + 2
        late = Envelope(Request(id="late", deadline=deadline), Routing(), kind="redis")
        await r.zadd(unique, {late.encode(): deadline})
        result, at = await wait_for_result(r, f"{unique}:results", 6)
        assert result.id == "late"
        assert result.error_code == ErrorCode.DEADLINE_EXCEEDED
        assert at - deadline < 2.0, f"answered {at - deadline:.2f} s after its deadline"
        # The sweep writes the result, then counts it: the count may trail the result.
        exceeded = "llm_d_async_async_exceeded_deadline_requests_total"
        with anyio.fail_after(2):
            while metric(processor, exceeded) != 1:
                await anyio.sleep(0.02)
        await anyio.sleep(0.1)
        assert metric(processor, exceeded) == 1  # counted once, not once per sweep
        assert metric(processor, "llm_d_async_async_inflight_requests") == 1  # still busy
        await client.aclose()


async def test_replicas_sweeping_together_answer_each_member_once(
    redis_url: str, unique: str, redis_client: Redis
) -> None:
    r = redis_client
    config = config_for(redis_url, unique)
    q = config.queues[0].queue_name
    past = int(time.time()) - 1
    await r.zadd(q, {member(f"{unique}-{i}", past, token=f"t{i}"): past for i in range(120)})
    await r.zadd(q, {member(f"{unique}-future", past + 600): past + 600})
    await sweep(config, Metrics(), replicas=3)
    results = [Result.decode(raw) for raw in await r.lrange(config.result_queue_name, 0, -1)]
    assert sorted(x.id for x in results) == sorted(f"{unique}-{i}" for i in range(120))
    assert {x.error_code for x in results} == {ErrorCode.DEADLINE_EXCEEDED}
    assert await r.zcard(q) == 1  # the future one stays


async def test_undecodable_expired_member_is_left_to_the_worker_path(
    redis_url: str, unique: str, redis_client: Redis
) -> None:
    r = redis_client
    config = config_for(redis_url, unique)
    q = config.queues[0].queue_name
    past = int(time.time()) - 1
    await r.zadd(q, {b'{"no": "id"}': past, member(f"{unique}-ok", past): past})
    metrics = Metrics()
    await sweep(config, metrics)
    assert await r.zrange(q, 0, -1) == [b'{"no": "id"}']  # dead-lettered once claimed
    assert await r.llen(config.result_queue_name) == 1
    exceeded = metrics.registry.get_sample_value(
        "llm_d_async_async_exceeded_deadline_requests_total",
        {"queue_id": q, "queue_name": q, "pool_name": "default"},
    )
    assert exceeded == 1


async def test_a_retry_due_after_its_deadline_is_answered_at_the_deadline(
    redis_url: str, unique: str, redis_client: Redis
) -> None:
    r = redis_client
    # A hand-back due later than the deadline used to sit in the retry set until then.
    config = config_for(redis_url, unique)
    q = config.queues[0].queue_name
    # 4 s: the fetch must come before the deadline even on a loaded machine (at +2, a
    # truncated second and a slow start let the expiry sweep answer it first).
    deadline = int(time.time()) + 4
    await r.zadd(q, {member(f"{unique}-retry", deadline): deadline})
    transport = SortedSetTransport(config, TransportContext())
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(transport.run)
            [delivery] = await transport.fetch(transport.queues[0], 1, 0)
            transport.decode(delivery)
            await transport.defer([Deferral(delivery, 3600.0)])
            result, at = await wait_for_result(r, config.result_queue_name, 8)
            tg.cancel_scope.cancel()
    finally:
        await transport.aclose()
    assert result.error_code == ErrorCode.DEADLINE_EXCEEDED
    assert at - deadline < 1.2


async def test_the_sweep_never_fetches_an_oversized_member(
    private_redis: RedisServer, unique: str
) -> None:
    # It is left to a worker (answered from its prefix); reading it whole, 20 at a time,
    # would cost the daemon memory the size limit is there to bound.
    config = config_for(private_redis.url, unique)
    q = config.queues[0].queue_name
    past = int(time.time()) - 1
    huge = member(f"{unique}-huge", past).replace(
        b'"payload":null', b'"payload":"' + b"z" * 2_000_000 + b'"'
    )
    async with Redis.from_url(private_redis.url) as r:
        await r.zadd(q, {huge: past, member(f"{unique}-small", past): past})
        sent_before = int((await r.info("stats"))["total_net_output_bytes"])
        transport = SortedSetTransport(config, TransportContext(max_message_bytes=1000))
        try:
            await transport.expire_due()
        finally:
            await transport.aclose()
        sent = int((await r.info("stats"))["total_net_output_bytes"]) - sent_before
        assert [Result.decode(x).id for x in await r.lrange(config.result_queue_name, 0, -1)] == [
            f"{unique}-small"
        ]
        assert await r.zrange(q, 0, -1) == [huge]
    assert sent < 100_000, f"{sent} bytes sent to the sweeping daemon"
