"""Equal deadlines come out in submission order, against real Redis and the
simulator over HTTP.

The client's score is the deadline plus upstream's per-deadline sequence fraction
(``enqueue_seq``, llm-d-async #463); before it, equal scores left ZPOPMIN to order by
member bytes, i.e. by the random token in each envelope.
"""

from __future__ import annotations

import secrets
import time

import pytest
import redis.asyncio as aioredis

from async_processor.client.redis_sortedset import SortedSetClient
from async_processor.config import PoolConfig
from tests.fixtures.inprocess import running, sortedset_config
from tests.fixtures.simulator import SimulatorProcess

pytestmark = pytest.mark.anyio


def _ids(n: int) -> list[str]:
    # A random prefix: the ids' byte order says nothing about their submission order.
    return [f"{secrets.token_hex(3)}-{i}" for i in range(n)]


async def test_scores_keep_the_deadline_and_order_equal_deadlines(
    redis_url: str, unique: str
) -> None:
    deadline = int(time.time()) + 600
    ids = _ids(50)
    r = aioredis.Redis.from_url(redis_url)
    async with SortedSetClient(redis_url, request_queue=unique) as client:
        await client.submit_many({"id": i, "deadline": deadline, "payload": {}} for i in ids[:25])
        # Another producer's plain ZADD (score = the bare deadline) sorts before ours.
        await r.zadd(unique, {b'{"id":"go-producer","deadline":1,"payload":{}}': deadline})
        for request_id in ids[25:]:
            await client.submit({"id": request_id, "deadline": deadline, "payload": {}})
    members = await r.zrange(unique, 0, -1, withscores=True)
    await r.aclose()
    assert all(int(score) == deadline for _, score in members)
    order = [raw.split(b'"id":"')[1].split(b'"')[0].decode() for raw, _ in members]
    assert order == ["go-producer", *ids]


async def test_two_thousand_equal_deadlines_are_dispatched_in_submission_order(
    redis_url: str, unique: str, simulator: SimulatorProcess
) -> None:
    deadline = int(time.time()) + 600
    ids = _ids(2000)
    pools = [PoolConfig(id="p", workers=1)]
    config = sortedset_config(redis_url, simulator.url, unique, pools=pools)
    results = f"{unique}:results"
    first = SortedSetClient(redis_url, request_queue=unique, result_queue=results)
    second = SortedSetClient(redis_url, request_queue=unique, result_queue=results)
    try:
        # Two producers taking turns, in chunks, before the daemon starts.
        for n, start in enumerate(range(0, len(ids), 250)):
            producer = (first, second)[n % 2]
            chunk = ids[start : start + 250]
            await producer.submit_many(
                {"id": i, "deadline": deadline, "payload": {}} for i in chunk
            )
        async with running(config):
            answered = await first.drain_results(len(ids), 120)
    finally:
        await first.aclose()
        await second.aclose()
    assert [r.status_code for r in answered] == [200] * len(ids)
    assert [r.id for r in answered] == ids


async def test_past_the_fractions_later_submissions_still_sort_after_earlier_ones(
    redis_url: str, unique: str
) -> None:
    deadline = int(time.time()) + 600
    r = aioredis.Redis.from_url(redis_url)
    async with SortedSetClient(redis_url, request_queue=unique) as client:
        await client.submit({"id": "first", "deadline": deadline, "payload": {}})
        # As if two million submissions of this deadline had come in between.
        await r.set(f"request-seq:{unique}:{deadline}", 2**21 - 2)
        for request_id in ("last-fraction", "past-1", "past-2"):
            await client.submit({"id": request_id, "deadline": deadline, "payload": {}})
    members = await r.zrange(unique, 0, -1, withscores=True)
    await r.aclose()
    scores = {raw.split(b'"id":"')[1].split(b'"')[0].decode(): score for raw, score in members}
    assert scores["first"] < scores["last-fraction"] <= scores["past-1"] == scores["past-2"]
    assert int(scores["past-2"]) == deadline


async def test_order_counters_live_a_bounded_time_and_only_when_used(
    redis_url: str, unique: str
) -> None:
    day = int(time.time()) + 24 * 3600
    late = 5_000_000_000  # from 2128 on: a double has no room for the fraction
    r = aioredis.Redis.from_url(redis_url)
    async with SortedSetClient(redis_url, request_queue=unique) as client:
        await client.submit({"id": "day", "deadline": day, "payload": {}})
        await client.submit({"id": "late", "deadline": late, "payload": {}})
    # Upstream's expiry: an hour past the deadline (its counter and ours are one key).
    assert abs(await r.expiretime(f"request-seq:{unique}:{day}") - (day + 3600)) <= 1
    assert not await r.exists(f"request-seq:{unique}:{late}")  # made and never read before
    await r.aclose()
