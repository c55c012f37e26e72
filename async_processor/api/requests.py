"""Single async requests: ``POST /v1/<endpoint>`` queued as one message, its answer kept
for ``GET /v1/requests/{id}`` (or waited for), ``DELETE`` to cancel.

Stage: the API's HTTP edge, for one request at a time. Input: an OpenAI request body
and ``X-AP-Mode`` (``enqueue``: 202 and the id; ``wait``, the default: the gateway's
answer, or 202 after ``X-Request-Timeout-Seconds``; ``direct``: proxied now, ``direct``),
``X-Request-Id`` (the same id twice is one request). Output: a queue message
``areq:<tenant>:<id>`` (the tenant as ``metadata.userid``), and the request's record,
which the collector completes once.
"""

from __future__ import annotations

import re
import time
from typing import Any

import anyio
from aiohttp import web

from async_processor.api import direct, keys
from async_processor.api.context import context, owned, tenant
from async_processor.api.errors import ApiError, not_found
from async_processor.api.store import loads
from async_processor.messages import Request

DEADLINE_SECONDS = 24 * 3600  # a queued request's deadline (its result is kept as long)
WAIT_SECONDS, MAX_WAIT_SECONDS = 60.0, 600.0
POLL = 0.05  # seconds between looks while a caller waits
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._-]{1,128}$")
MODES = ("wait", "enqueue", "direct")
DIRECT_IDLE_SECONDS = 600.0  # direct: the longest wait for the gateway's next bytes


def request_object(record: dict[str, str]) -> dict[str, Any]:
    return {
        "id": record["id"],
        "object": "request",
        "endpoint": record["endpoint"],
        "status": record["status"],
        "created_at": int(record["created_at"]),
        "completed_at": int(record["completed_at"]) if record.get("completed_at") else None,
        "response": loads(record.get("response"), None),
        "error": loads(record.get("error"), None),
    }


async def create_request(request: web.Request) -> web.StreamResponse:
    ctx, owner = context(request), tenant(request)
    endpoint = request.path
    if endpoint not in ctx.endpoints:
        raise not_found("endpoint", endpoint)
    mode = request.headers.get("X-AP-Mode", "wait").lower()
    if mode not in MODES:
        raise ApiError(400, f"X-AP-Mode must be one of {', '.join(MODES)}", param="X-AP-Mode")
    if mode == "direct":
        return await _direct(request, owner)
    wait = _wait_seconds(request, WAIT_SECONDS) if mode == "wait" else 0.0
    request_id = request.headers.get("X-Request-Id") or keys.new_id("req_")
    if not _REQUEST_ID.match(request_id):
        raise ApiError(400, "X-Request-Id: 1-128 of [A-Za-z0-9._-]", param="X-Request-Id")
    body = await request.read()
    _check_body(body)
    now = int(time.time())
    message = Request(
        id=keys.request_message_id(owner, request_id),
        deadline=now + DEADLINE_SECONDS,
        payload=body,
        created=now,
        metadata={"userid": owner},
        endpoint=endpoint,
    )
    record: dict[str, str | int] = {"id": request_id, "tenant": owner, "endpoint": endpoint,
                                    "status": "queued", "created_at": now}  # fmt: skip
    if await ctx.store.new_request(owner, request_id, record, DEADLINE_SECONDS):
        assert ctx.client is not None  # set before the app serves
        await ctx.client.submit_each(
            [message], queue=ctx.queue, result_queue=keys.result_list(ctx.queue)
        )
    return await _answer(request, owner, request_id, wait)


async def _direct(request: web.Request, owner: str) -> web.StreamResponse:
    ctx = context(request)
    if ctx.session is None or not ctx.gateway:
        raise ApiError(
            400, "X-AP-Mode: direct is not enabled (no --gateway-url)", param="X-AP-Mode"
        )
    body = await request.read()
    _check_body(body, streaming=True)
    idle = _wait_seconds(request, DIRECT_IDLE_SECONDS)
    return await direct.proxy(request, ctx.session, ctx.gateway, body, owner, idle)


def _wait_seconds(request: web.Request, default: float) -> float:
    text = request.headers.get("X-Request-Timeout-Seconds", str(default))
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not 0 <= seconds <= MAX_WAIT_SECONDS:
        raise ApiError(
            400, "X-Request-Timeout-Seconds: 0 to 600", param="X-Request-Timeout-Seconds"
        )
    return seconds


def _check_body(body: bytes, streaming: bool = False) -> None:
    """A JSON object with a model; ``stream: true`` only where it can be streamed back."""
    import msgspec

    try:
        parsed = msgspec.json.decode(body)
    except (msgspec.DecodeError, RecursionError):
        raise ApiError(400, "The body must be a JSON object.") from None
    if not isinstance(parsed, dict) or not isinstance(parsed.get("model"), str):
        raise ApiError(400, "The body must be a JSON object with a model.", param="model")
    if parsed.get("stream") is True and not streaming:
        raise ApiError(400, "stream: true is not supported for queued requests", param="stream")


async def _answer(
    request: web.Request, owner: str, request_id: str, wait: float
) -> web.StreamResponse:
    """The gateway's answer once the request has one (within ``wait`` s), else 202."""
    store = context(request).store
    end = time.monotonic() + wait
    while True:
        record = await store.request(owner, request_id)
        if record is None:  # expired between create and now
            raise not_found("request", request_id)
        if record["status"] != "queued" or time.monotonic() >= end:
            break
        await anyio.sleep(POLL)
    response = loads(record.get("response"), None)
    if not wait or response is None:
        status = 202 if record["status"] == "queued" else 200
        return web.json_response(request_object(record), status=status)
    status, body = int(response["status_code"]), response["body"]
    if isinstance(body, str):  # the gateway's answer was not JSON: as it came
        return web.Response(text=body, status=status)
    return web.json_response(body, status=status)


async def get_request(request: web.Request) -> web.Response:
    record = await owned(request, "request")
    return web.json_response(request_object(record))


async def cancel_request(request: web.Request) -> web.Response:
    ctx, record = context(request), await owned(request, "request")
    if record["status"] == "queued":
        assert ctx.client is not None
        await ctx.client.cancel(
            [keys.request_message_id(record["tenant"], record["id"])], queue=ctx.queue
        )
        error = {"code": "cancelled", "message": "The request was cancelled."}
        await ctx.store.finish_request(record["tenant"], record["id"], "cancelled", None, error)
        record = await owned(request, "request")
    return web.json_response(request_object(record))


def add_routes(app: web.Application, endpoints: tuple[str, ...]) -> None:
    for endpoint in endpoints:
        app.router.add_post(endpoint, create_request)
    app.router.add_get("/v1/requests/{request_id}", get_request)
    app.router.add_delete("/v1/requests/{request_id}", cancel_request)
