"""redis-sortedset transport: leased claims from deadline-ordered sorted sets.

Stage: broker I/O for ``--transport redis-sortedset``. Input: ``SortedSetConfig`` (queues
are sorted sets of envelopes scored by deadline). Output: ``Delivery`` objects for the
poller; results on Redis lists; hand-backs on the queue or the shared retry set.

At-least-once (docs/architecture.md G1), in upstream's claim layout (llm-d-async #412, so
Go daemons v0.9.1+ share the queue): a fetch moves members into ``<queue>:claimed`` /
``:claim-owners`` / ``:claims-idx`` under a lease and this process's owner token (one Lua
call); the heartbeat renews the claims still ours; any replica's reaper (or a Go daemon's)
puts expired claims back at their queue score; ``complete``/``defer``/``dead_letter``
acknowledge a claim atomically with their write, only while it is still ours (fenced). ``kill
-9`` loses nothing: a dead replica's claims come back after one lease. The current
release's ``<queue>:inflight`` claims are still reaped (``reap_legacy``, upgrades).

Exactly one result (G2): ``complete`` writes the result only if it sets the marker
``request-done:<id>:<fp>`` (TTL ``dedup_ttl_seconds``) in the same script. ``fp`` is the
envelope's ``request_token`` (the client sets a fresh one per submission, so a resubmitted
id gets a new result), else a digest of the request itself (a resubmission that changes
anything, e.g. its deadline, is new; a byte-identical one within the TTL is a duplicate),
else (undecodable message) the id alone for the TTL. With ``wait_replicas`` the same
pipeline ends in ``WAIT``, so a batch's results are on that many replicas before the
next one is written (docs/transports.md has what that buys on a failover).
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import replace
from typing import Literal

import structlog
from redis.asyncio import Redis

from async_processor.backlog_metrics import Backlog
from async_processor.config import SortedSetConfig
from async_processor.config.queues import QueueSpec
from async_processor.errors import TransportError
from async_processor.json_scan import id_from_prefix
from async_processor.messages import (
    LET_GO,
    Envelope,
    ErrorCode,
    Result,
    decode_envelope,
    too_large,
)
from async_processor.redis import entries, keys
from async_processor.redis.conn import connect
from async_processor.redis.conn import redis_errors as redis_errors
from async_processor.redis.keyspace import KeySpace
from async_processor.transports.base import (
    TRANSPORTS,
    Deferral,
    Delivery,
    TransportContext,
)
from async_processor.transports.redis_sortedset.claims import (
    Claim,
    ClaimBook,
    claim_of,
    defer_args,
    key_bytes,
)
from async_processor.transports.redis_sortedset.dataset import DatasetWatch
from async_processor.transports.redis_sortedset.discovery import (
    queue_catalog,
    transport_own_keys,
)
from async_processor.transports.redis_sortedset.fetch import Fetcher
from async_processor.transports.redis_sortedset.markers import MarkerChecks
from async_processor.transports.redis_sortedset.payloads import StoredPayloads
from async_processor.transports.redis_sortedset.proximity import read_backlogs
from async_processor.transports.redis_sortedset.routing import ROUTE_REJECTIONS, ResultRouting
from async_processor.transports.redis_sortedset.upkeep import SortedSetUpkeep
from async_processor.transports.redis_sortedset.writes import ResultWrites

log = structlog.get_logger(__name__)

ABANDON_REASONS = (
    "write_failed",
    "settle_timeout",
    "dead_letter_failed",
    "hand_back_timeout",
    "lease_entry_missing",  # the reaper's (upkeep)
)
# What ``_got_back`` found per delivery: its bytes held (again), its claim no longer held,
# or its claim held without its bytes, and answered with a failure result.
Back = Literal["held", "lapsed", "answered"]
HELD: Back = "held"
LAPSED: Back = "lapsed"
ANSWERED: Back = "answered"
BYTES_LOST_TEXT = "message bytes lost from the lease; cannot retry"


class SortedSetTransport(ResultWrites, MarkerChecks, SortedSetUpkeep, StoredPayloads):
    kind = "redis-sortedset"

    def __init__(
        self, config: SortedSetConfig, ctx: TransportContext, *, client: Redis | None = None
    ) -> None:
        self.config = config
        self._ctx = ctx
        self._redis = client if client is not None else connect(config.redis_connection())
        discovery = config.queue_discovery
        self._keys = KeySpace(cluster=config.mode == "cluster", queue_retry=discovery is not None)
        self._scripts = self._keys.scripts(self._redis)
        static = config.queue_specs()
        self._claims = ClaimBook([q.name for q in static])  # the heartbeat renews what it holds
        # Upstream's owner token: one per process, 16 hex characters (8 random bytes).
        self._owner = secrets.token_hex(8)
        self._dataset = DatasetWatch(self._redis, ctx.metrics)
        self._fetcher = Fetcher(
            self._redis,
            self._keys,
            self._scripts,
            self._claims,
            self._check_markers,
            owner=self._owner,
            lease=config.lease_seconds,
            max_bytes=ctx.max_message_bytes,
            metrics=ctx.metrics,
        )
        self._own = transport_own_keys(config, ctx.gate_params)
        self._catalog = queue_catalog(config, self._redis, self._keys, self._own, ctx.metrics)
        self.queues: Sequence[QueueSpec] = self._catalog.upkeep
        self._gather()
        self._routing = ResultRouting(config, self._keys, self._routed_own(), ctx.metrics)
        self._first_series(self.queues)

    def _first_series(self, queues: Sequence[QueueSpec]) -> None:
        """Every series of ``queues`` at 0 from the start, so alerts see a rise."""
        metrics = self._ctx.metrics
        if metrics is None:
            return
        for queue in queues:
            for reason in ROUTE_REJECTIONS:
                metrics.result_route_rejected_total.labels(queue.name, reason)
            for reason in ABANDON_REASONS:
                metrics.abandoned_total.labels(queue.name, reason)
            metrics.dead_letter_trimmed_total.labels(queue.name)
            metrics.legacy_claims_returned_total.labels(queue.name)
        for result_list in self.config.result_ttls():
            metrics.results_trimmed_total.labels(result_list)

    def _gather(self) -> None:
        """Rounds wait for other queues' claims only when there are other queues polled (a
        removed queue draining its claims is in upkeep, but no fetch of its joins a round)."""
        polled = len(self._catalog.static) + len(self._catalog.discovered)
        self._fetcher.gather = self.config.claim_gather_ms / 1000 if polled > 1 else 0.0

    def _routed_own(self) -> keys.OwnKeys:
        """The keys no message may name as its result list: ours, and every queue's."""
        names = self._catalog.names()
        own = replace(self._own, exact=self._own.exact | keys.queue_keys(names))
        return self._keys.own_keys(own, names)

    async def discover(self) -> list[QueueSpec]:
        """The discovered queues to poll now (``queue_discovery``); upkeep follows them,
        and removed ones until they hold no claim and no retry."""
        discovered = await self._catalog.refresh(self._redis)
        self._follow()
        if self._ctx.metrics is not None:
            self._ctx.metrics.discovered_queues.set(len(discovered))
        return discovered

    async def reconfigure(self, config: SortedSetConfig) -> None:
        """A hot reload's config (only ``queues`` differ); a removed queue stays in upkeep
        until it holds no claim."""
        await self._catalog.reconfigure(self._redis, config)
        self.config = config
        self._own = transport_own_keys(config, self._ctx.gate_params)
        self._follow()
        self._first_series(config.queue_specs())

    def _follow(self) -> None:
        self.queues = self._catalog.upkeep
        self._claims.prune(self._catalog.names())
        self._fetcher.served(set(self._catalog.names()))
        self._gather()
        self._routing.own = self._routed_own()

    # ------------------------------------------------------------------ fetch and decode

    async def fetch(self, queue: QueueSpec, limit: int, wait: float) -> list[Delivery]:
        """Claim up to ``limit`` earliest-deadline members, in a round with other queues'
        claims; an empty queue waits up to ``wait`` s for the idle probe (fetch.py)."""
        return await self._fetcher.fetch(queue, limit, wait)

    async def until_ready(self, queue: QueueSpec) -> None:
        """Return once ``queue`` may hold members: at once unless its last claim found it
        empty; then when the idle probe sees members in it."""
        await self._fetcher.until_ready(queue)

    def decode(self, delivery: Delivery) -> Envelope:
        """The member's envelope with routing filled from the queue (queue labels win)."""
        if delivery.envelope is not None:  # decoded at fetch time already
            return delivery.envelope
        limit = self._ctx.max_message_bytes
        claim = delivery.handle
        if isinstance(claim, Claim) and claim.digest:  # only a prefix was fetched
            raise too_large(claim.size, limit, id_from_prefix(delivery.raw))
        delivery.envelope = entries.decode_queued(delivery.raw, delivery.queue, limit)
        return delivery.envelope

    # ------------------------------------------------------------------ the message's bytes

    def let_go(self, delivery: Delivery) -> None:
        """Drop the message's bytes as its request goes out (``LetsGo``): a request waits
        seconds at the gateway, and its bytes (4.4 KB at 4 KiB payloads) were most of what
        the daemon held per request in flight (issue 13). While the claim is held
        ``<queue>:claimed`` has the member, which a hand-back or a dead letter reads back
        (``_got_back``); kept is its dedup fingerprint (a digest of the request, payload
        included). A member fetched as a prefix only (oversized) never gets this far."""
        claim = claim_of(delivery)
        envelope = delivery.envelope
        if envelope is None or claim.let_go or claim.digest:
            return
        claim.fingerprint = entries.fingerprint(envelope)
        claim.let_go = True
        delivery.raw = b""
        envelope.request.payload = LET_GO

    async def _got_back(self, deliveries: Sequence[Delivery]) -> list[Back]:
        """Per delivery, whether it holds its bytes again: those let go are read back from
        ``<queue>:claimed`` while the claim is ours, in one round trip. ``LAPSED``: the
        claim is no longer ours (its lease lapsed, and a reaper put the message back on its
        queue). ``ANSWERED``: the claim is still ours but its member is gone (an eviction,
        a DEL of the hash): no bytes to hand back, and the reaper would drop the claim
        without a trace, so the message ends here with a failure result (``_answer_lost``)."""
        gone = [d for d in deliveries if claim_of(d).let_go]
        lost: list[Delivery] = []
        if gone:
            async with self._redis.pipeline(transaction=False) as pipe:
                for delivery in gone:
                    name, key = delivery.queue.name, key_bytes(claim_of(delivery))
                    pipe.hget(self._keys.claimed(name), key)
                    pipe.hget(self._keys.owners(name), key)
                replies = await pipe.execute()
            for delivery, member, owner in zip(gone, replies[::2], replies[1::2], strict=True):
                if owner != self._owner.encode():
                    continue  # lapsed: not ours any more
                if member is not None:
                    self._restore(delivery, member)
                else:
                    lost.append(delivery)
            await self._answer_lost(lost)
        return [_back(d, lost) for d in deliveries]

    async def _answer_lost(self, deliveries: list[Delivery]) -> None:
        """A failure result for each held claim whose bytes are gone from its lease entry,
        acknowledging the claim in the same script: the message cannot be retried or
        parked, but it still ends as exactly one result (docs/architecture.md G2)."""
        if not deliveries:
            return
        items = []
        for delivery in deliveries:
            request_id = delivery.envelope.id if delivery.envelope else claim_of(delivery).id
            log.error("message_bytes_lost", queue=delivery.queue.name, request_id=request_id)
            failure = Result.failure(request_id, ErrorCode.INFERENCE_ERROR, BYTES_LOST_TEXT)
            items.append((delivery, failure))
        replies = await self._write_results(items, queued=False)
        for delivery, reply in zip(deliveries, replies, strict=True):
            if isinstance(reply, TransportError):  # a key of the wrong type: left to its lease
                log.error(
                    "message_bytes_lost_unanswered", queue=delivery.queue.name, error=str(reply)
                )

    def _restore(self, delivery: Delivery, member: bytes) -> None:
        """The member's bytes and payload back; routing stays as the worker left it (a
        retry's count and last answer), the payload byte for byte as the producer wrote it."""
        fresh = decode_envelope(member, max_bytes=self._ctx.max_message_bytes)
        delivery.raw = member
        if delivery.envelope is not None:
            delivery.envelope.request.payload = fresh.request.payload
        claim_of(delivery).let_go = False

    # ------------------------------------------------------------------ acknowledgements

    async def defer(self, items: Sequence[Deferral]) -> None:
        """Hand back: delay <= 0 to the queue at its deadline, else to the retry set."""
        if not items:
            return
        with self._claims.acking(i.delivery for i in items), redis_errors("defer"):
            backs = await self._got_back([i.delivery for i in items])
            kept = [i for i, back in zip(items, backs, strict=True) if back == HELD]
            replies = iter(await self._hand_back(kept))
        for item, back in zip(items, backs, strict=True):
            self._claims.release(item.delivery)
            if back != ANSWERED and not (back == HELD and next(replies)):
                log.warning("defer_skipped_lease_lost", queue=item.delivery.queue.name)

    async def _hand_back(self, items: Sequence[Deferral]) -> list[int]:
        """The defer script per item, in one round trip: 1 handed back, 0 claim not held."""
        if not items:
            return []
        async with self._redis.pipeline(transaction=False) as pipe:
            for item in items:
                await self._scripts["defer"](
                    keys=self._ack_keys(item.delivery, self._defer_target(item)),
                    args=[key_bytes(claim_of(item.delivery)), *defer_args(item), self._owner],
                    client=pipe,
                )
            return list(await pipe.execute())

    def _defer_target(self, item: Deferral) -> str:
        queue = item.delivery.queue.name
        return queue if item.delay <= 0 else self._keys.retry(queue, self.config.retry_queue_name)

    async def dead_letter(self, delivery: Delivery, reason: str, detail: str) -> None:
        """Park on ``<queue>:dead-letter`` as {reason, detail, raw, time, queue}; ack it."""
        claim = claim_of(delivery)
        target = self._keys.dead_letter(delivery.queue.name)
        parked, trimmed = 0, 0
        with self._claims.acking([delivery]), redis_errors("dead_letter"):
            [back] = await self._got_back([delivery])
            if back == HELD:
                entry = entries.dead_letter_entry(
                    delivery.raw,
                    delivery.queue.name,
                    reason,
                    detail,
                    size=claim.size,
                    digest=claim.digest,
                )
                parked, trimmed = await self._scripts["dead_letter"](
                    keys=self._ack_keys(delivery, target),
                    args=[
                        key_bytes(claim),
                        entry,
                        self.config.dead_letter_max_entries,
                        self._owner,
                    ],
                )
        self._claims.release(delivery)
        if not parked and back != ANSWERED:
            log.warning("dead_letter_skipped_lease_lost", queue=delivery.queue.name)
        if trimmed:
            log.warning("dead_letters_trimmed", queue=delivery.queue.name, count=trimmed)
            if self._ctx.metrics is not None:
                self._ctx.metrics.dead_letter_trimmed_total.labels(delivery.queue.name).inc(trimmed)

    def _ack_keys(self, delivery: Delivery, target: str) -> list[str]:
        return [*self._keys.claim_keys(delivery.queue.name), target]

    def abandon(self, delivery: Delivery, reason: str) -> None:
        """Stop renewing a claim whose write was given up: its lease expires within
        ``lease_seconds`` and any replica's reaper puts the message back
        (docs/architecture.md G11)."""
        self._claims.release(delivery)
        queue = delivery.queue.name
        request_id = delivery.envelope.id if delivery.envelope else None
        log.warning("claim_abandoned", queue=queue, request_id=request_id, reason=reason)
        if self._ctx.metrics is not None:
            self._ctx.metrics.abandoned_total.labels(queue, reason).inc()

    # ------------------------------------------------------------------ queries

    async def backlog(self, queue: QueueSpec) -> int | None:
        """Members waiting in the queue (claimed ones not counted)."""
        with redis_errors("backlog"):
            return int(await self._redis.zcard(queue.name))

    async def backlogs(self, queues: Sequence[QueueSpec], now: float) -> dict[str, Backlog | None]:
        """Every queue's depth and deadline proximity in two round trips (``proximity``)."""
        return await read_backlogs(self._redis, queues, now, atomic=not self._keys.cluster)

    async def health(self) -> None:
        with redis_errors("ping"):
            await self._redis.ping()

    async def aclose(self) -> None:
        await self._redis.aclose()


def _back(delivery: Delivery, lost: list[Delivery]) -> Back:
    if any(delivery is d for d in lost):
        return ANSWERED
    return LAPSED if claim_of(delivery).let_go else HELD


@TRANSPORTS.register("redis-sortedset", SortedSetConfig)
def build(config: SortedSetConfig, ctx: TransportContext) -> SortedSetTransport:
    return SortedSetTransport(config, ctx)
