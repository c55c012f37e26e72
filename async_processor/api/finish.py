"""A batch's last steps: cancel its unfinished lines, write its output and error files.

Stage: the API's producer side, at a batch's end. Input: a batch's record and the lines
recorded for it. Output: cancellation markers for its unfinished lines (in-flight calls
are aborted by the daemon), a ``batch_cancelled`` (or ``batch_expired``) error line for
each line without a result, the output and error files (ids derived from the batch id,
so a repeat after a crash rewrites the same files) and the batch's final status.
"""

from __future__ import annotations

import json
import time

from async_processor.api import keys
from async_processor.api.context import Context
from async_processor.api.lines import failed_line, split_lines
from async_processor.api.storage import writing
from async_processor.api.store import as_bytes, as_int
from async_processor.client import SortedSetClient

CHUNK = 1000  # lines per round trip
CANCELLED = ("batch_cancelled", "The batch was cancelled before this request finished.")
EXPIRED = ("batch_expired", "The batch's completion window ended before this request finished.")


async def close_lines(
    ctx: Context, client: SortedSetClient, record: dict[str, str], code: str, message: str
) -> None:
    """Cancel every submitted line without a result, then record every line without a
    result as an error line with ``code`` (a result arriving later is dropped)."""
    batch_id, store = record["id"], ctx.store
    total, submitted = as_int(record, "total"), as_int(record, "submitted")
    for start in range(0, total, CHUNK):
        stop = min(total, start + CHUNK)
        done = await store.done(batch_id, start, stop)
        open_lines = [start + i for i, answered in enumerate(done) if not answered]
        queued = [keys.line_id(batch_id, i) for i in open_lines if i < submitted]
        if queued:
            await client.cancel(queued, queue=ctx.queue)
        custom_ids = await store.custom_ids(batch_id, open_lines)
        lines = [
            failed_line(i, c or "", keys.line_id(batch_id, i), code, message)
            for i, c in zip(open_lines, custom_ids, strict=True)
        ]
        if lines:
            closed = await store.record(batch_id, lines)
            ctx.metrics.outcomes.labels(code.removeprefix("batch_")).inc(max(closed.new, 0))


async def finalize(ctx: Context, record: dict[str, str], from_: str, to: str) -> None:
    """Seal the batch (no result is recorded after this), write its files, then move it
    from ``from_`` to ``to``; its working keys go once it is there (``seq`` stays: the
    results stream reads the files in its order)."""
    batch_id, store = record["id"], ctx.store
    await store.update(batch_id, {"sealed": 1})
    files: dict[str, str | int] = {}
    for part, field, suffix in (
        ("out", "output_file_id", "output"),
        ("err", "error_file_id", "errors"),
    ):
        file_id = f"{keys.FILE_PREFIX}{batch_id.removeprefix(keys.BATCH_PREFIX)}-{suffix}"
        if await _write(ctx, record, part, file_id, suffix):
            files[field] = file_id
    if files:
        await store.update(batch_id, files)
    if await store.transition(batch_id, to, [from_], int(time.time())):
        await store.redis.delete(
            *(keys.batch_part(batch_id, p) for p in ("ids", "done", "out", "err", "lease"))
        )


async def _write(ctx: Context, record: dict[str, str], part: str, file_id: str, name: str) -> bool:
    """The lines of ``part`` as the file ``file_id`` (in input order when the batch asked
    for it, its recorded-order copy beside it); False when there are none."""
    key = keys.batch_part(record["id"], part)
    expires = int(record["created_at"]) + int(record["output_expires_seconds"])
    if record.get("output_order") != "input":
        size = await _copy_list(ctx, key, file_id)
    else:
        copy = keys.arrival_copy(file_id)
        if await _copy_list(ctx, key, copy):
            await ctx.store.expire_at("file", copy, expires)
        size = await _reorder(ctx, record, copy, file_id)
    if not size:
        return False
    await ctx.store.put_file(
        {
            "id": file_id,
            "tenant": record["tenant"],
            "bytes": size,
            "created_at": int(time.time()),
            "filename": f"{record['id']}_{name}.jsonl",
            "purpose": "batch_output",
            "expires_at": expires,
        }
    )
    return True


async def _copy_list(ctx: Context, key: str, file_id: str) -> int:
    """The list ``key`` as the file ``file_id``; its size (0: empty, no file)."""
    redis = ctx.store.redis
    length = int(await redis.llen(key))
    if not length:
        return 0
    size = 0
    async with writing(ctx.storage, file_id) as writer:
        for start in range(0, length, CHUNK):
            lines = await redis.lrange(key, start, start + CHUNK - 1)
            data = b"".join(as_bytes(line) + b"\n" for line in lines)
            size += len(data)
            await writer.write(data)
    return size


async def _reorder(ctx: Context, record: dict[str, str], source: str, file_id: str) -> int:
    """``source``'s lines as ``file_id`` in input order; its size (0: none). Memory holds
    one (offset, size) per line, never the lines: one pass to find them, then reads at
    their offsets, a chunk of input lines at a time."""
    spots: dict[str, tuple[int, int]] = {}
    offset = 0
    try:
        async for _, line in split_lines(ctx.storage.reader(source)):
            spots[json.loads(line)["custom_id"]] = (offset, len(line))
            offset += len(line) + 1
    except FileNotFoundError:  # no lines of this kind
        return 0
    if not spots:
        return 0
    size = 0
    async with writing(ctx.storage, file_id) as writer:
        for start in range(0, as_int(record, "total"), CHUNK):
            custom_ids = await ctx.store.custom_ids(
                record["id"], range(start, min(start + CHUNK, as_int(record, "total")))
            )
            found = [spots[c] for c in custom_ids if c is not None and c in spots]
            data = b"".join(x + b"\n" for x in await ctx.storage.read_at(source, found))
            size += len(data)
            await writer.write(data)
    return size
