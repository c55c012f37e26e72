"""Producer markers for redis-sortedset: cancel markers and the id index (``live:<id>``),
read for fetched batches and for everything in flight.

Stage: broker I/O (queries). Input: deliveries. Output: per delivery whether its
submission was cancelled; at fetch, second live entries of one id parked as
``superseded``. ``SortedSetTransport`` mixes this in.
"""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from redis.asyncio import Redis

from async_processor.config.redis import slot
from async_processor.errors import InvalidMessage, TransportError
from async_processor.messages import Envelope
from async_processor.redis import keys
from async_processor.redis.conn import redis_errors
from async_processor.redis.keyspace import KeySpace
from async_processor.transports.base import Delivery, TransportContext
from async_processor.transports.redis_sortedset.claims import (
    ClaimBook,
    by_queue,
    claim_of,
    token_of,
)

# A marker reading answers ``is_cancelled`` for this long; held claims are read again with
# any marker read once their reading is older than REFRESH_AGE (the cancel watch reads
# every CANCEL_WATCH_INTERVAL while anything is in flight). A cancel made after the last
# reading is still seen: the watch cuts the call within a round (docs/transports.md).
MARKER_FRESH = 0.5
REFRESH_AGE = 0.2


class MarkerChecks:
    """The marker half of ``SortedSetTransport``: it uses the transport's state, below."""

    _redis: Redis
    _keys: KeySpace
    _claims: ClaimBook
    _ctx: TransportContext
    decode: Callable[[Delivery], Envelope]
    dead_letter: Callable[[Delivery, str, str], Awaitable[None]]
    abandon: Callable[[Delivery, str], None]

    async def _check_markers(self, deliveries: list[Delivery]) -> list[Delivery]:
        """Read the cancel and live markers of a claim round in one round trip (best
        effort: a failure leaves the cancel check to ``is_cancelled``, since the claim has
        succeeded).

        A member whose queue's ``live:<id>`` marker holds another token is a second entry
        of a live id (written around the client's index, e.g. by a plain ZADD): it is
        parked as ``superseded``, so two entries of one id with different tokens are never
        both dispatched (the same token twice is one submission written twice by hand:
        both go, and the dedup marker keeps one result; docs/transports.md)."""
        tokened = [d for d in deliveries if self._decodes(d) and token_of(d)]
        if not tokened:
            return deliveries
        groups = self._slot_groups(tokened)
        try:
            with redis_errors("cancel check"):
                values = await self._read_markers(
                    [[*map(self._live_key, g), *self._cancel_keys(g)] for g in groups]
                )
        except TransportError:
            return deliveries
        superseded = []
        now = time.monotonic()
        for group, group_values in zip(groups, values, strict=True):
            lives, cancels = group_values[: len(group)], group_values[len(group) :]
            for delivery, live, cancelled in zip(
                group, lives, _cancelled(group, cancels), strict=True
            ):
                _note(delivery, cancelled, now)
                if live is not None and live != token_of(delivery).encode():
                    superseded.append(delivery)
        for delivery in superseded:
            await self._park_superseded(delivery)
        return [d for d in deliveries if d not in superseded]

    async def _read_markers(self, groups: list[list[str]]) -> list[list[Any]]:
        """The values of each group of keys (one queue's markers), in one round trip: one
        MGET outside cluster mode; else, in one pipeline, an MGET per group for the keys in
        its queue's slot (its first key's) and a GET for each key elsewhere (upstream's
        untagged cancel markers). A cluster pipeline refuses ``mget()``: sent as a command."""
        if not self._keys.cluster:
            values = iter(await self._redis.mget([k for g in groups for k in g]))
            return [[next(values) for _ in group] for group in groups]
        splits = [_by_slot(group) for group in groups]
        async with self._redis.pipeline(transaction=False) as pipe:
            for together, apart in splits:
                pipe.execute_command("MGET", *together)
                for key in apart:
                    pipe.get(key)
            replies = iter(await pipe.execute())
        out: list[list[Any]] = []
        for group, (together, apart) in zip(groups, splits, strict=True):
            found = dict(zip(together, next(replies), strict=True))
            found.update((key, next(replies)) for key in apart)
            out.append([found[key] for key in group])
        return out

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

    def _slot_groups(self, deliveries: list[Delivery]) -> list[list[Delivery]]:
        """``deliveries`` in groups whose markers one MGET may read: all of them outside
        cluster mode, else per queue (a queue's markers share its slot)."""
        if not self._keys.cluster:
            return [deliveries]
        return [[deliveries[i] for i in group] for group in by_queue(deliveries).values()]

    def _cancel_key(self, delivery: Delivery) -> str:
        """Made once per claim: the cancel watch reads the marker of every held claim
        several times a second (with 200 queues, 200 prefetched claims a replica)."""
        claim = claim_of(delivery)
        if not claim.cancel_key:
            request_id = delivery.envelope.id if delivery.envelope else ""
            claim.cancel_key = self._keys.cancel(delivery.queue.name, request_id)
        return claim.cancel_key

    def _cancel_keys(self, group: list[Delivery]) -> list[str]:
        """The cancel markers of ``group``: ours, and in cluster mode upstream's too
        (``request-cancel:<id>`` without the queue's tag, as a Go producer writes it on a
        cluster; ours there is ``{Q}:request-cancel:<id>``, still read)."""
        ours = [self._cancel_key(d) for d in group]
        if not self._keys.cluster:
            return ours
        return ours + [keys.cancel_key(d.envelope.id if d.envelope else "") for d in group]

    def _live_key(self, delivery: Delivery) -> str:
        request_id = delivery.envelope.id if delivery.envelope else ""
        return self._keys.live(delivery.queue.name, request_id)

    async def is_cancelled(self, delivery: Delivery) -> bool:
        """The producer's cancel marker holds this submission's token (no token: never):
        from a reading younger than ``MARKER_FRESH``, else asked now. Each reading answers
        one check: the next one reads again (or takes a later round's reading)."""
        claim = claim_of(delivery)
        fresh = time.monotonic() - claim.read_at <= MARKER_FRESH
        if claim.cancelled is not None and fresh:
            cancelled = claim.cancelled
        else:
            cancelled = (await self.cancelled([delivery]))[0]
        claim.cancelled, claim.read_at = None, -math.inf
        return cancelled

    async def cancelled(self, deliveries: Sequence[Delivery]) -> list[bool]:
        """``is_cancelled`` for many (a fetched batch, everything in flight), in one round
        trip. The same read refreshes the other claims this process holds whose reading
        is older than ``REFRESH_AGE`` (prefetched ones waiting for a worker): so the
        worker's check before dispatch (``worker.CANCEL_RECHECK``) finds a reading made at
        the cancel watch's last round instead of asking Redis for each message. Deliveries
        without a token are never cancelled and not asked about."""
        flags = [False] * len(deliveries)
        asked = [d for d in deliveries if token_of(d)]
        if not asked:
            return flags
        now = time.monotonic()
        wanted = set(asked)
        asked += [
            d
            for d in self._claims.all_held()
            if d not in wanted and token_of(d) and now - claim_of(d).read_at > REFRESH_AGE
        ]
        groups = self._slot_groups(asked)
        with redis_errors("cancel check"):
            values = await self._read_markers([self._cancel_keys(g) for g in groups])
        for group, group_values in zip(groups, values, strict=True):
            for delivery, cancelled in zip(group, _cancelled(group, group_values), strict=True):
                _note(delivery, cancelled, now)
        return [bool(claim_of(d).cancelled) if token_of(d) else False for d in deliveries]


def _by_slot(group: list[str]) -> tuple[list[str], list[str]]:
    """The keys of ``group`` in its first key's slot (one MGET), and the others."""
    home = slot(group[0])
    together = [key for key in group if slot(key) == home]
    return together, [key for key in group if slot(key) != home]


def _cancelled(group: list[Delivery], values: list[Any]) -> list[bool]:
    """Per delivery of ``group``: one of its cancel markers (``values``: ours for the
    group, then upstream's in cluster mode) holds its token."""
    tokens = [token_of(d).encode() for d in group]
    per_marker = [values[i :: len(group)] for i in range(len(group))]
    return [token in found for token, found in zip(tokens, per_marker, strict=True)]


def _note(delivery: Delivery, cancelled: bool, at: float) -> None:
    claim = claim_of(delivery)
    claim.cancelled, claim.read_at = cancelled, at
