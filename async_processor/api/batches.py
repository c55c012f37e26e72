"""The Batches API: create (idempotent), get, list, cancel, and the Batch object.

Stage: the API's HTTP edge. Input: JSON bodies and batch ids. Output: OpenAI Batch
objects, and the batch's record in the store, where ``runner`` takes it over.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Mapping
from typing import Any

from aiohttp import web

from async_processor.api import keys
from async_processor.api.context import Context, context, owned, tenant
from async_processor.api.errors import ApiError, not_found
from async_processor.api.files import DEFAULT_EXPIRY_SECONDS, expiry_seconds
from async_processor.api.listing import page
from async_processor.api.store import as_int, loads
from async_processor.durations import parse_duration

MAX_WINDOW_SECONDS = 30 * 24 * 3600
MAX_METADATA_KEYS = 16
TIMESTAMPS = (
    "in_progress_at",
    "expires_at",
    "finalizing_at",
    "completed_at",
    "failed_at",
    "expired_at",
    "cancelling_at",
    "cancelled_at",
)
CANCELLABLE = ("validating", "in_progress")
ORDERS = ("arrival", "input")


def batch_object(r: Mapping[str, str]) -> dict[str, Any]:
    errors = loads(r.get("errors"), None)
    return {
        "id": r["id"],
        "object": "batch",
        "endpoint": r["endpoint"],
        "errors": {"object": "list", "data": errors} if errors else None,
        "input_file_id": r["input_file_id"],
        "completion_window": r["completion_window"],
        "status": r["status"],
        "output_file_id": r.get("output_file_id") or None,
        "error_file_id": r.get("error_file_id") or None,
        "created_at": int(r["created_at"]),
        **{name: int(r[name]) if r.get(name) else None for name in TIMESTAMPS},
        "request_counts": {
            "total": as_int(r, "total"),
            "completed": as_int(r, "completed"),
            "failed": as_int(r, "failed"),
        },
        "usage": {
            "input_tokens": as_int(r, "input_tokens"),
            "input_tokens_details": {"cached_tokens": as_int(r, "cached_tokens")},
            "output_tokens": as_int(r, "output_tokens"),
            "output_tokens_details": {"reasoning_tokens": as_int(r, "reasoning_tokens")},
            "total_tokens": as_int(r, "total_tokens"),
        },
        "metadata": loads(r.get("metadata"), None),
        "model": r.get("model") or None,
    }


async def create_batch(request: web.Request) -> web.Response:
    ctx, owner = context(request), tenant(request)
    body = await _json_body(request)
    body_claim = keys.idempotency_key(owner, digest("body", json.dumps(body, sort_keys=True)))
    if request.headers.get("x-stainless-retry-count", "0") not in ("", "0"):
        earlier = await ctx.store.claimed(body_claim)
        if earlier is not None and (found := await ctx.store.batch_for(owner, earlier)):
            return web.json_response(batch_object(found))
    record = await new_record(ctx, owner, body)
    claims = []
    if key := request.headers.get("Idempotency-Key"):
        claims.append(keys.idempotency_key(owner, digest("key", key)))
    batch_id = await create(ctx, record, claims)
    await ctx.store.remember_body(body_claim, batch_id)
    found = await ctx.store.batch_for(owner, batch_id)
    if found is None:  # the batch an idempotency key named is gone (expired meanwhile)
        raise ApiError(409, "The batch for this Idempotency-Key no longer exists.")
    return web.json_response(batch_object(found))


async def create(ctx: Context, record: dict[str, str | int], claims: list[str]) -> str:
    """Keep the batch if its tenant has room under its caps (else 429); an idempotency
    claim that names a batch already gives that one back (and this one's place)."""
    owner, batch_id = str(record["tenant"]), str(record["id"])
    for claim in claims:  # a repeat of a made batch is no new batch: no cap applies
        if (held := await ctx.store.claimed(claim)) is not None:
            return held
    await ctx.guard.take_batch_place(
        owner, batch_id, int(record["created_at"]), int(record["file_lines"])
    )
    try:
        made = await ctx.store.create_batch(record, claims)
    except BaseException:
        await ctx.guard.release(owner, batch_id)
        raise
    if made != batch_id:
        await ctx.guard.release(owner, batch_id)
    return made


def digest(kind: str, text: str) -> str:
    return hashlib.sha256(f"{kind}:{text}".encode()).hexdigest()


async def _json_body(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except ValueError:
        raise ApiError(400, "The body must be a JSON object.") from None
    if not isinstance(body, dict):
        raise ApiError(400, "The body must be a JSON object.")
    return body


async def new_record(ctx: Context, owner: str, body: dict[str, Any]) -> dict[str, str | int]:
    input_file_id = body.get("input_file_id")
    if not isinstance(input_file_id, str) or not input_file_id:
        raise ApiError(400, "input_file_id is required", param="input_file_id")
    if (upload := await ctx.store.file(owner, input_file_id)) is None:
        raise not_found("file", input_file_id)
    endpoint = body.get("endpoint")
    if endpoint not in ctx.endpoints:
        raise ApiError(400, f"endpoint must be one of {', '.join(ctx.endpoints)}", param="endpoint")
    window = body.get("completion_window")
    seconds = _window_seconds(window)
    now = int(time.time())
    return {
        "id": keys.new_id(keys.BATCH_PREFIX),
        "tenant": owner,
        "input_file_id": input_file_id,
        "endpoint": str(endpoint),
        "completion_window": str(window),
        "status": "validating",
        "created_at": now,
        "expires_at": now + seconds,
        "deadline": now + seconds,
        "metadata": json.dumps(_metadata(body.get("metadata"))),
        "output_expires_seconds": _output_expiry(body.get("output_expires_after")),
        "sealed": 0,
        "submitted": 0,
        "file_lines": as_int(upload, "lines"),  # its queued lines until validation counts
        "output_order": _output_order(body, ctx.output_order),
    }


def _output_order(body: dict[str, Any], default: str) -> str:
    """``arrival`` or ``input``: the body's ``output_order`` (the SDK's ``extra_body``),
    else its metadata's, else the server's ``--output-order``."""
    metadata = body.get("metadata")
    given = body.get("output_order")
    if given is None and isinstance(metadata, dict):
        given = metadata.get("output_order")
    if given is None:
        return default
    if given not in ORDERS:
        raise ApiError(400, "output_order must be arrival or input", param="output_order")
    return str(given)


def _output_expiry(policy: object) -> int:
    """Seconds from the batch's creation its output files are kept (default 30 days)."""
    if policy is None:
        return DEFAULT_EXPIRY_SECONDS
    if not isinstance(policy, dict):
        raise ApiError(400, "output_expires_after must be an object", param="output_expires_after")
    return expiry_seconds(policy.get("anchor"), policy.get("seconds"), "output_expires_after")


def _window_seconds(window: object) -> int:
    try:
        seconds = parse_duration(window) if isinstance(window, str) else 0.0
    except ValueError:
        seconds = 0.0
    if not 1 <= seconds <= MAX_WINDOW_SECONDS:
        raise ApiError(
            400,
            "completion_window must be 24h (or a duration up to 720h)",
            param="completion_window",
        )
    return int(seconds)


def _metadata(metadata: object) -> dict[str, str] | None:
    if metadata is None:
        return None
    if (
        not isinstance(metadata, dict)
        or len(metadata) > MAX_METADATA_KEYS
        or not all(isinstance(k, str) and len(k) <= 64 for k in metadata)
        or not all(isinstance(v, str) and len(v) <= 512 for v in metadata.values())
    ):
        raise ApiError(
            400, "metadata: up to 16 string keys (<= 64) and values (<= 512)", param="metadata"
        )
    return dict(metadata)


async def get_batch(request: web.Request) -> web.Response:
    return web.json_response(batch_object(await owned(request, "batch")))


async def cancel_batch(request: web.Request) -> web.Response:
    record = await owned(request, "batch")
    store = context(request).store
    moved = await store.transition(record["id"], "cancelling", CANCELLABLE, int(time.time()))
    record = await owned(request, "batch")
    if not moved and record["status"] not in ("cancelling", "cancelled"):
        raise ApiError(409, f"Cannot cancel a batch with status {record['status']}.")
    return web.json_response(batch_object(record))


async def list_batches(request: web.Request) -> web.Response:
    ctx, owner = context(request), tenant(request)

    async def render(batch_id: str) -> dict[str, Any] | None:
        record = await ctx.store.batch_for(owner, batch_id)
        return None if record is None else batch_object(record)

    return await page(ctx.store, keys.batches_index(owner), request.query, render, (20, 100))


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/batches", create_batch)
    app.router.add_get("/v1/batches", list_batches)
    app.router.add_get("/v1/batches/{batch_id}", get_batch)
    app.router.add_post("/v1/batches/{batch_id}/cancel", cancel_batch)
