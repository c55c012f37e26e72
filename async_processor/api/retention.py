"""Retention: files and finished batches deleted when they expire, so nothing grows
without bound.

Stage: the API's upkeep. Input: the expiry schedule (``keys.EXPIRIES``: a file's
``expires_at``, an output file's ``output_expires_after``, a finished batch 30 days after
it ended). Output: the due files (record, index entry, bytes) and batches (record, index
entry, working keys) deleted, by one replica at a time (the ``RETENTION_LOCK``).
"""

from __future__ import annotations

import time

import anyio
import structlog
from redis.exceptions import RedisError

from async_processor.api import keys
from async_processor.api.context import Context
from async_processor.api.store import text
from async_processor.errors import TransportError

log = structlog.get_logger(__name__)

SWEEP = 200  # expiries per round trip
# Held while sweeping, then released; a replica killed mid-sweep holds it this long.
LOCK_MS = 60_000


async def keep_retention(ctx: Context, replica: str, every: float) -> None:
    while True:
        try:
            if await ctx.store.hold(keys.RETENTION_LOCK, replica, LOCK_MS):
                try:
                    await sweep(ctx, time.time())
                finally:
                    await ctx.store.release(keys.RETENTION_LOCK, replica)
        except (RedisError, TransportError, OSError) as exc:
            log.warning("api_retention_failed", error=str(exc))
        await anyio.sleep(every)


async def sweep(ctx: Context, now: float) -> int:
    """Delete whatever is due; how many were deleted."""
    deleted = 0
    while due := await ctx.store.due(now, SWEEP):
        for member in due:
            kind, _, object_id = member.partition(":")
            if kind == "file":
                await _delete_file(ctx, object_id)
            elif kind == "batch":
                await ctx.store.delete_batch(object_id)
            await ctx.store.redis.zrem(keys.EXPIRIES, member)
            deleted += 1
    if deleted:
        log.info("api_retention_deleted", count=deleted)
    return deleted


async def _delete_file(ctx: Context, file_id: str) -> None:
    owner = await ctx.store.redis.hget(keys.file_key(file_id), "tenant")
    if owner is not None:
        await ctx.store.delete_file(text(owner), file_id)
    await ctx.storage.delete(file_id)
