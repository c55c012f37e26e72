"""The data-set watch of redis-sortedset: notices when the Redis data set under the daemon
was replaced, so a loss the daemon cannot undo is said out loud instead of looking like
an idle queue.

Input: the transport's Redis client, every ``lease_seconds / 3`` (upkeep). Output: on a
replaced data set, one ``redis_dataset_lost`` error and ``redis_dataset_lost_total`` + 1
(per node in cluster mode).

Why: a master without persistence that is restarted (a supervisor, a pod restart) comes
back empty. If it is back before the sentinels call it down there is no failover at all:
its replica resyncs from it and empties too; and for about 8 s after a failover, sentinels
may still take a restarted empty master for the master. Every queued request is gone,
the in-flight ones find their leases gone (``lease_expired_before_complete``), and then
the daemon sees empty queues: no error, no progress (issue 30, item 5; a task dump shows
every poller probing an empty queue). ``FLUSHALL``, a ``FLUSHDB`` and eviction under
``maxmemory`` look the same. Nothing the daemon holds can bring those requests back; the
operator must know, and resubmit (docs/operations.md, "Redis lost its data set").

How: a marker key (no TTL) holds a random token; each process remembers the token it
read and, every round, sets a new one if the key is absent (``SET NX``) and reads it back.
A different token (set by this process or another after the loss) is a replaced data set.
Standalone and Sentinel: one key, ``DATASET_KEY``. Cluster: each primary can lose its
data set on its own, so one key per primary (``DATASET_NODE_PREFIX`` + a hash tag of the
lowest slot it serves, which its promoted replica serves after a failover), all in one
pipelined round (one round trip per node).
"""

from __future__ import annotations

import functools
import itertools
import uuid

import structlog
from redis.asyncio import Redis, RedisCluster
from redis.crc import key_slot

from async_processor.metrics import Metrics
from async_processor.redis.conn import redis_errors
from async_processor.redis.keys import DATASET_KEY, DATASET_NODE_PREFIX

log = structlog.get_logger(__name__)

ADVICE = (
    "the Redis data set was replaced by an empty one (a master restarted without "
    "persistence, a flush, eviction): queued requests are gone and will get no result; "
    "resubmit them, and run Redis with persistence (appendonly yes) or never restart a "
    "master automatically"
)
SLOTS = 16384


class DatasetWatch:
    """Remembers the data set's tokens and reports a change (see the module docstring)."""

    def __init__(self, redis: Redis | RedisCluster, metrics: Metrics | None = None) -> None:
        self._redis = redis
        self._metrics = metrics
        self._seen: dict[str, bytes | None] = {}  # marker key -> the token last read

    async def check(self) -> None:
        keys = marker_keys(self._redis)
        with redis_errors("dataset"):
            replies = await self._read(keys)
        current = dict(zip(keys, replies[1::2], strict=True))
        for key, token in current.items():
            if key in self._seen and token != self._seen[key]:
                log.error("redis_dataset_lost", marker=key, advice=ADVICE)
                if self._metrics is not None:
                    self._metrics.redis_dataset_lost_total.inc()
        self._seen = current

    async def _read(self, keys: list[str]) -> list[bytes | None]:
        async with self._redis.pipeline(transaction=False) as pipe:
            for key in keys:
                # A fresh token each time: after a loss even this process's own differs.
                pipe.set(key, uuid.uuid4().hex, nx=True)
                pipe.get(key)
            replies: list[bytes | None] = await pipe.execute()
        return replies


def marker_keys(client: Redis | RedisCluster) -> list[str]:
    """The marker keys to check: one, or in cluster mode one per primary serving slots."""
    if not isinstance(client, RedisCluster):
        return [DATASET_KEY]
    lowest: dict[str, int] = {}
    for slot, nodes in sorted(client.nodes_manager.slots_cache.items()):
        if nodes:
            lowest.setdefault(nodes[0].name, slot)
    return [f"{DATASET_NODE_PREFIX}{{{_tag(slot)}}}" for slot in sorted(lowest.values())]


@functools.cache
def _tag(slot: int) -> str:
    """A hash tag in ``slot`` (the first number that hashes there; ~16,000 tries once)."""
    return next(str(i) for i in itertools.count() if key_slot(str(i).encode()) == slot)
