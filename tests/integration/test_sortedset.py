"""redis-sortedset transport against a real redis-server: leases, reaper, retries, results."""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest
from redis.asyncio import Redis
from structlog.testing import capture_logs

from async_processor.config import SortedSetConfig
from async_processor.errors import InvalidMessage, TransportError
from async_processor.messages import ID_PREFIX_BYTES, Envelope, ErrorCode, Request, Result, Routing
from async_processor.metrics import Metrics
from async_processor.redis import entries
from async_processor.redis import keys as redis_keys
from async_processor.transports import build_transport
from async_processor.transports.base import Completion, Deferral, Delivery, TransportContext
from async_processor.transports.redis_sortedset.claims import claim_of
from async_processor.transports.redis_sortedset.transport import SortedSetTransport
from async_processor.transports.redis_sortedset.upkeep import CHUNK
from tests.fixtures.servers import free_port

pytestmark = pytest.mark.anyio
GW = "http://gw.test:8000"


@pytest.fixture
async def r(redis_url: str) -> AsyncIterator[Redis]:
    client = Redis.from_url(redis_url)
    yield client
    await client.aclose()


@pytest.fixture
def make_config(redis_url: str, unique: str) -> Callable[..., SortedSetConfig]:
    def make(**overrides: Any) -> SortedSetConfig:
        queues = overrides.pop(
            "queues",
            [{"queue_name": f"{unique}-q", "id": "qid", "igw_base_url": GW,
              "labels": {"tier": "batch", "team": "config"}}],
        )  # fmt: skip
        raw = {
            "url": redis_url,
            "retry_queue_name": f"{unique}-retry",
            "result_queue_name": f"{unique}-results",
            "lease_seconds": 5,
            "queues": queues,
            **overrides,
        }
        return SortedSetConfig.model_validate(raw)

    return make


@asynccontextmanager
async def opened(
    config: SortedSetConfig, ctx: TransportContext | None = None
) -> AsyncIterator[SortedSetTransport]:
    transport = SortedSetTransport(config, ctx or TransportContext())
    try:
        yield transport
    finally:
        await transport.aclose()


@asynccontextmanager
async def running(transport: SortedSetTransport) -> AsyncIterator[None]:
    async with anyio.create_task_group() as tg:
        await tg.start(transport.run)
        yield
        tg.cancel_scope.cancel()


def member(
    request_id: str,
    deadline: int,
    *,
    token: str = "",
    result_queue: str = "",
    labels: dict[str, str] | None = None,
) -> bytes:
    routing = Routing(request_token=token, result_queue_name=result_queue, labels=labels or {})
    request = Request(id=request_id, deadline=deadline, payload=b'{"prompt": "hi", "n": 1}')
    return Envelope(request=request, routing=routing, kind="redis").encode()


def future(seconds: int = 600) -> int:
    return int(time.time()) + seconds


async def results_of(r: Redis, name: str) -> list[Result]:
    return [Result.decode(raw) for raw in await r.lrange(name, 0, -1)]


async def fetch_one(transport: SortedSetTransport, decode: bool = True) -> Delivery:
    [delivery] = await transport.fetch(transport.queues[0], 1, 0)
    if decode:
        transport.decode(delivery)
    return delivery


async def test_fetch_claims_earliest_deadlines_and_fills_routing(make_config, r) -> None:
    config = make_config()
    q = config.queues[0].queue_name
    base = future()
    mid = member("mid", base + 20, labels={"team": "msg", "x": "1"})
    await r.zadd(q, {member("late", base + 30): base + 30, member("early", base + 10): base + 10})
    await r.zadd(q, {mid: base + 20})
    async with opened(config) as transport:
        deliveries = await transport.fetch(transport.queues[0], 2, 0)
        envelopes = [transport.decode(d) for d in deliveries]
        assert [e.id for e in envelopes] == ["early", "mid"]
        assert await r.zcard(q) == 1
        assert await r.zcard(redis_keys.claims_idx_key(q)) == 2
        assert await r.hlen(redis_keys.claimed_key(q)) == 2
        routing = envelopes[1].routing
        assert (routing.request_queue_name, routing.queue_id) == (q, "qid")
        assert routing.labels == {"team": "config", "x": "1", "tier": "batch"}
        assert deliveries[0].envelope is envelopes[0]
        assert await transport.backlog(transport.queues[0]) == 1


async def test_fetch_waits_for_a_message_then_gives_up(make_config, r) -> None:
    config = make_config()
    q = config.queues[0].queue_name
    async with opened(config) as transport:
        started = time.monotonic()
        assert await transport.fetch(transport.queues[0], 5, 0.3) == []
        assert time.monotonic() - started >= 0.29

        async def add_later() -> None:
            await anyio.sleep(0.2)
            await r.zadd(q, {member("late-arrival", future()): future()})

        async with anyio.create_task_group() as tg:
            tg.start_soon(add_later)
            got = await transport.fetch(transport.queues[0], 5, 3.0)
        assert [transport.decode(d).id for d in got] == ["late-arrival"]


async def test_expired_lease_is_reaped_with_its_deadline_score(make_config, r) -> None:
    config = make_config(lease_seconds=0.3)
    q = config.queues[0].queue_name
    deadline = future()
    raw = member("crashy", deadline)
    await r.zadd(q, {raw: deadline})
    async with opened(config) as crashed, opened(config) as survivor:
        await crashed.fetch(crashed.queues[0], 1, 0)  # claimed, then never answered
        assert await r.zcard(q) == 0
        async with running(survivor):  # another replica's reaper takes it back
            with anyio.fail_after(3):
                while await r.zscore(q, raw) is None:
                    await anyio.sleep(0.05)
        assert await r.zscore(q, raw) == deadline
        assert await r.zcard(redis_keys.claims_idx_key(q)) == 0
        assert await r.hlen(redis_keys.claimed_key(q)) == 0


async def test_heartbeat_keeps_a_long_request_claimed(make_config, r) -> None:
    config = make_config(lease_seconds=0.3)
    q = config.queues[0].queue_name
    await r.zadd(q, {member("long", future()): future()})
    async with opened(config) as worker, opened(config) as other, running(worker), running(other):
        delivery = await fetch_one(worker)
        await anyio.sleep(1.2)  # four leases long
        assert await r.zcard(q) == 0
        assert await r.zcard(redis_keys.claims_idx_key(q)) == 1
        await worker.complete([Completion(delivery, Result.http("long", 200, b"{}"))])
    assert [x.id for x in await results_of(r, config.result_queue_name)] == ["long"]
    assert await r.zcard(redis_keys.claims_idx_key(q)) == 0


async def test_two_replicas_claim_disjoint_messages(make_config, r) -> None:
    config = make_config()
    q = config.queues[0].queue_name
    deadline = future()
    await r.zadd(q, {member(f"m{i}", deadline + i): deadline + i for i in range(60)})
    seen: dict[str, list[str]] = {"a": [], "b": []}

    async def drain(name: str, transport: SortedSetTransport) -> None:
        while batch := await transport.fetch(transport.queues[0], 7, 0):
            seen[name] += [transport.decode(d).id for d in batch]

    async with opened(config) as a, opened(config) as b, anyio.create_task_group() as tg:
        tg.start_soon(drain, "a", a)
        tg.start_soon(drain, "b", b)
    assert not set(seen["a"]) & set(seen["b"])
    assert sorted(seen["a"] + seen["b"]) == sorted(f"m{i}" for i in range(60))


async def test_one_result_when_completed_twice_or_delivered_twice(make_config, r) -> None:
    config = make_config()
    q = config.queues[0].queue_name
    deadline = future()
    raw = member("dup", deadline, token="a" * 32)
    await r.zadd(q, {raw: deadline})
    async with opened(config) as a, opened(config) as b:
        first = await fetch_one(a)
        await a.complete([Completion(first, Result.http("dup", 200, b"one"))])
        await a.complete([Completion(first, Result.http("dup", 200, b"again"))])
        await r.zadd(q, {raw: deadline})  # the same message delivered again
        second = await fetch_one(b)
        await b.complete([Completion(second, Result.http("dup", 200, b"two"))])
        # Delivered again while still held: the later claim takes the claim key (as
        # upstream's claim does), and the earlier holder's answer is fenced.
        await r.zadd(q, {raw: deadline})
        third = await fetch_one(a)
        await r.zadd(q, {raw: deadline})
        fourth = await fetch_one(b)
        await a.complete([Completion(third, Result.http("dup", 200, b"three"))])
        await b.complete([Completion(fourth, Result.http("dup", 200, b"four"))])
    assert [(x.id, x.payload) for x in await results_of(r, config.result_queue_name)] == [
        ("dup", "one")
    ]
    assert await r.zcard(redis_keys.claims_idx_key(q)) == 0
    assert await r.ttl(redis_keys.done_key("dup", "a" * 32)) > 0


async def test_a_complete_after_its_claim_was_reclaimed_is_fenced(make_config, r) -> None:
    """Upstream's fenced ack: a stale owner writes nothing; the message, back on its queue,
    is answered once by its next owner."""
    config = make_config(lease_seconds=0.2)
    q = config.queues[0].queue_name
    deadline = future()
    await r.zadd(q, {member("slow", deadline): deadline})
    async with opened(config) as transport:
        delivery = await fetch_one(transport)
        await anyio.sleep(0.3)
        await transport.reap()
        assert await r.zcard(q) == 1  # back on the queue
        with capture_logs() as logs:
            await transport.complete([Completion(delivery, Result.http("slow", 200, b"{}"))])
        assert [e["event"] for e in logs] == ["lease_expired_before_complete"]
        assert await r.zcard(q) == 1 and await r.llen(config.result_queue_name) == 0
        again = await fetch_one(transport)
        await transport.complete([Completion(again, Result.http("slow", 200, b"{}"))])
    assert await r.zcard(q) == 0
    assert len(await results_of(r, config.result_queue_name)) == 1


async def test_an_expired_claim_without_its_lease_entry_is_counted_and_logged(
    make_config, r
) -> None:
    # reap.lua dropped such a claim without a trace: the message's bytes were gone with
    # the entry (an eviction, a DEL), so it could not be put back, and nothing said so.
    config = make_config(lease_seconds=0.2)
    q = config.queues[0].queue_name
    deadline = future()
    await r.zadd(q, {member("gone", deadline): deadline, member("kept", deadline): deadline})
    metrics = Metrics()
    async with opened(config, TransportContext(metrics=metrics)) as transport:
        first, second = await transport.fetch(transport.queues[0], 2, 0)
        await r.hdel(redis_keys.claimed_key(q), claim_of(first).id)
        await anyio.sleep(0.3)
        with capture_logs() as logs:
            await transport.reap()
    assert await r.zcard(redis_keys.claims_idx_key(q)) == 0
    assert await r.zrange(q, 0, -1) == [second.raw]  # the one with its entry is back
    assert [(e["event"], e["log_level"], e["count"]) for e in logs if "count" in e] == [
        ("reaped_claims_without_lease_entry", "error", 1),
        ("reap_moved", "info", 1),
    ]
    labels = {"queue_name": q, "reason": "lease_entry_missing"}
    counted = metrics.registry.get_sample_value("llm_d_async_async_abandoned_claims_total", labels)
    assert counted == 1


async def test_resubmission_gets_a_new_result(make_config, r) -> None:
    config = make_config()
    q = config.queues[0].queue_name
    deadline = future()
    submissions = [
        member("re", deadline, token="1" * 32),
        member("re", deadline, token="2" * 32),  # new token: a new submission
        member("bare", deadline),
        member("bare", deadline),  # byte-identical without a token: a duplicate
        member("bare", deadline + 1),  # changed without a token: a new submission
    ]
    async with opened(config) as transport:
        for raw in submissions:
            await r.zadd(q, {raw: deadline})
            delivery = await fetch_one(transport)
            await transport.complete(
                [Completion(delivery, Result.http(delivery.envelope.id, 200, b""))]
            )
    ids = [x.id for x in await results_of(r, config.result_queue_name)]
    assert sorted(ids) == ["bare", "bare", "re", "re"]


@pytest.mark.parametrize(
    ("queue_result", "routed", "expected"),
    [
        ("from-queue", "from-message", "from-queue"),
        ("", "from-message", "from-message"),
        ("", "", "default"),
    ],
)
async def test_result_routing_precedence(
    make_config, r, unique, queue_result, routed, expected
) -> None:
    queue = {"queue_name": f"{unique}-q", "igw_base_url": GW, "result_queue_name": ""}
    if queue_result:
        queue["result_queue_name"] = f"{unique}-{queue_result}"
    config = make_config(queues=[queue], result_queue_name=f"{unique}-default")
    request_id = f"{unique}-routed"  # the dedup marker is per id, server-wide
    raw = member(request_id, future(), result_queue=f"{unique}-{routed}" if routed else "")
    await r.zadd(f"{unique}-q", {raw: future()})
    async with opened(config) as transport:
        delivery = await fetch_one(transport)
        await transport.complete([Completion(delivery, Result.http(request_id, 200, b"{}"))])
    assert await r.llen(f"{unique}-{expected}") == 1


async def test_complete_cleans_cancellation_keys_of_its_own_token_only(make_config, r) -> None:
    config = make_config()
    q = config.queues[0].queue_name
    token = "c" * 32
    await r.zadd(
        q, {member("mine", future(), token=token): 1, member("old", future(), token=token): 2}
    )
    await r.set(redis_keys.active_key("mine"), token)
    await r.set(redis_keys.cancel_key("mine"), token)
    await r.set(redis_keys.active_key("old"), "d" * 32)  # resubmitted meanwhile
    async with opened(config) as transport:
        for delivery in await transport.fetch(transport.queues[0], 2, 0):
            envelope = transport.decode(delivery)
            await transport.complete([Completion(delivery, Result.http(envelope.id, 200, b""))])
    assert await r.exists(redis_keys.active_key("mine"), redis_keys.cancel_key("mine")) == 0
    assert await r.get(redis_keys.active_key("old")) == b"d" * 32


async def test_defer_zero_returns_the_updated_envelope_at_its_deadline(make_config, r) -> None:
    config = make_config()
    q = config.queues[0].queue_name
    deadline = future()
    await r.zadd(q, {member("back", deadline): deadline})
    async with opened(config) as transport:
        delivery = await fetch_one(transport)
        assert delivery.envelope is not None
        delivery.envelope.routing.labels["classification"] = "overflow"
        await transport.defer([Deferral(delivery, 0)])
        [(raw, score)] = await r.zrange(q, 0, -1, withscores=True)
    assert score == deadline
    assert raw == delivery.envelope.encode()
    assert json.loads(raw)["internal"]["labels"]["classification"] == "overflow"
    assert await r.zcard(redis_keys.claims_idx_key(q)) == 0


async def test_defer_with_delay_parks_in_retry_set_until_due(make_config, r) -> None:
    config = make_config()
    q = config.queues[0].queue_name
    deadline = future()
    await r.zadd(q, {member("later", deadline): deadline})
    async with opened(config) as transport:
        delivery = await fetch_one(transport)
        assert delivery.envelope is not None
        delivery.envelope.routing.retry_count = 1
        before = time.time()
        await transport.defer([Deferral(delivery, 1.0)])
        [(raw, due)] = await r.zrange(config.retry_queue_name, 0, -1, withscores=True)
        assert before + 0.9 < due < time.time() + 1.1
        assert await r.zcard(q) == 0 and await r.zcard(redis_keys.claims_idx_key(q)) == 0
        async with running(transport):
            await anyio.sleep(0.5)
            assert await r.zcard(q) == 0  # not yet due
            with anyio.fail_after(2):
                while not await r.zcard(q):
                    await anyio.sleep(0.05)
    assert await r.zrange(q, 0, -1, withscores=True) == [(raw, float(deadline))]
    assert json.loads(raw)["internal"]["retry_count"] == 1
    assert await r.zcard(config.retry_queue_name) == 0


async def test_retry_mover_drains_every_due_member_to_its_origin(make_config, r, unique) -> None:
    queues = [
        {"queue_name": f"{unique}-a", "igw_base_url": GW},
        {"queue_name": f"{unique}-b", "igw_base_url": GW},
    ]
    config = make_config(queues=queues)
    deadline = future()
    due = {}
    for i in range(CHUNK + 100):
        origin = f"{unique}-b" if i % 2 else ""  # no origin: the first configured queue
        env = Envelope(Request(id=f"r{i}", deadline=deadline + i),
                       Routing(request_queue_name=origin), kind="redis")  # fmt: skip
        due[env.encode()] = time.time() - 1
    await r.zadd(config.retry_queue_name, due)
    await r.zadd(config.retry_queue_name, {member("not-yet", deadline): time.time() + 60})
    async with opened(config) as transport:
        await transport.move_due()
    assert await r.zcard(config.retry_queue_name) == 1
    assert await r.zcard(f"{unique}-a") + await r.zcard(f"{unique}-b") == CHUNK + 100
    assert await r.zscore(f"{unique}-b", next(iter(k for k in due if b'"r1"' in k))) == deadline + 1
    assert await r.zscore(f"{unique}-a", next(iter(due))) == deadline


async def test_dead_letter_entry(make_config, r) -> None:
    config = make_config()
    q = config.queues[0].queue_name
    await r.zadd(q, {b'{"no": "id"}': 5})
    async with opened(config) as transport:
        delivery = await fetch_one(transport, decode=False)
        await transport.dead_letter(delivery, "missing_id", "request has no string id")
    [raw] = await r.lrange(redis_keys.dead_letter_key(q), 0, -1)
    entry = json.loads(raw)
    assert entry.keys() == {"reason", "detail", "raw", "time", "queue", "size", "sha1", "truncated"}
    assert (entry["reason"], entry["raw"], entry["queue"]) == ("missing_id", '{"no": "id"}', q)
    assert (entry["size"], entry["truncated"]) == (12, False)
    assert entry["sha1"] == hashlib.sha1(b'{"no": "id"}').hexdigest()
    assert abs(entry["time"] - time.time()) < 5
    assert await r.zcard(redis_keys.claims_idx_key(q)) == 0


async def test_is_cancelled_matches_the_token(make_config, r) -> None:
    config = make_config()
    q = config.queues[0].queue_name
    await r.zadd(q, {member("c1", future(), token="e" * 32): 1, member("c2", future()): 2})
    await r.set(redis_keys.cancel_key("c1"), "e" * 32)
    await r.set(redis_keys.cancel_key("c2"), "e" * 32)
    async with opened(config) as transport:
        with_token, without = await transport.fetch(transport.queues[0], 2, 0)
        transport.decode(with_token)
        transport.decode(without)
        assert await transport.is_cancelled(with_token)
        assert not await transport.is_cancelled(without)
        await r.set(redis_keys.cancel_key("c1"), "f" * 32)  # a newer submission's cancel
        assert not await transport.is_cancelled(with_token)


async def test_redis_down_raises_transport_error_and_upkeep_survives(make_config) -> None:
    config = make_config(url=f"redis://127.0.0.1:{free_port()}/0", lease_seconds=0.3)
    async with opened(config) as transport:
        queue = transport.queues[0]
        with pytest.raises(TransportError):
            await transport.health()
        with pytest.raises(TransportError):
            await transport.fetch(queue, 5, 0)
        with pytest.raises(TransportError):
            await transport.backlog(queue)
        fake = Delivery(queue=queue, raw=member("x", future()), handle=None)
        with pytest.raises(TypeError):  # not one of ours: a programming error, not Redis
            await transport.complete([Completion(fake, Result.http("x", 200, b""))])
        with anyio.move_on_after(0.5) as scope:
            await transport.run()
        assert scope.cancelled_caught  # upkeep kept retrying instead of crashing


async def test_registered_in_the_transport_registry(make_config) -> None:
    config = make_config()
    transport = build_transport("redis-sortedset", config, TransportContext())
    assert isinstance(transport, SortedSetTransport)
    await transport.health()
    await transport.aclose()


async def test_claims_survive_a_redis_crash(make_config, private_redis) -> None:
    config = make_config(url=private_redis.url)
    q = config.queues[0].queue_name
    async with Redis.from_url(private_redis.url) as r:
        await r.zadd(q, {member("durable", future()): 1})
    async with opened(config) as transport:
        delivery = await fetch_one(transport)
        private_redis.kill()
        with pytest.raises(TransportError):
            await transport.complete([Completion(delivery, Result.http("durable", 200, b""))])
        private_redis.start()  # same port and AOF: the claim is still in flight
        await transport.complete([Completion(delivery, Result.http("durable", 200, b""))])
    async with Redis.from_url(private_redis.url) as r:
        assert await r.llen(config.result_queue_name) == 1
        assert await r.zcard(redis_keys.claims_idx_key(q)) == 0


# --------------------------------------------- producer-chosen keys of the wrong type (review)


async def test_unusable_result_list_falls_back_to_the_default_and_acks_once(
    make_config, r, unique
) -> None:
    # The envelope's result_queue_name names a key that is not a list. The script used to
    # ack the claim and set the dedup marker before LPUSH failed: no result, ever, and
    # every retry of the batch was then skipped as a duplicate.
    config = make_config()
    q = config.queues[0].queue_name
    wrong = f"{unique}-not-a-list"
    await r.set(wrong, "x")
    deadline = future()
    await r.zadd(q, {member("wr", deadline, token="b" * 32, result_queue=wrong): deadline})
    async with opened(config) as transport:
        delivery = await fetch_one(transport)
        await transport.complete([Completion(delivery, Result.http("wr", 200, b"{}"))])
    assert [x.id for x in await results_of(r, config.result_queue_name)] == ["wr"]
    assert await r.get(wrong) == b"x"
    assert await r.zcard(redis_keys.claims_idx_key(q)) == 0


async def test_failed_hand_back_leaves_the_claim_held(make_config, r, unique) -> None:
    # A retry set that is not a sorted set: ZADD fails. The claim must still be held (the
    # message stays leased and comes back), not acknowledged and lost.
    config = make_config(retry_queue_name=f"{unique}-retry-string")
    await r.set(config.retry_queue_name, "x")
    q = config.queues[0].queue_name
    deadline = future()
    await r.zadd(q, {member("hb", deadline): deadline})
    async with opened(config) as transport:
        delivery = await fetch_one(transport)
        with pytest.raises(TransportError):
            await transport.defer([Deferral(delivery, 5.0)])
    assert await r.zcard(redis_keys.claims_idx_key(q)) == 1
    assert await r.hlen(redis_keys.claimed_key(q)) == 1


async def test_retry_whose_origin_is_not_a_sorted_set_goes_to_the_first_queue(
    make_config, r, unique
) -> None:
    # request_queue_name comes from the message. A key of another type made ZADD fail
    # after the ZREM (message lost) and aborted the move of every member behind it.
    config = make_config()
    wrong = f"{unique}-origin-string"
    await r.set(wrong, "x")
    deadline = future()
    bad = Envelope(Request(id="bad", deadline=deadline), Routing(request_queue_name=wrong))
    good = Envelope(Request(id="good", deadline=deadline + 1), Routing())
    # Naming the retry set itself: moved "back" into it, then removed, it would be lost.
    itself = Envelope(
        Request(id="self", deadline=deadline + 2),
        Routing(request_queue_name=config.retry_queue_name),
    )
    await r.zadd(config.retry_queue_name, {bad.encode(): 1, good.encode(): 2, itself.encode(): 3})
    async with opened(config) as transport:
        await transport.move_due()
    q = config.queues[0].queue_name
    assert await r.zcard(config.retry_queue_name) == 0
    assert await r.zscore(q, bad.encode()) == deadline
    assert await r.zscore(q, good.encode()) == deadline + 1
    assert await r.zscore(q, itself.encode()) == deadline + 2


async def test_cancel_markers_of_many_queues_are_read_in_one_pipeline(
    make_config, r, unique
) -> None:
    # The cancel watcher asks about everything in flight: one MGET for all queues (in
    # cluster mode one per queue, pipelined: a queue's markers share its slot), none for
    # untokened messages.
    names = [f"{unique}-q{n}" for n in range(3)]
    config = make_config(queues=[{"queue_name": n, "igw_base_url": GW} for n in names])
    deadline = future()
    for n, name in enumerate(names):
        await r.zadd(name, {member(f"{name}-m", deadline, token=f"{n:032x}"): deadline})
        await r.zadd(name, {member(f"{name}-plain", deadline + 1): deadline + 1})
    await r.set(redis_keys.cancel_key(f"{names[1]}-m"), f"{1:032x}")
    async with opened(config) as transport:
        deliveries = [d for q in transport.queues for d in await transport.fetch(q, 2, 0)]
        for delivery in deliveries:
            transport.decode(delivery)
        stats = await r.info("commandstats")
        before = int(stats.get("cmdstat_mget", {}).get("calls", 0))
        flags = await transport.cancelled(deliveries)
        stats = await r.info("commandstats")
        assert int(stats["cmdstat_mget"]["calls"]) - before == 1
    cancelled = [transport.decode(d).id for d, flag in zip(deliveries, flags, strict=True) if flag]
    assert cancelled == [f"{names[1]}-m"]


async def test_fetch_checks_the_batch_cancel_markers_in_one_round_trip(make_config, r) -> None:
    # A GET per message in the poller cost ~100 us of client CPU (of a 250 us budget) and
    # a round trip each; the markers of a batch are now read with the claim, in one MGET.
    config = make_config()
    q = config.queues[0].queue_name
    deadline = future()
    tokens = {f"m{i}": f"{i:032x}" for i in range(3)}
    await r.zadd(q, {member(i, deadline + n, token=t): deadline + n
                     for n, (i, t) in enumerate(tokens.items())})  # fmt: skip
    await r.set(redis_keys.cancel_key("m1"), tokens["m1"])
    async with opened(config) as transport:
        deliveries = await transport.fetch(transport.queues[0], 3, 0)

        async def mgets() -> int:
            stats = await r.info("commandstats")
            return int(stats.get("cmdstat_mget", {}).get("calls", 0))

        before = await mgets()
        flags = [await transport.is_cancelled(d) for d in deliveries]
        assert [transport.decode(d).id for d in deliveries] == ["m0", "m1", "m2"]
        assert flags == [False, True, False]
        assert await mgets() == before
        await r.delete(redis_keys.cancel_key("m1"))  # later checks ask Redis again
        assert not await transport.is_cancelled(deliveries[1])
        assert await mgets() == before + 1


async def test_heartbeat_never_extends_a_lease_another_replica_reclaimed(make_config, r) -> None:
    config = make_config(lease_seconds=0.2)
    q = config.queues[0].queue_name
    deadline = future()
    await r.zadd(q, {member("contested", deadline): deadline})
    async with opened(config) as a, opened(config) as b:
        first = await fetch_one(a)
        await anyio.sleep(0.3)  # a stalls past its lease
        await b.reap()
        second = await fetch_one(b)
        assert second.handle.id == first.handle.id  # one claim key: id NUL token
        b_expiry = await r.zscore(redis_keys.claims_idx_key(q), second.handle.id)
        await anyio.sleep(0.01)
        await a.heartbeat()
        assert await r.zscore(redis_keys.claims_idx_key(q), second.handle.id) == b_expiry
        assert first.handle.id not in a._claims.held[q]
        # a finishes anyway: fenced, it writes nothing; b's answer is the one result.
        await a.complete([Completion(first, Result.http("contested", 200, b"a"))])
        await b.complete([Completion(second, Result.http("contested", 200, b"b"))])
    assert [x.payload for x in await results_of(r, config.result_queue_name)] == ["b"]
    assert await r.zcard(q) == 0
    assert await r.zcard(redis_keys.claims_idx_key(q)) == 0


async def test_an_undecodable_member_is_claimed_by_its_sha1_and_handed_back(make_config, r) -> None:
    # Upstream drops such a member; ours answers or dead-letters it, so it is owned while
    # held: keyed by its SHA-1 (no id to key it by), and put back at its claimed score.
    config = make_config()
    q = config.queues[0].queue_name
    await r.zadd(q, {b"not json": 42})
    async with opened(config) as transport:
        delivery = await fetch_one(transport, decode=False)
        assert delivery.handle.id == hashlib.sha1(b"not json").hexdigest()
        assert await r.hget(redis_keys.claimed_key(q), delivery.handle.id) == b"not json"
        with pytest.raises(InvalidMessage):
            transport.decode(delivery)
        await transport.defer([Deferral(delivery, 0)])
    assert await r.zrange(q, 0, -1, withscores=True) == [(b"not json", 42.0)]
    assert not await r.exists(redis_keys.claimed_key(q), redis_keys.claims_idx_key(q))


async def test_a_retried_claim_answers_with_the_batch_it_already_claimed(
    make_config, r, unique
) -> None:
    # redis-py retries a command whose reply was lost (Redis restarting) with the same
    # arguments: the claim ran twice, the first batch claimed and never received, left to
    # wait out its lease in nobody's hands (seen in the AOF restart e2e). The call's record
    # (claim-batch:<owner>:<n>) answers the retry with that batch.
    config = make_config()
    q = config.queues[0].queue_name
    deadline = future()
    first, second = member("c1", deadline), member("c2", deadline + 1)
    await r.zadd(q, {first: deadline, second: deadline + 1})
    async with opened(config) as transport:
        claim = transport._scripts["claim"]
        args = [config.lease_seconds, 1000, 100, "0123456789abcdef", 1]
        script_keys = [q, *transport._keys.claim_keys(q), f"claim-batch:{unique}:7"]
        [once] = await claim(keys=script_keys, args=args)
        [again] = await claim(keys=script_keys, args=args)
    assert once == again
    assert once[1] == first
    assert await r.zrange(q, 0, -1) == [second]
    assert await r.hgetall(redis_keys.claimed_key(q)) == {b"c1": first}
    assert await r.hgetall(redis_keys.claim_owners_key(q)) == {b"c1": b"0123456789abcdef"}
    assert 0 < await r.ttl(f"claim-batch:{unique}:7") <= config.lease_seconds


# --------------------------------------------- a message routes only within allowed keys (G10)


def rejected(metrics: Metrics, queue: str, reason: str) -> float:
    value = metrics.registry.get_sample_value(
        "llm_d_async_async_result_route_rejected_total", {"queue_name": queue, "reason": reason}
    )
    return value or 0.0


@pytest.mark.parametrize(
    "target",
    [
        "{u}-other",  # another configured request queue, empty: LPUSH would make it a list
        "{u}-retry",
        "{u}-q:inflight",
        "{u}-q:inflight:meta",
        "{u}-q:dead-letter",
        "request-cancel:{u}",
        "request-done:{u}",
        "{u}-budget",  # a queue gate's key
        "{u}-quota:tenant:x",  # under a pool gate's key prefix
        "{u}-rate:state",  # under a pool gate's control key
    ],
)
async def test_a_message_cannot_route_its_result_into_a_daemon_key(
    make_config, r, unique, target
) -> None:
    target = target.format(u=unique)
    queues = [
        {"queue_name": f"{unique}-q", "igw_base_url": GW,
         "gate_type": "redis", "gate_params": {"budget_key": f"{unique}-budget"}},
        {"queue_name": f"{unique}-other", "igw_base_url": GW},
    ]  # fmt: skip
    config = make_config(queues=queues)
    pool_gates = [{"prefix": f"{unique}-quota:"}, {"control_key": f"{unique}-rate"}]
    metrics = Metrics()
    request_id = f"{unique}-route"
    deadline = future()
    await r.zadd(f"{unique}-q", {member(request_id, deadline, result_queue=target): deadline})
    ctx = TransportContext(metrics=metrics, gate_params=pool_gates)
    async with opened(config, ctx) as transport:
        delivery = await fetch_one(transport)
        await transport.complete([Completion(delivery, Result.http(request_id, 200, b"{}"))])
    assert [x.id for x in await results_of(r, config.result_queue_name)] == [request_id]
    assert await r.type(target) in (b"none", b"zset")  # never turned into a list
    assert rejected(metrics, f"{unique}-q", "reserved_key") == 1
    # The other queue still takes producers' ZADDs and the daemon's claims.
    await r.zadd(f"{unique}-other", {member(f"{unique}-later", deadline): deadline})
    async with opened(config) as transport:
        [later] = await transport.fetch(transport.queues[1], 1, 0)
        assert later.raw


@pytest.mark.parametrize(("routed", "lands_in"), [("results:mine", "routed"), ("mine", "default")])
async def test_result_queue_pattern_bounds_message_routing(
    make_config, r, unique, routed, lands_in
) -> None:
    config = make_config(result_queue_pattern=f"{unique}-results:*")
    routed = f"{unique}-{routed}"
    metrics = Metrics()
    request_id = f"{unique}-pattern"
    deadline = future()
    q = config.queues[0].queue_name
    await r.zadd(q, {member(request_id, deadline, result_queue=routed): deadline})
    async with opened(config, TransportContext(metrics=metrics)) as transport:
        delivery = await fetch_one(transport)
        await transport.complete([Completion(delivery, Result.http(request_id, 200, b"{}"))])
    expected = routed if lands_in == "routed" else config.result_queue_name
    assert [x.id for x in await results_of(r, expected)] == [request_id]
    assert rejected(metrics, q, "pattern_mismatch") == (lands_in == "default")


async def test_a_retry_goes_back_to_the_queue_it_was_claimed_from(make_config, r, unique) -> None:
    # The message names another queue as its own: informational only. Moved there, it
    # would sit in a sorted set nobody polls and never get a result.
    config = make_config()
    q = config.queues[0].queue_name
    elsewhere = f"{unique}-elsewhere"
    deadline = future()
    routing = Routing(request_queue_name=elsewhere)
    raw = Envelope(Request(id=f"{unique}-r", deadline=deadline), routing, kind="redis").encode()
    await r.zadd(q, {raw: deadline})
    # A member already in the retry set naming an unconfigured queue: the first queue.
    stray = Envelope(Request(id=f"{unique}-s", deadline=deadline), routing, kind="redis")
    await r.zadd(config.retry_queue_name, {stray.encode(): 1})
    async with opened(config) as transport:
        delivery = await fetch_one(transport)
        await transport.defer([Deferral(delivery, 0.01)])
        await anyio.sleep(0.05)
        await transport.move_due()
    assert not await r.exists(elsewhere)
    assert sorted(json.loads(m)["data"]["id"] for m in await r.zrange(q, 0, -1)) == [
        f"{unique}-r",
        f"{unique}-s",
    ]


async def test_a_retry_cjson_cannot_read_still_goes_back_to_its_own_queue(
    make_config, r, unique
) -> None:
    # JSON (and the daemon) accept a lone surrogate escape; Redis's cjson refuses the whole
    # member, so move_due.lua read no origin and no deadline: the retry went to the first
    # queue (another pool and gateway), scored "now".
    first, second = f"{unique}-a", f"{unique}-b"
    config = make_config(queues=[{"queue_name": n, "igw_base_url": GW} for n in (first, second)])
    deadline = future()
    raw = b'{"id":"%s-u","deadline":%d,"payload":{"p":"\\ud800"}}' % (unique.encode(), deadline)
    await r.zadd(second, {raw: deadline})
    async with opened(config) as transport:
        [delivery] = await transport.fetch(transport.queues[1], 1, 0)
        transport.decode(delivery)
        await transport.defer([Deferral(delivery, 0.01)])
        await anyio.sleep(0.05)
        await transport.move_due()
    assert await r.zcard(first) == 0
    [(back, score)] = await r.zrange(second, 0, -1, withscores=True)
    assert b'"p":"\\ud800"' in back  # the payload's bytes are unchanged
    assert score == deadline


async def test_a_batch_survives_a_wrong_typed_in_flight_key(make_config, r) -> None:
    # claim.lua popped the members and then failed on ZADD: Redis does not roll a script
    # back, so every fetch destroyed a batch. Now the types are checked before any write.
    config = make_config()
    q = config.queues[0].queue_name
    deadline = future()
    await r.zadd(q, {member(f"b{i}", deadline + i): deadline + i for i in range(5)})
    await r.set(redis_keys.claims_idx_key(q), "not a sorted set")
    async with opened(config) as transport:
        for _ in range(3):
            with pytest.raises(TransportError, match="WRONGTYPE"):
                await transport.fetch(transport.queues[0], 2, 0)
        assert await r.zcard(q) == 5
        await r.delete(redis_keys.claims_idx_key(q))
        assert len(await transport.fetch(transport.queues[0], 5, 0)) == 5


async def test_complete_changes_nothing_when_a_key_has_the_wrong_type(make_config, r) -> None:
    # The in-flight hash turned into a string after the claim: complete used to push the
    # result and set the marker before failing on HDEL (a half-done step).
    config = make_config()
    q = config.queues[0].queue_name
    deadline = future()
    await r.zadd(q, {member("half", deadline): deadline})
    async with opened(config) as transport:
        delivery = await fetch_one(transport)
        await r.delete(redis_keys.claimed_key(q))
        await r.set(redis_keys.claimed_key(q), "x")
        with pytest.raises(TransportError, match="WRONGTYPE"):
            await transport.complete([Completion(delivery, Result.http("half", 200, b"{}"))])
    assert await r.llen(config.result_queue_name) == 0
    assert not await r.exists(redis_keys.done_key("half", entries.fingerprint(delivery.envelope)))
    assert await r.zcard(redis_keys.claims_idx_key(q)) == 1


async def test_different_id_and_token_pairs_never_share_a_dedup_marker(
    make_config, r, unique
) -> None:
    # "request-done:<id>:<token>" made ("a:b", "c") and ("a", "b:c") one submission.
    config = make_config()
    q = config.queues[0].queue_name
    deadline = future()
    first = member(f"{unique}:b", deadline, token="c")
    second = member(unique, deadline, token="b:c")
    await r.zadd(q, {first: deadline, second: deadline + 1})
    async with opened(config) as transport:
        for delivery in await transport.fetch(transport.queues[0], 2, 0):
            envelope = transport.decode(delivery)
            await transport.complete([Completion(delivery, Result.http(envelope.id, 200, b"{}"))])
    ids = sorted(x.id for x in await results_of(r, config.result_queue_name))
    assert ids == sorted([f"{unique}:b", unique])


async def test_an_identical_resubmission_is_counted_and_logged_not_silent(
    make_config, r, unique
) -> None:
    # The same bytes submitted again within the dedup TTL: one result (as before), but
    # the producer waiting for a second one must be able to see why.
    config = make_config()
    q = config.queues[0].queue_name
    metrics = Metrics()
    raw = member(f"{unique}-again", future())
    async with opened(config, TransportContext(metrics=metrics)) as transport:
        with capture_logs() as logs:
            for _ in range(2):
                await r.zadd(q, {raw: 1})
                delivery = await fetch_one(transport)
                await transport.complete(
                    [Completion(delivery, Result.http(f"{unique}-again", 200, b""))]
                )
    assert await r.llen(config.result_queue_name) == 1
    labels = {"queue_id": "qid", "queue_name": q, "pool_name": "default"}
    sample = "llm_d_async_async_duplicates_suppressed_total"
    assert metrics.registry.get_sample_value(sample, labels) == 1
    [warned] = [x for x in logs if x["event"] == "duplicate_suppressed"]
    assert warned["log_level"] == "warning" and warned["request_id"] == f"{unique}-again"


# --------------------------------------------- sizes are bytes, checked before parsing (G10)


async def test_an_oversized_member_is_answered_without_being_fetched_whole(
    make_config, r, unique
) -> None:
    config = make_config()
    q = config.queues[0].queue_name
    deadline = future()
    big = member(f"{unique}-big", deadline).replace(b'"n": 1', b'"n": "' + b"x" * 300_000 + b'"')
    await r.zadd(q, {big: deadline})
    async with opened(config, TransportContext(max_message_bytes=1000)) as transport:
        delivery = await fetch_one(transport, decode=False)
        assert len(delivery.raw) <= ID_PREFIX_BYTES < len(big)  # only a prefix came over
        with pytest.raises(InvalidMessage) as caught:
            transport.decode(delivery)
        assert (caught.value.reason, caught.value.request_id) == ("too_large", f"{unique}-big")
        assert f"{len(big)} bytes exceeds the 1000-byte limit" in str(caught.value)
        failure = Result.failure(f"{unique}-big", ErrorCode.INVALID_REQUEST, str(caught.value))
        await transport.complete([Completion(delivery, failure)])
    [result] = await results_of(r, config.result_queue_name)
    assert result.error_code == ErrorCode.INVALID_REQUEST
    assert await r.zcard(redis_keys.claims_idx_key(q)) == 0


async def test_an_oversized_member_answered_after_its_lease_lapsed_is_answered_once(
    make_config, r, unique
) -> None:
    # Only a prefix of it was fetched. Its stale owner's answer is fenced; its next claim
    # (of a prefix again, keyed by its SHA-1 or its id) answers it, once.
    config = make_config(lease_seconds=0.2)
    q = config.queues[0].queue_name
    deadline = future()
    big = member(f"{unique}-big", deadline).replace(b'"n": 1', b'"n": "' + b"x" * 300_000 + b'"')
    last = big.rindex(b"x")  # beyond the prefix fetched: same score, first bytes and size
    look_alike = big[:last] + b"y" + big[last + 1 :]
    await r.zadd(q, {big: deadline})
    async with opened(config, TransportContext(max_message_bytes=1000)) as transport:
        delivery = await fetch_one(transport, decode=False)
        await r.zadd(q, {look_alike: deadline})
        await anyio.sleep(0.3)
        await transport.reap()
        assert await r.zscore(q, big) == deadline  # back on its queue
        failure = Result.failure(f"{unique}-big", ErrorCode.INVALID_REQUEST, "too large")
        await transport.complete([Completion(delivery, failure)])
        assert await r.llen(config.result_queue_name) == 0  # fenced
        again = await fetch_one(transport, decode=False)
        await transport.complete([Completion(again, failure)])
    assert await r.zrange(q, 0, -1) == [look_alike]
    assert len(await results_of(r, config.result_queue_name)) == 1


async def test_a_huge_dead_letter_keeps_a_prefix_its_size_and_hash(make_config, r) -> None:
    config = make_config()
    q = config.queues[0].queue_name
    huge = b'{"no_id": "' + b"y" * 500_000 + b'"}'
    await r.zadd(q, {huge: 1})
    async with opened(config, TransportContext(max_message_bytes=1000)) as transport:
        delivery = await fetch_one(transport, decode=False)
        with pytest.raises(InvalidMessage) as caught:
            transport.decode(delivery)
        assert caught.value.request_id is None
        await transport.dead_letter(delivery, caught.value.reason, str(caught.value))
    [raw] = await r.lrange(redis_keys.dead_letter_key(q), 0, -1)
    entry = json.loads(raw)
    assert len(raw) < 8192
    assert entry["raw"] == huge[: entries.DEAD_LETTER_RAW_BYTES].decode()
    assert (entry["size"], entry["truncated"]) == (len(huge), True)
    assert entry["sha1"] == hashlib.sha1(huge).hexdigest()


async def test_dead_letter_lists_are_capped_oldest_trimmed_and_counted(make_config, r) -> None:
    config = make_config(dead_letter_max_entries=3)
    q = config.queues[0].queue_name
    metrics = Metrics()
    await r.zadd(q, {f'{{"n": {i}}}'.encode(): i for i in range(5)})
    async with opened(config, TransportContext(metrics=metrics)) as transport:
        for _ in range(5):
            delivery = await fetch_one(transport, decode=False)
            await transport.dead_letter(delivery, "missing_id", "no id")
    kept = [json.loads(x)["raw"] for x in await r.lrange(redis_keys.dead_letter_key(q), 0, -1)]
    assert kept == ['{"n": 4}', '{"n": 3}', '{"n": 2}']  # newest first, oldest trimmed
    sample = "llm_d_async_async_dead_letter_trimmed_total"
    assert metrics.registry.get_sample_value(sample, {"queue_name": q}) == 2


async def test_a_cancelled_fetch_on_a_redis_that_never_answers_ends_in_bounded_time(
    make_config: Callable[..., SortedSetConfig],
) -> None:
    """The claim is shielded (so it is recorded whole), but not past CLAIM_SHIELD_SECONDS:
    a blackholed Redis must not hold a shutdown (or a removed queue's poller) for the
    client's socket timeout, or at all with none."""
    from async_processor.transports.redis_sortedset.fetch import CLAIM_SHIELD_SECONDS

    connections: list[Any] = []

    async def swallow(stream: Any) -> None:
        connections.append(stream)
        await anyio.sleep_forever()

    listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=free_port())
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    silent = Redis(host="127.0.0.1", port=port)  # no socket timeout: waits for ever
    transport = SortedSetTransport(make_config(), TransportContext(), client=silent)
    ended = anyio.Event()

    async def fetch(scope: anyio.CancelScope) -> None:
        with scope, pytest.raises(TransportError):
            await transport.fetch(transport.queues[0], 1, 0)
        ended.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, swallow)
        scope = anyio.CancelScope()
        tg.start_soon(fetch, scope)
        await anyio.sleep(0.2)
        scope.cancel()  # a shutdown, or the queue removed
        with anyio.move_on_after(CLAIM_SHIELD_SECONDS + 5):
            await ended.wait()
        finished = ended.is_set()
        for stream in connections:  # let a fetch still stuck end
            await stream.aclose()
        tg.cancel_scope.cancel()
    await transport.aclose()
    assert finished


async def test_a_claim_cut_after_it_landed_lets_its_leases_lapse(
    make_config: Callable[..., SortedSetConfig],
    redis_url: str,
    unique: str,
    r: Redis,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Cut while checking the markers: the claimed members are no longer renewed by the
    heartbeat, so the reaper returns them (held for ever, they would be stranded)."""
    from async_processor.client.redis_sortedset import SortedSetClient
    from async_processor.transports.redis_sortedset import fetch as redis_fetch

    queue = f"{unique}-q"
    async with SortedSetClient(redis_url, queue, f"{unique}-results") as client:
        await client.submit({"id": "m1", "deadline": future(), "payload": {}})
    monkeypatch.setattr(redis_fetch, "CLAIM_SHIELD_SECONDS", 0.2)
    async with opened(make_config()) as transport:

        async def hangs(*_: Any, **__: Any) -> None:
            await anyio.sleep_forever()

        monkeypatch.setattr(transport._redis, "mget", hangs)
        with pytest.raises(TransportError):
            await transport.fetch(transport.queues[0], 1, 0)
        assert await r.zcard(redis_keys.claims_idx_key(queue)) == 1  # the claim landed
        assert transport._claims.renewable(queue) == []  # and is not renewed
