"""``GET /v1/batches/{id}/results?after=<n>``: the lines of a batch finished so far, while it
runs and after, as JSONL.

Stage: the API's HTTP edge, reading a batch's results. Input: the batch, and ``after``:
how many of its result lines the caller has already (0 at first). Output: the next
result lines in the order they were recorded (each exactly its output or error file
line), streamed in chunks; ``X-AP-Batch-Status`` says whether more can come. The order
is the batch's ``seq`` (one byte per recorded line, 1: output, 0: error), so a cursor
taken while the batch ran goes on from its files once it ended: the first ``after``
bytes say how many output and error lines the caller has, the rest which comes next.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from aiohttp import web

from async_processor.api import keys
from async_processor.api.context import Context, context, owned
from async_processor.api.errors import ApiError
from async_processor.api.lines import split_lines
from async_processor.api.store import TERMINAL, as_bytes

CHUNK = 1000  # lines per round trip or write


async def batch_results(request: web.Request) -> web.StreamResponse:
    record = await owned(request, "batch")
    ctx, batch_id = context(request), record["id"]
    after = _after(request.query.get("after", "0"))
    seq = as_bytes(await ctx.store.redis.get(keys.batch_part(batch_id, "seq")) or b"")
    done, rest = seq[:after], seq[after:]
    outs = done.count(1)
    sources = (
        (_file_lines(ctx, record, "out", outs), _file_lines(ctx, record, "err", len(done) - outs))
        if record["status"] in TERMINAL
        else (
            _list_lines(ctx, batch_id, "out", outs),
            _list_lines(ctx, batch_id, "err", len(done) - outs),
        )
    )
    response = web.StreamResponse(
        headers={"Content-Type": "application/jsonl", "X-AP-Batch-Status": record["status"]}
    )
    await response.prepare(request)
    buffer: list[bytes] = []
    for kind in rest:
        line = await anext(sources[0] if kind else sources[1], None)
        if line is None:  # the lists went with the batch's end meanwhile: ask again
            break
        buffer.append(line + b"\n")
        if len(buffer) >= CHUNK:
            await response.write(b"".join(buffer))
            buffer.clear()
    await response.write(b"".join(buffer))
    await response.write_eof()
    return response


def _after(text: str) -> int:
    if not text.isascii() or not text.isdigit() or len(text) > 9:
        raise ApiError(400, "after must be the number of result lines already read", param="after")
    return int(text)


async def _list_lines(ctx: Context, batch_id: str, part: str, start: int) -> AsyncIterator[bytes]:
    """The ``out`` or ``err`` list of a running batch from ``start`` on."""
    key = keys.batch_part(batch_id, part)
    while chunk := await ctx.store.redis.lrange(key, start, start + CHUNK - 1):
        for line in chunk:
            yield as_bytes(line)
        start += len(chunk)


async def _file_lines(
    ctx: Context, record: dict[str, str], part: str, start: int
) -> AsyncIterator[bytes]:
    """The lines of an ended batch's output or error file in recorded order (an
    input-ordered batch keeps such a copy), from ``start`` on."""
    field = "output_file_id" if part == "out" else "error_file_id"
    file_id = record.get(field)
    if not file_id:
        return
    if record.get("output_order") == "input":
        file_id = keys.arrival_copy(file_id)
    seen = 0
    try:
        async for _, line in split_lines(ctx.storage.reader(file_id)):
            if seen >= start:
                yield line
            seen += 1
    except OSError:  # expired and deleted meanwhile: the stream ends here
        return


def add_routes(app: web.Application) -> None:
    app.router.add_get("/v1/batches/{batch_id}/results", batch_results)
