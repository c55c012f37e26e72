"""Result writer: batched result writes and hand-backs to the transport.

Input: completions (delivery + result) and deferrals (delivery + delay) from pollers and
workers, through one bounded stream; a deferral whose deadline passed while it waited
here is written as its ``DEADLINE_EXCEEDED`` result instead. Output:
``transport.complete`` / ``transport.defer`` calls, one per batch, and per landed result
its metrics (error code, time since submission, deadline slack). A failed write is
retried with backoff until it lands: the message stays leased on the broker meanwhile,
so a crash loses nothing (docs/architecture.md G1).
A batch that keeps failing while the broker answers is split, and an item that still
fails is abandoned (G11): its lease is no longer renewed, so the broker hands
the message out again (this replica or another finishes it), and a result is kept and
retried with backoff (at most ``HELD_MAX`` of them) instead of thrown away; after
``HELD_ATTEMPTS`` writes only when a lease brings its message back. Without leases
(redis-pubsub) a hand-back is kept too: it is the message's only copy.
Failures with the broker up are what Redis refusing writes looks like (NOREPLICAS,
READONLY, MISCONF, OOM): PING still answers.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from typing import TypeVar

import anyio
import structlog
from anyio.abc import ObjectSendStream
from anyio.streams.memory import MemoryObjectReceiveStream

from async_processor.errors import PartialWrite
from async_processor.metrics import Metrics
from async_processor.retry import expired, last_answer
from async_processor.transports.base import Abandons, Completion, Deferral, Transport, abandon

log = structlog.get_logger(__name__)

BATCH = 64
BUFFER = 1024
SPLIT_AFTER = 3  # failures of a whole batch (broker up) before items are tried one by one
ABANDON_AFTER = 5  # failures of one item (broker up) before it is left to its lease
HELD_MAX = 1024  # abandoned results kept for later writes; beyond, the oldest is dropped
HELD_ATTEMPTS = 60  # writes of one held result before it is dropped (its lease is back)
HELD_FIRST_DELAY, HELD_MAX_DELAY = 0.5, 5.0  # backoff between passes over held results
T = TypeVar("T", bound="Op")


Op = Completion | Deferral


class ResultWriter:
    """Owns the write side of the pipeline; ``run`` ends once every sender has closed."""

    def __init__(
        self, transport: Transport, buffer: int = BUFFER, metrics: Metrics | None = None
    ) -> None:
        self._transport = transport
        self._metrics = metrics
        # A transport with slow round trips (Pub/Sub) may take larger batches than BATCH.
        self._batch: int = getattr(transport, "write_batch", BATCH)
        self._send, self._receive = anyio.create_memory_object_stream[Op](buffer)
        # Abandoned writes with their failed write count, oldest first; set while any.
        self._held: deque[tuple[Op, int]] = deque()
        self._holding = anyio.Event()

    def sender(self) -> ObjectSendStream[Op]:
        """A sender for one producer task; the writer stops when all are closed."""
        return self._send.clone()

    def close(self) -> None:
        """Drop the writer's own sender (call once every producer has its clone)."""
        self._send.close()

    async def run(self) -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._retry_held)
            await self._drain()
            tg.cancel_scope.cancel()
        await self._write_held()  # a last try; what is left comes back with its lease

    async def _drain(self) -> None:
        async with self._receive:
            while True:
                try:
                    first = await self._receive.receive()
                except anyio.EndOfStream:
                    return
                batch = [first, *_take_ready(self._receive, self._batch - 1)]
                await self._write(batch)

    async def _write(self, batch: Sequence[Op]) -> None:
        completions = [op for op in batch if isinstance(op, Completion)]
        deferrals = [op for op in batch if isinstance(op, Deferral)]
        if deferrals:
            deferrals = self._late_answered(deferrals, completions)
        if completions:
            landed = await self._land("complete", completions, self._transport.complete)
            self._observe(landed)
        if deferrals:
            await self._land("defer", deferrals, self._transport.defer)

    async def _land(
        self, what: str, items: Sequence[T], write: Callable[[Sequence[T]], Awaitable[None]]
    ) -> list[T]:
        """Write a batch; if it keeps failing while the broker is up, one item is to blame.

        Then each item is written on its own, and one that still fails is left to its lease
        (the broker hands it out again later) instead of stalling every result behind it.
        A write that lands all but some items (``PartialWrite``) is retried for those only.
        Returns the items written.
        """
        pending = list(items)  # not written yet

        async def write_pending() -> None:
            try:
                await write(list(pending))
            except PartialWrite as exc:
                pending[:] = [pending[i] for i in exc.failed]
                raise

        if len(items) > 1 and await self._attempt(what, write_pending, SPLIT_AFTER):
            return list(items)
        unwritten = {id(item) for item in pending}
        landed = [item for item in items if id(item) not in unwritten]
        limit = ABANDON_AFTER
        for item in pending:
            if await self._attempt(what, partial(write, [item]), limit):
                landed.append(item)
                limit = ABANDON_AFTER
                continue
            self._abandon(what, item)
            # Redis refusing every write looks the same: the items behind it get one try
            # each, so a batch is given up in seconds, not a minute.
            limit = 1
        return landed

    def _late_answered(
        self, deferrals: list[Deferral], completions: list[Completion]
    ) -> list[Deferral]:
        """The hand-backs to write; one whose deadline passed while it waited here is
        written as its result instead (``DEADLINE_EXCEEDED``, or its last HTTP answer),
        added to ``completions``, rather than handed back to be answered later."""
        now = time.time()
        kept = []
        for deferral in deferrals:
            envelope = deferral.delivery.envelope
            if envelope is None or envelope.request.deadline > now:
                kept.append(deferral)
                continue
            final = expired(envelope.id, last_answer(envelope.routing))
            completions.append(Completion(deferral.delivery, final.result))
            if self._metrics is not None:
                q = deferral.delivery.queue
                self._metrics.queue(q.id, q.name, q.pool).exceeded_deadline_total.inc()
        return kept

    def _observe(self, written: Sequence[Completion]) -> None:
        if self._metrics is None:
            return
        now = time.time()
        for delivery, result in written:
            q = delivery.queue
            request = delivery.envelope.request if delivery.envelope is not None else None
            self._metrics.queue(q.id, q.name, q.pool).result_written(result, request, now)

    def _abandon(self, what: str, item: Op) -> None:
        log.error("result_write_abandoned", op=what, item=_describe(item))
        abandon(self._transport, item.delivery, "write_failed")
        if isinstance(item, Deferral) and isinstance(self._transport, Abandons):
            return  # its lease brings the message back: the hand-back holds nothing more
        if len(self._held) >= HELD_MAX:
            self._drop_held("held_full")
        self._held.append((item, 0))
        self._holding.set()

    def _drop_held(self, why: str) -> None:
        item, attempts = self._held.popleft()
        log.warning(
            "held_result_dropped",
            item=_describe(item),
            reason=why,
            attempts=attempts,
        )

    async def _retry_held(self) -> None:
        """Write held results with backoff while there are any."""
        delay = HELD_FIRST_DELAY
        while True:
            await self._holding.wait()
            await anyio.sleep(delay)
            landed = await self._write_held()
            delay = HELD_FIRST_DELAY if landed else min(HELD_MAX_DELAY, delay * 2)

    async def _write_held(self) -> bool:
        """One pass, oldest first, stopping at the first failure (which goes to the back)."""
        while self._held:
            item, attempts = self._held[0]
            try:
                await self._write_one(item)
            except Exception as exc:  # a crash here would stop every later write
                log.warning("held_result_write_failed", attempt=attempts + 1, error=str(exc))
                # Given up only where a lease brings the message back; without one
                # (redis-pubsub) the held write is its only copy (HELD_MAX bounds them).
                if attempts + 1 >= HELD_ATTEMPTS and isinstance(self._transport, Abandons):
                    self._drop_held("attempts")
                else:
                    self._held[0] = (item, attempts + 1)
                    self._held.rotate(-1)
                return False
            self._held.popleft()
            log.info("held_result_written", item=_describe(item))
        self._holding = anyio.Event()
        return True

    async def _write_one(self, item: Op) -> None:
        if isinstance(item, Deferral):
            await self._transport.defer([item])
        else:
            await self._transport.complete([item])
            self._observe([item])

    async def _attempt(self, what: str, call: Callable[[], Awaitable[None]], limit: int) -> bool:
        """Retry until it lands (True), or until ``limit`` failures with the broker up (False).

        While the broker itself is down, retries go on: that is an outage, not a bad item.
        """
        delay, failures = 0.1, 0
        while True:
            try:
                await call()
                return True
            except Exception as exc:  # any failure is retried; a crash here would stop all
                failures += 1
                log.warning("result_write_failed", op=what, attempt=failures, error=str(exc))
                if failures >= limit and await self._broker_up():
                    return False
            await anyio.sleep(delay)
            delay = min(5.0, delay * 2)

    async def _broker_up(self) -> bool:
        try:
            await self._transport.health()
        except Exception:
            return False
        return True


def _take_ready(stream: MemoryObjectReceiveStream[Op], limit: int) -> list[Op]:
    out: list[Op] = []
    while len(out) < limit:
        try:
            out.append(stream.receive_nowait())
        except (anyio.WouldBlock, anyio.EndOfStream):
            break
    return out


def _describe(item: Op) -> str:
    delivery = item.delivery
    envelope = delivery.envelope
    return envelope.id if envelope is not None else f"<undecoded message on {delivery.queue.name}>"
