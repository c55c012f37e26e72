"""The Files API: upload (streamed and checked while it streams), list, get, content,
delete.

Stage: the API's HTTP edge. Input: multipart uploads and file ids. Output: OpenAI File
objects, file bytes, and the file's record in the store (bytes in ``Storage``).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from aiohttp import BodyPartReader, web

from async_processor.api import keys
from async_processor.api.context import Context, context, owned, tenant
from async_processor.api.errors import ApiError
from async_processor.api.listing import page
from async_processor.api.storage import Writer

UPLOAD_CHUNK = 256 * 1024
FIELD_BYTES = 1024  # a form field other than the file
MAX_EXPIRY_SECONDS = 30 * 24 * 3600
DEFAULT_EXPIRY_SECONDS = 30 * 24 * 3600  # a batch file expires after 30 days, as OpenAI's


def file_object(record: Mapping[str, str]) -> dict[str, Any]:
    expires = record.get("expires_at")
    return {
        "id": record["id"],
        "object": "file",
        "bytes": int(record["bytes"]),
        "created_at": int(record["created_at"]),
        "filename": record["filename"],
        "purpose": record["purpose"],
        "status": "processed",
        "expires_at": int(expires) if expires else None,
        "status_details": None,
    }


async def create_file(request: web.Request) -> web.Response:
    ctx = context(request)
    if not request.content_type.startswith("multipart/"):
        raise ApiError(400, "Upload a file as multipart/form-data.", param="file")
    file_id, owner = keys.new_id(keys.FILE_PREFIX), tenant(request)
    stored = await ctx.guard.check_bytes(owner, 1)  # a tenant at its cap sends nothing
    fields: dict[str, str] = {}
    size, lines, filename, writer = -1, 0, "", None
    try:
        reader = await request.multipart()
        while (part := await reader.next()) is not None:
            if not isinstance(part, BodyPartReader):
                raise ApiError(400, "nested multipart is not supported")
            if part.name == "file":
                if writer is not None:
                    raise ApiError(400, "one file per upload", param="file")
                writer = await ctx.storage.writer(file_id)
                filename = (part.filename or "upload.jsonl")[:255]
                size, lines = await _stream(part, writer, ctx, owner, stored)
            else:
                fields[str(part.name)] = await _field(part)
        record = _record(file_id, owner, fields, filename, size)
        record["lines"] = lines
        if writer is None:
            raise ApiError(400, "missing file", param="file")
        await writer.commit()
    except BaseException:
        if writer is not None:
            await writer.discard()
        raise
    await ctx.store.put_file(record)
    return web.json_response(file_object({k: str(v) for k, v in record.items()}))


def _record(
    file_id: str, owner: str, fields: Mapping[str, str], filename: str, size: int
) -> dict[str, str | int]:
    if fields.get("purpose") != "batch":
        raise ApiError(400, "purpose must be 'batch'", param="purpose")
    now = int(time.time())
    record: dict[str, str | int] = {
        "id": file_id,
        "tenant": owner,
        "bytes": size,
        "created_at": now,
        "filename": filename,
        "purpose": "batch",
    }
    anchor, seconds = fields.get("expires_after[anchor]"), fields.get("expires_after[seconds]")
    if anchor is None and seconds is None:
        record["expires_at"] = now + DEFAULT_EXPIRY_SECONDS
    else:
        record["expires_at"] = now + expiry_seconds(anchor, seconds, "expires_after")
    return record


def expiry_seconds(anchor: object, seconds: object, param: str) -> int:
    """``{anchor: created_at, seconds: 3600..2592000}``, as OpenAI takes it (form fields
    are text)."""
    if anchor != "created_at":
        raise ApiError(400, f"{param}.anchor must be created_at", param=param)
    text = str(seconds) if isinstance(seconds, int | str) and not isinstance(seconds, bool) else ""
    if not text.isascii() or not text.isdigit() or not 3600 <= int(text) <= MAX_EXPIRY_SECONDS:
        raise ApiError(400, f"{param}.seconds must be 3600 to 2592000", param=param)
    return int(text)


async def _field(part: BodyPartReader) -> str:
    data = b""
    while chunk := await part.read_chunk(FIELD_BYTES):
        data += chunk
        if len(data) > FIELD_BYTES:
            raise ApiError(400, f"form field {part.name!r} is too long", param=part.name)
    return data.decode("utf-8", errors="replace")


async def _stream(
    part: BodyPartReader, writer: Writer, ctx: Context, owner: str, stored: int
) -> tuple[int, int]:
    """Copy the file part to storage; 413 as soon as it passes a limit, 429 as soon as
    it passes the tenant's bytes cap (``stored``: the tenant's bytes before it). Its
    size and lines."""
    limits = ctx.limits
    size = lines = 0
    last = b"\n"
    while chunk := await part.read_chunk(UPLOAD_CHUNK):
        size += len(chunk)
        lines += chunk.count(b"\n")
        last = chunk[-1:]
        if size > limits.max_file_bytes:
            raise ApiError(413, f"File is larger than {limits.max_file_bytes} bytes.", param="file")
        if lines > limits.max_file_lines:
            raise ApiError(413, f"File has more than {limits.max_file_lines} lines.", param="file")
        await ctx.guard.check_bytes(owner, size, stored)
        await writer.write(chunk)
    if last != b"\n":
        lines += 1
    if lines > limits.max_file_lines:
        raise ApiError(413, f"File has more than {limits.max_file_lines} lines.", param="file")
    return size, lines


async def list_files(request: web.Request) -> web.Response:
    ctx, owner = context(request), tenant(request)
    purpose = request.query.get("purpose")

    async def render(file_id: str) -> dict[str, Any] | None:
        record = await ctx.store.file(owner, file_id)
        if record is None or (purpose and record["purpose"] != purpose):
            return None
        return file_object(record)

    limits = (10_000, 10_000)
    return await page(ctx.store, keys.files_index(owner), request.query, render, limits)


async def get_file(request: web.Request) -> web.Response:
    return web.json_response(file_object(await owned(request, "file")))


async def file_content(request: web.Request) -> web.StreamResponse:
    record = await owned(request, "file")
    response = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
    response.content_length = int(record["bytes"])
    await response.prepare(request)
    async for chunk in context(request).storage.reader(record["id"]):
        await response.write(chunk)
    await response.write_eof()
    return response


async def delete_file(request: web.Request) -> web.Response:
    record = await owned(request, "file")
    ctx = context(request)
    await ctx.store.delete_file(record["tenant"], record["id"])
    await ctx.storage.delete(record["id"])
    return web.json_response({"id": record["id"], "object": "file", "deleted": True})


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/files", create_file)
    app.router.add_get("/v1/files", list_files)
    app.router.add_get("/v1/files/{file_id}", get_file)
    app.router.add_get("/v1/files/{file_id}/content", file_content)
    app.router.add_delete("/v1/files/{file_id}", delete_file)
