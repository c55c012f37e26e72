"""Replicas that went away: the results they had taken but not recorded go back.

Stage: the API's consumer side, beside the collector. Input: each replica's heartbeat
(``keys.REPLICAS``: name -> last seen, Redis clock) and the processing lists the client
library keeps per reader. Output: the entries of a replica silent for ``timeout`` s moved
back to the result list (newest first onto the reading end, so the oldest is read first;
each with one atomic LMOVE), so a replica that
is killed and comes back under another name (a new pod) strands no result. A replica
only slow, not gone, does no harm: recording a result twice counts it once.
"""

from __future__ import annotations

import anyio
import structlog
from redis.asyncio import Redis
from redis.exceptions import RedisError

from async_processor.api import keys
from async_processor.api.store import text
from async_processor.client.redis_sortedset import processing_key
from async_processor.errors import TransportError

log = structlog.get_logger(__name__)

MOVES = 1000  # entries moved back per replica per look (the next look goes on)


async def heartbeat(redis: Redis, replica: str) -> None:
    seconds, _ = await redis.time()
    await redis.zadd(keys.REPLICAS, {replica: int(seconds)})


async def adopt_silent(redis: Redis, result_list: str, me: str, timeout: float) -> int:
    """Move back what replicas silent for ``timeout`` s hold; how many entries moved."""
    seconds, _ = await redis.time()
    silent = [text(n) for n in await redis.zrangebyscore(keys.REPLICAS, "-inf", seconds - timeout)]
    moved = 0
    for name in silent:
        if name == me:
            continue
        processing = processing_key(result_list, f"api-{name}")
        done = True
        for _ in range(MOVES):
            if await redis.lmove(processing, result_list, "LEFT", "RIGHT") is None:
                break
            moved += 1
        else:
            done = False
        if done:
            await redis.zrem(keys.REPLICAS, name)
    if moved:
        log.warning("api_results_adopted", moved=moved, replicas=silent)
    return moved


async def keep_watch(redis: Redis, result_list: str, me: str, timeout: float) -> None:
    """Forever: beat, and take back what silent replicas hold, every third of ``timeout``."""
    while True:
        try:
            await heartbeat(redis, me)
            await adopt_silent(redis, result_list, me, timeout)
        except (RedisError, TransportError, OSError) as exc:
            log.warning("api_replica_watch_failed", error=str(exc))
        await anyio.sleep(timeout / 3)
