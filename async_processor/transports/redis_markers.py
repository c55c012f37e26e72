"""Producer markers for redis-sortedset: cancel markers and the id index (``live:<id>``),
read for fetched batches and for everything in flight.

Stage: broker I/O (queries). Input: deliveries. Output: per delivery whether its
submission was cancelled; at fetch, second live entries of one id parked as
``superseded``. ``SortedSetTransport`` mixes this in.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

from redis.asyncio import Redis

from async_processor.errors import InvalidMessage, TransportError
from async_processor.messages import Envelope
from async_processor.transports.base import Delivery, TransportContext
from async_processor.transports.redis_claims import by_queue, claim_of, token_of
from async_processor.transports.redis_keys import redis_errors
from async_processor.transports.redis_keyspace import KeySpace


class MarkerChecks:
    """The marker half of ``SortedSetTransport``: it uses the transport's state, below."""

    _redis: Redis
    _keys: KeySpace
    _ctx: TransportContext
    decode: Callable[[Delivery], Envelope]
    dead_letter: Callable[[Delivery, str, str], Awaitable[None]]
    abandon: Callable[[Delivery, str], None]

    async def _check_markers(self, deliveries: list[Delivery]) -> list[Delivery]:
        """Read the batch's cancel and live markers in one MGET (best effort: a failure
        leaves the cancel check to ``is_cancelled``, since the claim has succeeded).

        A member whose queue's ``live:<id>`` marker holds another token is a second entry
        of a live id (written around the client's index, e.g. by a plain ZADD): it is
        parked as ``superseded``, so two entries of one id are never both dispatched."""
        tokened = [d for d in deliveries if self._decodes(d) and token_of(d)]
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
            token = token_of(delivery).encode()
            claim_of(delivery).cancelled = cancel == token
            if live is not None and live != token:
                superseded.append(delivery)
        for delivery in superseded:
            await self._park_superseded(delivery)
        return [d for d in deliveries if d not in superseded]

    async def _park_superseded(self, delivery: Delivery) -> None:
        queue = delivery.queue
        try:
            await self.dead_letter(
                delivery, "superseded", "another submission of this id is live on this queue"
            )
        except TransportError:
            # Not parked: let its lease lapse so a later claim decides again, instead of
            # failing the fetch and leaving the rest of the batch held but never handed on.
            self.abandon(delivery, "dead_letter_failed")
            return
        if self._ctx.metrics is not None:
            self._ctx.metrics.queue(queue.id, queue.name, queue.pool).dead_letter("superseded")

    def _decodes(self, delivery: Delivery) -> bool:
        try:
            self.decode(delivery)
        except InvalidMessage:  # the poller decodes it again and answers or dead-letters it
            return False
        return True

    def _cancel_key(self, delivery: Delivery) -> str:
        request_id = delivery.envelope.id if delivery.envelope else ""
        return self._keys.cancel(delivery.queue.name, request_id)

    def _live_key(self, delivery: Delivery) -> str:
        request_id = delivery.envelope.id if delivery.envelope else ""
        return self._keys.live(delivery.queue.name, request_id)

    async def is_cancelled(self, delivery: Delivery) -> bool:
        """The producer's cancel marker holds this submission's token (no token: never)."""
        claim = claim_of(delivery)
        cancelled, claim.cancelled = claim.cancelled, None
        if cancelled is not None:
            return cancelled
        return (await self.cancelled([delivery]))[0]

    async def cancelled(self, deliveries: Sequence[Delivery]) -> list[bool]:
        """``is_cancelled`` for many (a fetched batch, everything in flight): one MGET per
        queue (each queue's markers share its slot in cluster mode), all in one round trip.
        Deliveries without a token are never cancelled and not asked about."""
        flags = [False] * len(deliveries)
        tokened = [i for i, d in enumerate(deliveries) if token_of(d)]
        groups = [
            [tokened[j] for j in group]
            for group in by_queue([deliveries[i] for i in tokened]).values()
        ]
        if not groups:
            return flags
        with redis_errors("cancel check"):
            async with self._redis.pipeline(transaction=False) as pipe:
                for group in groups:
                    pipe.mget([self._cancel_key(deliveries[i]) for i in group])
                replies = await pipe.execute()
        for group, values in zip(groups, replies, strict=True):
            for i, value in zip(group, values, strict=True):
                flags[i] = value == token_of(deliveries[i]).encode()
        return flags
