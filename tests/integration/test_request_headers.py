"""Headers the daemon adds for the router, on the wire: the in-process pipeline with a real
redis-server and the simulator over HTTP (what it recorded of each request)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web

from async_processor.durations import parse_duration
from async_processor.headers import INFERENCE_TTL_HEADER
from tests.fixtures.inprocess import running, sortedset_config, submit
from tests.fixtures.simulator import SimulatorProcess

pytestmark = pytest.mark.anyio


def _req(request_id: str, ttl: float = 600, **extra: Any) -> dict[str, Any]:
    return {"id": request_id, "deadline": int(time.time() + ttl), "payload": {"p": 1}, **extra}


def _sent(simulator: SimulatorProcess, request_id: str) -> dict[str, str]:
    [seen] = [r for r in simulator.requests() if r["headers"].get("x-test-id") == request_id]
    headers: dict[str, str] = seen["headers"]
    return headers


@pytest.mark.parametrize("enabled", [True, False])
async def test_inference_ttl_is_the_time_left_in_go_syntax(
    redis_url: str, unique: str, simulator: SimulatorProcess, enabled: bool
) -> None:
    config = sortedset_config(redis_url, simulator.url, unique, inference_ttl_header=enabled)
    request = _req("t1", ttl=3700, headers={"x-test-id": "t1"})
    async with running(config):
        client = await submit(redis_url, unique, request)
        [result] = await client.drain_results(1, 20)
        answered = time.time()
    assert result.status_code == 200
    sent = {k.lower(): v for k, v in _sent(simulator, "t1").items()}
    if not enabled:  # off by default, as upstream sends nothing
        assert INFERENCE_TTL_HEADER not in sent
        return
    text = sent[INFERENCE_TTL_HEADER]
    # Go's Duration.String: hours and minutes written out, at most milliseconds.
    assert text.startswith("1h0m") or text.startswith("1h1m"), text
    left = parse_duration(text)
    assert request["deadline"] - answered - 1 <= left <= request["deadline"] - time.time() + 20


async def test_a_caller_may_not_set_the_ttl_when_the_daemon_does(
    redis_url: str, unique: str, simulator: SimulatorProcess
) -> None:
    config = sortedset_config(redis_url, simulator.url, unique, inference_ttl_header=True)
    request = _req("t2", headers={"X-LLM-D-Inference-TTL": "100h"})
    async with running(config):
        client = await submit(redis_url, unique, request)
        [result] = await client.drain_results(1, 20)
    assert result.error_code == "INVALID_REQUEST"


@pytest.fixture
async def raw_gateway() -> AsyncIterator[tuple[str, list[list[tuple[bytes, bytes]]]]]:
    """A gateway that keeps each request's header names as they came on the wire (the
    simulator's aiohttp parser spells well-known names its own way)."""
    heads: list[list[tuple[bytes, bytes]]] = []

    async def answer(request: web.Request) -> web.Response:
        heads.append(list(request.raw_headers))
        return web.json_response({"ok": True})

    app = web.Application()
    app.router.add_post("/{tail:.*}", answer)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    yield f"http://127.0.0.1:{runner.addresses[0][1]}", heads
    await runner.cleanup()


@pytest.mark.parametrize("spelling", ["content-type", "CONTENT-TYPE", "Content-Type"])
async def test_one_canonical_content_type_reaches_the_gateway(
    redis_url: str,
    unique: str,
    raw_gateway: tuple[str, list[list[tuple[bytes, bytes]]]],
    spelling: str,
) -> None:
    # The caller's variant overrides the default but goes out as one "Content-Type"
    # (upstream #494), not under the caller's spelling nor next to the default.
    url, heads = raw_gateway
    request = _req("c1", headers={spelling: "application/json; x=1"})
    async with running(sortedset_config(redis_url, url, unique)):
        client = await submit(redis_url, unique, request)
        [result] = await client.drain_results(1, 20)
    assert result.status_code == 200
    [head] = heads
    assert [(k, v) for k, v in head if k.lower() == b"content-type"] == [
        (b"Content-Type", b"application/json; x=1")
    ]
