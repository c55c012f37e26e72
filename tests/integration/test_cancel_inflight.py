"""A cancel reaches a request already at the gateway (docs/architecture.md G14), over real
HTTP and Redis.

The gateway here hangs on the request (as a GPU busy with a long generation would) and
records when its connection closes: the cancel must abort the call within a second,
answer CANCELLED exactly once, and give back the worker slot and the pool gate's permit.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio
import pytest
from aiohttp import web

from async_processor.config import PoolConfig
from async_processor.config.queues import QueueSpec
from async_processor.health import listening
from async_processor.messages import Envelope, Request, Routing
from async_processor.pipeline.cancels import CancelWatch
from async_processor.pipeline.worker import CANCEL_RECHECK
from async_processor.transports.base import Delivery
from async_processor.transports.redis_pubsub import RedisPubSubTransport
from tests.fixtures.inprocess import KEEPS_CANCELLED_CALLS, running, sortedset_config, submit
from tests.integration.test_redis_pubsub import transport_for

pytestmark = pytest.mark.anyio


@dataclass
class HangingGateway:
    """Hangs on ``{"hang": true}`` bodies until the client goes away; answers the rest."""

    url: str = ""
    arrived: dict[str, float] = field(default_factory=dict)
    closed: dict[str, float] = field(default_factory=dict)
    answered: list[str] = field(default_factory=list)

    async def handle(self, request: web.Request) -> web.Response:
        body = json.loads(await request.read())
        name = body["name"]
        self.arrived[name] = time.time()
        if not body.get("hang"):
            self.answered.append(name)
            return web.json_response({"ok": name})
        try:
            await anyio.sleep_forever()
        finally:  # handler_cancellation: cancelled when the connection closes
            self.closed[name] = time.time()
        raise AssertionError("unreachable")


@asynccontextmanager
async def hanging_gateway() -> AsyncIterator[HangingGateway]:
    gateway = HangingGateway()
    app = web.Application()
    app.router.add_post("/v1/completions", gateway.handle)
    async with listening(app, "127.0.0.1", 0, handler_cancellation=True) as port:
        gateway.url = f"http://127.0.0.1:{port}"
        yield gateway


def _req(request_id: str, hang: bool) -> dict[str, Any]:
    payload = {"name": request_id, "hang": hang}
    return {"id": request_id, "deadline": int(time.time() + 120), "payload": payload}


async def _until(predicate: Any, timeout: float = 10.0) -> None:
    with anyio.fail_after(timeout):
        while not predicate():
            await anyio.sleep(0.02)


@KEEPS_CANCELLED_CALLS
async def test_cancel_aborts_the_gateway_call_and_frees_slot_and_permit(
    redis_url: str, unique: str
) -> None:
    # One worker and a pool gate of one permit: the second request runs only if both
    # were given back by the cancelled one.
    pools = [
        PoolConfig(id="p", workers=1, gate_type="local-max-concurrency", gate_params={"limit": 1})
    ]
    async with hanging_gateway() as gateway:
        config = sortedset_config(redis_url, gateway.url, unique, pools=pools)
        async with running(config):
            client = await submit(redis_url, unique, _req("hung", hang=True))
            await _until(lambda: "hung" in gateway.arrived)
            await anyio.sleep(0.5)  # well past the fetch-time and pre-dispatch checks
            cancelled_at = time.time()
            assert await client.cancel(["hung"], queue=unique) == 1
            await _until(lambda: "hung" in gateway.closed, timeout=5)
            [result] = await client.drain_results(1, 5)
            await client.submit(_req("next", hang=False))
            [after] = await client.drain_results(1, 10)
            assert await client.drain_results(1, 1.0) == []  # exactly one result each
    assert gateway.closed["hung"] - cancelled_at < 1.0
    assert (result.id, result.error_code) == ("hung", "CANCELLED")
    assert (after.id, after.status_code, gateway.answered) == ("next", 200, ["next"])


@KEEPS_CANCELLED_CALLS
async def test_a_cancel_while_waiting_for_a_worker_is_answered_without_sending(
    redis_url: str, unique: str
) -> None:
    """The watch covers a message only once a worker holds it; one fetched ahead, waiting
    for the worker, is checked again just before dispatch (``Worker._cancelled``). Else
    a quick gateway answers it before the watch's next round: a 200, not CANCELLED."""
    pools = [PoolConfig(id="p", workers=1)]
    async with hanging_gateway() as gateway:
        config = sortedset_config(redis_url, gateway.url, unique, pools=pools)
        async with running(config):
            client = await submit(
                redis_url, unique, _req("busy", hang=True), _req("queued", hang=False)
            )
            await _until(lambda: "busy" in gateway.arrived)
            with anyio.fail_after(5):  # "queued" is fetched, past the fetch-time check
                while await client.inflight_depth() < 2:
                    await anyio.sleep(0.02)
            await anyio.sleep(CANCEL_RECHECK)  # it waited: the worker asks again
            assert await client.cancel(["queued", "busy"], queue=unique) == 2
            results = await client.drain_results(2, 5)
    assert {r.id: r.error_code for r in results} == {"busy": "CANCELLED", "queued": "CANCELLED"}
    assert "queued" not in gateway.arrived and gateway.answered == []


@KEEPS_CANCELLED_CALLS
async def test_a_cancel_of_another_submission_does_not_cut_this_one(
    redis_url: str, unique: str
) -> None:
    """The marker must hold *this* submission's token: a stale cancel leaves it running."""
    async with hanging_gateway() as gateway:
        config = sortedset_config(redis_url, gateway.url, unique)
        async with running(config):
            client = await submit(redis_url, unique, _req("kept", hang=True))
            await _until(lambda: "kept" in gateway.arrived)
            stale = "0" * 32  # an older submission's token
            await client._redis.set("request-cancel:kept", stale)
            await anyio.sleep(1.0)
            assert "kept" not in gateway.closed
            assert await client.cancel(["kept"], queue=unique) == 1
            [result] = await client.drain_results(1, 5)
    assert result.error_code == "CANCELLED"


def _pubsub_delivery(queue: QueueSpec, request_id: str, token: str) -> Delivery:
    request = Request(id=request_id, deadline=int(time.time()) + 60, payload=b"{}")
    envelope = Envelope(request=request, routing=Routing(request_token=token))
    return Delivery(queue=queue, raw=b"", envelope=envelope)


async def test_redis_pubsub_watch_cancels_only_marked_tokens(redis_url: str, unique: str) -> None:
    transport: RedisPubSubTransport = transport_for(redis_url, unique)
    queue = transport.queues[0]
    marked = _pubsub_delivery(queue, f"{unique}-a", "a" * 32)
    other = _pubsub_delivery(queue, f"{unique}-b", "b" * 32)
    tokenless = _pubsub_delivery(queue, f"{unique}-c", "")
    watch = CancelWatch(transport)
    try:
        await transport._redis.set(f"request-cancel:{unique}-a", "a" * 32)
        await transport._redis.set(f"request-cancel:{unique}-b", "z" * 32)
        await transport._redis.set(f"request-cancel:{unique}-c", "")
        a, b, c = anyio.CancelScope(), anyio.CancelScope(), anyio.CancelScope()
        for delivery, scope in ((marked, a), (other, b), (tokenless, c)):
            watch.add(delivery, scope)
        assert await watch.check() == 1
        assert (a.cancel_called, b.cancel_called, c.cancel_called) == (True, False, False)
        assert await transport.is_cancelled(marked)
    finally:
        await transport.aclose()
