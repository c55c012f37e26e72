"""In-flight cancellation: a cancel marker reaches requests already at the gateway.

Stage: beside the workers. Input: the deliveries workers are processing (each registered
for as long as its worker holds it: pool gate, transforms, HTTP call). Output: the cancel
scope of each delivery whose producer cancelled it is cancelled, which aborts its HTTP
call (the httptools and aiohttp clients close the connection, so the gateway stops the
work and frees the GPU; pyreqwest 0.15 lets the call run to its own timeout);
the worker then answers ``CANCELLED`` and gives its slot and gate permits back as usual.

The markers of everything in flight are read together, one round trip per
``CANCEL_WATCH_INTERVAL`` (redis-sortedset: one MGET; in cluster mode one per queue,
pipelined), instead of a GET per request: the poller already checks a batch at fetch
time, this covers what follows.
Transports without cancel markers (gcp-pubsub) are not watched.

The watch starts when a worker takes the message, and the worker sends at once; so for a
message that waited after its fetch (prefetched behind busy workers), the worker also
asks right before dispatch (``Worker._cancelled``): a cancel made while it waited is
answered without sending, not cut after the gateway may already have answered.
"""

from __future__ import annotations

import anyio
import structlog

from async_processor.errors import TransportError
from async_processor.transports.base import Delivery, Transport, WatchesCancels

log = structlog.get_logger(__name__)

# A cancel reaches an in-flight request within this (plus one Redis round trip)...
CANCEL_WATCH_INTERVAL = 0.25
# ...while reading at most this many markers a second: at 10,000 in flight a fixed 250 ms
# would cost Redis 40,000 reads a second for a rare event, so the round slows down instead.
MAX_MARKER_READS_PER_SECOND = 4000


def watch_interval(watched: int, floor: float = CANCEL_WATCH_INTERVAL) -> float:
    """Seconds until the next round for ``watched`` deliveries (2.5 s at 10,000)."""
    return max(floor, watched / MAX_MARKER_READS_PER_SECOND)


class CancelWatch:
    """The cancel scopes of the deliveries being worked on, checked in one batch."""

    def __init__(self, transport: Transport, interval: float = CANCEL_WATCH_INTERVAL) -> None:
        self._transport = transport if isinstance(transport, WatchesCancels) else None
        self._interval = interval
        self._scopes: dict[Delivery, anyio.CancelScope] = {}

    def add(self, delivery: Delivery, scope: anyio.CancelScope) -> None:
        """Cancel ``scope`` when ``delivery``'s producer cancels it, until ``discard``; the
        caller tells a cut by ``scope.cancel_called``."""
        if self._transport is not None:
            self._scopes[delivery] = scope

    def discard(self, delivery: Delivery) -> None:
        self._scopes.pop(delivery, None)

    async def run(self) -> None:
        """Check every ``interval`` s until cancelled (returns at once when not watching)."""
        if self._transport is None:
            return
        while True:
            await anyio.sleep(watch_interval(len(self._scopes), self._interval))
            await self.check()

    async def check(self) -> int:
        """Cancel the scopes of the watched deliveries that are cancelled; how many."""
        if self._transport is None or not self._scopes:
            return 0
        deliveries = list(self._scopes)
        try:
            flags = await self._transport.cancelled(deliveries)
        except TransportError as exc:  # the next round asks again
            log.warning("cancel_watch_failed", error=str(exc))
            return 0
        cut = 0
        for delivery, flag in zip(deliveries, flags, strict=True):
            scope = self._scopes.get(delivery)
            if flag and scope is not None and not scope.cancel_called:
                request_id = delivery.envelope.id if delivery.envelope else None
                log.info("request_cancelled_in_flight", request_id=request_id)
                scope.cancel()
                cut += 1
        return cut
