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
from typing import Any

import anyio
import pytest
from aiohttp import web
from redis.asyncio import Redis

from async_processor.client.redis_sortedset import SortedSetClient
from async_processor.config import SortedSetConfig
from async_processor.messages import Result
from async_processor.transports.base import Completion, Deferral
from tests.fixtures.inprocess import metric, running, sortedset_config
from tests.fixtures.servers import free_port
from tests.integration.test_sortedset import future, opened

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
def r(redis_client: Redis) -> Redis:
    return redis_client


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
        for name in ("enqueue_seq", "dispatch_epoch", "x_future"):
            assert field_text(rewritten, name) == field_text(UPSTREAM_ROUTING, name), name
        # Unresolved at its first fetch: the route and its TTL are the queue's now (none),
        # as a Go daemon resolves them (§3).
        assert b'"result_ttl_seconds"' not in rewritten
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


# ------------------------------------------------------------ §5: submission order


def go_score(deadline: int, seq: int) -> float:
    """Upstream's score, as its producer writes it (``%.17g`` of this double)."""
    return deadline + min(seq, 2097151) / 2097152 if seq > 0 else float(deadline)


async def test_the_client_shares_upstreams_counter_field_and_score(redis_url, r, unique) -> None:
    deadline = future()
    counter = f"request-seq:{unique}:{deadline}"
    async with SortedSetClient(redis_url, request_queue=unique) as client:
        await client.submit({"id": "py-1", "deadline": deadline, "payload": {}})
        # A Go producer's submission in between: it takes the next number of the same
        # counter and scores it by the same formula.
        seq = await r.incr(counter)
        await r.zadd(unique, {go_envelope("go-2", deadline, extra=b'"enqueue_seq":%d' % seq):
                              go_score(deadline, seq)})  # fmt: skip
        await client.submit({"id": "py-3", "deadline": deadline, "payload": {}})
    members = await r.zrange(unique, 0, -1, withscores=True)
    ids = [json.loads(m)["data"]["id"] for m, _ in members]
    assert ids == ["py-1", "go-2", "py-3"]
    seqs = [json.loads(m)["internal"].get("enqueue_seq") for m, _ in members]
    assert seqs == [1, 2, 3]
    assert [s for _, s in members] == [go_score(deadline, n) for n in (1, 2, 3)]
    # Upstream's expiry: an hour past the deadline.
    assert abs(await r.expiretime(counter) - (deadline + 3600)) <= 1
    assert not await r.exists(f"{unique}:seq:{deadline}")  # the old counter is not written


async def test_a_hand_back_and_a_retry_keep_their_place_among_equal_deadlines(
    make_config, r, redis_url
) -> None:
    config = make_config()
    q = config.queues[0].queue_name
    deadline = future()
    members = {
        go_envelope(f"m{n}", deadline, extra=b'"enqueue_seq":%d' % n): go_score(deadline, n)
        for n in (1, 2, 3)
    }
    await r.zadd(q, members)
    async with opened(config) as transport:
        first, second = await transport.fetch(transport.queues[0], 2, 0)
        for delivery in (first, second):
            transport.decode(delivery)
        await transport.defer([Deferral(first, 0.0), Deferral(second, 0.05)])
        assert await r.zscore(q, (await r.zrange(q, 0, 0))[0]) == go_score(deadline, 1)
        async with anyio.create_task_group() as tg:  # the retry mover brings m2 back
            await tg.start(transport.run)
            with anyio.fail_after(5):
                while await r.zcard(q) < 3:
                    await anyio.sleep(0.05)
            tg.cancel_scope.cancel()
    back = await r.zrange(q, 0, -1, withscores=True)
    assert [json.loads(m)["data"]["id"] for m, _ in back] == ["m1", "m2", "m3"]
    assert [s for _, s in back] == [go_score(deadline, n) for n in (1, 2, 3)]


async def test_a_hand_back_of_the_current_releases_order_keeps_its_score(make_config, r) -> None:
    config = make_config()
    q = config.queues[0].queue_name
    deadline = future()
    # Written by the current release's client: no enqueue_seq, score deadline + n / 2^20.
    old = {go_envelope(f"o{n}", deadline): deadline + n / 2**20 for n in (1, 2)}
    await r.zadd(q, old)
    async with opened(config) as transport:
        [first] = await transport.fetch(transport.queues[0], 1, 0)
        transport.decode(first)
        await transport.defer([Deferral(first, 0.0)])
    back = await r.zrange(q, 0, -1, withscores=True)
    assert [json.loads(m)["data"]["id"] for m, _ in back] == ["o1", "o2"]
    assert back[0][1] == deadline + 1 / 2**20


# --------------------------------------------------------- §4: payloads stored apart

ODD_PAYLOAD = b'{"z":1,  "a":12345678901234567890,"f":1.10,"s":"caf\\u00e9"}'


def go_payload_envelope(request_id: str, deadline: int, token: str = TOKEN) -> bytes:
    """A Go producer's envelope with ``WithPayloadKeys()``: no ``data.payload``."""
    ref = b'"payload_ref":"request-payload:' + request_id.encode() + b":" + token.encode() + b'"'
    return go_envelope(request_id, deadline, token=token, extra=ref).replace(
        b',"payload":{"model":"m","prompt":"hi","n":1.0}', b""
    )


class Gateway:
    """A gateway that records each body it is sent and answers 200 ``{}``."""

    def __init__(self) -> None:
        self.bodies: dict[str, bytes] = {}

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.read()
        self.bodies[request.headers.get("x-test-id", str(len(self.bodies)))] = body
        return web.json_response({})


@pytest.fixture
async def gateway() -> AsyncIterator[tuple[Gateway, str]]:
    recorder = Gateway()
    app = web.Application()
    app.router.add_route("POST", "/{tail:.*}", recorder.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    try:
        yield recorder, f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def results_by_id(r: Redis, name: str, n: int) -> dict[str, dict[str, Any]]:
    with anyio.fail_after(15):
        while await r.llen(name) < n:
            await anyio.sleep(0.05)
    return {(o := json.loads(raw))["id"]: o for raw in await r.lrange(name, 0, -1)}


async def test_a_stored_payload_is_dispatched_verbatim_and_deleted_with_its_result(
    redis_url, r, unique, gateway
) -> None:
    recorder, url = gateway
    deadline = future()
    await r.set(f"request-payload:stored:{TOKEN}", ODD_PAYLOAD, px=600_000)
    member = go_payload_envelope("stored", deadline).replace(
        b'"data":{', b'"data":{"headers":{"x-test-id":"stored"},'
    )
    await r.zadd(unique, {member: deadline})
    config = sortedset_config(redis_url, url, unique)
    async with running(config):
        results = await results_by_id(r, f"{unique}:results", 1)
    assert recorder.bodies["stored"] == ODD_PAYLOAD
    assert results["stored"]["status_code"] == 200
    assert results["stored"]["request_token"] == TOKEN
    assert not await r.exists(f"request-payload:stored:{TOKEN}")


async def test_a_missing_payload_key_is_one_payload_unavailable_result(
    redis_url, r, unique, gateway
) -> None:
    recorder, url = gateway
    deadline = future()
    await r.zadd(unique, {go_payload_envelope("gone", deadline): deadline})
    config = sortedset_config(redis_url, url, unique)
    async with running(config) as processor:
        results = await results_by_id(r, f"{unique}:results", 1)
        await anyio.sleep(0.3)
    assert await r.llen(f"{unique}:results") == 1
    assert results["gone"]["error_code"] == "PAYLOAD_UNAVAILABLE"
    assert results["gone"]["error_message"] == "request payload is missing"
    assert recorder.bodies == {}  # never sent body-less
    assert metric(processor, "llm_d_async_async_failed_requests_total") == 1


async def test_a_retry_parks_only_the_envelope_and_keeps_the_key(make_config, r) -> None:
    config = make_config()
    q = config.queues[0].queue_name
    deadline = future()
    key = f"request-payload:retried:{TOKEN}"
    await r.set(key, ODD_PAYLOAD, px=600_000)
    await r.zadd(q, {go_payload_envelope("retried", deadline): deadline})
    async with opened(config) as transport:
        [delivery] = await transport.fetch(transport.queues[0], 1, 0)
        transport.decode(delivery)
        assert await transport.load_payloads([delivery]) == [None]
        assert bytes(delivery.envelope.request.payload) == ODD_PAYLOAD
        transport.let_go(delivery)  # as the worker does when it sends the request
        await transport.defer([Deferral(delivery, 30.0)])
    [parked] = await r.zrange(config.retry_queue_name, 0, -1)
    assert b'"payload"' not in parked.replace(b'"payload_ref"', b"")
    assert await r.get(key) == ODD_PAYLOAD


async def test_payloads_are_read_only_for_messages_that_will_be_dispatched(
    redis_url, r, unique, gateway
) -> None:
    """A cancelled message never reads its payload; the others' are read together."""
    recorder, url = gateway
    deadline = future()
    ids = [f"{unique}-p{n}" for n in range(3)]
    for n, request_id in enumerate(ids):
        await r.set(f"request-payload:{request_id}:{TOKEN}", ODD_PAYLOAD, px=600_000)
        await r.zadd(unique, {go_payload_envelope(request_id, deadline + n): deadline + n})
    await r.set(f"request-cancel:{ids[1]}", TOKEN)
    reads: list[str] = []
    config = sortedset_config(redis_url, url, unique, transport_extra={"batch_size": 10})
    async with r.monitor() as monitor, anyio.create_task_group() as tg:

        async def watch() -> None:
            async for command in monitor.listen():
                if unique in command["command"] and "request-payload:" in command["command"]:
                    reads.append(command["command"])

        tg.start_soon(watch)
        await anyio.sleep(0.1)
        async with running(config):
            results = await results_by_id(r, f"{unique}:results", 3)
        await anyio.sleep(0.1)
        tg.cancel_scope.cancel()
    assert results[ids[1]]["error_code"] == "CANCELLED"
    assert len(recorder.bodies) == 2
    gets = [c for c in reads if c.startswith(("MGET", "GET"))]
    assert len(gets) == 1 and gets[0].startswith("MGET"), reads
    assert ids[0] in gets[0] and ids[2] in gets[0] and ids[1] not in gets[0]


async def test_the_clients_payload_key_mode_writes_upstreams_shape(
    redis_url, r, unique, gateway
) -> None:
    recorder, url = gateway
    deadline = future()
    request = {"id": "keyed", "deadline": deadline, "payload": {"z": 1, "a": [1.10, "é"]}}
    async with SortedSetClient(
        redis_url, request_queue=unique, result_queue=f"{unique}:results", payload_keys=True
    ) as client:
        token = await client.submit(request)
    [member] = await r.zrange(unique, 0, -1)
    envelope = json.loads(member)
    key = f"request-payload:keyed:{token}"
    assert envelope["internal"]["payload_ref"] == key
    assert "payload" not in envelope["data"]
    assert json.loads(await r.get(key)) == request["payload"]
    ttl_ms = await r.pttl(key)
    assert (
        (deadline - time.time()) * 1000 + 590_000
        < ttl_ms
        <= (deadline - time.time()) * 1000 + 601_000
    )
    async with running(sortedset_config(redis_url, url, unique)):
        results = await results_by_id(r, f"{unique}:results", 1)
    assert results["keyed"]["status_code"] == 200
    assert json.loads(next(iter(recorder.bodies.values()))) == request["payload"]
    assert not await r.exists(key)


def test_payload_key_mode_is_off_by_default() -> None:
    assert SortedSetClient("redis://127.0.0.1:1/0").payload_keys is False
