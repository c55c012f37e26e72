"""The sorted set's backlog poll: every queue's depth and its deadlines' proximity.

Stage: the backlog poll (``pipeline.backlog`` through ``ReadsBacklogs``). Input: the
queues and the time. Output: per queue a ``Backlog``: its ``ZCARD`` and, for each of
upstream's bounds b (ms), ``ZCOUNT Q -inf (now_s + b_s + 1``: the members due within b
(scores are deadlines, whole seconds plus the submission-order fraction). None for a
queue whose read failed.

Cheap with many idle queues: one pipeline of ``ZCARD`` for all of them, then only the
non-empty ones are counted, each queue's ``ZCARD`` and counts in one ``MULTI`` as
upstream reads them (cluster mode: pipelined without it, queues being in different slots,
and the counts clamped to be cumulative and within the depth). Two round trips per poll
whatever the number of queues; the per-queue reads of before took one per queue.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from redis.asyncio import Redis

from async_processor.backlog_metrics import PROXIMITY_BUCKETS, Backlog
from async_processor.config.queues import QueueSpec
from async_processor.redis.conn import redis_errors


async def read_backlogs(
    redis: Redis, queues: Sequence[QueueSpec], now: float, *, atomic: bool
) -> dict[str, Backlog | None]:
    """Raises ``TransportError`` when the broker fails as a whole."""
    names = list(dict.fromkeys(q.name for q in queues))
    with redis_errors("backlog"):
        async with redis.pipeline(transaction=False) as pipe:
            for name in names:
                pipe.zcard(name)
            depths = await pipe.execute(raise_on_error=False)
        busy = [n for n, d in zip(names, depths, strict=True) if isinstance(d, int) and d > 0]
        counted = await _counts(redis, busy, now, atomic) if busy else {}
    readings: dict[str, Backlog | None] = {}
    for name, depth in zip(names, depths, strict=True):
        if not isinstance(depth, int):
            readings[name] = None
        elif depth == 0:
            readings[name] = Backlog(0, (0,) * len(PROXIMITY_BUCKETS))
        else:
            readings[name] = counted.get(name)
    return readings


async def _counts(
    redis: Redis, names: list[str], now: float, atomic: bool
) -> dict[str, Backlog | None]:
    bounds = [f"({math.floor(now) + b // 1000 + 1}" for b in PROXIMITY_BUCKETS]
    async with redis.pipeline(transaction=atomic) as pipe:
        for name in names:
            pipe.zcard(name)
            for bound in bounds:
                pipe.zcount(name, "-inf", bound)
        replies = await pipe.execute(raise_on_error=False)
    step = 1 + len(bounds)
    return {name: _backlog(replies[i * step : (i + 1) * step]) for i, name in enumerate(names)}


def _backlog(replies: list[object]) -> Backlog | None:
    if not all(isinstance(r, int) for r in replies):
        return None
    depth, *due = (int(r) for r in replies)  # type: ignore[call-overload]
    # Without MULTI (cluster) writes may land between the commands: keep the buckets
    # cumulative and within the depth.
    cumulative: list[int] = []
    for count in due:
        cumulative.append(min(depth, max(count, cumulative[-1] if cumulative else 0)))
    return Backlog(depth, tuple(cumulative))
