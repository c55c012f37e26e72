"""Queue discovery for redis-sortedset: the tenant queue list from a Redis set or a
key-prefix scan, checked and bounded (docs/transports.md, "Tenant queues found in Redis").

Stage: broker I/O (which queues exist). Input: ``queue_discovery`` (``set_key`` or
``key_prefix``, ``max_queues``) and the daemon's own keys. Output: the names to poll, each
a sorted set nobody else owns; every refused name counted by reason.

A listed name is untrusted input (docs/architecture.md G14): it is refused (``daemon_key``)
when it is one of the daemon's keys or shaped like one (``<q>:claimed``, ``<q>:retry``,
``…:live:…``, ``request-done:…``, a result list, a gate key), ``bad_name`` when empty,
over ``MAX_NAME_BYTES`` or not UTF-8 text without control characters, ``cross_slot`` in
cluster mode when its result list is in another slot, ``over_cap`` past
``max_queues``, and ``wrong_type`` when a set names a key that is not a sorted set (the
upkeep scripts cover many queues per call, so one such key failed them for every
queue). A set is read with SSCAN and never more than ``2 × max_queues`` members per
refresh, so an enormous set costs a bounded read; a prefix scan walks every primary's
keyspace (SCAN ... TYPE zset) a bounded part per refresh (``scan``), skipping the
daemon's keys under the prefix without counting them. The checks (``names``) also
hold the names restored from ``REMOVED_QUEUES_KEY``, read with SSCAN, at most
``2 × max_queues`` of them (anyone who can write to Redis can fill that set too).
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, cast

import structlog
from redis.asyncio import Redis

from async_processor.config import SortedSetConfig
from async_processor.config.queues import QueueSpec
from async_processor.config.transports import QueueDiscovery
from async_processor.redis.conn import redis_errors
from async_processor.redis.keys import EMPTY_SINCE_KEY, REMOVED_QUEUES_KEY, OwnKeys, own_keys
from async_processor.redis.keyspace import KeySpace
from async_processor.transports.redis_sortedset.names import NameRules, text
from async_processor.transports.redis_sortedset.scan import PrefixScan

if TYPE_CHECKING:
    from async_processor.metrics import Metrics

log = structlog.get_logger(__name__)

SCAN_COUNT = 500  # SSCAN of the set: its members per round trip
# A prefix scan's keys visited per SCAN, and SCANs per refresh (docs/transports.md has the
# measured cost; a refresh visits at most COUNT x CALLS keys of each primary's keyspace).
PREFIX_SCAN_COUNT = 2000
PREFIX_SCAN_CALLS = 10


def transport_own_keys(
    config: SortedSetConfig, pool_gate_params: Iterable[Mapping[str, Any]]
) -> OwnKeys:
    """The keys a redis-sortedset deployment owns beyond its queues' derived ones: its
    configured queues' keys, the retry set, markers and every gate key (the configured
    queues', the pools' and the discovery template's)."""
    static = config.queue_specs()
    params = [*(q.gate_params for q in static), *pool_gate_params]
    if config.queue_discovery is not None:
        params.append(config.queue_discovery.template.gate_params)
    names = [q.name for q in static]
    return own_keys(names, config.retry_queue_name, params, config.result_queue_pattern)


def queue_lister(
    config: SortedSetConfig,
    redis: Redis,
    keyspace: KeySpace,
    own: OwnKeys,
    metrics: Metrics | None,
) -> QueueLister | None:
    """The lister of ``config.queue_discovery`` (None without it), as the daemon reads it."""
    if config.queue_discovery is None:
        return None
    static = [q.name for q in config.queue_specs()]
    return QueueLister(
        redis,
        config.queue_discovery,
        cluster=keyspace.cluster,
        own=keyspace.own_keys(own, static),
        static=frozenset(static),
        result_list=config.result_queue_name,
        metrics=metrics,
    )


def queue_catalog(
    config: SortedSetConfig,
    redis: Redis,
    keyspace: KeySpace,
    own: OwnKeys,
    metrics: Metrics | None,
) -> QueueCatalog:
    """The catalog of ``config``, with its lister; without discovery, the same name rules
    for the removed queues an earlier run left."""
    lister = queue_lister(config, redis, keyspace, own, metrics)
    if lister is not None:
        return QueueCatalog(config, keyspace, lister, lister.rules)
    static = [q.name for q in config.queue_specs()]
    rules = NameRules(
        None,
        # No slot check: it holds the queue against the discovery template's result
        # list, gone with discovery (upkeep touches only the queue's own keys).
        cluster=False,
        own=keyspace.own_keys(own, static),
        result_list=config.result_queue_name,
        metrics=metrics,
    )
    return QueueCatalog(config, keyspace, None, rules)


class QueueLister:
    """Reads the discovery source; ``names`` returns what may be polled, in source order."""

    def __init__(
        self,
        redis: Redis,
        discovery: QueueDiscovery,
        *,
        cluster: bool,
        own: OwnKeys,
        static: frozenset[str],
        result_list: str,
        metrics: Metrics | None,
    ) -> None:
        self._redis = redis
        self._config = discovery
        self.static = static  # configured: polled already (a hot reload changes them)
        self.rules = NameRules(
            discovery, cluster=cluster, own=own, result_list=result_list, metrics=metrics
        )
        self.scan = PrefixScan(
            redis,
            _glob_escape(discovery.key_prefix) + "*",
            count=PREFIX_SCAN_COUNT,
            calls=PREFIX_SCAN_CALLS,
            limit=2 * discovery.max_queues,
            keep=self._outside_daemon_keys,
        )

    async def names(self, *, whole: bool = False) -> list[str]:
        """The queues to poll: at most ``max_queues``, each checked. A prefix scan walks
        part of the keyspace per call (``PrefixScan``), or with ``whole`` to a cycle's end."""
        cap = self._config.max_queues
        accepted: dict[str, None] = {}
        examined = 0
        with redis_errors("queue discovery"):
            async for raw in self._members(whole):
                name = text(raw)
                if name in self.static:  # configured: polled already
                    continue
                reason = self.rules.refusal(name) if name is not None else "bad_name"
                examined += 1
                if reason is None and name not in accepted:
                    if len(accepted) == cap:
                        self.rules.refuse(name or "", "over_cap")
                        break
                    accepted[name or ""] = None
                elif reason is not None:
                    self.rules.refuse(name or repr(raw), reason)
                if examined >= 2 * cap:  # a set of refused names cannot make us read it all
                    self.rules.refuse("", "over_cap")
                    break
            if not self._config.set_key:  # a prefix scan reads sorted sets only
                return list(accepted)
            return await self.rules.sorted_sets(self._redis, list(accepted))

    async def _members(self, whole: bool) -> AsyncIterator[bytes]:
        if self._config.set_key:
            async for raw in self._redis.sscan_iter(self._config.set_key, count=SCAN_COUNT):
                yield raw
            return
        for raw in await (self.scan.cycle() if whole else self.scan.step()):
            yield raw

    def _outside_daemon_keys(self, raw: bytes) -> bool:
        """A prefix scan keeps no daemon key (a queue's in-flight or retry set under the
        prefix): neither counted nor examined, nor held between refreshes."""
        name = text(raw)
        return name is None or self.rules.refusal(name) != "daemon_key"


async def _redis_now(redis: Redis) -> float:
    seconds, micros = await redis.time()
    return float(seconds + micros / 1e6)


def removed_cap(config: SortedSetConfig) -> int:
    """How many names of ``REMOVED_QUEUES_KEY`` are read: ``2 × max_queues``, as a refresh
    reads of its source (the set is untrusted: each name costs a check, a TYPE, a status
    line), the default ``max_queues`` without discovery."""
    default = int(QueueDiscovery.model_fields["max_queues"].default)
    discovery = config.queue_discovery
    return 2 * (discovery.max_queues if discovery else default)


async def removed_members(
    redis: Redis, cap: int, page: tuple[int, list[bytes]] | None = None
) -> tuple[list[bytes], bool]:
    """At most ``cap`` members of ``REMOVED_QUEUES_KEY`` (SSCAN), and whether it may hold
    more (not how many: SCARD is not in the documented ACL); ``page``: the first SSCAN
    reply, when the caller pipelined it."""
    with redis_errors("queue discovery"):
        cursor, first = page or await redis.sscan(REMOVED_QUEUES_KEY, 0, count=SCAN_COUNT)
        raws = cast("list[bytes]", list(first))  # the client does not decode
        while cursor and len(raws) < cap:
            cursor, more = await redis.sscan(REMOVED_QUEUES_KEY, cursor, count=SCAN_COUNT)
            raws += cast("list[bytes]", more)
    return raws[:cap], bool(cursor) or len(raws) > cap


def _glob_escape(prefix: str) -> str:
    return re.sub(r"([*?\[\]\\])", r"\\\1", prefix)


class QueueCatalog:
    """The queues a redis-sortedset transport serves: configured, discovered, and removed
    ones still holding claims or retries (``upkeep``: reaped, moved and swept until empty,
    so nothing of theirs is stranded). A removed queue is named in Redis
    (``REMOVED_QUEUES_KEY``) before its poller stops and until it is empty, so a daemon
    killed or restarted meanwhile, with discovery or without, takes its upkeep over."""

    def __init__(
        self,
        config: SortedSetConfig,
        keyspace: KeySpace,
        lister: QueueLister | None,
        rules: NameRules,
    ) -> None:
        self._config = config
        self._keys = keyspace
        self._removed_keys = replace(keyspace, queue_retry=True)  # a discovered queue's own
        self._lister = lister
        self._rules = rules
        self.static: list[QueueSpec] = config.queue_specs()
        self.discovered: dict[str, QueueSpec] = {}
        self._lingering: dict[str, QueueSpec] = {}
        discovery = config.queue_discovery
        # Discovery off: an older deployment's replica may still poll at the default pace.
        default = float(QueueDiscovery.model_fields["refresh_seconds"].default)
        refresh = discovery.refresh_seconds if discovery else default
        # How long a removed queue stays named once empty: past the refresh of a replica
        # that lags one refresh behind, and one lease (docs/transports.md).
        self._grace = 2 * refresh + config.lease_seconds
        self._removed_cap = removed_cap(config)
        self._restored = False

    @property
    def upkeep(self) -> list[QueueSpec]:
        return [*self.static, *self.discovered.values(), *self._lingering.values()]

    @property
    def removed(self) -> list[str]:
        return list(self._lingering)

    async def refresh(self, redis: Redis) -> list[QueueSpec]:
        """Read the source; returns the discovered queues to poll now."""
        assert self._lister is not None
        names = await self._lister.names()
        gone = [n for n in self.discovered if n not in names]
        if gone:  # named in Redis before its poller stops: a kill from here on strands nothing
            with redis_errors("queue discovery"):
                async with redis.pipeline(transaction=False) as pipe:
                    pipe.sadd(REMOVED_QUEUES_KEY, *gone)
                    pipe.zrem(EMPTY_SINCE_KEY, *gone)  # removed anew: its grace starts again
                    await pipe.execute()
        wanted = {
            n: self.discovered.get(n) or self._lingering.pop(n, None) or self._spec(n)
            for n in names
        }
        for name in gone:
            self._lingering[name] = self.discovered[name]
        self.discovered = wanted
        await self.drop_empty(redis)
        return list(wanted.values())

    async def reconfigure(self, redis: Redis, config: SortedSetConfig) -> None:
        """A hot reload's queues (nothing else changed): a configured queue taken out is
        named removed in Redis before its poller stops and stays in upkeep until it holds
        no claim (as a removed discovered one); a name configured now is no longer
        discovered or removed."""
        static = config.queue_specs()
        names = {q.name for q in static}
        gone = [q for q in self.static if q.name not in names]
        back = [n for n in names if n in self._lingering or n in self.discovered]
        with redis_errors("queue discovery"):
            async with redis.pipeline(transaction=False) as pipe:
                if gone:
                    pipe.sadd(REMOVED_QUEUES_KEY, *(q.name for q in gone))
                    pipe.zrem(EMPTY_SINCE_KEY, *(q.name for q in gone))
                if back:
                    pipe.srem(REMOVED_QUEUES_KEY, *back)
                await pipe.execute()
        for name in back:
            self._lingering.pop(name, None)
            self.discovered.pop(name, None)
        self._lingering.update((q.name, q) for q in gone)
        self._config, self.static = config, static
        if self._lister is not None:
            self._lister.static = frozenset(names)

    async def restore(self, redis: Redis) -> None:
        """Once: the removed queues an earlier run left holding claims or retries join
        upkeep (a listed or configured one is served as such), if they pass the checks a
        discovered name passes: the set is read back from Redis, so it is untrusted."""
        if self._restored:
            return
        served = {q.name for q in self.static} | set(self.discovered)
        raws, more = await removed_members(redis, self._removed_cap)
        if more:  # left for a later start, once drop_empty has forgotten the empty ones
            self._rules.refuse("", "over_cap")
            log.warning("removed_queues_over_cap", read=self._removed_cap)
        listed = filter(None, map(text, raws))
        names = [n for n in listed if n not in served and self._allowed(n)]
        with redis_errors("queue discovery"):
            names = await self._rules.sorted_sets(redis, names)
        for name in names:
            self._lingering.setdefault(name, self._spec(name))
        self._restored = True

    def _allowed(self, name: str) -> bool:
        reason = self._rules.refusal(name)
        if reason is not None:
            self._rules.refuse(name, reason)
        return reason is None

    async def survey(self, removed: Iterable[bytes]) -> list[tuple[str, QueueSpec]]:
        """What a daemon of this config serves now, read-only (``status``, ``dead-letters``):
        (origin, queue) for each configured queue, each discovered one (the daemon's
        source, refusal rules and cap) and each removed one still named in
        ``REMOVED_QUEUES_KEY`` (``removed``, its members: draining claims or retries)."""
        served = [("configured", q) for q in self.static]
        if self._lister is not None:
            names = await self._lister.names(whole=True)  # a scan's whole cycle
            served += [("discovered", self._spec(n)) for n in names]
        known = {q.name for _, q in served}
        listed = filter(None, map(text, removed))
        removed_names = sorted(n for n in listed if n not in known and self._allowed(n))
        return [*served, *(("removed", self._spec(n)) for n in removed_names)]

    def _spec(self, name: str) -> QueueSpec:
        if self._config.queue_discovery is None:  # discovery turned off: upkeep only
            return QueueSpec(id=name, name=name)
        return self._config.discovered_spec(name)

    async def drop_empty(self, redis: Redis) -> None:
        """Forget removed queues that have held no claim and no retry for ``grace`` s.

        The time each was first seen empty is kept in Redis (``EMPTY_SINCE_KEY``, by
        Redis's clock), so every replica counts from the first sighting, and a claim or
        retry seen meanwhile restarts the count. The grace outlasts a lagging replica that
        has not refreshed yet and makes one last claim (then dies): that claim lands while
        the queue is still named, so someone reaps it. A queue named by an older daemon
        (no time recorded) starts its count at its first check.
        """
        names = list(self._lingering)
        if not names:
            return
        with redis_errors("queue discovery"):
            now = await _redis_now(redis)
            async with redis.pipeline(transaction=False) as pipe:
                for name in names:  # claims (either layout) and retries
                    pipe.zcard(self._keys.claims_idx(name))
                    pipe.zcard(self._keys.inflight(name))
                    pipe.zcard(self._removed_keys.retry(name, ""))
                counts = await pipe.execute()
            busy = [n for i, n in enumerate(names) if any(counts[3 * i : 3 * i + 3])]
            empty = [n for n in names if n not in busy]
            async with redis.pipeline(transaction=False) as pipe:
                if busy:
                    pipe.zrem(EMPTY_SINCE_KEY, *busy)
                for name in empty:
                    pipe.zadd(EMPTY_SINCE_KEY, {name: now}, nx=True)
                if empty:
                    pipe.zmscore(EMPTY_SINCE_KEY, empty)
                since = (await pipe.execute())[-1] if empty else []
            done = [n for n, t in zip(empty, since, strict=True) if now - t >= self._grace]
            if done:  # the time first: a kill between the two restarts the count, never ends it
                await redis.zrem(EMPTY_SINCE_KEY, *done)
                await redis.srem(REMOVED_QUEUES_KEY, *done)
        for name in done:
            del self._lingering[name]

    def names(self) -> Sequence[str]:
        return [q.name for q in self.upkeep]
