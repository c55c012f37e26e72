"""The write half of ``SortedSetTransport``: results written and claims acknowledged.

Stage: broker I/O (``complete``). Input: ``Completion``s (a delivery and its result).
Output: per item, atomically, the result on its list, the dedup marker, the fenced ack
(upstream's claim layout: written only while the claim is still this process's) and the
cancellation cleanup (``lua/complete.lua``, one script per hash slot of the batch).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import structlog
from redis.asyncio import Redis
from redis.commands.core import AsyncScript

from async_processor.config import SortedSetConfig
from async_processor.errors import PartialWrite, TransportError
from async_processor.messages import Result
from async_processor.redis import entries, keys
from async_processor.redis.conn import redis_errors
from async_processor.redis.keyspace import KeySpace
from async_processor.transports.base import Completion, Delivery, TransportContext
from async_processor.transports.redis_sortedset.claims import (
    Claim,
    ClaimBook,
    by_queue,
    claim_of,
    key_bytes,
    token_of,
)
from async_processor.transports.redis_sortedset.payloads import payload_key
from async_processor.transports.redis_sortedset.routing import ResultRouting

log = structlog.get_logger(__name__)

ScriptCall = tuple[list[str], list[bytes | str | int]]  # one script's keys and arguments
Written = tuple[int, int, int]  # a complete reply: (written, held, fell_back)


class ResultWrites:
    """The write half of ``SortedSetTransport``: it uses the transport's state, below."""

    config: SortedSetConfig
    _ctx: TransportContext
    _redis: Redis
    _keys: KeySpace
    _scripts: dict[str, AsyncScript]
    _claims: ClaimBook
    _routing: ResultRouting
    _result_ttls: Callable[[], dict[str, int]]  # the retained lists' TTLs (upkeep)
    _owner: str  # this process's claim owner token (16 hex)

    async def complete(self, items: Sequence[Completion]) -> None:
        """Per item, atomically: result + dedup marker + fenced ack + cancellation cleanup
        (one script per hash slot of the batch: one call outside cluster mode). An item
        whose keys have the wrong type fails alone (``PartialWrite``) and stays held. An
        item whose claim is no longer ours (its lease lapsed and it was reclaimed) writes
        nothing: the message's next owner answers it, as upstream's fenced ack does."""
        if not items:
            return
        with self._claims.acking(d for d, _ in items):
            try:
                replies = await self._write_results(items, queued=False)
                self._settled(items, replies)
                # Only where the ack was ours: a reclaimed message's next owner reads its
                # body from that key (complete.lua deletes it only after its ack, too).
                await self._drop_payloads(
                    [d for (d, _), r in zip(items, replies, strict=True) if _acked(r)]
                )
            except TransportError:
                # The scripts may have run (the reply lost, or the cleanup after them
                # failed): the writer sends the batch again, see Claim.unsure.
                for delivery, _ in items:
                    claim_of(delivery).unsure = True
                raise
        failed = [i for i, reply in enumerate(replies) if isinstance(reply, TransportError)]
        if failed:
            raise PartialWrite(str(replies[failed[0]]), failed)

    def _settled(
        self, items: Sequence[Completion], replies: Sequence[Written | TransportError]
    ) -> None:
        """Forget the claims written, and warn of those no longer ours (lease lapsed)."""
        lost = 0
        for (delivery, _), reply in zip(items, replies, strict=True):
            if isinstance(reply, TransportError):
                continue  # still held: the writer tries it again, then leaves it to its lease
            self._claims.release(delivery)
            # After a lost reply the claim is most likely gone by our own write.
            lost += not reply[1] and not claim_of(delivery).unsure
        if lost:
            log.warning("lease_expired_before_complete", count=lost)

    async def _write_results(
        self, items: Sequence[tuple[Delivery, Result]], *, queued: bool
    ) -> list[Written | TransportError]:
        """The complete script once per hash slot of the batch (all queues together
        outside cluster mode), all in one round trip: for claims, or (``queued``) for
        members still waiting in their queue. Replies, in the order of ``items``:
        (written, held, fell_back), or the error of an item whose keys have the wrong type
        (nothing of it written)."""
        targets = [self._routing.target(delivery) for delivery, _ in items]
        groups = self._slot_batches([delivery for delivery, _ in items])
        calls = [self._complete_call(items, targets, g, queued=queued) for g in groups]
        with redis_errors("complete"):
            replies = await self._run_complete(calls)
        self._check_replicas(replies[len(groups) :])
        scripts: list[Written | TransportError] = [(0, 0, 0)] * len(items)
        for group, group_replies in zip(groups, replies[: len(groups)], strict=True):
            for index, reply in zip(group, group_replies, strict=True):
                scripts[index] = _written(reply)
        for (delivery, result), target, reply in zip(items, targets, scripts, strict=True):
            if isinstance(reply, TransportError):
                continue
            written, held, fell_back = reply
            if held and not written:  # ours, but its submission was answered already
                self._duplicate(delivery, result)
            if fell_back:
                self._routing.rejected(delivery, target, "wrong_type")
        await self._expire_results(items, targets, scripts)
        return scripts

    async def _expire_results(
        self,
        items: Sequence[tuple[Delivery, Result]],
        targets: Sequence[str],
        replies: Sequence[Written | TransportError],
    ) -> None:
        """Upstream's result TTL (routing ``result_ttl_seconds``, frozen at the first
        fetch): a list a result was written to expires that long after the write, as
        upstream's ack sets it. A message is untrusted input: on a list we retain
        (configured, or a discovered queue's own), the configured retention wins (a TTL
        below it is raised to it; a list kept for ever gets no expiry from a message).
        Not atomic with the write: if this fails the list keeps its results longer
        (logged), never fewer."""
        wanted: dict[str, int] = {}
        for (delivery, _), target, reply in zip(items, targets, replies, strict=True):
            ttl = delivery.envelope.routing.result_ttl_seconds if delivery.envelope else 0
            if ttl > 0 and not isinstance(reply, TransportError) and reply[0]:
                name = self.config.result_queue_name if reply[2] else target
                wanted[name] = max(wanted.get(name, 0), ttl)
        configured = self._result_ttls() if wanted else {}
        expiries = {
            name: max(ttl, configured.get(name, 0))
            for name, ttl in wanted.items()
            if configured.get(name, -1) != 0
        }
        if not expiries:
            return
        try:
            with redis_errors("result ttl"):
                async with self._redis.pipeline(transaction=False) as pipe:
                    for name, ttl in expiries.items():
                        pipe.expire(name, ttl)
                    await pipe.execute()
        except TransportError as exc:
            log.warning("result_ttl_failed", error=str(exc), lists=len(expiries))

    def _slot_batches(self, deliveries: Sequence[Delivery]) -> list[list[int]]:
        """Indexes of ``deliveries`` per complete call: a queue's items together, the
        queues of one hash slot (all of them outside cluster mode) in one call."""
        per_queue = by_queue(deliveries)
        return [
            [index for name in names for index in per_queue[name]]
            for names in self._keys.slot_groups(list(per_queue))
        ]

    async def _run_complete(self, calls: list[ScriptCall]) -> list[Any]:
        """The complete scripts in one round trip: a single one sent alone (a pipeline of
        scripts first asks Redis whether it has them, a second round trip per batch);
        several, or any followed by ``WAIT``, as one pipeline."""
        script = self._scripts["complete"]
        if len(calls) == 1 and not self.config.wait_replicas:
            script_keys, args = calls[0]
            return [await script(keys=script_keys, args=args)]
        async with self._redis.pipeline(transaction=False) as pipe:
            for script_keys, args in calls:
                await script(keys=script_keys, args=args, client=pipe)
            if self.config.wait_replicas:  # same round trip: WAIT follows the scripts
                pipe.wait(self.config.wait_replicas, self.config.wait_timeout_ms)
            return await pipe.execute()

    def _complete_call(
        self,
        items: Sequence[tuple[Delivery, Result]],
        targets: Sequence[str],
        group: Sequence[int],
        *,
        queued: bool,
    ) -> ScriptCall:
        """Keys and arguments of one complete script for the items at ``group`` (one
        hash slot)."""
        script_keys: list[str] = []
        args: list[bytes | str | int] = [
            self.config.dedup_ttl_seconds,
            "queued" if queued else "claim",
            self._owner,
        ]
        for index in group:
            delivery, result = items[index]
            script_keys += self._complete_keys(delivery, result, targets[index], queued=queued)
            member = delivery.raw if queued else key_bytes(claim_of(delivery))
            token = token_of(delivery)
            drop = "1" if payload_key(delivery) and not self._keys.cluster else ""
            args += [member, _stamped(result, token).encode(), token, drop]
        return script_keys, args

    async def _drop_payloads(self, deliveries: Sequence[Delivery]) -> None:
        """Cluster mode: delete the answered requests' payload keys once their results are
        written (the key sits in another slot than the result's script; as upstream)."""
        names = [name for d in deliveries if (name := payload_key(d)) is not None]
        if names and self._keys.cluster:
            with redis_errors("payload delete"):
                async with self._redis.pipeline(transaction=False) as pipe:
                    for name in names:
                        pipe.delete(name)
                    await pipe.execute()

    def _duplicate(self, delivery: Delivery, result: Result) -> None:
        """A second delivery of a submission already answered (a redelivery, or the same
        bytes submitted again within ``dedup_ttl_seconds``): no second result, but never
        silent (the producer may be resubmitting on purpose and waiting in vain)."""
        queue = delivery.queue
        log.warning("duplicate_suppressed", request_id=result.id, queue=queue.name)
        self._ctx.count_duplicate(queue)

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
        claimed, owners, idx = self._keys.claim_keys(name)
        return [
            self._keys.done(name, result.id, _fingerprint(delivery)),
            target,
            name if queued else claimed,
            owners,
            idx,
            self._keys.active(name, result.id),
            self._keys.cancel(name, result.id),
            self._routing.configured(delivery),
            self._keys.live(name, result.id),
            keys.result_side_key(target, "pushed"),
            keys.result_side_key(self._routing.configured(delivery), "pushed"),
            # Cluster mode: the payload key is in another slot (dropped after the script).
            (not self._keys.cluster and payload_key(delivery)) or idx,
        ]


def _written(reply: Any) -> Written | TransportError:
    """One item's complete reply: (written, held, fell_back), or its WRONGTYPE text."""
    if isinstance(reply, bytes):
        return TransportError(f"redis complete failed: {reply.decode(errors='replace')}")
    return int(reply[0]), int(reply[1]), int(reply[2])


def _acked(reply: Written | TransportError) -> bool:
    """Whether the item's claim was still ours and is now acknowledged."""
    return not isinstance(reply, TransportError) and bool(reply[1])


def _stamped(result: Result, token: str) -> Result:
    """The result with its submission's ``request_token`` (upstream's result readers
    need it); the same result when the token is empty or already on it."""
    if not token or result.request_token == token:
        return result
    return replace(result, request_token=token)


def _fingerprint(delivery: Delivery) -> str:
    """Kept by ``let_go`` (the request can no longer be digested without its payload),
    else made now; a member the deadline sweep read has no claim."""
    claim = delivery.handle
    if isinstance(claim, Claim) and claim.fingerprint:
        return claim.fingerprint
    return entries.fingerprint(delivery.envelope)
