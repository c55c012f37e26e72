"""A cancel given for one queue reaches only that queue's submission of an id, against a
real redis-server: standalone keeps one ``request-active:<id>`` / ``request-cancel:<id>``
per id (the Go reference's names), so the client takes the token from the queue's own id
index (``<queue>:live:<id>``), and a submission elsewhere leaves a pending cancel alone.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis

from async_processor.client.redis_sortedset import SortedSetClient
from async_processor.config import SortedSetConfig
from async_processor.messages import Envelope, Request, Routing
from async_processor.redis import keys as redis_keys
from async_processor.transports.base import Delivery, TransportContext
from async_processor.transports.redis_sortedset.transport import SortedSetTransport

pytestmark = pytest.mark.anyio


def request(request_id: str) -> dict[str, object]:
    return {"id": request_id, "deadline": int(time.time()) + 600, "payload": {}}


@pytest.fixture
async def client(redis_url: str, unique: str) -> AsyncIterator[SortedSetClient]:
    async with SortedSetClient(redis_url, f"{unique}-qa") as c:
        yield c


@pytest.fixture
async def transport(redis_url: str, unique: str) -> AsyncIterator[SortedSetTransport]:
    config = SortedSetConfig.model_validate(
        {"url": redis_url, "retry_queue_name": f"{unique}:retry",
         "queues": [{"queue_name": f"{unique}-{q}", "igw_base_url": "http://gw:1"}
                    for q in ("qa", "qb")]}
    )  # fmt: skip
    t = SortedSetTransport(config, TransportContext())
    try:
        yield t
    finally:
        await t.aclose()


async def fetch_both(transport: SortedSetTransport) -> tuple[Delivery, Delivery]:
    [a] = await transport.fetch(transport.queues[0], 10, 0)
    [b] = await transport.fetch(transport.queues[1], 10, 0)
    return a, b


async def test_a_cancel_for_one_queue_leaves_the_same_id_on_another_alone(
    client: SortedSetClient, transport: SortedSetTransport, unique: str
) -> None:
    qa, qb = f"{unique}-qa", f"{unique}-qb"
    token_a = await client.submit(request(f"{unique}-x"), queue=qa)
    # Submitted later: request-active:<id> holds qb's token.
    await client.submit(request(f"{unique}-x"), queue=qb)
    a, b = await fetch_both(transport)  # both in flight
    assert await client.cancel([f"{unique}-x"], queue=qa) == 1
    assert await transport.cancelled([a, b]) == [True, False]
    assert await transport._redis.get(redis_keys.cancel_key(f"{unique}-x")) == token_a.encode()


async def test_a_submission_on_another_queue_keeps_a_pending_cancel(
    client: SortedSetClient, transport: SortedSetTransport, unique: str
) -> None:
    qa, qb = f"{unique}-qa", f"{unique}-qb"
    await client.submit(request(f"{unique}-x"), queue=qa)
    assert await client.cancel([f"{unique}-x"], queue=qa) == 1
    await client.submit(request(f"{unique}-x"), queue=qb)  # used to delete request-cancel:x
    a, b = await fetch_both(transport)
    assert await transport.cancelled([a, b]) == [True, False]


async def test_a_cancel_for_a_queue_without_the_id_marks_nothing(
    client: SortedSetClient, transport: SortedSetTransport, unique: str
) -> None:
    await client.submit(request(f"{unique}-x"), queue=f"{unique}-qb")
    assert await client.cancel([f"{unique}-x"], queue=f"{unique}-qa") == 0
    assert not await transport._redis.exists(redis_keys.cancel_key(f"{unique}-x"))


async def test_a_submission_made_around_the_client_is_still_cancelled(
    client: SortedSetClient, transport: SortedSetTransport, redis_url: str, unique: str
) -> None:
    """The Go producer's way: a plain ZADD and ``request-active:<id>``, no id index."""
    token = secrets.token_hex(16)
    envelope = Envelope(
        request=Request(id=f"{unique}-go", deadline=int(time.time()) + 600, payload=b"{}"),
        routing=Routing(request_token=token),
        kind="redis",
    )
    r = Redis.from_url(redis_url)
    try:
        await r.zadd(f"{unique}-qa", {envelope.encode(): int(time.time()) + 600})
        await r.set(redis_keys.active_key(f"{unique}-go"), token)
    finally:
        await r.aclose()
    assert await client.cancel([f"{unique}-go"], queue=f"{unique}-qa") == 1
    [delivery] = await transport.fetch(transport.queues[0], 10, 0)
    assert await transport.cancelled([delivery]) == [True]
