"""Upstream's wire (llm-d-async v0.10 and main, shared/reference/upstream-v0.10.md §2-§5,
§14), spoken as a Go producer and a Go result reader would, on a real redis-server.

The envelopes are written here as bytes, the way Go's ``encoding/json`` lays them out
(struct order, ``omitempty``), not built with our own classes: a field we would drop or
re-format shows up as a byte difference.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest
from redis.asyncio import Redis

from async_processor.config import SortedSetConfig
from async_processor.messages import Result
from async_processor.transports.base import Completion, Deferral, TransportContext
from async_processor.transports.redis_sortedset.transport import SortedSetTransport

pytestmark = pytest.mark.anyio
GW = "http://gw.test:8000"
TOKEN = "9f3c2a1b7d6e5f40"

# Routing fields only upstream writes, one of them (``dispatch_epoch``, the SQL branch's)
# and one invented field unknown to us, with number texts a re-encoding would change.
UPSTREAM_ROUTING = (
    b'"result_ttl_seconds":3600,"result_routing_resolved":false,"enqueue_seq":7,'
    b'"dispatch_epoch":12345678901234567890,"x_future":{"a":1.50e0,"b":[1E2,-0.0]}'
)


def go_envelope(request_id: str, deadline: int, *, token: str = TOKEN, extra: bytes = b"") -> bytes:
    """A Go producer's queue member (v0.10 main): routing first, then kind, then data."""
    routing = b'"request_token":"' + token.encode() + b'","request_queue_name":"q"'
    if extra:
        routing += b"," + extra
    return (
        b'{"internal":{' + routing + b'},"request_kind":"redis","data":{"id":"'
        + request_id.encode() + b'","deadline":' + str(deadline).encode()
        + b',"payload":{"model":"m","prompt":"hi","n":1.0},"model":"m"}}'
    )  # fmt: skip


def field_text(member: bytes, name: str) -> bytes:
    """The exact JSON text of routing field ``name`` in ``member`` (object or scalar)."""
    start = member.index(b'"' + name.encode() + b'":') + len(name) + 3
    depth, end = 0, start
    while end < len(member):
        char = member[end : end + 1]
        if char in (b"{", b"["):
            depth += 1
        elif char in (b"}", b"]"):
            if depth == 0:
                return member[start:end]
            depth -= 1
        elif char == b"," and depth == 0:
            return member[start:end]
        end += 1
    return member[start:end]


@pytest.fixture
async def r(redis_url: str) -> AsyncIterator[Redis]:
    client = Redis.from_url(redis_url)
    yield client
    await client.aclose()


@pytest.fixture
def make_config(redis_url: str, unique: str) -> Callable[..., SortedSetConfig]:
    def make(lease: float = 5, **queue: Any) -> SortedSetConfig:
        return SortedSetConfig.model_validate(
            {
                "url": redis_url,
                "retry_queue_name": f"{unique}-retry",
                "result_queue_name": f"{unique}-results",
                "lease_seconds": lease,
                "queues": [{"queue_name": f"{unique}-q", "igw_base_url": GW, **queue}],
            }
        )

    return make


@asynccontextmanager
async def opened(config: SortedSetConfig) -> AsyncIterator[SortedSetTransport]:
    transport = SortedSetTransport(config, TransportContext())
    try:
        yield transport
    finally:
        await transport.aclose()


def future(seconds: int = 600) -> int:
    return int(time.time()) + seconds


# ------------------------------------------------------------ §2: request_token on results


async def test_every_result_carries_its_request_token_and_none_without_one(make_config, r) -> None:
    config = make_config()
    q = config.queues[0].queue_name
    deadline = future()
    await r.zadd(q, {go_envelope("with", deadline): deadline})
    await r.zadd(q, {go_envelope("without", deadline + 1, token=""): deadline + 1})
    async with opened(config) as transport:
        deliveries = await transport.fetch(transport.queues[0], 2, 0)
        for delivery in deliveries:
            transport.decode(delivery)
        await transport.complete(
            [Completion(d, Result.http(d.envelope.id, 200, b"{}")) for d in deliveries]
        )
    pushed = [json.loads(raw) for raw in await r.lrange(config.result_queue_name, 0, -1)]
    by_id = {p["id"]: p for p in pushed}
    assert by_id["with"]["request_token"] == TOKEN
    assert "request_token" not in by_id["without"]  # omitted when empty, as upstream


# ------------------------------------------ §14.2: routing fields kept byte for byte


async def test_a_retry_and_a_hand_back_keep_upstream_and_unknown_fields_verbatim(
    make_config, r
) -> None:
    config = make_config()
    q = config.queues[0].queue_name
    deadline = future()
    members = {
        go_envelope(name, deadline + i, extra=UPSTREAM_ROUTING): deadline + i
        for i, name in enumerate(("retried", "handed-back"))
    }
    await r.zadd(q, members)
    async with opened(config) as transport:
        retried, handed = await transport.fetch(transport.queues[0], 2, 0)
        for delivery in (retried, handed):
            transport.decode(delivery)
        assert retried.envelope is not None
        retried.envelope.routing.retry_count += 1
        await transport.defer([Deferral(retried, 30.0), Deferral(handed, 0.0)])
    [parked] = await r.zrange(config.retry_queue_name, 0, -1)
    [back] = await r.zrange(q, 0, -1)
    for rewritten in (parked, back):
        for name in ("result_ttl_seconds", "enqueue_seq", "dispatch_epoch", "x_future"):
            assert field_text(rewritten, name) == field_text(UPSTREAM_ROUTING, name), name
        envelope = json.loads(rewritten)
        assert envelope["data"]["model"] == "m"
        # The payload too, byte for byte (``1.0`` stays ``1.0``).
        assert b'"payload":{"model":"m","prompt":"hi","n":1.0}' in rewritten
    assert json.loads(parked)["internal"]["retry_count"] == 1


async def test_a_reclaimed_member_is_the_producer_bytes_unchanged(make_config, r) -> None:
    config = make_config(lease=0.2)
    q = config.queues[0].queue_name
    deadline = future()
    raw = go_envelope("crashy", deadline, extra=UPSTREAM_ROUTING)
    await r.zadd(q, {raw: deadline + 7 / 2097152})
    async with opened(config) as crashed, opened(config) as survivor:
        await crashed.fetch(crashed.queues[0], 1, 0)  # claimed, never answered
        async with anyio.create_task_group() as tg:
            await tg.start(survivor.run)
            with anyio.fail_after(5):
                while await r.zscore(q, raw) is None:
                    await anyio.sleep(0.05)
            tg.cancel_scope.cancel()
    assert await r.zscore(q, raw) == deadline + 7 / 2097152


# ----------------------------------------------- §3: result routing frozen at first fetch


async def test_the_result_route_is_frozen_at_the_first_fetch(make_config, r, unique) -> None:
    first = make_config(result_queue_name=f"{unique}-bound")
    q = first.queues[0].queue_name
    deadline = future()
    await r.zadd(q, {go_envelope("frozen", deadline): deadline})
    async with opened(first) as transport:
        [delivery] = await transport.fetch(transport.queues[0], 1, 0)
        transport.decode(delivery)
        await transport.defer([Deferral(delivery, 0.0)])
    [back] = await r.zrange(q, 0, -1)
    routing = json.loads(back)["internal"]
    assert routing["result_routing_resolved"] is True
    assert routing["result_queue_name"] == f"{unique}-bound"
    # The queue's result list changes (a reload, a new release): the message answers where
    # it was bound, as a Go daemon would.
    moved = make_config(result_queue_name=f"{unique}-moved")
    async with opened(moved) as transport:
        [delivery] = await transport.fetch(transport.queues[0], 1, 0)
        transport.decode(delivery)
        await transport.complete([Completion(delivery, Result.http("frozen", 200, b"{}"))])
    assert await r.llen(f"{unique}-moved") == 0
    [result] = await r.lrange(f"{unique}-bound", 0, -1)
    assert json.loads(result)["id"] == "frozen"


async def test_a_frozen_route_naming_a_key_of_ours_is_still_refused(make_config, r, unique) -> None:
    config = make_config()
    q = config.queues[0].queue_name
    deadline = future()
    hostile = b'"result_queue_name":"' + q.encode() + b'","result_routing_resolved":true'
    await r.zadd(q, {go_envelope("hostile", deadline, extra=hostile): deadline})
    async with opened(config) as transport:
        [delivery] = await transport.fetch(transport.queues[0], 1, 0)
        transport.decode(delivery)
        await transport.complete([Completion(delivery, Result.http("hostile", 200, b"{}"))])
    assert await r.type(q) == b"none"  # nothing pushed onto the request queue's key
    [result] = await r.lrange(config.result_queue_name, 0, -1)
    assert json.loads(result)["id"] == "hostile"


def test_field_text_reads_nested_values() -> None:
    assert field_text(UPSTREAM_ROUTING, "x_future") == b'{"a":1.50e0,"b":[1E2,-0.0]}'
    assert re.fullmatch(rb"\d+", field_text(UPSTREAM_ROUTING, "dispatch_epoch"))
