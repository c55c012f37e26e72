"""redis-sortedset transport logic and its Lua scripts on fakeredis (fast; real Redis in
tests/integration/test_sortedset.py)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import anyio
import fakeredis
import pytest

from async_processor.config import SortedSetConfig
from async_processor.errors import TransportError
from async_processor.messages import Envelope, Request, Result, Routing
from async_processor.redis import entries, scripts
from async_processor.redis import keys as redis_keys
from async_processor.transports.base import Completion, Deferral, TransportContext
from async_processor.transports.redis_sortedset.claims import STALE_CLAIM_GRACE
from async_processor.transports.redis_sortedset.transport import SortedSetTransport
from async_processor.transports.redis_sortedset.upkeep import _every

pytestmark = pytest.mark.anyio
Q = "queue-a"


@pytest.fixture
async def fake() -> AsyncIterator[fakeredis.FakeAsyncRedis]:
    client = fakeredis.FakeAsyncRedis()
    yield client
    await client.aclose()


def make(fake: fakeredis.FakeAsyncRedis, **overrides: object) -> SortedSetTransport:
    raw = {
        "queues": [
            {"queue_name": Q, "id": "a", "igw_base_url": "http://gw:1", "labels": {"k": "cfg"}},
            {"queue_name": "queue-b", "igw_base_url": "http://gw:1", "result_queue_name": "qb"},
        ],
        "lease_seconds": 5,
        **overrides,
    }
    config = SortedSetConfig.model_validate(raw)
    return SortedSetTransport(config, TransportContext(max_message_bytes=2000), client=fake)


def envelope(request_id: str, deadline: int, token: str = "", origin: str = "") -> bytes:
    routing = Routing(request_token=token, request_queue_name=origin, labels={"k": "msg"})
    return Envelope(Request(id=request_id, deadline=deadline), routing, kind="redis").encode()


CLAIM_KEYS = (redis_keys.claimed_key, redis_keys.claim_owners_key, redis_keys.claims_idx_key)


def soon() -> int:
    return int(time.time()) + 600


async def test_a_batch_of_results_is_one_script_call(fake) -> None:
    # One script per result cost a script run and its command encoding per message (#13);
    # each item is still answered on its own: written, duplicate, or lease lost.
    transport = make(fake)
    deadline = soon()
    await fake.zadd(
        Q, {envelope(f"b{i}", deadline + i, token=f"t{i}"): deadline + i for i in range(4)}
    )
    deliveries = await transport.fetch(transport.queues[0], 10, 0)
    script = transport._scripts["complete"]
    calls: list[int] = []

    async def counting(**kwargs: object) -> object:
        calls.append(len(kwargs["keys"]))  # type: ignore[arg-type]
        return await script(**kwargs)  # type: ignore[arg-type]

    transport._scripts["complete"] = counting  # type: ignore[assignment]
    # Its lease lapsed and another owner took it: fenced, nothing written for it.
    await fake.hset(redis_keys.claim_owners_key(Q), deliveries[3].handle.id, "f" * 16)
    items = [(d, Result.http(transport.decode(d).id, 200, b"{}")) for d in deliveries]
    replies = await transport._write_results([*items, items[0]], queued=False)
    assert len(calls) == 1
    assert replies == [(1, 1, 0), (1, 1, 0), (1, 1, 0), (0, 0, 0), (0, 0, 0)]
    assert await fake.llen("result-list") == 3
    assert await fake.hkeys(redis_keys.claimed_key(Q)) == [deliveries[3].handle.id.encode()]


async def test_a_batch_is_one_request_without_a_pipeline(fake, monkeypatch) -> None:
    # A pipeline of scripts first asks Redis which it has (SCRIPT EXISTS): a second round
    # trip per result batch. A batch goes alone as one script call, whatever its queues
    # (it was one script per queue in a pipeline: with 200 tenant queues, one per result).
    transport = make(fake)
    await fake.zadd(Q, {envelope(f"p{i}", soon(), token=f"t{i}"): soon() for i in range(2)})
    await fake.zadd("queue-b", {envelope("pb", soon(), token="tb"): soon()})
    a = await transport.fetch(transport.queues[0], 10, 0)
    b = await transport.fetch(transport.queues[1], 10, 0)
    pipelines: list[object] = []
    real = fake.pipeline

    def counting(*args: object, **kwargs: object) -> object:
        pipelines.append(args)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(fake, "pipeline", counting)
    done = [Completion(d, Result.http(transport.decode(d).id, 200, b"{}")) for d in a + b]
    await transport.complete(done[:2])
    assert pipelines == []
    await transport.complete(done[2:])
    assert pipelines == []
    assert await fake.llen("result-list") == 2
    assert await fake.llen("qb") == 1
    await fake.zadd(Q, {envelope("p9", soon(), token="t9"): soon()})
    await fake.zadd("queue-b", {envelope("pc", soon(), token="tc"): soon()})
    both = await transport.fetch(transport.queues[0], 10, 0)
    both += await transport.fetch(transport.queues[1], 10, 0)
    script = transport._scripts["complete"]
    calls: list[int] = []

    async def counted(**kwargs: object) -> object:
        calls.append(len(kwargs["keys"]))  # type: ignore[arg-type]
        return await script(**kwargs)  # type: ignore[arg-type]

    transport._scripts["complete"] = counted  # type: ignore[assignment]
    await transport.complete(
        [Completion(d, Result.http(transport.decode(d).id, 200, b"{}")) for d in both]
    )
    assert pipelines == []
    assert calls == [24]  # both queues' items in one call
    assert await fake.llen("result-list") == 3
    assert await fake.llen("qb") == 2


async def test_claim_then_complete_acknowledges_and_writes_once(fake) -> None:
    transport = make(fake)
    await fake.zadd(Q, {envelope("x", soon(), token="t"): soon()})
    [delivery] = await transport.fetch(transport.queues[0], 10, 0)
    assert transport.decode(delivery).routing.labels == {"k": "cfg"}
    assert delivery.handle.id == "x\x00t"  # upstream's claim key: id NUL token
    assert await fake.hget(redis_keys.claimed_key(Q), "x\x00t") == delivery.raw
    owner = await fake.hget(redis_keys.claim_owners_key(Q), "x\x00t")
    assert owner == transport._owner.encode() and len(owner) == 16
    await transport.complete([Completion(delivery, Result.http("x", 200, b"a"))] * 2)
    assert await fake.llen("result-list") == 1
    assert await fake.exists(redis_keys.done_key("x", "t"))
    assert not await fake.exists(*(k(Q) for k in CLAIM_KEYS))


async def test_reap_returns_expired_claims_only(fake) -> None:
    transport = make(fake, lease_seconds=0.05)
    old, new = soon(), soon() + 1
    await fake.zadd(Q, {envelope("old", old): old, envelope("new", new): new})
    await transport.fetch(transport.queues[0], 1, 0)
    await anyio.sleep(0.1)
    await transport.fetch(transport.queues[0], 1, 0)  # "new": its lease is still running
    await transport.reap()
    assert await fake.zrange(Q, 0, -1, withscores=True) == [(envelope("old", old), old)]
    assert await fake.zcard(redis_keys.claims_idx_key(Q)) == 1


async def test_heartbeat_forgets_lost_and_stale_claims(fake) -> None:
    transport = make(fake)
    stale_deadline = int(time.time() - STALE_CLAIM_GRACE - 10)
    await fake.zadd(Q, {envelope("keep", soon()): 1, envelope("lost", soon()): 2,
                        envelope("stale", stale_deadline): 3})  # fmt: skip
    deliveries = await transport.fetch(transport.queues[0], 3, 0)
    for delivery in deliveries:
        transport.decode(delivery)
    # Reclaimed and claimed by another owner: not renewed, forgotten.
    await fake.hset(redis_keys.claim_owners_key(Q), deliveries[1].handle.id, "f" * 16)
    idx = redis_keys.claims_idx_key(Q)
    before = await fake.zscore(idx, deliveries[0].handle.id)
    other = await fake.zscore(idx, deliveries[1].handle.id)
    await anyio.sleep(0.01)
    await transport.heartbeat()
    assert await fake.zscore(idx, deliveries[0].handle.id) > before
    assert await fake.zscore(idx, deliveries[1].handle.id) == other
    assert list(transport._claims.held[Q]) == [deliveries[0].handle.id]


async def test_defer_after_lost_lease_does_not_duplicate(fake) -> None:
    transport = make(fake)
    await fake.zadd(Q, {envelope("d", soon()): soon()})
    [delivery] = await transport.fetch(transport.queues[0], 1, 0)
    await fake.delete(redis_keys.claim_owners_key(Q))  # the reaper took it back
    await transport.defer([Deferral(delivery, 3)])
    await transport.dead_letter(delivery, "r", "d")
    assert await fake.zcard("retry-sortedset") == 0
    assert await fake.llen(redis_keys.dead_letter_key(Q)) == 0
    assert transport._claims.held[Q] == {}


async def test_move_due_sends_unparsable_members_to_the_first_queue_now(fake) -> None:
    transport = make(fake)
    await fake.zadd("retry-sortedset", {b"{broken": 1, envelope("b", 777, origin="queue-b"): 2})
    await transport.move_due()
    [(raw, score)] = await fake.zrange(Q, 0, -1, withscores=True)
    assert raw == b"{broken" and abs(score - time.time()) < 5
    assert await fake.zrange("queue-b", 0, -1, withscores=True) == [
        (envelope("b", 777, origin="queue-b"), 777.0)
    ]


async def test_result_list_precedence(fake) -> None:
    # An oversized member's decode needs the claim's SHA-1 (redis.sha1hex, which fakeredis
    # lacks): tests/integration/test_sortedset.py covers it against redis-server.
    transport = make(fake)
    await fake.zadd("queue-b", {envelope("rb", soon()): 1})
    [delivery] = await transport.fetch(transport.queues[1], 1, 0)
    transport.decode(delivery)
    await transport.complete([Completion(delivery, Result.http("rb", 200, b""))])
    assert await fake.llen("qb") == 1  # the queue's own result list beats the default


def test_fingerprint_prefers_the_token_then_the_request() -> None:
    with_token = Envelope(Request(id="i", deadline=5), Routing(request_token="tok"))
    bare = Envelope(Request(id="i", deadline=5))
    later = Envelope(Request(id="i", deadline=6))

    assert entries.fingerprint(with_token) == "tok"
    assert entries.fingerprint(bare).startswith("sha-")
    assert entries.fingerprint(bare) != entries.fingerprint(later)
    assert entries.fingerprint(None) == ""


def test_keys_and_scripts() -> None:
    assert redis_keys.done_key("i").startswith("request-done:i:")
    # Message fields may hold ":"; the pair is hashed, so these never share a marker.
    assert redis_keys.done_key("a:b", "c") != redis_keys.done_key("a", "b:c")
    assert redis_keys.done_key("a:b") != redis_keys.done_key("a", "b")
    assert redis_keys.active_key("i") == "request-active:i"
    assert redis_keys.cancel_key("i") == "request-cancel:i"
    assert "inflight" in scripts.script_source("reap_legacy")  # the upgrade's reaper
    with pytest.raises(KeyError, match="known"):
        scripts.script_source("nope")


async def test_upkeep_loop_backs_off_and_keeps_going() -> None:
    calls = 0

    async def flaky() -> None:
        nonlocal calls
        calls += 1
        if calls < 3:
            raise TransportError("down")

    with anyio.move_on_after(0.5):
        await _every("test", 0.02, flaky)
    assert calls > 3  # survived two failures, then ran on at its interval
