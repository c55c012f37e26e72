"""A batch's last steps: cancel its unfinished lines, write its output and error files.

Stage: the API's producer side, at a batch's end. Input: a batch's record and the lines
recorded for it. Output: cancellation markers for its unfinished lines (in-flight calls
are aborted by the daemon), a ``batch_cancelled`` (or ``batch_expired``) error line for
each line without a result, the output and error files (ids derived from the batch id,
so a repeat after a crash rewrites the same files) and the batch's final status.
"""

from __future__ import annotations

import time

from async_processor.api import keys
from async_processor.api.context import Context
from async_processor.api.lines import failed_line
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
            await store.record(batch_id, lines)


async def finalize(ctx: Context, record: dict[str, str], from_: str, to: str) -> None:
    """Seal the batch (no result is recorded after this), write its files, then move it
    from ``from_`` to ``to``; its working keys go once it is there."""
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
    """The lines of ``part`` as the file ``file_id``; False when there are none."""
    redis, key = ctx.store.redis, keys.batch_part(record["id"], part)
    length = int(await redis.llen(key))
    if not length:
        return False
    writer = await ctx.storage.writer(file_id)
    size = 0
    try:
        for start in range(0, length, CHUNK):
            lines = await redis.lrange(key, start, start + CHUNK - 1)
            data = b"".join(as_bytes(line) + b"\n" for line in lines)
            size += len(data)
            await writer.write(data)
        await writer.commit()
    except BaseException:
        await writer.discard()
        raise
    await ctx.store.put_file(
        {
            "id": file_id,
            "tenant": record["tenant"],
            "bytes": size,
            "created_at": int(time.time()),
            "filename": f"{record['id']}_{name}.jsonl",
            "purpose": "batch_output",
            "expires_at": int(record["created_at"]) + int(record["output_expires_seconds"]),
        }
    )
    return True
