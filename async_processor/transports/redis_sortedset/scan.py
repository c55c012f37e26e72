"""A key-prefix scan spread over queue-discovery refreshes (``queue_discovery.key_prefix``).

Stage: broker I/O (which queues exist). Input: ``SCAN <cursor> MATCH <prefix>* TYPE zset
COUNT n`` on every primary (each cluster master). Output: per refresh, the names seen by
the last whole cycle and by the current one so far.

Why spread: a scan visits every key of the database, not only the prefix's, so a whole
walk per refresh cost one round trip per ``SCAN_COUNT`` keys (200 round trips a refresh
with 100,000 unrelated keys). Here one refresh makes at most ``calls`` round trips and
the walk resumes where the last one stopped; a cycle ends when every primary's cursor is
back at 0, or once ``limit`` names were kept (as a whole walk stopped at its bound).
SCAN returns every key that exists for a whole cycle at least once, so a queue is found
within one cycle of being created and is dropped when a whole cycle ends without it:
at most two cycles after its key went.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

from redis.asyncio import Redis, RedisCluster

STANDALONE = ""  # the one node's name outside cluster mode


class PrefixScan:
    """``step`` walks part of the keyspace; ``cycle`` walks what is left of a cycle."""

    def __init__(
        self,
        redis: Redis,
        match: str,
        *,
        count: int,
        calls: int,
        limit: int,
        keep: Callable[[bytes], bool],
    ) -> None:
        self._redis = redis
        self._match = match
        self._count = count
        self._calls = calls
        self._limit = limit
        self._keep = keep  # names worth holding (not the daemon's own keys under the prefix)
        self._cursors: dict[str, int] = {}  # node -> cursor; empty: the next step starts a cycle
        self._found: dict[bytes, None] = {}  # this cycle's names so far, in scan order
        self._whole: list[bytes] = []  # the last whole cycle's
        self.cycles = 0  # whole cycles walked
        self.round_trips = 0

    async def step(self) -> list[bytes]:
        """At most ``calls`` SCANs; the names known now (the last whole cycle's, then
        those this cycle found that it did not have)."""
        if not self._cursors:
            self._cursors = {node: 0 for node in await self._nodes()}
        for _ in range(self._calls):
            if await self._scan_once():
                return list(self._whole)
        return list({**dict.fromkeys(self._whole), **self._found})

    async def cycle(self) -> list[bytes]:
        """Walk on until a cycle ends (``status``, which needs every name at once)."""
        done = self.cycles
        while self.cycles == done:
            await self.step()
        return list(self._whole)

    async def _scan_once(self) -> bool:
        """One SCAN on the first primary not done yet; True when the cycle ended."""
        node, cursor = next((n, c) for n, c in self._cursors.items() if c != -1)
        following, names = await self._scan(node, cursor)
        self.round_trips += 1
        for name in names:
            if self._keep(name):
                self._found[name] = None
        self._cursors[node] = following or -1  # -1: this primary is done
        if len(self._found) < self._limit and any(c != -1 for c in self._cursors.values()):
            return False
        self._whole, self._found, self._cursors = list(self._found), {}, {}
        self.cycles += 1
        return True

    async def _nodes(self) -> list[str]:
        if isinstance(self._redis, RedisCluster):
            await self._redis.initialize()  # a new client learns its nodes on first use
            return [node.name for node in self._redis.get_primaries()]
        return [STANDALONE]

    async def _scan(self, node: str, cursor: int) -> tuple[int, list[bytes]]:
        args: dict[str, Any] = {"match": self._match, "count": self._count, "_type": "zset"}
        if node == STANDALONE:
            following, names = await self._redis.scan(cursor, **args)
            return int(following), cast(list[bytes], names)
        cluster: Any = self._redis
        target = cluster.get_node(node_name=node)
        if target is None:  # a primary gone (failover): the cycle starts again
            self._cursors = {}
            raise ConnectionError(f"cluster node {node} is gone")
        cursors, names = await cluster.scan(cursor, target_nodes=target, **args)
        return int(cursors[node]), list(names)
