"""redis-sortedset lets a message's bytes go once its request is written (issue 13's memory),
against a real redis-server and the simulator over HTTP: while a request waits at the
gateway the daemon holds no copy of the message; a hand-back or a dead letter gets what
it needs back from Redis (``<queue>:claimed``), the payload byte for byte."""

from __future__ import annotations

import gc
import hashlib
import json
import time
import tracemalloc
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager

import anyio
import pytest
from redis.asyncio import Redis
from structlog.testing import capture_logs

from async_processor.config import SortedSetConfig
from async_processor.messages import LET_GO, Result
from async_processor.redis import keys as redis_keys
from async_processor.transports.base import Completion, Deferral, Delivery
from async_processor.transports.redis_sortedset.transport import SortedSetTransport
from tests.fixtures.inprocess import running, sortedset_config, submit
from tests.fixtures.servers import stop_process
from tests.fixtures.simulator import SimulatorProcess, start_simulator
from tests.integration import test_sortedset as sortedset
from tests.integration.test_sortedset import fetch_one, future, opened, results_of

pytestmark = pytest.mark.anyio
# The transport tests' fixtures: a config on this test's queue, a client of its Redis.
make_config, r = sortedset.make_config, sortedset.r
# What the byte-for-byte tests of messages.py guard: key order, a 20-digit integer (no
# double holds it), escapes and a lone surrogate, spacing.
ODD_PAYLOAD = (
    b'{"z": 1, "big": 12345678901234567890, "s": "\\u00e9\\ud800 \\"q\\"",'
    b' "a": [1.0e+2, -0.0], "prompt": "hi"}'
)


def odd_member(request_id: str, deadline: int, token: str = "") -> bytes:
    internal = f'{{"request_token": "{token}"}}' if token else "{}"
    return (
        (
            f'{{"internal": {internal}, "request_kind": "redis", "data": {{"id": "{request_id}",'
            f' "deadline": {deadline}, "payload": '
        ).encode()
        + ODD_PAYLOAD
        + b', "metadata": {"u": "1"}}}'
    )


def let_go(transport: SortedSetTransport, delivery: Delivery) -> None:
    transport.let_go(delivery)
    assert delivery.raw == b""
    assert delivery.envelope is not None and delivery.envelope.request.payload is LET_GO


@asynccontextmanager
async def held_and_let_go(
    config: SortedSetConfig, r: Redis, raw: bytes, deadline: int
) -> AsyncIterator[tuple[SortedSetTransport, Delivery]]:
    """``raw`` queued at ``deadline`` on the config's queue, claimed, and its bytes let go
    as the worker does when its request is written."""
    await r.zadd(config.queues[0].queue_name, {raw: deadline})
    async with opened(config) as transport:
        delivery = await fetch_one(transport)
        let_go(transport, delivery)
        yield transport, delivery


async def test_a_retry_after_the_bytes_were_let_go_is_written_byte_for_byte(make_config, r) -> None:
    config = make_config()
    q = config.queues[0].queue_name
    deadline = future()
    await r.zadd(q, {odd_member("odd", deadline, token="t" * 32): deadline})
    async with opened(config) as transport:
        delivery = await fetch_one(transport)
        assert delivery.envelope is not None
        delivery.envelope.routing.retry_count += 1  # what the worker does for a retry
        delivery.envelope.routing.last_status = 503
        expected = delivery.envelope.encode()  # what the daemon wrote holding the bytes
        let_go(transport, delivery)
        await transport.defer([Deferral(delivery, 30.0)])
    [(written, _)] = await r.zrange(config.retry_queue_name, 0, -1, withscores=True)
    assert written == expected
    assert ODD_PAYLOAD in written
    routing = json.loads(written)["internal"]
    assert (routing["retry_count"], routing["last_status"]) == (1, 503)
    assert await r.zcard(redis_keys.claims_idx_key(q)) == 0
    assert await r.hlen(redis_keys.claimed_key(q)) == 0


async def test_a_hand_back_after_let_go_whose_lease_lapsed_adds_no_second_copy(
    make_config, r
) -> None:
    config = make_config(lease_seconds=0.2)
    q = config.queues[0].queue_name
    deadline = future()
    raw = odd_member("lapsed", deadline)
    async with held_and_let_go(config, r, raw, deadline) as (transport, delivery):
        await anyio.sleep(0.3)
        await transport.reap()  # the member is back on its queue
        with capture_logs() as logs:
            await transport.defer([Deferral(delivery, 0)])
    assert await r.zrange(q, 0, -1) == [raw]
    assert await r.zcard(config.retry_queue_name) == 0
    assert "defer_skipped_lease_lost" in {e["event"] for e in logs}


def look_alike(queue: str, n: int, deadline: int) -> bytes:
    """Bare requests whose first bytes and size are the same: only the id at the end
    differs."""
    prompt = "p" * 256
    text = (
        f'{{"payload": {{"prompt": "{prompt}"}}, "deadline": {deadline}, "id": "{queue}-{n:04}"}}'
    )
    return text.encode()


async def test_a_complete_after_a_lapsed_lease_is_fenced_and_answered_by_the_next_owner(
    make_config, r
) -> None:
    """Its bytes let go and its lease lapsed: the late result writes nothing (upstream's
    fenced ack), the member back on its queue is left alone among its look-alikes, and its
    next owner answers it once."""
    config = make_config(lease_seconds=0.2)
    q = config.queues[0].queue_name
    deadline = future()
    ours = look_alike(q, 150, deadline)
    await r.zadd(q, {ours: deadline})
    async with opened(config) as transport:
        delivery = await fetch_one(transport)
        assert delivery.raw == ours
        alikes = {look_alike(q, n, deadline): deadline for n in range(20) if n != 150}
        await r.zadd(q, alikes)
        let_go(transport, delivery)
        await anyio.sleep(0.3)
        await transport.reap()
        assert await r.zscore(q, ours) == deadline  # back on its queue
        await transport.complete([Completion(delivery, Result.http(f"{q}-0150", 200, b"{}"))])
        assert await r.zscore(q, ours) == deadline and await r.zcard(q) == len(alikes) + 1
        assert await r.llen(config.result_queue_name) == 0
        await r.zrem(q, *alikes)
        again = await fetch_one(transport)
        await transport.complete([Completion(again, Result.http(f"{q}-0150", 200, b"{}"))])
    assert await r.zcard(q) == 0
    assert [x.id for x in await results_of(r, config.result_queue_name)] == [f"{q}-0150"]


async def test_a_dead_letter_after_let_go_holds_the_raw_message(make_config, r) -> None:
    config = make_config()
    q = config.queues[0].queue_name
    deadline = future()
    raw = odd_member("parked", deadline)
    async with held_and_let_go(config, r, raw, deadline) as (transport, delivery):
        await transport.dead_letter(delivery, "malformed", "parked after its request went out")
    [entry] = [json.loads(e) for e in await r.lrange(redis_keys.dead_letter_key(q), 0, -1)]
    assert entry["raw"] == raw.decode()
    assert entry["sha1"] == hashlib.sha1(raw).hexdigest()
    assert await r.zcard(redis_keys.claims_idx_key(q)) == 0


@pytest.fixture
def slow_simulator() -> Iterator[SimulatorProcess]:
    handle = start_simulator("--latency", "60")
    yield handle
    stop_process(handle.proc)


def big_request(request_id: str, payload_bytes: int) -> dict[str, object]:
    payload = {"prompt": "x" * payload_bytes, "big": 12345678901234567890}
    return {"id": request_id, "deadline": int(time.time() + 120), "payload": payload}


def blocks_of(size: int) -> int:
    """Allocations alive of at least ``size`` bytes (a message's bytes are one)."""
    gc.collect()
    return sum(1 for trace in tracemalloc.take_snapshot().traces if trace.size >= size)


async def test_a_request_at_the_gateway_holds_no_copy_of_its_message(
    redis_url: str, unique: str, slow_simulator: SimulatorProcess
) -> None:
    # The message (~1 MiB here) is one allocation in this process from the claim until
    # the request is written; while the gateway works on it none of its size is alive.
    # Then the attempt times out (2 s): the retry is written from Redis, the payload byte
    # for byte, with its retry count.
    size = 1 << 20
    config = sortedset_config(
        redis_url, slow_simulator.url, unique, concurrency=1, request_timeout="2s"
    )
    tracemalloc.start()
    try:
        async with running(config) as processor:
            transport = processor.transport
            assert isinstance(transport, SortedSetTransport)
            before = blocks_of(size)
            await (await submit(redis_url, unique, big_request("big", size))).aclose()
            with anyio.fail_after(10):
                while slow_simulator.stats()["in_flight"] < 1:
                    await anyio.sleep(0.05)
            [held] = list(transport._claims.all_held())
            assert held.raw == b""
            assert blocks_of(size) == before
            with anyio.fail_after(10):
                while not await _retry_members(redis_url, unique):
                    await anyio.sleep(0.05)
    finally:
        tracemalloc.stop()
    [member] = await _retry_members(redis_url, unique)
    envelope = json.loads(member)
    assert envelope["internal"]["retry_count"] == 1
    assert envelope["data"]["payload"] == big_request("big", size)["payload"]
    assert b'"big":12345678901234567890}' in member


async def _retry_members(url: str, queue: str) -> list[bytes]:
    client = Redis.from_url(url)
    try:
        return list(await client.zrange(f"{queue}:retry", 0, -1))
    finally:
        await client.aclose()


async def test_a_retry_whose_lease_entry_is_gone_ends_as_one_failure_result(
    redis_url: str, unique: str, slow_simulator: SimulatorProcess
) -> None:
    # The lease hash (the only copy of the bytes while the request is at the gateway) is
    # deleted, e.g. evicted, with the claim still held; then the attempt times out (2 s).
    # The retry cannot be written: the message ends as one failure result, not in silence.
    config = sortedset_config(
        redis_url, slow_simulator.url, unique, concurrency=1, request_timeout="2s"
    )
    client = Redis.from_url(redis_url)
    try:
        async with running(config):
            await (await submit(redis_url, unique, big_request("evicted", 64))).aclose()
            with anyio.fail_after(10):
                while slow_simulator.stats()["in_flight"] < 1:
                    await anyio.sleep(0.05)
            assert await client.delete(redis_keys.claimed_key(unique)) == 1
            with capture_logs() as logs, anyio.fail_after(10):
                while not await client.llen(f"{unique}:results"):
                    await anyio.sleep(0.05)
        [result] = await results_of(client, f"{unique}:results")
        assert (result.id, result.error_code) == ("evicted", "INFERENCE_ERROR")
        assert result.error_message == "message bytes lost from the lease; cannot retry"
        for key in (unique, f"{unique}:retry", redis_keys.claims_idx_key(unique)):
            assert await client.zcard(key) == 0
        events = {e["event"] for e in logs}
        assert "message_bytes_lost" in events
        assert "defer_skipped_lease_lost" not in events
    finally:
        await client.aclose()


async def test_a_dead_letter_whose_lease_entry_is_gone_ends_as_one_failure_result(
    make_config, r
) -> None:
    config = make_config()
    q = config.queues[0].queue_name
    deadline = future()
    async with held_and_let_go(config, r, odd_member("gone", deadline), deadline) as (
        transport,
        delivery,
    ):
        await r.delete(redis_keys.claimed_key(q))
        with capture_logs() as logs:
            await transport.dead_letter(delivery, "malformed", "parked after its request went out")
    [result] = await results_of(r, config.result_queue_name)
    assert (result.id, result.error_code) == ("gone", "INFERENCE_ERROR")
    assert await r.llen(redis_keys.dead_letter_key(q)) == 0
    assert await r.zcard(redis_keys.claims_idx_key(q)) == 0
    assert "dead_letter_skipped_lease_lost" not in {e["event"] for e in logs}
