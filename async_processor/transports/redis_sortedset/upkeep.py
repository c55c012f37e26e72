"""Upkeep for redis-sortedset: the loops that keep claims and queues healthy between
fetches, on every replica (docs/architecture.md G1, G7).

heartbeat (renew the claims still this process's), reap (expired claims back on their queue,
any replica's or a Go daemon's; and the previous release's ``<queue>:inflight`` claims,
first at start-up: the upgrade's migration), move_due (due retries back on their origin
queue), expire_due (queued members past their deadline answered without a worker), retain
(unconsumed results trimmed), settle_removed (removed discovered queues an earlier run left,
kept until empty) and the data-set watch (dataset.py: a Redis that came back empty is
reported). ``SortedSetTransport`` mixes this in; ``run`` is its upkeep task."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import anyio
import structlog
from anyio.abc import TaskStatus
from redis.asyncio import Redis
from redis.commands.core import AsyncScript

from async_processor.config import SortedSetConfig
from async_processor.config.queues import QueueSpec
from async_processor.errors import InvalidMessage, TransportError
from async_processor.messages import Envelope, Result
from async_processor.redis import keys
from async_processor.redis.conn import redis_errors, warn_if_evicting
from async_processor.redis.keyspace import KeySpace
from async_processor.retry import expired, last_answer
from async_processor.transports.base import Delivery, TransportContext
from async_processor.transports.redis_sortedset.claims import ClaimBook, key_text
from async_processor.transports.redis_sortedset.dataset import DatasetWatch
from async_processor.transports.redis_sortedset.discovery import QueueCatalog

log = structlog.get_logger(__name__)

RETRY_MOVE_INTERVAL = 0.2  # seconds between checks of the retry set for due members
CHUNK = 500  # members per reaper / retry-mover / heartbeat script call
EXPIRE_INTERVAL = 0.5  # seconds between deadline sweeps: results within ~1 s of a deadline
RETAIN_INTERVAL = 10.0  # seconds between retention rounds: results trimmed within TTL + this
# A retained list expires this long after its TTL unless a round renews it: what a queue
# that left upkeep (or a deployment stopped for good) left there goes too, past its TTL.
RETAIN_GRACE = 2 * int(RETAIN_INTERVAL)
EXPIRE_CHUNK = 20  # members decoded per sweep round trip (each up to --max-message-bytes)
UPKEEP_MAX_BACKOFF = 5.0

WriteResults = Callable[..., Awaitable[list[tuple[int, int, int] | TransportError]]]


class SortedSetUpkeep:
    """The upkeep half of ``SortedSetTransport``: it uses the transport's state, below."""

    config: SortedSetConfig
    queues: Sequence[QueueSpec]
    _ctx: TransportContext
    _keys: KeySpace
    _scripts: dict[str, AsyncScript]
    _redis: Redis
    _claims: ClaimBook
    _owner: str  # this process's claim owner token
    _catalog: QueueCatalog
    _dataset: DatasetWatch
    decode: Callable[[Delivery], Envelope]
    _write_results: WriteResults
    # Queues' own result lists whose trimmed series exist (immutable: a safe class default).
    _trim_series: frozenset[str] = frozenset()

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Heartbeat, reaper and retry mover, until cancelled."""
        lease = self.config.lease_seconds
        await self.migrate_legacy()
        async with anyio.create_task_group() as tg:
            tg.start_soon(_every, "heartbeat", lease / 3, self.heartbeat)
            tg.start_soon(_every, "reap", self.config.reclaim_interval(), self.reap)
            tg.start_soon(_every, "retry_move", RETRY_MOVE_INTERVAL, self.move_due)
            tg.start_soon(_every, "expire", EXPIRE_INTERVAL, self.expire_due)
            tg.start_soon(_every, "retain", RETAIN_INTERVAL, self.retain)
            tg.start_soon(_every, "removed", lease / 2, self.settle_removed)
            tg.start_soon(_every, "dataset", lease / 3, self._dataset.check)
            tg.start_soon(warn_if_evicting, self._redis)
            task_status.started()

    async def _pipelined(
        self, action: str, script: str, key_groups: Sequence[list[str]], args: list[Any]
    ) -> list[Any]:
        """One script call per key group (each one queue's slot), in one round trip."""
        return await self._run_calls(action, script, [(keys, args) for keys in key_groups])

    async def _run_calls(
        self, action: str, script: str, calls: Sequence[tuple[list[str], list[Any]]]
    ) -> list[Any]:
        """Calls of one script in one round trip: a single call alone (a pipeline of
        scripts first asks Redis whether it has them: a second round trip), several as a
        pipeline."""
        if not calls:
            return []
        run = self._scripts[script]
        with redis_errors(action):
            if len(calls) == 1:
                return [await run(keys=calls[0][0], args=calls[0][1])]
            async with self._redis.pipeline(transaction=False) as pipe:
                for script_keys, args in calls:
                    await run(keys=script_keys, args=args, client=pipe)
                return list(await pipe.execute())

    async def _drain(
        self,
        action: str,
        script: str,
        key_groups: list[list[str]],
        read: Callable[[list[str], Any], tuple[int, int]] | None = None,
    ) -> None:
        """Repeat a chunked move script, for all key groups in one round trip, until no
        call takes a full chunk (only the groups that did go again). ``read`` turns a
        group's reply into (taken, moved) and reports what else it says; by default a
        count, or ``[moved, queue, error, ...]`` (move_due_own.lua), whose failed queues
        are logged once a round while their group's others move."""
        total = 0
        failed: dict[str, str] = {}
        read = read or (lambda _, reply: _moved(failed, reply))
        while key_groups:
            replies = await self._pipelined(action, script, key_groups, [CHUNK])
            counts = [read(group, reply) for group, reply in zip(key_groups, replies, strict=True)]
            total += sum(moved for _, moved in counts)
            full = [taken >= CHUNK for taken, _ in counts]
            key_groups = [group for group, more in zip(key_groups, full, strict=True) if more]
        if total:
            log.info(f"{action}_moved", count=total)
        for queue, error in failed.items():
            log.warning(f"{action}_failed", queue=queue, error=error)

    async def heartbeat(self) -> None:
        """Renew every claim this process holds while it is still ours (fenced, as
        upstream's renew), one call per slot group (at most ``CHUNK`` claims a call), all
        in one round trip; forget claims taken back. A queue whose claim keys have the
        wrong type fails alone (its leases lapse)."""
        held = {
            name: ids for name in list(self._claims.held) if (ids := self._claims.renewable(name))
        }
        calls = _extend_calls(self._keys, held, [self.config.lease_seconds, self._owner])
        replies = await self._run_calls("heartbeat", "extend", [(k, a) for k, a, _ in calls])
        for (_, _, names), reply in zip(calls, replies, strict=True):
            for name, lost in zip(names, reply, strict=True):
                if isinstance(lost, bytes):
                    log.warning("heartbeat_failed", queue=name, error=lost.decode(errors="replace"))
                    continue
                really_lost = self._claims.forget_lost(name, (key_text(c) for c in lost))
                if really_lost:
                    log.warning("leases_lost", queue=name, count=len(really_lost))

    async def reap(self) -> None:
        """Put every expired claim of every queue back at its queue score, whoever held
        it (upstream's reclaim). A claim whose member is gone (an eviction, a DEL by hand)
        has nothing to put back: its message is lost unless its holder still answers it,
        so each is logged and counted, never dropped silently. Then the current release's
        expired claims (``reap_legacy``)."""
        groups = [[q.name, *self._keys.claim_keys(q.name)] for q in self.queues]
        await self._drain("reap", "reap", groups, self._reaped)
        await self._reap_legacy()

    async def migrate_legacy(self) -> None:
        """At start-up: the claims the current release left in ``<queue>:inflight`` whose
        lease expired go back to their queue (idempotent: a claim moves once; logged and
        counted). Claims still leased belong to pods of that release still running; the
        reaper keeps taking back those that expire, so an upgrade pod by pod loses nothing."""
        try:
            moved = await self._reap_legacy()
        except TransportError as exc:  # the reaper's next round tries again
            log.warning("legacy_claims_migration_failed", error=str(exc))
            return
        log.info("legacy_claims_migrated", count=moved, queues=len(self.queues))

    async def _reap_legacy(self) -> int:
        groups = [
            [q.name, self._keys.inflight(q.name), self._keys.inflight_meta(q.name)]
            for q in self.queues
        ]
        moved = 0

        def read(group: list[str], reply: list[int]) -> tuple[int, int]:
            nonlocal moved
            taken, kept = self._reaped(group, reply)
            moved += kept
            if kept and self._ctx.metrics is not None:
                self._ctx.metrics.legacy_claims_returned_total.labels(group[0]).inc(kept)
            return taken, kept

        await self._drain("reap", "reap_legacy", groups, read)
        return moved

    def _reaped(self, group: list[str], reply: list[int]) -> tuple[int, int]:
        """reap.lua's ``{taken, without a lease entry}`` for ``group``'s queue."""
        taken, missing = int(reply[0]), int(reply[1])
        if missing:
            log.error("reaped_claims_without_lease_entry", queue=group[0], count=missing)
            if self._ctx.metrics is not None:
                self._ctx.metrics.abandoned_total.labels(group[0], "lease_entry_missing").inc(
                    missing
                )
        return taken, taken - missing

    async def retain(self) -> None:
        """Per result list (configured, and each served or removed queue's own, from the
        discovery template's ``<queue>``): record its pushed count (the marks that date its
        entries, also read by ``status``) and trim what is unconsumed past its TTL; one
        round trip per TTL."""
        ttls = self._result_ttls()
        by_ttl: dict[int, list[str]] = {}
        for result_list, ttl in ttls.items():
            by_ttl.setdefault(ttl, []).append(result_list)
        for ttl, lists in by_ttl.items():
            side = keys.result_side_key
            groups = [[r, side(r, "pushed"), side(r, "marks")] for r in lists]
            args = [ttl, max(ttl, keys.MARKS_HORIZON_SECONDS), RETAIN_GRACE]
            replies = await self._pipelined("retain", "retain", groups, args)
            for result_list, (trimmed, _, _) in zip(lists, replies, strict=True):
                if trimmed:
                    self._trimmed(result_list, int(trimmed), ttl)
        self._follow_trim_series(ttls)

    def _result_ttls(self) -> dict[str, int]:
        """``result_ttls`` plus the result list of each queue in upkeep that has its own
        (the template's ``<queue>``), at the transport's TTL."""
        ttls = self.config.result_ttls()
        for queue in self.queues:
            if queue.result_queue_name:
                ttls.setdefault(queue.result_queue_name, self.config.result_ttl_seconds)
        return ttls

    def _trimmed(self, result_list: str, count: int, ttl: int) -> None:
        log.warning("results_trimmed", result_list=result_list, count=count, ttl=ttl)
        if self._ctx.metrics is not None:
            self._ctx.metrics.results_trimmed_total.labels(result_list).inc(count)

    def _follow_trim_series(self, ttls: dict[str, int]) -> None:
        """A queue's own result list has its trimmed series (at 0 from its first round)
        while the queue is in upkeep, so tenant churn does not grow the scrape."""
        if self._ctx.metrics is None:
            return
        family = self._ctx.metrics.results_trimmed_total
        own = frozenset(ttls) - frozenset(self.config.result_ttls())
        for result_list in own - self._trim_series:
            family.labels(result_list)
        for result_list in self._trim_series - own:
            family.remove(result_list)
        self._trim_series = own

    async def settle_removed(self) -> None:
        """Upkeep for the removed queues an earlier run left in Redis (a kill or restart
        while they drained); without discovery they are also forgotten here once empty."""
        await self._catalog.restore(self._redis)
        if self.config.queue_discovery is None:
            await self._catalog.drop_empty(self._redis)
        self.queues = self._catalog.upkeep

    async def move_due(self) -> None:
        """Move every due retry back to its origin queue, scored by its deadline (in
        cluster mode and with discovered queues each queue's own retry set, many queues
        per call)."""
        names = [q.name for q in self.queues]
        if not self._keys.cluster and not self._keys.queue_retry:
            await self._drain("retry_move", "move_due", [[self.config.retry_queue_name, *names]])
            # Discovery turned off: removed discovered queues still have their own sets.
            removed = [[keys.retry_key(n), n] for n in self._catalog.removed]
            await self._drain("retry_move", "move_due_own", removed)
            return
        groups = [
            [key for n in group for key in (self._keys.retry(n, ""), n)]
            for group in self._keys.slot_groups(names)
        ]
        await self._drain("retry_move", "move_due_own", groups)
        # Discovery on: what a deployment before it left in the shared set goes home, to a
        # configured queue only (the shared set's rule sends an unknown origin to the first).
        configured = [q.name for q in self.config.queue_specs()]
        if not self._keys.cluster and configured:
            shared = self.config.retry_queue_name
            with redis_errors("retry_move"):
                left = await self._redis.exists(shared)
            if left:
                await self._drain("retry_move", "move_due", [[shared, *configured]])

    async def expire_due(self) -> None:
        """Answer every queued member past its deadline with its DEADLINE_EXCEEDED result
        (dedup marker included), without a worker slot (docs/architecture.md G7). Any replica may
        run it: the script answers a member only while it is still queued. The first
        look covers many queues per call, all calls in one round trip."""
        by_name = {q.name: q for q in self.queues}
        groups = self._keys.slot_groups(list(by_name))
        replies = await self._pipelined("expire", "expired_many", groups, self._expire_args(0))
        firsts = [raws for reply in replies for raws in reply]
        queues = [by_name[name] for group in groups for name in group]
        for queue, raws in zip(queues, firsts, strict=True):
            if isinstance(raws, bytes):  # its key has the wrong type: the others still go
                log.warning("expire_failed", queue=queue.name, error=raws.decode(errors="replace"))
                continue
            answered = await self._expire_queue(queue, raws) if raws else 0
            if answered:
                log.info("expired_answered", queue=queue.name, count=answered)
                if self._ctx.metrics is not None:
                    bound = self._ctx.metrics.queue(queue.id, queue.name, queue.pool)
                    bound.exceeded_deadline_total.inc(answered)

    def _expire_args(self, skipped: int) -> list[float | int]:
        return [time.time(), skipped, EXPIRE_CHUNK, self._ctx.max_message_bytes]

    async def _expire_queue(self, queue: QueueSpec, raws: list[bytes]) -> int:
        """Answer ``raws`` (a first look) and whatever further chunks the queue holds."""
        answered = skipped = 0
        while True:
            now = time.time()
            items = [item for raw in raws if (item := self._expired(queue, raw, now))]
            skipped += len(raws) - len(items)
            if items:
                replies = await self._write_results(items, queued=True)
                answered += sum(r[1] for r in replies if not isinstance(r, TransportError))
                # A member whose keys have the wrong type stays queued: this queue's sweep
                # stops here (the next chunk would read it again) and tries again next
                # round; the queues after it are still swept (raising stopped them all).
                failure = next((r for r in replies if isinstance(r, TransportError)), None)
                if failure is not None:
                    log.warning("expire_failed", queue=queue.name, error=str(failure))
                    return answered
            if len(raws) < EXPIRE_CHUNK:
                return answered
            with redis_errors("expire"):
                raws = await self._scripts["expired"](
                    keys=[queue.name], args=self._expire_args(skipped)
                )

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


def _extend_calls(
    keyspace: KeySpace, held: dict[str, list[tuple[bytes, float]]], head: list[Any]
) -> list[tuple[list[str], list[Any], list[str]]]:
    """The heartbeat's extend calls: (keys, args, queue per key pair) per slot group, at
    most ``CHUNK`` claims a call (a queue with more is split over calls); ``head`` are the
    arguments every call starts with (lease, owner)."""
    calls: list[tuple[list[str], list[Any], list[str]]] = []
    for names in keyspace.slot_groups(list(held)):
        parts = [(n, held[n][i : i + CHUNK]) for n in names for i in range(0, len(held[n]), CHUNK)]
        count = CHUNK  # start a call at the first part
        for name, claims in parts:
            if count + len(claims) > CHUNK:
                calls.append(([], list(head), []))
                count = 0
            script_keys, args, queues = calls[-1]
            script_keys += [keyspace.owners(name), keyspace.claims_idx(name)]
            args += [len(claims), *(value for claim in claims for value in claim)]
            queues.append(name)
            count += len(claims)
    return calls


def _moved(failed: dict[str, str], reply: int | list[Any]) -> tuple[int, int]:
    """A move script's reply as (taken, moved), its failed queues noted in ``failed``."""
    if isinstance(reply, list):
        moved, *errors = reply
        failed.update(zip(_texts(errors[::2]), _texts(errors[1::2]), strict=True))
        return int(moved), int(moved)
    return reply, reply


def _texts(raws: list[bytes]) -> list[str]:
    return [raw.decode(errors="replace") for raw in raws]


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
