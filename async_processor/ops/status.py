"""``async-processor status``: one screen of broker state per queue, for operators and scripts.

Stage: outside the daemon (read-only; also the source of ``exporter``'s gauges). Input:
the daemon's own flags and config (so it looks at exactly the keys the daemon uses).
Output: per queue its depth, claims in flight, retries due / parked, oldest deadline and
dead letters; per result list its length and the age of its oldest unconsumed result;
as a table, or JSON with ``--json``. With ``queue_discovery`` the queues are the daemon's:
configured, discovered (the same set or prefix scan, refusal rules and cap) and removed
ones still draining, each with its own retry set and result list.

What each transport can tell: the sorted set has all of it. redis-pubsub channels keep no
backlog (depth and in flight are unknown), but its retry set and dead-letter lists are
Redis keys. gcp-pubsub reports the undelivered messages of each subscription from Cloud
Monitoring (unknown on the emulator or without credentials); the rest lives in Pub/Sub.
Unknown is ``null`` in JSON and ``-`` in the table, never 0.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import anyio
from redis.asyncio import Redis

from async_processor.cli.args import daemon_config
from async_processor.config import AppConfig, GcpPubSubConfig, RedisPubSubConfig, SortedSetConfig
from async_processor.config.queues import QueueSpec
from async_processor.errors import TransportError
from async_processor.ops.status_table import QueueStatus, Status, render
from async_processor.redis.conn import connect, redis_errors
from async_processor.redis.keys import REMOVED_QUEUES_KEY, result_side_key
from async_processor.redis.keyspace import KeySpace
from async_processor.transports.redis_sortedset.discovery import (
    SCAN_COUNT,
    queue_catalog,
    removed_cap,
    removed_members,
    transport_own_keys,
)

RETRY_SCAN_CHUNK = 1000  # retry-set members read per round trip


async def collect(
    config: AppConfig, *, per_queue_retries: bool = True, result_ages: bool = True
) -> Status:
    """The status of every configured queue and result list (TransportError if unreachable).

    ``per_queue_retries`` reads every retry-set member to tell which queue it returns to
    (about 1 s per 100,000 members); without it only the set's totals are counted.
    ``result_ages`` dates each result list's oldest unconsumed result (``oldest_results``).
    """
    transport = config.transport_config
    if isinstance(transport, GcpPubSubConfig):
        return await _gcp_status(config.transport, transport)
    client = connect(transport.redis_connection())
    try:
        gates = [pool.gate_params for pool in config.pools]
        return await redis_status(
            config.transport, transport, client, per_queue_retries, result_ages, gates
        )
    finally:
        await client.aclose()


async def redis_status(
    name: str,
    config: SortedSetConfig | RedisPubSubConfig,
    client: Redis,
    per_queue_retries: bool = True,
    result_ages: bool = True,
    pool_gate_params: Sequence[Mapping[str, Any]] = (),
) -> Status:
    now, removed = await _clock_and_removed(client, config)
    served = await served_queues(config, client, removed, pool_gate_params)
    keyspace = _keyspace(config)
    retry_sets = _retry_sets(keyspace, config, served)
    # Only the sorted set's results are dated (by the daemon's retention rounds).
    dated = result_ages and isinstance(config, SortedSetConfig)
    result_lists = _result_lists(config, [q for _, q in served])
    with redis_errors("status"):
        counts = await _counts(
            client, keyspace, config, [q for _, q in served], result_lists, list(retry_sets), now,
            dated=dated,
        )  # fmt: skip
        replies = iter(counts)
        due: Counter[str] = Counter()
        parked: Counter[str] = Counter()
        for retry_set, origins in retry_sets.items() if per_queue_retries else ():
            if len(origins) > 1:  # a shared set: its members say where they return
                set_due, set_parked = await _retries(client, retry_set, origins, now)
                due, parked = due + set_due, parked + set_parked
    statuses = [_queue_status(origin, queue, config, replies) for origin, queue in served]
    lengths: dict[str, int | None] = {}
    ages: dict[str, float | None] = {}
    for result_list in result_lists:
        lengths[result_list] = length = next(replies)
        if dated:
            ages[result_list] = _oldest_age(length, next(replies), next(replies), now)
    retries = {r: {"due": next(replies), "parked": next(replies)} for r in retry_sets}
    if per_queue_retries:
        for retry_set, origins in retry_sets.items():
            if len(origins) == 1:  # a queue's own set: counted by score already
                due[origins[0]] += retries[retry_set]["due"]
                parked[origins[0]] += retries[retry_set]["parked"]
        for status in statuses:
            status.retry_due, status.retry_parked = due[status.queue], parked[status.queue]
    return Status(name, now, statuses, lengths, retries, ages)


async def _clock_and_removed(
    client: Redis, config: SortedSetConfig | RedisPubSubConfig
) -> tuple[float, list[bytes] | None]:
    """Redis's clock and the removed queues still draining (a few, while they drain; at
    most ``removed_cap``: anyone who can write to Redis can fill that set), in one round
    trip for a small set, but a cluster pipeline takes no TIME."""
    if not isinstance(config, SortedSetConfig):  # no removed queues
        with redis_errors("status"):
            seconds, micros = await client.time()
        return seconds + micros / 1e6, None
    with redis_errors("status"):
        if config.mode == "cluster":
            (seconds, micros), page = await client.time(), None
        else:
            async with client.pipeline(transaction=False) as pipe:
                pipe.time()
                pipe.sscan(REMOVED_QUEUES_KEY, 0, count=SCAN_COUNT)
                (seconds, micros), page = await pipe.execute()
    removed, _ = await removed_members(client, removed_cap(config), page)
    return seconds + micros / 1e6, removed


async def served_queues(
    config: SortedSetConfig | RedisPubSubConfig,
    client: Redis,
    removed: Iterable[bytes] | None,
    pool_gate_params: Sequence[Mapping[str, Any]] = (),
) -> list[tuple[str, QueueSpec]]:
    """(origin, queue) for every queue a daemon of ``config`` serves now: configured, and
    on redis-sortedset the discovered ones (read as the daemon reads them) and the removed
    ones still draining (``removed``: the members of ``REMOVED_QUEUES_KEY``, read here if
    None; with discovery turned off too), by ``QueueCatalog.survey``."""
    if not isinstance(config, SortedSetConfig):
        return [("configured", q) for q in config.queue_specs()]
    if removed is None:
        removed, _ = await removed_members(client, removed_cap(config))
    keyspace = _keyspace(config)
    own = transport_own_keys(config, pool_gate_params)
    return await queue_catalog(config, client, keyspace, own, None).survey(removed)


def _keyspace(config: SortedSetConfig | RedisPubSubConfig) -> KeySpace:
    """The daemon's key names: with discovery, a retry set per queue."""
    discovery = isinstance(config, SortedSetConfig) and config.queue_discovery is not None
    return KeySpace(cluster=config.mode == "cluster", queue_retry=discovery)


def _queue_status(
    origin: str, queue: QueueSpec, config: SortedSetConfig | RedisPubSubConfig, replies: Any
) -> QueueStatus:
    status = QueueStatus(queue.name, queue.pool, dead_letters=next(replies), origin=origin)
    if isinstance(config, SortedSetConfig):
        # Claims in upstream's layout (ours and a Go daemon's), plus the previous release's.
        status.depth, status.in_flight = next(replies), next(replies) + next(replies)
        oldest = next(replies)
        status.oldest_deadline = oldest[0][1] if oldest else None
    return status


def _oldest_age(
    length: int, pushed: bytes | None, marks: list[tuple[bytes, float]], now: float
) -> float | None:
    """The age of a result list's oldest unconsumed result, from the marks the daemon's
    retention rounds keep (``lua/retain.lua``): result n was written no later than the
    first mark whose count reaches n."""
    oldest = int(pushed or 0) - int(length) + 1
    dated = [when for count, when in marks if int(count) >= oldest]
    return None if not length or not marks else now - min(dated, default=now)


def _retry_sets(
    keyspace: KeySpace,
    config: SortedSetConfig | RedisPubSubConfig,
    served: list[tuple[str, QueueSpec]],
) -> dict[str, list[str]]:
    """Retry set -> the queues whose retries it holds: one shared set (its configured
    queues), or one per queue (cluster mode, discovery, and always a removed discovered
    queue's). With discovery the shared set is listed too: the daemon still moves home
    what an earlier deployment left there."""
    own = replace(keyspace, queue_retry=True)
    sets: dict[str, list[str]] = {}
    for origin, queue in served:
        retry = (own if origin == "removed" else keyspace).retry(
            queue.name, config.retry_queue_name
        )
        sets.setdefault(retry, []).append(queue.name)
    if keyspace.queue_retry and not keyspace.cluster and config.queues:
        sets[config.retry_queue_name] = [q.queue_name for q in config.queues]
    return sets


async def _counts(
    client: Redis,
    keyspace: KeySpace,
    config: SortedSetConfig | RedisPubSubConfig,
    queues: list[QueueSpec],
    result_lists: list[str],
    retry_sets: list[str],
    now: float,
    *,
    dated: bool,
) -> list[Any]:
    """One round trip: per queue its counts, then the result lists (each its length, and
    with ``dated`` its retention counter and marks), then the retry sets.

    A transaction (one consistent snapshot) where one node has every key; in a cluster the
    keys sit in each queue's slot, so the pipeline goes node by node.
    """
    async with client.pipeline(transaction=not keyspace.cluster) as pipe:
        for queue in (q.name for q in queues):
            pipe.llen(keyspace.dead_letter(queue))
            if isinstance(config, SortedSetConfig):
                pipe.zcard(queue)
                pipe.zcard(keyspace.claims_idx(queue))
                pipe.zcard(keyspace.inflight(queue))
                pipe.zrange(queue, 0, 0, withscores=True)
        for result_list in result_lists:
            pipe.llen(result_list)
            if dated:
                pipe.get(result_side_key(result_list, "pushed"))
                pipe.zrange(result_side_key(result_list, "marks"), 0, -1, withscores=True)
        for retry_set in retry_sets:
            pipe.zcount(retry_set, "-inf", now)
            pipe.zcount(retry_set, f"({now}", "+inf")
        return list(await pipe.execute())


def _result_lists(
    config: SortedSetConfig | RedisPubSubConfig, queues: list[QueueSpec]
) -> list[str]:
    """The configured result lists and each served queue's own (a message may route
    elsewhere; those are not known)."""
    names = [config.result_queue_name]
    if isinstance(config, SortedSetConfig):
        names += [q.result_queue_name for q in queues if q.result_queue_name]
    return list(dict.fromkeys(names))


async def _retries(
    client: Redis, retry_set: str, queues: Sequence[str], now: float
) -> tuple[Counter[str], Counter[str]]:
    """Retry-set members per origin queue: (due, parked), read in chunks.

    Paging by rank while the mover works may count a member twice or miss one: a
    snapshot for people, not an invariant.

    The origin is the envelope's ``internal.request_queue_name`` when it is a configured
    queue, else the first queue, as the retry mover (``lua/move_due.lua``) decides.
    """
    due: Counter[str] = Counter()
    parked: Counter[str] = Counter()
    start = 0
    while True:
        last = start + RETRY_SCAN_CHUNK - 1
        chunk: list[tuple[bytes, float]] = await client.zrange(  # type: ignore[assignment]
            retry_set, start, last, withscores=True
        )
        for member, score in chunk:
            (due if score <= now else parked)[_origin(member, queues)] += 1
        if len(chunk) < RETRY_SCAN_CHUNK:
            return due, parked
        start += RETRY_SCAN_CHUNK


def _origin(member: bytes, queues: Sequence[str]) -> str:
    try:
        routing = json.loads(member).get("internal")
        name = routing.get("request_queue_name") if isinstance(routing, dict) else None
    except (ValueError, AttributeError):  # not JSON, or not an object
        name = None
    return str(name) if name in queues else queues[0]


async def _gcp_status(name: str, config: GcpPubSubConfig) -> Status:
    # Imported here: the Google libraries load only for the gcp transport (as in the daemon).
    from async_processor.transports.gcp_pubsub.backlog import BacklogReader
    from async_processor.transports.gcp_pubsub.transport import resource_path

    reader = BacklogReader(config.project_id, enabled=not os.environ.get("PUBSUB_EMULATOR_HOST"))
    statuses = []
    try:
        for topic in config.topics:
            path = resource_path(config.project_id, "subscriptions", topic.subscriber_id)
            depth = await reader.undelivered(path)
            statuses.append(QueueStatus(topic.subscriber_id, topic.worker_pool_id, depth=depth))
    finally:
        await reader.aclose()
    return Status(name, time.time(), statuses)


# -- output ---------------------------------------------------------------------------


def _flags(parser: argparse.ArgumentParser) -> None:
    parser.description = "Queue depth, in flight, retries, oldest deadline and dead letters."
    parser.add_argument("--json", action="store_true", help="print JSON (for scripts)")


def main(argv: list[str]) -> int:
    """``async-processor status [the daemon's flags] [--json]``; exit 1 if unreachable."""
    config, opts = daemon_config(argv, "async-processor status", _flags)
    try:
        status = anyio.run(collect, config)
    except TransportError as exc:
        print(f"async-processor status: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(status.to_json(), indent=2) if opts["json"] else render(status))
    return 0
