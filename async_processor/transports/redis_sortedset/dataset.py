"""The data-set watch of redis-sortedset: notices when the Redis data set under the daemon
was replaced, so a loss the daemon cannot undo is said out loud instead of looking like
an idle queue.

Input: the transport's Redis client, every ``lease_seconds / 3`` (upkeep). Output: on a
replaced data set, one ``redis_dataset_lost`` error and ``redis_dataset_lost_total`` + 1.

Why: a master without persistence that is restarted (a supervisor, a pod restart) comes
back empty. If it is back before the sentinels call it down there is no failover at all:
its replica resyncs from it and empties too; and for about 8 s after a failover, sentinels
may still take a restarted empty master for the master. Every queued request is gone,
the in-flight ones find their leases gone (``lease_expired_before_complete``), and then
the daemon sees empty queues: no error, no progress (issue 30, item 5; a task dump shows
every poller probing an empty queue). ``FLUSHALL``, a ``FLUSHDB`` and eviction under
``maxmemory`` look the same. Nothing the daemon holds can bring those requests back; the
operator must know, and resubmit (docs/operations.md, "Redis lost its data set").

How: one marker key (``DATASET_KEY``, no TTL) holds a random token; each process remembers
the token it read and, every round, sets a new one if the key is absent (``SET NX``) and
reads it back. A different token (set by this process or another after the loss) is a
replaced data set.
In cluster mode the key lives on one node: a loss on another node is not seen here.
"""

from __future__ import annotations

import uuid

import structlog
from redis.asyncio import Redis

from async_processor.metrics import Metrics
from async_processor.redis.conn import redis_errors
from async_processor.redis.keys import DATASET_KEY

log = structlog.get_logger(__name__)

ADVICE = (
    "the Redis data set was replaced by an empty one (a master restarted without "
    "persistence, a flush, eviction): queued requests are gone and will get no result; "
    "resubmit them, and run Redis with persistence (appendonly yes) or never restart a "
    "master automatically"
)


class DatasetWatch:
    """Remembers the data set's token and reports a change (see the module docstring)."""

    def __init__(self, redis: Redis, metrics: Metrics | None = None) -> None:
        self._redis = redis
        self._metrics = metrics
        self._seen: bytes | None = None  # the token this process has been reading

    async def check(self) -> None:
        with redis_errors("dataset"):
            async with self._redis.pipeline(transaction=False) as pipe:
                # A fresh token each time: after a loss even this process's own differs.
                pipe.set(DATASET_KEY, uuid.uuid4().hex, nx=True)
                pipe.get(DATASET_KEY)
                _, current = await pipe.execute()
        if self._seen is not None and current != self._seen:
            log.error("redis_dataset_lost", advice=ADVICE)
            if self._metrics is not None:
                self._metrics.redis_dataset_lost_total.inc()
        self._seen = current
