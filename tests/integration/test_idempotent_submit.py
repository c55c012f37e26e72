"""Idempotent submission on redis-sortedset, against a real redis-server and the simulator:
an id that is queued, in flight or retrying gets no second entry; once its result is
written it may be submitted again; the daemon never dispatches two live entries of one id.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator

import anyio
import pytest
from redis.asyncio import Redis

from async_processor.client.redis_sortedset import SortedSetClient, Submitted
from async_processor.config import SortedSetConfig
from async_processor.messages import Result
from async_processor.transports.base import Completion, Deferral, TransportContext
from async_processor.transports.redis_sortedset.transport import SortedSetTransport
from tests.fixtures.inprocess import running, sortedset_config
from tests.fixtures.simulator import SimulatorProcess

pytestmark = pytest.mark.anyio


@pytest.fixture
async def client(redis_url: str, unique: str) -> AsyncIterator[SortedSetClient]:
    async with SortedSetClient(redis_url, unique, f"{unique}:results") as c:
        yield c


def request(request_id: str, prompt: str = "hi") -> dict[str, object]:
    return {"id": request_id, "deadline": int(time.time()) + 600, "payload": {"prompt": prompt}}


async def test_a_live_id_is_not_queued_twice_until_its_result(
    client: SortedSetClient, redis_url: str, unique: str
) -> None:
    [first] = await client.submit_each([request("x")])
    assert first.queued
    config = SortedSetConfig.model_validate(
        {"url": redis_url, "retry_queue_name": f"{unique}:retry",
         "queues": [{"queue_name": unique, "igw_base_url": "http://gw:1"}]}
    )  # fmt: skip
    transport = SortedSetTransport(config, TransportContext())
    try:
        refused = Submitted(first.token, queued=False)
        assert await client.submit_each([request("x")]) == [refused]  # queued
        [delivery] = await transport.fetch(transport.queues[0], 10, 0)
        assert await client.submit_each([request("x")]) == [refused]  # in flight
        await transport.defer([Deferral(delivery, 30.0)])
        assert await client.submit_each([request("x")]) == [refused]  # retrying
        assert await client.request_depth() == 0  # the one entry waits in the retry set
        retry = f"{unique}:retry"
        await transport._redis.zadd(
            retry, {m: 0 for m in await transport._redis.zrange(retry, 0, -1)}
        )
        await transport.move_due()  # due now: back on the queue
        [delivery] = await transport.fetch(transport.queues[0], 10, 0)
        await transport.complete([Completion(delivery, Result.http("x", 200, b"{}"))])
    finally:
        await transport.aclose()
    [again] = await client.submit_each([request("x")])  # the result is written: free again
    assert again.queued and again.token != first.token
    assert await client.request_depth() == 1


async def test_concurrent_submissions_of_one_id_queue_one_entry(
    redis_url: str, unique: str
) -> None:
    outcomes: list[Submitted] = []

    async def producer() -> None:
        async with SortedSetClient(redis_url, unique) as mine:
            outcomes.extend(await mine.submit_each([request("same")] * 5))

    async with anyio.create_task_group() as tg:
        for _ in range(10):
            tg.start_soon(producer)
    queued = [o for o in outcomes if o.queued]
    assert len(outcomes) == 50 and len(queued) == 1
    assert {o.token for o in outcomes} == {queued[0].token}
    async with SortedSetClient(redis_url, unique) as check:
        assert await check.request_depth() == 1


async def test_the_index_is_per_queue(client: SortedSetClient, unique: str) -> None:
    [a] = await client.submit_each([request("q-id")])
    [b] = await client.submit_each([request("q-id")], queue=f"{unique}-other")
    assert a.queued and b.queued


async def test_the_daemon_dispatches_one_of_two_live_entries(
    client: SortedSetClient, redis_url: str, unique: str, simulator: SimulatorProcess
) -> None:
    """A second entry written around the index (a plain ZADD, as the Go producer does)
    while the id is live is parked as superseded, not dispatched."""
    await client.submit(request("dup", prompt="ours"))
    r = Redis.from_url(redis_url)
    other = request("dup", prompt="around-the-index")
    member = json.dumps({"internal": {"request_token": "f" * 32}, "request_kind": "redis",
                         "data": other})  # fmt: skip
    await r.zadd(unique, {member: int(time.time())})  # claimed first
    async with running(sortedset_config(redis_url, simulator.url, unique)):
        [result] = await client.drain_results(1, 15)
        assert await client.drain_results(1, 1.0) == []
    parked = [json.loads(x) for x in await r.lrange(f"{unique}:dead-letter", 0, -1)]
    await r.aclose()
    prompts = [json.loads(x["body"])["prompt"] for x in simulator.requests()]
    assert result.id == "dup" and result.status_code == 200
    assert prompts == ["ours"]
    assert [x["reason"] for x in parked] == ["superseded"]
    assert "around-the-index" in parked[0]["raw"]


async def test_a_superseded_entry_that_cannot_be_parked_does_not_strand_its_batch(
    client: SortedSetClient, redis_url: str, unique: str
) -> None:
    """Parking fails (the dead-letter key is taken by a string): the fetch still hands on
    the rest of its batch, and the superseded claim is let go rather than renewed."""
    await client.submit(request("dup"))
    await client.submit(request("other"))
    r = Redis.from_url(redis_url)
    member = json.dumps({"internal": {"request_token": "f" * 32}, "request_kind": "redis",
                         "data": request("dup", prompt="around-the-index")})  # fmt: skip
    await r.zadd(unique, {member: 0})
    await r.set(f"{unique}:dead-letter", "squatter")
    config = SortedSetConfig.model_validate(
        {"url": redis_url, "retry_queue_name": f"{unique}:retry",
         "queues": [{"queue_name": unique, "igw_base_url": "http://gw:1"}]}
    )  # fmt: skip
    transport = SortedSetTransport(config, TransportContext())
    try:
        fetched = await transport.fetch(transport.queues[0], 10, 0)
        prompts = {
            json.loads(bytes(transport.decode(d).request.payload))["prompt"] for d in fetched
        }
        assert prompts == {"hi"}  # ours and "other", not the superseded entry
        held = transport._claims.held[unique]
        assert len(held) == 2  # the superseded claim is no longer renewed
    finally:
        await transport.aclose()
        await r.aclose()
