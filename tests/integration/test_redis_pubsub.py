"""redis-pubsub transport against a real redis-server: channels, buffer, retries, restarts."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, cast

import anyio
import pytest
from redis.asyncio import Redis
from redis.asyncio.client import PubSub
from structlog.testing import capture_logs

from async_processor.config import RedisPubSubConfig
from async_processor.errors import TransportError
from async_processor.messages import Envelope, Request, Result, Routing
from async_processor.metrics import Metrics
from async_processor.pipeline.results import ResultWriter
from async_processor.transports import build_transport
from async_processor.transports.base import Completion, Deferral, Delivery, TransportContext
from async_processor.transports.redis_pubsub import RedisPubSubTransport
from tests.fixtures.lossy_proxy import lossy_proxy
from tests.fixtures.servers import RedisServer

pytestmark = pytest.mark.anyio


def transport_for(
    url: str, unique: str, *channels: str, metrics: Metrics | None = None
) -> RedisPubSubTransport:
    config = RedisPubSubConfig.model_validate(
        {
            "url": url,
            "retry_queue_name": f"{unique}-retry",
            "result_queue_name": f"{unique}-results",
            "queues": [
                {
                    "queue_name": f"{unique}-{c}",
                    "igw_base_url": "http://127.0.0.1:1",
                    "labels": {"q": c},
                }
                for c in channels or ("in",)
            ],
        }
    )
    built = build_transport("redis-pubsub", config, TransportContext(metrics=metrics))
    assert isinstance(built, RedisPubSubTransport)
    return built


def request(request_id: str, **extra: Any) -> bytes:
    return json.dumps(
        {"id": request_id, "deadline": int(time.time()) + 300, "payload": {"p": 1}, **extra}
    ).encode()


def envelope(request_id: str) -> bytes:
    env = Envelope(Request(id=request_id, deadline=int(time.time()) + 300), Routing(), "redis")
    return env.encode()


@asynccontextmanager
async def running(t: RedisPubSubTransport) -> AsyncIterator[RedisPubSubTransport]:
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(t.run)
            yield t
            tg.cancel_scope.cancel()
    finally:
        await t.aclose()


@asynccontextmanager
async def listening(url: str, channel: str) -> AsyncIterator[PubSub]:
    client = Redis.from_url(url)
    pubsub = client.pubsub(ignore_subscribe_messages=True)
    await pubsub.subscribe(channel)
    try:
        yield pubsub
    finally:
        await pubsub.aclose()  # type: ignore[no-untyped-call]
        await client.aclose()


async def received(pubsub: PubSub, count: int, timeout: float = 3.0) -> list[bytes]:
    out: list[bytes] = []
    with anyio.move_on_after(timeout):
        while len(out) < count:
            message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.1)
            if message is not None:
                out.append(message["data"])
    return out


async def fetch_n(
    t: RedisPubSubTransport, n: int, timeout: float = 5.0, index: int = 0
) -> list[Delivery]:
    out: list[Delivery] = []
    with anyio.fail_after(timeout):
        while len(out) < n:
            out += await t.fetch(t.queues[index], n - len(out), 0.5)
    return out


async def test_channel_to_result_channel(redis_url: str, unique: str) -> None:
    async with (
        running(transport_for(redis_url, unique)) as t,
        listening(redis_url, f"{unique}-results") as results,
    ):
        publisher = Redis.from_url(redis_url)
        assert await publisher.publish(f"{unique}-in", envelope("e1")) == 1
        assert await publisher.publish(f"{unique}-in", request("bare1")) == 1
        await publisher.aclose()
        first, second = await fetch_n(t, 2)
        env = t.decode(first)
        assert (env.id, env.kind) == ("e1", "redis")
        assert env.routing.request_queue_name == f"{unique}-in"
        assert env.routing.labels == {"q": "in"}
        assert t.decode(second).kind == "plain"
        await t.complete(
            [
                Completion(first, Result.http("e1", 200, b"{}")),
                Completion(second, Result.http("bare1", 200, b"{}")),
            ]
        )
        got = await received(results, 2)
        assert sorted(Result.decode(raw).id for raw in got) == ["bare1", "e1"]
        await t.health()


async def test_one_result_per_submission(redis_url: str, unique: str) -> None:
    metrics = Metrics()
    async with (
        running(transport_for(redis_url, unique, metrics=metrics)) as t,
        listening(redis_url, f"{unique}-results") as results,
    ):
        publisher = Redis.from_url(redis_url)
        await publisher.publish(f"{unique}-in", envelope("same"))
        await publisher.aclose()
        [delivery] = await fetch_n(t, 1)
        t.decode(delivery)
        result = Result.http("same", 200, b"{}")
        # Two replicas (fan-out) completing the same message: one result goes out.
        await t.complete([Completion(delivery, result)])
        await t.complete([Completion(delivery, result)])
        assert len(await received(results, 2, timeout=1.0)) == 1
    # The one not published is counted, as on redis-sortedset.
    labels = {"queue_id": "", "queue_name": f"{unique}-in", "pool_name": "default"}
    sample = "llm_d_async_async_duplicates_suppressed_total"
    assert metrics.registry.get_sample_value(sample, labels) == 1


async def test_full_buffer_applies_backpressure_without_dropping(
    redis_url: str, unique: str
) -> None:
    t = transport_for(redis_url, unique)
    buffer = t.queues[0].batch_size
    total = buffer * 3
    async with running(t):
        publisher = Redis.from_url(redis_url)
        async with publisher.pipeline(transaction=False) as pipe:
            for i in range(total):
                pipe.publish(f"{unique}-in", envelope(f"m{i}"))
            await pipe.execute()
        await publisher.aclose()
        await anyio.sleep(0.5)  # nobody fetches: the buffer fills and the reader waits
        ids = [t.decode(d).id for d in await fetch_n(t, total)]
        assert ids == [f"m{i}" for i in range(total)]


async def test_deferred_message_comes_back_after_its_delay(redis_url: str, unique: str) -> None:
    async with running(transport_for(redis_url, unique)) as t:
        publisher = Redis.from_url(redis_url)
        await publisher.publish(f"{unique}-in", envelope("again"))
        [delivery] = await fetch_n(t, 1)
        env = t.decode(delivery)
        env.routing.retry_count = 1
        deferred_at = time.monotonic()
        await t.defer([Deferral(delivery, 0.6)])
        assert await publisher.zcard(f"{unique}-retry") == 1
        [back] = await fetch_n(t, 1)
        waited = time.monotonic() - deferred_at
        assert 0.6 <= waited < 1.5  # due retries are checked every 250 ms, not 30 s
        assert t.decode(back).routing.retry_count == 1
        assert await publisher.zcard(f"{unique}-retry") == 0
        await publisher.aclose()


async def test_a_retry_cjson_cannot_read_still_comes_back(redis_url: str, unique: str) -> None:
    # A lone surrogate escape is JSON the daemon accepts (the payload passes through as is),
    # but Redis's cjson refuses the whole member: the pop never matched it to its channel,
    # so it stayed in the retry set for ever, with no result.
    async with running(transport_for(redis_url, unique)) as t:
        publisher = Redis.from_url(redis_url)
        await publisher.publish(f"{unique}-in", request("surrogate", payload={"p": "\ud800"}))
        [delivery] = await fetch_n(t, 1)
        t.decode(delivery)
        await t.defer([Deferral(delivery, 0.01)])
        [back] = await fetch_n(t, 1)
        assert t.decode(back).id == "surrogate"
        assert b'{"p": "\\ud800"}' in back.raw  # the payload's bytes are unchanged
        await publisher.aclose()


async def test_buffered_messages_are_handed_back_on_close(redis_url: str, unique: str) -> None:
    publisher = Redis.from_url(redis_url)
    async with running(transport_for(redis_url, unique)) as t:
        for i in range(5):
            await publisher.publish(f"{unique}-in", envelope(f"b{i}"))
        with anyio.fail_after(5):
            while t._buffers[f"{unique}-in"].room() > t._buffers[f"{unique}-in"].size - 5:
                await anyio.sleep(0.02)
    # Never fetched, yet not lost: in the retry set, due now, routed to their channel.
    members = cast(list[bytes], await publisher.zrange(f"{unique}-retry", 0, -1))
    routed = [json.loads(m)["internal"]["request_queue_name"] for m in members]
    assert sorted(json.loads(m)["data"]["id"] for m in members) == [f"b{i}" for i in range(5)]
    assert routed == [f"{unique}-in"] * 5
    await publisher.aclose()


async def test_retries_of_other_channels_are_left_alone(redis_url: str, unique: str) -> None:
    other = routed("x", f"{unique}-elsewhere")
    publisher = Redis.from_url(redis_url)
    await publisher.zadd(f"{unique}-retry", {other: 0})
    t = transport_for(redis_url, unique)
    try:
        assert await t.move_due() == 0
        assert await publisher.zcard(f"{unique}-retry") == 1
    finally:
        await t.aclose()
        await publisher.aclose()


async def test_undecodable_and_dead_letter(redis_url: str, unique: str) -> None:
    async with running(transport_for(redis_url, unique)) as t:
        publisher = Redis.from_url(redis_url)
        await publisher.publish(f"{unique}-in", b"not json")
        [delivery] = await fetch_n(t, 1)
        await t.dead_letter(delivery, "malformed", "not json")
        [entry] = await publisher.lrange(f"{unique}-in:dead-letter", 0, -1)
        assert json.loads(entry)["reason"] == "malformed"
        assert json.loads(entry)["raw"] == "not json"
        await publisher.aclose()


async def test_resubscribes_after_redis_restart(private_redis: RedisServer, unique: str) -> None:
    async with running(transport_for(private_redis.url, unique)) as t:
        private_redis.restart()
        publisher = Redis.from_url(private_redis.url)
        with anyio.fail_after(5):
            while await publisher.publish(f"{unique}-in", envelope("after")) == 0:
                await anyio.sleep(0.05)
        [delivery] = await fetch_n(t, 1)
        assert t.decode(delivery).id == "after"
        await t.health()
        await publisher.aclose()


async def test_not_ready_before_subscribing_and_deprecation_logged(
    redis_url: str, unique: str
) -> None:
    with capture_logs() as logs:
        t = transport_for(redis_url, unique)
    try:
        with pytest.raises(TransportError, match="not subscribed"):
            await t.health()
    finally:
        await t.aclose()
    [warning] = [e for e in logs if e["event"] == "redis_pubsub_deprecated"]  # one
    assert "set --transport redis-sortedset" in warning["message"]  # the flag to set
    assert "fan-out" in warning["message"]


def routed(request_id: str, channel: str) -> bytes:
    """A retry-set member routed back to ``channel``."""
    routing = Routing(request_queue_name=channel)
    return Envelope(
        Request(id=request_id, deadline=int(time.time()) + 300), routing, "redis"
    ).encode()


async def test_a_retry_move_whose_reply_was_lost_still_delivers_its_batch(
    redis_server: RedisServer, redis_url: str, unique: str
) -> None:
    r = Redis.from_url(redis_url)
    async with lossy_proxy(redis_server.port) as proxy:
        t = transport_for(proxy.url, unique)
        try:
            assert await t.move_due() == 0  # script loaded: the next reply is a pop's
            await r.zadd(f"{unique}-retry", {routed("due", f"{unique}-in"): 0})
            proxy.lose_next_reply()  # Redis pops "due"; redis-py sends the pop again
            assert await t.move_due() == 1
            assert proxy.replies_lost == 1
            [delivery] = await t.fetch(t.queues[0], 10, 0.5)
            assert t.decode(delivery).id == "due"
            assert await r.zcard(f"{unique}-retry") == 0
            assert await r.keys(f"{unique}-retry:pop:*") == []  # the record, once handed over
        finally:
            await t.aclose()
            await r.aclose()


async def test_a_refused_dead_letter_is_held_and_written_once_redis_accepts(
    redis_url: str, unique: str
) -> None:
    r = Redis.from_url(redis_url)
    key = f"{unique}-in:dead-letter"
    await r.set(key, "wrong type")  # every LPUSH to it fails (WRONGTYPE); PING still works
    async with running(transport_for(redis_url, unique)) as t:
        await r.publish(f"{unique}-in", b"not json")
        [delivery] = await fetch_n(t, 1)
        await t.dead_letter(delivery, "malformed", "not json")  # refused: held, not raised
        await anyio.sleep(0.5)
        assert await r.get(key) == b"wrong type"
        await r.delete(key)
        with anyio.fail_after(10):  # the retry mover writes it (backing off meanwhile)
            while not await r.exists(key):
                await anyio.sleep(0.05)
        [entry] = await r.lrange(key, 0, -1)
        assert json.loads(entry)["raw"] == "not json"
    await r.aclose()


async def test_a_hand_back_redis_refuses_for_a_while_is_kept_and_written(
    private_redis: RedisServer, unique: str
) -> None:
    # Pub/sub holds no lease: a hand-back (a retry) the writer gave up on after a few
    # refused writes (some 2 s of NOREPLICAS/READONLY with PING answering) was its
    # message's only copy, lost with no result; retries are documented as durable.
    admin = Redis.from_url(private_redis.url)
    async with running(transport_for(private_redis.url, unique)) as t:
        await admin.publish(f"{unique}-in", envelope("again"))
        [delivery] = await fetch_n(t, 1)
        t.decode(delivery)
        writer = ResultWriter(t)
        sender = writer.sender()
        writer.close()
        await admin.config_set("min-replicas-to-write", 1)
        with capture_logs() as logs:
            async with anyio.create_task_group() as tg:
                tg.start_soon(writer.run)
                async with sender:
                    await sender.send(Deferral(delivery, 0.01))
                    with anyio.fail_after(10):
                        while not any(e["event"] == "result_write_abandoned" for e in logs):
                            await anyio.sleep(0.05)
                    await admin.config_set("min-replicas-to-write", 0)
                    [back] = await fetch_n(t, 1, timeout=10)  # written, then moved when due
        assert t.decode(back).id == "again"
    await admin.aclose()
