"""The Batch API's Redis state on a real redis-server: results counted once, status
changes that never go backwards, sealed batches, id-cursor pages (api/store.py)."""

from __future__ import annotations

import json

import pytest
from redis.asyncio import Redis

from async_processor.api import keys
from async_processor.api.collector import record_results
from async_processor.api.metrics import ApiMetrics
from async_processor.api.replicas import adopt_silent
from async_processor.api.store import Line, Store
from async_processor.client.redis_sortedset import processing_key
from async_processor.messages import ErrorCode, Result

pytestmark = pytest.mark.anyio


async def _batch(store: Store, tenant: str, lines: int = 3) -> str:
    batch_id = keys.new_id(keys.BATCH_PREFIX)
    record = {"id": batch_id, "tenant": tenant, "status": "in_progress", "created_at": 1,
              "sealed": 0, "total": lines}  # fmt: skip
    await store.create_batch(record, [])
    await store.redis.hset(
        keys.batch_part(batch_id, "ids"), mapping={i: f"c{i}" for i in range(lines)}
    )
    return batch_id


async def test_a_result_read_twice_is_recorded_once(redis_client: Redis, unique: str) -> None:
    store = Store(redis_client)
    batch_id = await _batch(store, unique)
    body = json.dumps({"usage": {"prompt_tokens": 4, "completion_tokens": 6, "total_tokens": 10}})
    results = [
        Result.http(keys.line_id(batch_id, 0), 200, body.encode()),
        Result.failure(keys.line_id(batch_id, 2), ErrorCode.CANCELLED, "cancelled"),
        Result(id="someone-else:7"),  # not a line: dropped, not an error
    ]
    metrics = ApiMetrics()
    for _ in range(3):  # a reader killed before its ack reads them again
        await record_results(store, results, metrics)
    counted = metrics.registry.get_sample_value
    assert counted("async_processor_api_results_total", {"outcome": "recorded"}) == 2
    assert counted("async_processor_api_results_total", {"outcome": "dropped"}) == 7
    assert counted("async_processor_api_first_result_seconds_count") == 1
    record = await store.batch(batch_id)
    assert record is not None
    assert (record["completed"], record["failed"], record["total_tokens"]) == ("1", "1", "10")
    out = await redis_client.lrange(keys.batch_part(batch_id, "out"), 0, -1)
    err = await redis_client.lrange(keys.batch_part(batch_id, "err"), 0, -1)
    assert [json.loads(x)["custom_id"] for x in out] == ["c0"]
    assert [json.loads(x)["error"]["code"] for x in err] == ["CANCELLED"]
    assert await store.done(batch_id, 0, 3) == [True, False, True]


async def test_a_sealed_batch_takes_no_more_lines(redis_client: Redis, unique: str) -> None:
    store = Store(redis_client)
    batch_id = await _batch(store, unique)
    await store.update(batch_id, {"sealed": 1})
    assert (await store.record(batch_id, [Line(1, True, "{}")])).new == -1
    assert await store.done(batch_id, 0, 3) == [False, False, False]
    assert (await store.record("batch_gone", [Line(1, True, "{}")])).new == -1


async def test_status_never_goes_backwards(redis_client: Redis, unique: str) -> None:
    store = Store(redis_client)
    batch_id = await _batch(store, unique)
    assert await store.transition(batch_id, "cancelling", ["validating", "in_progress"], 5)
    # A slower replica that still thinks the batch is in progress changes nothing.
    assert not await store.transition(batch_id, "finalizing", ["in_progress"], 6)
    assert not await store.transition(batch_id, "in_progress", ["validating"], 6)
    assert await store.transition(batch_id, "cancelled", ["cancelling"], 7)
    record = await store.batch(batch_id)
    assert record is not None
    assert (record["status"], record["cancelling_at"], record["cancelled_at"]) == (
        "cancelled", "5", "7",
    )  # fmt: skip
    assert record.get("finalizing_at") is None
    assert batch_id not in await store.open_batches()


async def test_a_wrong_typed_key_fails_the_record_and_changes_nothing(
    redis_client: Redis, unique: str
) -> None:
    store = Store(redis_client)
    batch_id = await _batch(store, unique)
    await redis_client.set(keys.batch_part(batch_id, "err"), "not a list")
    with pytest.raises(Exception, match="WRONGTYPE"):
        await store.record(batch_id, [Line(0, True, "{}")])
    assert await store.done(batch_id, 0, 1) == [False]


async def test_pages_follow_an_id_cursor_even_a_deleted_one(
    redis_client: Redis, unique: str
) -> None:
    store = Store(redis_client)
    index = keys.files_index(unique)
    ids = [f"file-{i:012x}aaaa" for i in range(7)]
    await redis_client.zadd(index, dict.fromkeys(ids, 0))
    assert await store.page(index, None, 3, "desc") == (ids[:3:-1][:3], True)
    assert await store.page(index, ids[2], 10, "asc") == (ids[3:], False)
    await redis_client.zrem(index, ids[4])
    assert await store.page(index, ids[4], 2, "desc") == ([ids[3], ids[2]], True)


async def test_a_silent_replicas_taken_results_go_back_oldest_first(
    redis_client: Redis, unique: str
) -> None:
    results = f"{{{unique}}}:api-results"
    gone, alive = processing_key(results, "api-gone"), processing_key(results, "api-alive")
    await redis_client.lpush(gone, b"r1", b"r2", b"r3")  # r1 the oldest (BLMOVE's LEFT end)
    await redis_client.lpush(alive, b"a1")
    await redis_client.lpush(results, b"new")
    now, _ = await redis_client.time()
    await redis_client.zadd(keys.REPLICAS, {"gone": now - 120, "alive": now, "me": now - 120})
    assert await adopt_silent(redis_client, results, "me", timeout=60) == 3
    # The next reader (BLMOVE from the RIGHT end) takes r1, r2, r3 first, then "new".
    assert await redis_client.lrange(results, 0, -1) == [b"new", b"r3", b"r2", b"r1"]
    assert await redis_client.lrange(alive, 0, -1) == [b"a1"]
    assert await redis_client.zscore(keys.REPLICAS, "gone") is None
    assert await redis_client.zscore(keys.REPLICAS, "alive") is not None
    await redis_client.zrem(keys.REPLICAS, "alive", "me")
