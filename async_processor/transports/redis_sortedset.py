"""redis-sortedset transport: leased claims from deadline-ordered sorted sets.

Stage: broker I/O for ``--transport redis-sortedset``. Input: ``SortedSetConfig`` (queues
are sorted sets of envelopes scored by deadline). Output: ``Delivery`` objects for the
poller; results on Redis lists; hand-backs on the queue or the shared retry set.

At-least-once (docs/architecture.md G1): a fetch moves members into ``<queue>:inflight`` under a
lease (one Lua call); the heartbeat extends the leases this process holds; any replica's
reaper puts expired claims back with their deadline score; ``complete``/``defer``/
``dead_letter`` acknowledge a claim atomically with their write. ``kill -9`` loses nothing:
a dead replica's claims come back after one lease.

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

import itertools
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import anyio
import structlog
from anyio.abc import TaskStatus
from redis.asyncio import Redis
from redis.commands.core import AsyncScript

from async_processor.config import SortedSetConfig
from async_processor.errors import InvalidMessage, TransportError
from async_processor.json_scan import id_from_prefix
from async_processor.messages import ID_PREFIX_BYTES, Envelope, Result, too_large
from async_processor.retry import expired, last_answer
from async_processor.transports import redis_keys as keys
from async_processor.transports.base import (
    TRANSPORTS,
    Completion,
    Deferral,
    Delivery,
    QueueSpec,
    TransportContext,
)
from async_processor.transports.redis_conn import connect
from async_processor.transports.redis_keys import redis_errors as redis_errors
from async_processor.transports.redis_keyspace import KeySpace

log = structlog.get_logger(__name__)

FETCH_POLL_STEP = 0.1  # seconds between claim attempts while a fetch waits on an empty queue
RETRY_MOVE_INTERVAL = 0.2  # seconds between checks of the retry set for due members
CHUNK = 500  # members per reaper / retry-mover / heartbeat script call
ROUTE_REJECTIONS = ("reserved_key", "pattern_mismatch", "wrong_type", "cross_slot")
ABANDON_REASONS = ("write_failed", "settle_timeout", "dead_letter_failed")
EXPIRE_INTERVAL = 0.5  # seconds between deadline sweeps: results within ~1 s of a deadline
RETAIN_INTERVAL = 10.0  # seconds between retention rounds: results trimmed within TTL + this
EXPIRE_CHUNK = 20  # members decoded per sweep round trip (each up to --max-message-bytes)
UPKEEP_MAX_BACKOFF = 5.0
# Stop extending a claim this long after its deadline: by then the pipeline has answered
# it, so a claim still held is a leak, and letting it expire hands the message back.
STALE_CLAIM_GRACE = 300.0


@dataclass(frozen=True, slots=True)
class Claim:
    """A delivery's receipt: the claim id in ``<queue>:inflight`` and its original score.

    ``cancelled`` is the cancel check made with the fetch (one MGET per batch instead of a
    GET per message); the first ``is_cancelled`` uses it, later ones ask Redis again.
    ``size`` is the member's size in bytes; ``digest`` (its SHA-1) is set only for a member
    over ``--max-message-bytes``, of which the delivery holds a prefix only.
    """

    id: str
    score: float
    size: int = 0
    digest: str = ""
    cancelled: bool | None = None


class SortedSetTransport:
    kind = "redis-sortedset"

    def __init__(
        self, config: SortedSetConfig, ctx: TransportContext, *, client: Redis | None = None
    ) -> None:
        self.config = config
        self.queues: Sequence[QueueSpec] = config.queue_specs()
        self._ctx = ctx
        self._redis = client if client is not None else connect(config.redis_connection())
        self._keys = KeySpace(cluster=config.mode == "cluster")
        self._scripts = self._keys.scripts(self._redis)
        self._owner = uuid.uuid4().hex  # claim ids are unique per process and fetch
        self._fetches = itertools.count()
        # Claims this process holds, per queue name: the heartbeat extends them.
        self._held: dict[str, dict[str, Delivery]] = {q.name: {} for q in self.queues}
        # Claims whose ack is on its way: a heartbeat that misses them is not a lost lease.
        self._settling: set[str] = set()
        names = [q.name for q in self.queues]
        own = keys.own_keys(
            names,
            config.retry_queue_name,
            [*(q.gate_params for q in self.queues), *ctx.gate_params],
            config.result_queue_pattern,
        )
        self._own_keys = self._keys.own_keys(own, names)
        if ctx.metrics is not None:  # every series at 0 from the start, so alerts see a rise
            for queue in self.queues:
                for reason in ROUTE_REJECTIONS:
                    ctx.metrics.result_route_rejected_total.labels(queue.name, reason)
                for reason in ABANDON_REASONS:
                    ctx.metrics.abandoned_total.labels(queue.name, reason)
                ctx.metrics.dead_letter_trimmed_total.labels(queue.name)
            for result_list in config.result_ttls():
                ctx.metrics.results_trimmed_total.labels(result_list)

    # ------------------------------------------------------------------ fetch and decode

    async def fetch(self, queue: QueueSpec, limit: int, wait: float) -> list[Delivery]:
        """Claim up to ``limit`` earliest-deadline members; poll an empty queue for ``wait`` s."""
        if limit <= 0:
            return []
        give_up = anyio.current_time() + wait
        while True:
            deliveries = await self._claim(queue, limit)
            remaining = give_up - anyio.current_time()
            if deliveries or remaining <= 0:
                return deliveries
            await anyio.sleep(min(remaining, FETCH_POLL_STEP))

    async def _claim(self, queue: QueueSpec, limit: int) -> list[Delivery]:
        prefix = f"{self._owner}:{next(self._fetches)}"
        with redis_errors("claim"):
            flat = await self._scripts["claim"](
                keys=[
                    queue.name,
                    self._keys.inflight(queue.name),
                    self._keys.inflight_meta(queue.name),
                ],
                args=[
                    limit,
                    self.config.lease_seconds,
                    prefix,
                    self._ctx.max_message_bytes,
                    ID_PREFIX_BYTES,
                ],
            )
        held = self._held.setdefault(queue.name, {})
        deliveries = []
        for i in range(0, len(flat), 5):
            claim = Claim(
                id=flat[i].decode(),
                score=float(flat[i + 2]),
                size=int(flat[i + 3]),
                digest=flat[i + 4].decode(),
            )
            delivery = Delivery(queue=queue, raw=bytes(flat[i + 1]), handle=claim)
            held[claim.id] = delivery
            deliveries.append(delivery)
        return await self._check_markers(deliveries)

    async def _check_markers(self, deliveries: list[Delivery]) -> list[Delivery]:
        """Read the batch's cancel and live markers in one MGET (best effort: a failure
        leaves the cancel check to ``is_cancelled``, since the claim has succeeded).

        A member whose queue's ``live:<id>`` marker holds another token is a second entry
        of a live id (written around the client's index, e.g. by a plain ZADD): it is
        parked as ``superseded``, so two entries of one id are never both dispatched."""
        tokened = [d for d in deliveries if self._decodes(d) and _token(d)]
        if not tokened:
            return deliveries
        names = [self._cancel_key(d) for d in tokened] + [self._live_key(d) for d in tokened]
        try:
            with redis_errors("cancel check"):
                values = await self._redis.mget(names)
        except TransportError:
            return deliveries
        superseded = []
        for delivery, cancel, live in zip(
            tokened, values[: len(tokened)], values[len(tokened) :], strict=True
        ):
            token = _token(delivery).encode()
            delivery.handle = replace(_claim(delivery), cancelled=cancel == token)
            if live is not None and live != token:
                superseded.append(delivery)
        for delivery in superseded:
            await self._park_superseded(delivery)
        return [d for d in deliveries if d not in superseded]

    async def _park_superseded(self, delivery: Delivery) -> None:
        queue = delivery.queue
        await self.dead_letter(
            delivery, "superseded", "another submission of this id is live on this queue"
        )
        if self._ctx.metrics is not None:
            self._ctx.metrics.queue(queue.id, queue.name, queue.pool).dead_letter("superseded")

    def _decodes(self, delivery: Delivery) -> bool:
        try:
            self.decode(delivery)
        except InvalidMessage:  # the poller decodes it again and answers or dead-letters it
            return False
        return True

    def decode(self, delivery: Delivery) -> Envelope:
        """The member's envelope with routing filled from the queue (queue labels win)."""
        if delivery.envelope is not None:  # decoded at fetch time already
            return delivery.envelope
        limit = self._ctx.max_message_bytes
        claim = delivery.handle
        if isinstance(claim, Claim) and claim.digest:  # only a prefix was fetched
            raise too_large(claim.size, limit, id_from_prefix(delivery.raw))
        return keys.decode_delivery(delivery, limit)

    # ------------------------------------------------------------------ acknowledgements

    async def complete(self, items: Sequence[Completion]) -> None:
        """Per item, atomically: result + dedup marker + ack + cancellation cleanup (one
        script per queue of the batch)."""
        if not items:
            return
        with self._acking(d for d, _ in items):
            replies = await self._write_results(items, queued=False)
        lost = []
        for (delivery, _), (_, held, _) in zip(items, replies, strict=True):
            self._release(delivery)
            if not held:
                lost.append(delivery)
        await self._drop_returned(lost)

    async def _write_results(
        self, items: Sequence[tuple[Delivery, Result]], *, queued: bool
    ) -> list[tuple[int, int, int]]:
        """The complete script once per queue of the batch, all in one round trip: for
        claims, or (``queued``) for members still waiting in their queue. Replies, in the
        order of ``items``: (written, held, fell_back)."""
        targets = [self._result_list(delivery) for delivery, _ in items]
        groups = _by_queue(items)
        with redis_errors("complete"):
            async with self._redis.pipeline(transaction=False) as pipe:
                for group in groups.values():
                    await self._complete_group(pipe, items, targets, group, queued=queued)
                if self.config.wait_replicas:  # same round trip: WAIT follows the scripts
                    pipe.wait(self.config.wait_replicas, self.config.wait_timeout_ms)
                replies = await pipe.execute()
        self._check_replicas(replies[len(groups) :])
        scripts: list[tuple[int, int, int]] = [(0, 0, 0)] * len(items)
        for group, group_replies in zip(groups.values(), replies[: len(groups)], strict=True):
            for index, reply in zip(group, group_replies, strict=True):
                scripts[index] = (int(reply[0]), int(reply[1]), int(reply[2]))
        for (delivery, result), target, (written, held, fell_back) in zip(
            items, targets, scripts, strict=True
        ):
            if not written and (held or not queued):
                self._duplicate(delivery, result)
            if fell_back:
                self._route_rejected(delivery, target, "wrong_type")
        return scripts

    async def _complete_group(
        self,
        pipe: Any,
        items: Sequence[tuple[Delivery, Result]],
        targets: Sequence[str],
        group: Sequence[int],
        *,
        queued: bool,
    ) -> None:
        """Queue one complete script for the items at ``group`` (one queue: one slot)."""
        script_keys: list[str] = []
        args: list[bytes | str | int] = [
            self.config.dedup_ttl_seconds,
            "queued" if queued else "claim",
        ]
        for index in group:
            delivery, result = items[index]
            script_keys += self._complete_keys(delivery, result, targets[index], queued=queued)
            member = delivery.raw if queued else _claim(delivery).id
            args += [member, result.encode(), _token(delivery)]
        await self._scripts["complete"](keys=script_keys, args=args, client=pipe)

    def _duplicate(self, delivery: Delivery, result: Result) -> None:
        """A second delivery of a submission already answered (a redelivery, or the same
        bytes submitted again within ``dedup_ttl_seconds``): no second result, but never
        silent (the producer may be resubmitting on purpose and waiting in vain)."""
        queue = delivery.queue
        log.warning("duplicate_suppressed", request_id=result.id, queue=queue.name)
        if self._ctx.metrics is not None:
            self._ctx.metrics.duplicates_suppressed_total.labels(
                queue.id, queue.name, queue.pool
            ).inc()

    def _check_replicas(self, waited: list[int]) -> None:
        """The results are written either way; fewer replicas than asked means a failover
        now could lose them, which the operator should hear about."""
        if waited and waited[0] < self.config.wait_replicas:
            log.warning(
                "results_not_replicated", replicas=waited[0], wanted=self.config.wait_replicas
            )

    def _complete_keys(
        self, delivery: Delivery, result: Result, target: str, *, queued: bool
    ) -> list[str]:
        name = delivery.queue.name
        return [
            self._keys.done(name, result.id, keys.fingerprint(delivery)),
            target,
            name if queued else self._keys.inflight(name),
            self._keys.inflight_meta(name),
            self._keys.active(name, result.id),
            self._keys.cancel(name, result.id),
            self._configured_list(delivery),
            self._keys.live(name, result.id),
            keys.result_side_key(target, "pushed"),
            keys.result_side_key(self._configured_list(delivery), "pushed"),
        ]

    def _result_list(self, delivery: Delivery) -> str:
        """Queue config > the envelope's routing > the transport default (the reference's
        order), except that the message may not name one of the daemon's own keys, nor a
        name outside ``result_queue_pattern``: then the configured list
        (docs/architecture.md G10)."""
        configured = self._configured_list(delivery)
        routed = delivery.envelope.routing.result_queue_name if delivery.envelope else ""
        if delivery.queue.result_queue_name or not routed:
            return configured
        reason = self._own_keys.rejection(routed)
        if reason is None and not self._keys.routable(delivery.queue.name, routed):
            reason = "cross_slot"
        if reason is not None:
            self._route_rejected(delivery, routed, reason)
            return configured
        return routed

    def _configured_list(self, delivery: Delivery) -> str:
        return delivery.queue.result_queue_name or self.config.result_queue_name

    def _route_rejected(self, delivery: Delivery, routed: str, reason: str) -> None:
        """Log and count a message-named result list the result did not go to."""
        queue = delivery.queue.name
        log.warning(
            "result_route_rejected",
            request_id=delivery.envelope.id if delivery.envelope else None,
            queue=queue,
            result_list=routed,
            reason=reason,
            written_to=self._configured_list(delivery),
        )
        if self._ctx.metrics is not None:
            self._ctx.metrics.result_route_rejected_total.labels(queue, reason).inc()

    async def _drop_returned(self, deliveries: list[Delivery]) -> None:
        """A completed message whose lease had expired may be back on its queue: remove it
        so no replica works on it again (the dedup marker already stops a second result)."""
        if not deliveries:
            return
        log.warning("lease_expired_before_complete", count=len(deliveries))
        with redis_errors("complete"):
            async with self._redis.pipeline(transaction=False) as pipe:
                for delivery in deliveries:
                    pipe.zrem(delivery.queue.name, delivery.raw)
                await pipe.execute()

    async def defer(self, items: Sequence[Deferral]) -> None:
        """Hand back: delay <= 0 to the queue at its deadline, else to the retry set."""
        if not items:
            return
        with self._acking(i.delivery for i in items), redis_errors("defer"):
            async with self._redis.pipeline(transaction=False) as pipe:
                for item in items:
                    await self._scripts["defer"](
                        keys=self._ack_keys(item.delivery, self._defer_target(item)),
                        args=[_claim(item.delivery).id, *_defer_args(item)],
                        client=pipe,
                    )
                replies = await pipe.execute()
        for item, handed_back in zip(items, replies, strict=True):
            self._release(item.delivery)
            if not handed_back:
                log.warning("defer_skipped_lease_lost", queue=item.delivery.queue.name)

    def _defer_target(self, item: Deferral) -> str:
        queue = item.delivery.queue.name
        return queue if item.delay <= 0 else self._keys.retry(queue, self.config.retry_queue_name)

    async def dead_letter(self, delivery: Delivery, reason: str, detail: str) -> None:
        """Park on ``<queue>:dead-letter`` as {reason, detail, raw, time, queue}; ack it."""
        claim = _claim(delivery)
        entry = keys.dead_letter_entry(
            delivery, reason, detail, size=claim.size, digest=claim.digest
        )
        target = self._keys.dead_letter(delivery.queue.name)
        with self._acking([delivery]), redis_errors("dead_letter"):
            parked, trimmed = await self._scripts["dead_letter"](
                keys=self._ack_keys(delivery, target),
                args=[claim.id, entry, self.config.dead_letter_max_entries],
            )
        self._release(delivery)
        if not parked:
            log.warning("dead_letter_skipped_lease_lost", queue=delivery.queue.name)
        if trimmed:
            log.warning("dead_letters_trimmed", queue=delivery.queue.name, count=trimmed)
            if self._ctx.metrics is not None:
                self._ctx.metrics.dead_letter_trimmed_total.labels(delivery.queue.name).inc(trimmed)

    def _ack_keys(self, delivery: Delivery, target: str) -> list[str]:
        name = delivery.queue.name
        return [self._keys.inflight(name), self._keys.inflight_meta(name), target]

    @contextmanager
    def _acking(self, deliveries: Iterable[Delivery]) -> Iterator[None]:
        ids = {_claim(d).id for d in deliveries}
        self._settling |= ids
        try:
            yield
        finally:
            self._settling -= ids

    def abandon(self, delivery: Delivery, reason: str) -> None:
        """Stop renewing a claim whose write was given up: its lease expires within
        ``lease_seconds`` and any replica's reaper puts the message back
        (docs/architecture.md G11)."""
        self._release(delivery)
        queue = delivery.queue.name
        request_id = delivery.envelope.id if delivery.envelope else None
        log.warning("claim_abandoned", queue=queue, request_id=request_id, reason=reason)
        if self._ctx.metrics is not None:
            self._ctx.metrics.abandoned_total.labels(queue, reason).inc()

    def _cancel_key(self, delivery: Delivery) -> str:
        request_id = delivery.envelope.id if delivery.envelope else ""
        return self._keys.cancel(delivery.queue.name, request_id)

    def _live_key(self, delivery: Delivery) -> str:
        request_id = delivery.envelope.id if delivery.envelope else ""
        return self._keys.live(delivery.queue.name, request_id)

    def _release(self, delivery: Delivery) -> None:
        self._held.get(delivery.queue.name, {}).pop(_claim(delivery).id, None)

    # ------------------------------------------------------------------ queries

    async def is_cancelled(self, delivery: Delivery) -> bool:
        """The producer's cancel marker holds this submission's token (no token: never)."""
        claim = _claim(delivery)
        if claim.cancelled is not None:
            delivery.handle = replace(claim, cancelled=None)
            return claim.cancelled
        return (await self.cancelled([delivery]))[0]

    async def cancelled(self, deliveries: Sequence[Delivery]) -> list[bool]:
        """``is_cancelled`` for many (a fetched batch, everything in flight): one MGET per
        queue, since each queue's markers share its slot in cluster mode."""
        flags = [False] * len(deliveries)
        by_queue: dict[str, list[int]] = {}
        for i, delivery in enumerate(deliveries):
            by_queue.setdefault(delivery.queue.name, []).append(i)
        for indexes in by_queue.values():
            markers = [(self._cancel_key(deliveries[i]), _token(deliveries[i])) for i in indexes]
            marked = await keys.marked_cancelled(self._redis, markers)
            for i, flag in zip(indexes, marked, strict=True):
                flags[i] = flag
        return flags

    async def backlog(self, queue: QueueSpec) -> int | None:
        """Members waiting in the queue (claimed ones not counted)."""
        with redis_errors("backlog"):
            return int(await self._redis.zcard(queue.name))

    async def health(self) -> None:
        with redis_errors("ping"):
            await self._redis.ping()

    async def aclose(self) -> None:
        await self._redis.aclose()

    # ------------------------------------------------------------------ upkeep

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Heartbeat, reaper and retry mover, until cancelled."""
        lease = self.config.lease_seconds
        async with anyio.create_task_group() as tg:
            tg.start_soon(_every, "heartbeat", lease / 3, self.heartbeat)
            tg.start_soon(_every, "reap", lease / 2, self.reap)
            tg.start_soon(_every, "retry_move", RETRY_MOVE_INTERVAL, self.move_due)
            tg.start_soon(_every, "expire", EXPIRE_INTERVAL, self.expire_due)
            tg.start_soon(_every, "retain", RETAIN_INTERVAL, self.retain)
            task_status.started()

    async def heartbeat(self) -> None:
        """Extend every lease this process holds; forget claims that were taken back."""
        for name, held in self._held.items():
            claim_ids = self._live_claims(held)
            for start in range(0, len(claim_ids), CHUNK):
                with redis_errors("heartbeat"):
                    lost = await self._scripts["extend"](
                        keys=[self._keys.inflight(name)],
                        args=[self.config.lease_seconds, *claim_ids[start : start + CHUNK]],
                    )
                # A claim acked while the extend was on its way is not lost, only done.
                really_lost = [
                    claim
                    for claim in (c.decode() for c in lost)
                    if claim not in self._settling and held.pop(claim, None) is not None
                ]
                if really_lost:
                    log.warning("leases_lost", queue=name, count=len(really_lost))

    def _live_claims(self, held: dict[str, Delivery]) -> list[str]:
        """Held claim ids, dropping those long past their deadline (a leak, see above)."""
        cutoff = time.time() - STALE_CLAIM_GRACE
        stale = [cid for cid, d in held.items() if _deadline(d) < cutoff]
        for claim_id in stale:
            log.warning("stale_claim_released", claim=claim_id)
            del held[claim_id]
        return list(held)

    async def reap(self) -> None:
        """Put every expired claim of every configured queue back with its deadline score."""
        for queue in self.queues:
            name = queue.name
            inflight = [name, self._keys.inflight(name), self._keys.inflight_meta(name)]
            await _drain("reap", self._scripts["reap"], inflight)

    async def retain(self) -> None:
        """Per configured result list: record its pushed count (the marks that date its
        entries, also read by ``status``) and trim what is unconsumed past its TTL."""
        for result_list, ttl in self.config.result_ttls().items():
            with redis_errors("retain"):
                trimmed, _, _ = await self._scripts["retain"](
                    keys=[
                        result_list,
                        keys.result_side_key(result_list, "pushed"),
                        keys.result_side_key(result_list, "marks"),
                    ],
                    args=[ttl, max(ttl, keys.MARKS_HORIZON_SECONDS)],
                )
            if trimmed:
                log.warning("results_trimmed", result_list=result_list, count=trimmed, ttl=ttl)
                if self._ctx.metrics is not None:
                    self._ctx.metrics.results_trimmed_total.labels(result_list).inc(trimmed)

    async def move_due(self) -> None:
        """Move every due retry back to its origin queue, scored by its deadline (in
        cluster mode each queue's own retry set, one slot per call)."""
        names = [q.name for q in self.queues]
        groups = (
            [[self._keys.retry(n, ""), n] for n in names]
            if self._keys.cluster
            else [[self.config.retry_queue_name, *names]]
        )
        for retry_keys in groups:
            await _drain("retry_move", self._scripts["move_due"], retry_keys)

    async def expire_due(self) -> None:
        """Answer every queued member past its deadline with its DEADLINE_EXCEEDED result
        (dedup marker included), without a worker slot (docs/architecture.md G7). Any replica may
        run it: the script answers a member only while it is still queued."""
        for queue in self.queues:
            answered = await self._expire_queue(queue)
            if answered:
                log.info("expired_answered", queue=queue.name, count=answered)
                if self._ctx.metrics is not None:
                    bound = self._ctx.metrics.queue(queue.id, queue.name, queue.pool)
                    bound.exceeded_deadline_total.inc(answered)

    async def _expire_queue(self, queue: QueueSpec) -> int:
        answered = skipped = 0
        while True:
            now = time.time()
            with redis_errors("expire"):
                raws = await self._scripts["expired"](
                    keys=[queue.name],
                    args=[now, skipped, EXPIRE_CHUNK, self._ctx.max_message_bytes],
                )
            items = [item for raw in raws if (item := self._expired(queue, raw, now))]
            skipped += len(raws) - len(items)
            if items:
                replies = await self._write_results(items, queued=True)
                answered += sum(held for _, held, _ in replies)
            if len(raws) < EXPIRE_CHUNK:
                return answered

    def _expired(self, queue: QueueSpec, raw: bytes, now: float) -> tuple[Delivery, Result] | None:
        """The member's DEADLINE_EXCEEDED result; None for one a worker must handle (it does
        not decode, so it is answered INVALID_REQUEST or dead-lettered, or its score lies)."""
        if not raw:  # over --max-message-bytes: not even fetched
            return None
        delivery = Delivery(queue=queue, raw=raw)
        try:
            envelope = self.decode(delivery)
        except InvalidMessage:
            return None
        if envelope.request.deadline >= now:
            return None
        return delivery, expired(envelope.id, last_answer(envelope.routing)).result


async def _drain(action: str, script: AsyncScript, script_keys: list[str]) -> None:
    """Repeat a chunked move script until a call moves less than a full chunk."""
    total = 0
    while True:
        with redis_errors(action):
            moved = int(await script(keys=script_keys, args=[CHUNK]))
        total += moved
        if moved < CHUNK:
            break
    if total:
        log.info(f"{action}_moved", count=total)


async def _every(name: str, interval: float, step: Callable[[], Awaitable[None]]) -> None:
    """Run ``step`` every ``interval`` s; on failure log and back off, never crash."""
    failures = 0
    while True:
        try:
            await step()
            failures = 0
        except TransportError as exc:
            failures += 1
            log.warning("upkeep_failed", task=name, error=str(exc), failures=failures)
        delay = interval if not failures else min(UPKEEP_MAX_BACKOFF, interval * 2**failures)
        await anyio.sleep(delay)


def _by_queue(items: Sequence[tuple[Delivery, Result]]) -> dict[str, list[int]]:
    """Indexes of ``items`` per queue name, in order: a queue's keys share one cluster slot
    (its hash tag), so one script may touch them all."""
    groups: dict[str, list[int]] = {}
    for index, (delivery, _) in enumerate(items):
        groups.setdefault(delivery.queue.name, []).append(index)
    return groups


def _claim(delivery: Delivery) -> Claim:
    if not isinstance(delivery.handle, Claim):
        raise TypeError("delivery was not fetched by the redis-sortedset transport")
    return delivery.handle


def _token(delivery: Delivery) -> str:
    return delivery.envelope.routing.request_token if delivery.envelope else ""


def _deadline(delivery: Delivery) -> float:
    envelope = delivery.envelope
    return float(envelope.request.deadline) if envelope else _claim(delivery).score


def _defer_args(item: Deferral) -> list[bytes | float | str]:
    """(member, score, mode): the updated envelope at its deadline, or due after the delay."""
    delivery = item.delivery
    member = delivery.envelope.encode() if delivery.envelope else delivery.raw
    if item.delay > 0:
        return [member, item.delay, "delay", _deadline(delivery)]
    return [member, _deadline(delivery), "at"]


@TRANSPORTS.register("redis-sortedset", SortedSetConfig)
def build(config: SortedSetConfig, ctx: TransportContext) -> SortedSetTransport:
    return SortedSetTransport(config, ctx)
