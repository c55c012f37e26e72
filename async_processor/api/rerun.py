"""``POST /v1/batches/{id}/retry_failed``: a new batch of only an ended batch's failed lines,
without a new upload.

Stage: the API's HTTP edge. Input: an ended batch (completed, expired or cancelled) with
failed lines, its error file and its input file. Output: a new input file holding the
input lines whose ``custom_id`` is in the error file (their exact bytes, in input order)
and a new batch of it (same endpoint, window and metadata; the tenant's caps apply).
Idempotent: the same batch's retry is one batch (a claim key per batch id); a repeat gets
it, a concurrent one's file is deleted.
"""

from __future__ import annotations

import time

import msgspec
from aiohttp import web

from async_processor.api import keys
from async_processor.api.batches import batch_object, create, digest, new_record
from async_processor.api.context import Context, context, owned
from async_processor.api.errors import ApiError
from async_processor.api.lines import split_lines
from async_processor.api.storage import writing
from async_processor.api.store import as_int, loads

RETRYABLE = ("completed", "expired", "cancelled")
CHUNK = 1000  # lines per write


async def retry_failed(request: web.Request) -> web.Response:
    record = await owned(request, "batch")
    ctx, owner = context(request), record["tenant"]
    claim = keys.idempotency_key(owner, digest("retry_failed", record["id"]))
    if (earlier := await ctx.store.claimed(claim)) is not None:
        return await _answer(ctx, owner, earlier)
    if record["status"] not in RETRYABLE or not as_int(record, "failed"):
        raise ApiError(
            409,
            f"Only an ended batch with failed lines can be retried (this one: "
            f"{record['status']}, {as_int(record, 'failed')} failed).",
        )
    file_id = await _failed_lines_file(ctx, record)
    body = {
        "input_file_id": file_id,
        "endpoint": record["endpoint"],
        "completion_window": record["completion_window"],
        "metadata": loads(record.get("metadata"), None),
        "output_order": record.get("output_order") or ctx.output_order,
    }
    try:
        made = await create(ctx, await new_record(ctx, owner, body), [claim])
    except BaseException:
        await _drop_file(ctx, owner, file_id)
        raise
    found = await ctx.store.batch_for(owner, made)
    if found is None or found["input_file_id"] != file_id:  # another retry made it first
        await _drop_file(ctx, owner, file_id)
    return await _answer(ctx, owner, made)


async def _answer(ctx: Context, owner: str, batch_id: str) -> web.Response:
    found = await ctx.store.batch_for(owner, batch_id)
    if found is None:  # the retry batch expired meanwhile
        raise ApiError(409, "This batch's retry no longer exists.")
    return web.json_response(batch_object(found))


async def _failed_lines_file(ctx: Context, record: dict[str, str]) -> str:
    """A new input file of the batch's failed lines; its id (409 when the batch's input
    or error file is gone)."""
    failed: set[str] = set()
    try:
        async for _, line in split_lines(ctx.storage.reader(record["error_file_id"])):
            failed.add(str(msgspec.json.decode(line)["custom_id"]))
    except (KeyError, OSError):
        raise ApiError(409, "The batch's error file no longer exists.") from None
    file_id = keys.new_id(keys.FILE_PREFIX)
    size = lines = 0
    buffer: list[bytes] = []
    try:
        async with writing(ctx.storage, file_id) as writer:
            async for _, line in split_lines(ctx.storage.reader(record["input_file_id"])):
                if msgspec.json.decode(line)["custom_id"] in failed:
                    buffer.append(line + b"\n")
                if len(buffer) >= CHUNK:
                    size, lines = size + sum(map(len, buffer)), lines + len(buffer)
                    await writer.write(b"".join(buffer))
                    buffer.clear()
            size, lines = size + sum(map(len, buffer)), lines + len(buffer)
            await writer.write(b"".join(buffer))
    except OSError:
        raise ApiError(409, "The batch's input file no longer exists.") from None
    now = int(time.time())
    await ctx.store.put_file({
        "id": file_id, "tenant": record["tenant"], "bytes": size, "lines": lines,
        "created_at": now, "filename": f"{record['id']}_retry.jsonl", "purpose": "batch",
        "expires_at": now + int(record["output_expires_seconds"]),
    })  # fmt: skip
    return file_id


async def _drop_file(ctx: Context, owner: str, file_id: str) -> None:
    await ctx.store.delete_file(owner, file_id)
    await ctx.storage.delete(file_id)


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/batches/{batch_id}/retry_failed", retry_failed)
