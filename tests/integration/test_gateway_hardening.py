"""The gateway request is the daemon's (docs/architecture.md G10), over real HTTP and a real
redis-server.

A small aiohttp gateway records what reaches it: hostile message headers, redirects and
endpoints that climb out of the base path must be refused before anything is sent (or,
for a redirect, the 3xx is the result and its target is never asked).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web
from redis.asyncio import Redis

from async_processor.client.redis_sortedset import SortedSetClient
from async_processor.config import MergePolicyConfig
from async_processor.health import listening
from async_processor.messages import Envelope, Request, Result, Routing
from tests.fixtures.inprocess import metric, running, sortedset_config, submit
from tests.fixtures.scripted_gateway import Script, scripted_gateway

TEXT = b'{"choices":[{"text":'  # 20 bytes: chunk size 14

pytestmark = pytest.mark.anyio


@dataclass
class Gateway:
    url: str = ""
    hits: Counter[str] = field(default_factory=Counter)
    headers: dict[str, dict[str, str]] = field(default_factory=dict)


@pytest.fixture
async def gateway() -> AsyncIterator[Gateway]:
    state = Gateway()

    async def record(request: web.Request) -> web.StreamResponse:
        await request.read()
        state.hits[request.path] += 1
        request_id = request.headers.get("x-test-id", "")
        # Names lower-cased: clients send them in different letter cases (pyreqwest: Title-Case).
        state.headers[request_id] = {k.lower(): v for k, v in request.headers.items()}
        if request.path.startswith("/redirect/"):
            # Another host name for the same server: a followed redirect would land here.
            target = f"http://localhost:{request.url.port}/stolen"
            raise web.HTTPTemporaryRedirect(target)
        return web.json_response({"ok": True})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", record)
    async with listening(app, "127.0.0.1", 0) as port:
        state.url = f"http://127.0.0.1:{port}"
        yield state


def _req(request_id: str, **extra: Any) -> dict[str, Any]:
    return {"id": request_id, "deadline": int(time.time() + 60), "payload": {"p": 1}, **extra}


async def _results(
    redis_url: str,
    queue: str,
    base: str,
    *requests: dict[str, Any],
    merge: MergePolicyConfig | None = None,
) -> dict[str, Result]:
    config = sortedset_config(redis_url, base, queue)
    if merge is not None:
        config = config.model_copy(update={"merge_policy": merge})
    async with running(config):
        client = await submit(redis_url, queue, *requests)
        results = await client.drain_results(len(requests), 20)
        await client.aclose()
    return {r.id: r for r in results}


HOSTILE = {
    "host": {"Host": "admin.internal"},
    "content-length": {"Content-Length": "2"},
    "transfer-encoding": {"Transfer-Encoding": "chunked"},
    "connection": {"Connection": "close"},
    "upgrade": {"Upgrade": "websocket"},
    "te": {"TE": "trailers"},
    "trailer": {"Trailer": "X-A"},
    "keep-alive": {"Keep-Alive": "timeout=5"},
    "expect": {"Expect": "100-continue"},  # aiohttp held the body back for a 100 Continue
    "proxy": {"Proxy-Authorization": "Basic eA=="},
    "deadline": {"X-Request-Deadline": "9999999999"},
    "objective": {"x-gateway-inference-objective": "critical"},
    "objective-llmd": {"X-LLM-D-Inference-Objective": "critical"},
    "priority": {"x-gateway-priority": "100"},
    "fairness": {"X-LLM-D-Inference-Fairness-Id": "someone-else"},
}


async def test_hostile_headers_are_invalid_request_and_never_sent(
    redis_url: str, unique: str, gateway: Gateway
) -> None:
    requests = [_req(name, headers={**h, "x-test-id": name}) for name, h in HOSTILE.items()]
    requests.append(_req("fine", headers={"X-Tenant": "t1", "x-test-id": "fine"}))
    results = await _results(redis_url, unique, gateway.url, *requests)
    for name in HOSTILE:
        assert results[name].error_code == "INVALID_REQUEST", name
        assert "set by the daemon" in results[name].error_message
    assert results["fine"].status_code == 200
    assert list(gateway.headers) == ["fine"]  # nothing hostile went out
    assert gateway.headers["fine"]["host"] == gateway.url.removeprefix("http://")


async def test_headers_the_merge_policy_is_configured_to_stamp_are_refused_too(
    redis_url: str, unique: str, gateway: Gateway
) -> None:
    # No "userid" in metadata, so no fairness header is stamped on these messages: the
    # configured name is the daemon's all the same.
    merge = MergePolicyConfig(
        type="tier-priority",
        parameters={"fairness_header": "x-my-tenant", "priority_header": "x-my-priority"},
    )
    requests = [
        _req("tenant", headers={"X-My-Tenant": "someone-else"}),
        _req("priority", headers={"x-my-priority": "0"}),
        _req("fine", headers={"x-test-id": "fine"}),
    ]
    results = await _results(redis_url, unique, gateway.url, *requests, merge=merge)
    assert results["tenant"].error_code == results["priority"].error_code == "INVALID_REQUEST"
    assert results["fine"].status_code == 200
    assert list(gateway.headers) == ["fine"]
    assert gateway.headers["fine"]["x-my-priority"] != "0"


async def test_a_message_cannot_give_itself_a_gates_classification(
    redis_url: str, unique: str, gateway: Gateway
) -> None:
    # "classification" is a redis-quota verdict. A producer's own
    # internal.labels.classification = "reserved" stood when no quota gate judged the
    # message (none configured, or no quota attribute in its metadata): it jumped into the
    # reserved lanes, ahead of all overflow work, with x-gateway-priority 0, and would WAIT
    # under tier-priority-admission where its peers are refused.
    config = sortedset_config(redis_url, gateway.url, unique)
    merge = MergePolicyConfig(
        type="tier-priority", parameters={"priority_header": "x-gateway-priority"}
    )
    config = config.model_copy(update={"merge_policy": merge})
    deadline = int(time.time() + 60)
    request = Request(id="forged", deadline=deadline, payload=b"{}", headers={"x-test-id": "f"})
    labels = {"classification": "reserved", "tier": "interactive"}
    forged = Envelope(request, Routing(labels=labels), kind="redis").encode()
    async with running(config), SortedSetClient(redis_url, unique, f"{unique}:results") as client:
        admin = Redis.from_url(redis_url)
        await admin.zadd(unique, {forged: deadline})
        await admin.aclose()
        [result] = await client.drain_results(1, 20)
    assert result.status_code == 200
    # The message's own tier stands (the queue sets none): overflow-interactive.
    assert gateway.headers["f"]["x-gateway-priority"] == "3"


async def test_a_redirect_is_the_result_and_never_followed(
    redis_url: str, unique: str, gateway: Gateway
) -> None:
    request = _req("r", headers={"Authorization": "Bearer tenant-secret"})
    results = await _results(redis_url, unique, gateway.url + "/redirect", request)
    assert results["r"].status_code == 307
    assert gateway.hits == {"/redirect/v1/completions": 1}  # /stolen never asked


@pytest.mark.parametrize(
    "endpoint",
    [
        "../admin",
        "/v1/../../admin",
        "%2e%2e/admin",
        "/v1/%2E%2E/%2e%2e/admin",
        "..%2fadmin",
        "%252e%252e/admin",
    ],
)
async def test_endpoint_cannot_climb_out_of_the_base_path(
    redis_url: str, unique: str, gateway: Gateway, endpoint: str
) -> None:
    requests = [_req("out", endpoint=endpoint), _req("in", endpoint="/v1/x/../chat")]
    results = await _results(redis_url, unique, gateway.url + "/api", *requests)
    assert results["out"].error_code == "INVALID_REQUEST"
    assert "leaves the base path '/api'" in results["out"].error_message
    assert results["in"].status_code == 200
    assert gateway.hits == {"/api/v1/chat": 1}


async def test_an_endpoint_with_a_control_character_is_refused(
    redis_url: str, unique: str, gateway: Gateway
) -> None:
    """Clients drop a tab or line end from a URL: ``/.\t./`` went out as ``/../``."""
    requests = [_req("tab", endpoint="/v1/.\t./.\t./admin"), _req("lf", endpoint="/.\n./x")]
    results = await _results(redis_url, unique, gateway.url + "/api", *requests)
    for name in ("tab", "lf"):
        assert results[name].error_code == "INVALID_REQUEST"
        assert "control character" in results[name].error_message
    assert not gateway.hits


async def test_a_cut_short_answer_is_retried_never_a_result(redis_url: str, unique: str) -> None:
    """Finding 1 of issue 31 end to end: ``chunked `` (a trailing space), one chunk, a
    close. The attempt is no answer (counted by reason) and the retry's whole answer is
    the result."""
    cut = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked \r\n\r\n14\r\n" + TEXT + b"\r\n"
    whole = b'HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 11\r\n\r\n{"ok":true}'
    async with scripted_gateway() as scripted:
        scripted.play(Script((cut,), "close"))
        scripted.play(Script((whole,)))
        config = sortedset_config(redis_url, scripted.url.removesuffix("/v1/completions"), unique)
        async with running(config) as processor:
            client = await submit(redis_url, unique, _req("r"))
            (result,) = await client.drain_results(1, 20)
            await client.aclose()
            cut_short = metric(
                processor, "llm_d_async_async_gateway_no_answer_total", reason="cut_short"
            )
    assert (result.status_code, result.payload) == (200, '{"ok":true}')
    assert cut_short == 1
