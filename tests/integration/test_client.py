"""The client library against a real redis-server, and its round trip through the transport."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import AsyncIterator

import anyio
import pytest
from redis.asyncio import Redis
from redis.asyncio.client import Pipeline
from redis.exceptions import ConnectionError as RedisConnectionError

from async_processor.client.redis_sortedset import SortedSetClient, UndecodableResult
from async_processor.config import SortedSetConfig
from async_processor.errors import TransportError
from async_processor.messages import ErrorCode, Request, Result, decode_envelope
from async_processor.redis import keys as redis_keys
from async_processor.transports.base import Completion, TransportContext
from async_processor.transports.redis_sortedset.transport import SortedSetTransport
from tests.fixtures.lossy_proxy import lossy_proxy
from tests.fixtures.servers import RedisServer, free_port

pytestmark = pytest.mark.anyio


@pytest.fixture
async def r(redis_url: str) -> AsyncIterator[Redis]:
    client = Redis.from_url(redis_url)
    yield client
    await client.aclose()


@pytest.fixture
async def client(redis_url: str, unique: str) -> AsyncIterator[SortedSetClient]:
    async with SortedSetClient(redis_url, f"{unique}-q", f"{unique}-results") as c:
        yield c


def request(request_id: str, in_seconds: int = 600) -> dict[str, object]:
    return {
        "id": request_id,
        "deadline": int(time.time()) + in_seconds,
        "payload": {"model": "m", "prompt": "hi", "big": 12345678901234567890123},
        "metadata": {"tenant": "t1"},
    }


async def test_submit_writes_the_reference_envelope_and_markers(client, r, unique) -> None:
    req = request(f"{unique}-1")
    token = await client.submit(req)
    assert len(token) == 32 and int(token, 16) >= 0
    [(raw, score)] = await r.zrange(f"{unique}-q", 0, -1, withscores=True)
    assert int(score) == req["deadline"] < score  # + the submission-order fraction
    obj = json.loads(raw)
    assert obj["request_kind"] == "redis"
    assert obj["internal"] == {
        "request_token": token,
        "request_queue_name": f"{unique}-q",
        "result_queue_name": f"{unique}-results",
        "enqueue_seq": 1,  # upstream's submission order (llm-d-async #463)
    }
    assert obj["data"]["metadata"] == {"tenant": "t1"}
    assert b'"big":12345678901234567890123' in raw  # payload bytes kept exact
    assert await r.get(redis_keys.active_key(f"{unique}-1")) == token.encode()
    assert 590 <= await r.ttl(redis_keys.active_key(f"{unique}-1")) <= 600


async def test_submit_keeps_a_request_payload_verbatim(client, r, unique) -> None:
    payload = b'{"z": 1, "a": [1.0, 2e3], "s": "\\u00e9"}'
    await client.submit(Request(id=f"{unique}-v", deadline=int(time.time()) + 60, payload=payload))
    [raw] = await r.zrange(f"{unique}-q", 0, -1)
    assert decode_envelope(raw).request.payload == payload


async def test_submit_routes_to_other_queues(client, r, unique) -> None:
    await client.submit(request(f"{unique}-o"), queue=f"{unique}-other", result_queue="elsewhere")
    [raw] = await r.zrange(f"{unique}-other", 0, -1)
    assert json.loads(raw)["internal"]["result_queue_name"] == "elsewhere"
    assert await client.request_depth() == 0
    assert await client.request_depth(f"{unique}-other") == 1


@pytest.mark.parametrize(
    "bad",
    [
        {"deadline": 2_000_000_000},
        {"id": "", "deadline": 2_000_000_000},
        {"id": "past", "deadline": 1_000},
        {"id": "no-deadline"},
    ],
)
async def test_submit_rejects_invalid_requests(client, bad) -> None:
    with pytest.raises(ValueError):
        await client.submit(bad)
    assert await client.request_depth() == 0


async def test_submit_many_pipelines_thousands(client, r, unique) -> None:
    tokens = await client.submit_many(request(f"{unique}-{i}") for i in range(1200))
    assert len(set(tokens)) == 1200
    assert await client.request_depth() == 1200
    assert await r.get(redis_keys.active_key(f"{unique}-1199")) == tokens[-1].encode()


async def test_cancel_copies_the_active_token(client, r, unique) -> None:
    token = await client.submit(request(f"{unique}-c"))
    assert await client.cancel([f"{unique}-c", f"{unique}-unknown"]) == 1
    assert await r.get(redis_keys.cancel_key(f"{unique}-c")) == token.encode()
    assert await r.ttl(redis_keys.cancel_key(f"{unique}-c")) > 6 * 24 * 3600
    assert not await r.exists(redis_keys.cancel_key(f"{unique}-unknown"))
    # A resubmission while it is still queued is refused: the cancel still applies.
    [again] = await client.submit_each([request(f"{unique}-c")])
    assert (again.token, again.queued) == (token, False)
    assert await r.get(redis_keys.cancel_key(f"{unique}-c")) == token.encode()
    assert await client.request_depth() == 1


async def test_round_trip_through_the_transport(client, redis_url, unique) -> None:
    await client.submit_many(
        [request(f"{unique}-a"), request(f"{unique}-b"), request(f"{unique}-x")]
    )
    await client.cancel([f"{unique}-x"])
    config = SortedSetConfig.model_validate(
        {"url": redis_url, "queues": [{"queue_name": f"{unique}-q", "igw_base_url": "http://gw:1"}]}
    )
    transport = SortedSetTransport(config, TransportContext())
    try:
        deliveries = await transport.fetch(transport.queues[0], 10, 0)
        assert await client.inflight_depth() == 3
        done = []
        for delivery in deliveries:
            envelope = transport.decode(delivery)
            if await transport.is_cancelled(delivery):
                done.append(
                    Completion(
                        delivery, Result.failure(envelope.id, ErrorCode.CANCELLED, "cancelled")
                    )
                )
            else:
                done.append(Completion(delivery, Result.http(envelope.id, 200, b'{"ok":true}')))
        await transport.complete(done)
    finally:
        await transport.aclose()
    assert await client.result_depth() == 3
    got = await client.drain_results(5, timeout=0.5)
    assert {(x.id, x.status_code, x.error_code) for x in got} == {
        (f"{unique}-a", 200, ""),
        (f"{unique}-b", 200, ""),
        (f"{unique}-x", 0, "CANCELLED"),
    }
    assert await client.inflight_depth() == 0


async def test_results_iterator_waits_then_ends(client, r, unique) -> None:
    async def produce() -> None:
        await anyio.sleep(0.2)
        await r.lpush(f"{unique}-results", Result.http("late", 200, b"x").encode())

    seen = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(produce)
        async for result in client.results(timeout=0.5):
            seen.append(result.id)
    assert seen == ["late"]
    started = time.monotonic()
    assert await client.drain_results(1, timeout=0.2) == []
    assert time.monotonic() - started < 2


async def test_client_raises_transport_error_when_redis_is_down() -> None:
    async with SortedSetClient(f"redis://127.0.0.1:{free_port()}/0") as down:
        with pytest.raises(TransportError):
            await down.submit(request("nobody-home"))
        with pytest.raises(TransportError):
            await down.request_depth()


# ------------------------------------------------------------ nothing lost, nothing half-done


@pytest.mark.parametrize("deadline", [2**62, 253_402_300_800, 2**63 - 1])
async def test_submit_with_an_out_of_range_deadline_writes_nothing(
    client: SortedSetClient, r: Redis, unique: str, deadline: int
) -> None:
    # 2**62 made the marker's SET EX fail inside the MULTI while the ZADD went through.
    valid = request(f"{unique}-ok")
    with pytest.raises(ValueError, match="deadline"):
        await client.submit_many([valid, {**request(f"{unique}-far"), "deadline": deadline}])
    assert await r.zcard(f"{unique}-q") == 0
    assert await r.exists(f"request-active:{unique}-ok", f"request-active:{unique}-far") == 0


async def test_a_result_whose_pop_reply_was_lost_is_still_returned(
    redis_server: RedisServer, r: Redis, unique: str
) -> None:
    results = f"{unique}-results"
    await r.lpush(results, Result.http("first", 200, b"1").encode())
    await r.lpush(results, Result.http("second", 200, b"2").encode())
    async with (
        lossy_proxy(redis_server.port) as proxy,
        SortedSetClient(proxy.url, f"{unique}-q", results) as client,
    ):
        await client.result_depth()  # connected: the next reply is the read's
        proxy.lose_next_reply()  # Redis pops "first"; redis-py re-sends the pop
        got = await client.drain_results(3, timeout=1.0)
    assert proxy.replies_lost == 1
    assert sorted(x.id for x in got) == ["first", "second"]
    assert await r.llen(results) == 0
    assert await r.keys(f"*{unique}*processing*") == []  # each removed once handed over


async def test_a_consumer_resumes_what_it_had_moved_but_not_returned(
    redis_url: str, r: Redis, unique: str
) -> None:
    results = f"{unique}-results"
    await r.lpush(results, Result.http("moved", 200, b"1").encode())
    # What a consumer that crashed after its move left behind, under its own name.
    await r.lmove(results, f"{{{results}}}:processing:c1", "RIGHT", "LEFT")
    async with SortedSetClient(redis_url, f"{unique}-q", results, consumer="c1") as client:
        [result] = await client.drain_results(2, timeout=0.3)
    assert result.id == "moved"


async def test_a_drained_result_costs_one_round_trip(
    redis_server: RedisServer, r: Redis, unique: str
) -> None:
    # One move per result, after one look at what the processing list still holds (the
    # removal of the batch before, pipelined with it); the batch goes at the clean exit.
    results = f"{unique}-results"
    await r.lpush(results, *(Result.http(f"r{i}", 200, b"{}").encode() for i in range(20)))
    async with (
        lossy_proxy(redis_server.port) as proxy,
        SortedSetClient(proxy.url, f"{unique}-q", results) as client,
    ):
        await client.result_depth()  # connected
        before = proxy.requests
        got = await client.drain_results(20, timeout=5)
        round_trips = proxy.requests - before
    assert [x.id for x in got] == [f"r{i}" for i in range(20)]
    assert round_trips == 1 + 20
    assert await r.keys(f"*{unique}*processing*") == []


# A consumer that dies (SIGKILL) after its move landed and before the removal ran.
_DIES_BEFORE_REMOVAL = """
import os, signal, sys
import anyio
from redis.asyncio import Redis
from async_processor.client.redis_sortedset import SortedSetClient

def die(self, *args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)

Redis.lrem = die  # also a pipeline's

async def main() -> None:
    url, results = sys.argv[1:]
    async with SortedSetClient(url, "unused", results, consumer="c1") as client:
        await client.drain_results(1, timeout=5)

anyio.run(main)
"""


async def killed_consumer(script: str, redis_url: str, r: Redis, unique: str) -> str:
    """Three results r0..r2 on a list, then ``script`` run as consumer c1 until its
    SIGKILL; returns the list."""
    results = f"{unique}-results"
    await r.lpush(results, *(Result.http(f"r{i}", 200, b"{}").encode() for i in range(3)))
    with anyio.fail_after(30):
        dead = await anyio.run_process(
            [sys.executable, "-c", script, redis_url, results], check=False
        )
    assert dead.returncode == -9
    return results


async def test_a_consumer_killed_between_move_and_removal_loses_nothing(
    redis_url: str, r: Redis, unique: str
) -> None:
    results = await killed_consumer(_DIES_BEFORE_REMOVAL, redis_url, r, unique)
    assert await r.llen(f"{{{results}}}:processing:c1") == 1  # moved, never removed
    async with SortedSetClient(redis_url, f"{unique}-q", results, consumer="c1") as client:
        got = await client.drain_results(4, timeout=0.5)
    assert [x.id for x in got] == ["r0", "r1", "r2"]
    assert await r.keys(f"*{unique}*processing*") == []
    assert await r.llen(results) == 0


# A consumer killed (SIGKILL) while it handles the batch drain_results returned.
_DIES_HANDLING_A_BATCH = """
import os, signal, sys
import anyio
from async_processor.client.redis_sortedset import SortedSetClient

async def main() -> None:
    url, results = sys.argv[1:]
    async with SortedSetClient(url, "unused", results, consumer="c1") as client:
        batch = await client.drain_results(2, timeout=5)
        assert len(batch) == 2
        os.kill(os.getpid(), signal.SIGKILL)

anyio.run(main)
"""


async def test_a_consumer_killed_while_handling_a_drained_batch_gets_it_again(
    redis_url: str, r: Redis, unique: str
) -> None:
    """drain_results is at-least-once: before, it removed its results before returning
    them, so a consumer killed while handling them lost them."""
    results = await killed_consumer(_DIES_HANDLING_A_BATCH, redis_url, r, unique)
    async with SortedSetClient(redis_url, f"{unique}-q", results, consumer="c1") as client:
        again = await client.drain_results(1, timeout=0.5)  # a crash's leftovers come first
        rest = await client.drain_results(5, timeout=0.5)
    assert [x.id for x in [*again, *rest]] == ["r0", "r1", "r2"]
    assert await r.keys(f"*{unique}*processing*") == []


async def test_after_a_failed_removal_the_next_read_returns_that_result_first(
    client: SortedSetClient, r: Redis, unique: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    results = f"{unique}-results"
    await r.lpush(results, *(Result.http(f"r{i}", 200, b"{}").encode() for i in range(3)))
    [first] = await client.drain_results(1, timeout=1)  # the list is known empty after it

    async def fails(self: Pipeline, raise_on_error: bool = True) -> list[object]:
        monkeypatch.undo()
        raise RedisConnectionError("connection lost")

    monkeypatch.setattr(Pipeline, "execute", fails)
    with pytest.raises(TransportError):
        await client.drain_results(1, timeout=1)  # r1 moved, its removal failed
    rest = await client.drain_results(3, timeout=0.5)
    assert [x.id for x in [first, *rest]] == ["r0", "r1", "r2"]
    await client.ack()
    assert await r.keys(f"*{unique}*processing*") == []


@pytest.mark.parametrize(
    "entry",
    [
        b"not json \xff",
        # These raised out of the read (OverflowError, RecursionError): the entry stayed
        # first in the processing list, so a consumer resuming by name crashed again.
        b'{"id": "x", "status_code": 1e999}',
        b"[" * 100_000,
    ],
)
async def test_an_undecodable_result_is_returned_raw_not_dropped(
    client: SortedSetClient, r: Redis, unique: str, entry: bytes
) -> None:
    await r.lpush(f"{unique}-results", entry, Result.http("ok", 200, b"{}").encode())
    first, second = await client.drain_results(2, timeout=2)
    assert isinstance(first, UndecodableResult)
    assert first.raw == entry and first.error.startswith("not a result:")
    assert second.id == "ok" and not isinstance(second, UndecodableResult)
