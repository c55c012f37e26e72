"""Settler: the one place a message leaves the pipeline and its pool slot comes back.

Input: messages that end in a poller (poison, expired, cancelled, refused, dropped) and
the outcomes of workers. Output: ``Completion`` / ``Deferral`` ops on the result writer's
stream, dead letters on the transport, and the pool slot (and, for a worker's message,
the gate permits) given back (docs/architecture.md G12). One per poller and one per pool's
workers: each holds its own sender of the result writer, closed (``aclose``) when its owner
ends (a pool's workers: when the last of its tasks has).
"""

from __future__ import annotations

import anyio
import structlog
from anyio.abc import ObjectSendStream

from async_processor.errors import TransportError
from async_processor.messages import Result
from async_processor.pipeline.capacity import PoolCapacity
from async_processor.pipeline.results import Op
from async_processor.retry import Counter, Final, Outcome
from async_processor.transports.base import Completion, Deferral, Delivery, Transport, abandon
from async_processor.work import Work, put, put_nowait

log = structlog.get_logger(__name__)

SETTLE_TIMEOUT = 10.0


class Settler:
    def __init__(
        self, *, transport: Transport, writer: ObjectSendStream[Op], capacity: PoolCapacity
    ) -> None:
        self.transport = transport
        self.capacity = capacity
        self._writer = writer

    async def aclose(self) -> None:
        """Close this settler's sender: the writer ends once every settler has closed."""
        await self._writer.aclose()

    async def finish(self, delivery: Delivery, result: Result) -> None:
        """The message's result to the writer, then its slot back. A send that is cut
        short keeps the slot: the caller hands the message back, which gives it."""
        await put(self._writer, Completion(delivery, result))
        self.capacity.release()

    async def defer(self, delivery: Delivery, delay: float) -> None:
        """The message back to the broker after ``delay`` (through the writer), then its slot."""
        await put(self._writer, Deferral(delivery, delay))
        self.capacity.release()

    async def dead_letter(self, delivery: Delivery, reason: str, detail: str) -> None:
        """Park a message with no usable id, then give its slot back."""
        try:
            await self.transport.dead_letter(delivery, reason, detail)
        except TransportError as err:
            # Given up at once, not kept leased: the lease brings it back for another try.
            log.warning(
                "dead_letter_failed",
                queue=delivery.queue.name,
                pool=delivery.queue.pool,
                error=str(err),
            )
            abandon(self.transport, delivery, "dead_letter_failed")
        self.capacity.release()

    def release(self, count: int = 1) -> None:
        """Slots reserved for a fetch that brought fewer messages, or none."""
        self.capacity.release(count)

    async def settle(self, work: Work, outcome: Outcome) -> None:
        """A worker's outcome: counted and written, then the slot and the gate's permits
        given back, also when the write is cut short (the settle timeout)."""
        try:
            if not self.hand_over(work, outcome):
                if isinstance(outcome, Final):
                    _count(work, outcome)
                await put(self._writer, _op(work, outcome))
        finally:
            await self.give_back(work)

    async def settle_within(self, work: Work, outcome: Outcome) -> None:
        """``settle``, shielded and bounded: a writer that cannot take it in time gets the
        message abandoned (lease no longer renewed, logged and counted), so it comes back."""
        with anyio.move_on_after(SETTLE_TIMEOUT, shield=True) as settling:
            await self.settle(work, outcome)
        if settling.cancelled_caught:
            log.error("settle_timed_out", request_id=work.envelope.id)
            abandon(self.transport, work.delivery, "settle_timeout")

    def hand_over(self, work: Work, outcome: Outcome) -> bool:
        """``settle``'s write when the writer has room now: counted and queued without
        waiting. False: nothing was done (the writer is full), ``settle`` it."""
        if not put_nowait(self._writer, _op(work, outcome)):
            return False
        if isinstance(outcome, Final):
            _count(work, outcome)
        return True

    async def give_back(self, work: Work) -> None:
        """A worker's message is done with: its slot and the gate's permits back."""
        self.capacity.release()
        await work.releases.release_all()


def _op(work: Work, outcome: Outcome) -> Op:
    if isinstance(outcome, Final):
        return Completion(work.delivery, outcome.result)
    return Deferral(work.delivery, outcome.delay)


def _count(work: Work, final: Final) -> None:
    m = work.metrics
    if final.counter is Counter.SUCCESS:
        m.successful_total.inc()
    elif final.counter is Counter.FAILED:
        m.failed_total.inc()
    elif final.counter is Counter.DEADLINE:
        m.exceeded_deadline_total.inc()
