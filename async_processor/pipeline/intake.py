"""Intake: a poller's fetched batch admitted message by message (the poller's second half).

Stage: inside each ``Poller``, after the fetch. Input: the deliveries of one fetch.
Output: each decoded and checked (deadline, cancel marker), through the queue gate, its
payload loaded where stored apart, then ``Work`` into the queue's lane (in line for it,
held, while the lane is full); or a result (poison, expired, cancelled, dropped), a dead
letter or a deferral through the poller's ``Settler``.

Every wait here ends at a deadline (issue 30, item 5): a message whose payload is still
to be loaded is held by the pool's expiry from its admission on (answered at its deadline
while the rest of the batch is gated and the payloads read), and a queue gate that waits
inside ``apply`` (``local-max-concurrency`` in ``blocking`` mode) waits at most until the
earliest deadline among its message and those behind it in the batch, or the gate-wait
timeout; then its message is answered (its deadline passed) or handed back, and the
poller goes on, answering each one behind at its deadline. A stop cancels any of it; the
rest of the batch is handed back.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Sequence
from contextlib import suppress
from dataclasses import dataclass

import anyio
from structlog.typing import FilteringBoundLogger

from async_processor.errors import InvalidMessage, TransportError
from async_processor.gates.base import (
    Action,
    Gate,
    Releases,
    Verdict,
    refusal_decision,
    waits_in_apply,
)
from async_processor.messages import (
    CANCELLED_TEXT,
    GATE_DROPPED_TEXT,
    Envelope,
    ErrorCode,
    Result,
)
from async_processor.metrics import QueueMetrics
from async_processor.pipeline.held import HeldLine, HeldWork
from async_processor.pipeline.settle import Settler
from async_processor.retry import REFUSE_DELAY, expired, last_answer
from async_processor.transports.base import Delivery, LoadsPayloads, Transport, abandon
from async_processor.work import Work

HAND_BACK_TIMEOUT = 5.0


@dataclass
class Behind:
    """The deliveries after one in its batch (from ``start`` on: no copy per message),
    and the earliest of their deadlines."""

    batch: Sequence[Delivery]
    start: int
    earliest: float


class Intake:
    """The admission half of ``Poller`` (which sets these in its ``__init__``)."""

    _transport: Transport
    _gate: Gate
    _gate_wait: float  # the longest a queue gate may wait inside apply (--gate-wait-timeout)
    _settler: Settler
    _metrics: QueueMetrics
    _log: FilteringBoundLogger
    _held: HeldWork
    _line: HeldLine
    _payloads: LoadsPayloads | None
    _handed_on: set[Delivery]
    _in_flight: int
    _unpicked: int
    _landed: anyio.Event

    async def _admit_all(self, deliveries: Sequence[Delivery]) -> None:
        # Let through by the gate, their payloads stored apart: loaded together, then sent.
        loading: list[Work] = []
        earliest = self._earliest_behind(deliveries)
        try:
            for index, delivery in enumerate(deliveries):
                if delivery in self._handed_on:  # answered at its deadline while one waited
                    self._handed_on.discard(delivery)
                    continue
                try:
                    behind = Behind(deliveries, index + 1, earliest[index])
                    if (work := await self._admit(delivery, behind)) is not None:
                        self._held.hold(work)  # answered at its deadline while others go first
                        loading.append(work)
                except BaseException:
                    # Cut short (shutdown) mid-batch: the rest handed back now, not at lease end.
                    rest = [d for d in deliveries[index:] if d not in self._handed_on]
                    await self._hand_back(rest)
                    self._handed_on.difference_update(deliveries[index:])
                    raise
                self._handed_on.discard(delivery)
            await self._load_and_forward(loading)
            await self._line.send()
        except BaseException:
            await self._give_back(loading)
            await self._give_back(self._line.take_back())
            raise

    async def _admit(self, delivery: Delivery, behind: Behind) -> Work | None:
        """The delivery handled (forwarded, answered, handed back), or its Work when its
        payload is still to be loaded (``_load_and_forward``)."""
        envelope = await self._decode(delivery)
        if envelope is None:
            return None
        request = envelope.request
        if request.deadline < time.time():
            await self._expire(delivery, envelope)
            return None
        if await self._cancelled(delivery):
            await self._finish(
                delivery, Result.failure(request.id, ErrorCode.CANCELLED, CANCELLED_TEXT)
            )
            return None
        return await self._gate_and_forward(delivery, behind)

    async def _load_and_forward(self, loading: list[Work]) -> None:
        """The payloads of ``loading`` in one read (``LoadsPayloads``); each then goes on,
        or ends with the result the transport gave it (missing, unusable). A failed read
        hands them all back to their queue. ``loading`` is emptied as each is settled."""
        if not loading:
            return
        assert self._payloads is not None  # only its deliveries wait for a load
        try:
            outcomes = await self._payloads.load_payloads([w.delivery for w in loading])
        except TransportError as exc:
            self._log.warning("payload_fetch_failed", error=str(exc), count=len(loading))
            await self._give_back(loading)
            return
        for outcome in outcomes:
            work = loading[0]
            if not self._held.take(work):  # answered at its deadline while it loaded
                del loading[0]
            elif outcome is None:
                self._forward(work)
                del loading[0]
            else:
                del loading[0]
                with anyio.CancelScope(shield=True):
                    await work.releases.release_all()
                self._metrics.failed_total.inc()
                await self._finish(work.delivery, outcome)
            self._handed_on.discard(work.delivery)  # settled: no _admit holds it

    async def _give_back(self, loading: list[Work]) -> None:
        """Works not sent on (loading, or in line for the lane): their gate permits
        released, their messages handed back, but for one already handed on or answered
        at its deadline meanwhile."""
        works = [w for w in loading if w.delivery not in self._handed_on and self._held.take(w)]
        loading[:] = []
        with anyio.CancelScope(shield=True):
            for work in works:
                await work.releases.release_all()
        await self._hand_back([w.delivery for w in works])
        self._handed_on.difference_update(w.delivery for w in works)

    async def _gate_and_forward(self, delivery: Delivery, behind: Behind) -> Work | None:
        envelope = delivery.envelope
        assert envelope is not None
        releases = Releases()
        forwarded = False
        try:
            verdict = await self._gated(envelope, releases, behind)
            if verdict is None:
                await self._wait_ended(delivery, envelope)
            elif verdict.action in (Action.CONTINUE, Action.WAIT):
                # Wait means nothing at queue level: the pool gate is where workers park.
                self._in_flight += 1
                releases.add(self._land)  # runs when the worker is done, or below if not sent
                work = Work(delivery, envelope, self._metrics, releases, picked=self._picked)
                if self._payloads is not None and self._payloads.stored_apart(delivery):
                    forwarded = True  # its permits go with it to _load_and_forward
                    return work
                self._forward(work)
                forwarded = True
                self._handed_on.add(delivery)
            elif verdict.action is Action.REFUSE:
                self._metrics.gate_decision(refusal_decision(envelope))
                await self._defer(delivery, REFUSE_DELAY)
            else:
                self._metrics.gate_decision("dropped")
                result = verdict.result or Result.failure(
                    envelope.id, ErrorCode.GATE_DROPPED, GATE_DROPPED_TEXT
                )
                await self._finish(delivery, result)
        except Exception as exc:  # a gate backend failure defers the message, never drops it
            self._metrics.gate_decision("error")
            self._log.warning("queue_gate_error", request_id=envelope.id, error=str(exc))
            await self._defer(delivery, REFUSE_DELAY)
        finally:
            if not forwarded:
                with anyio.CancelScope(shield=True):
                    await releases.release_all()
        return None

    async def _gated(
        self, envelope: Envelope, releases: Releases, behind: Behind
    ) -> Verdict | None:
        """The queue gate's verdict; None if a gate that waits inside ``apply``
        (``gates.base.waits_in_apply``: ``local-max-concurrency`` in ``blocking`` mode)
        waits past this message's deadline or ``--gate-wait-timeout``. Meanwhile each one
        behind it in the batch is answered at its deadline (the wait is cut then, and
        taken up again); the ones ahead are held, answered at their deadline by the
        pool's expiry."""
        if not waits_in_apply(self._gate):  # its check ends by itself: no scope to pay for
            return await self._gate.apply(envelope, releases)
        give_up = min(envelope.request.deadline, time.time() + self._gate_wait)
        while True:
            if behind.earliest <= time.time():
                await self._expire_due(behind)
            with anyio.move_on_after(max(0.0, min(give_up, behind.earliest) - time.time())):
                return await self._gate.apply(envelope, releases)
            if time.time() >= give_up:
                return None

    def _earliest_behind(self, deliveries: Sequence[Delivery]) -> list[float]:
        """For each delivery, the earliest deadline among those after it in the batch
        (each decoded once here, kept on it for ``_decode``; a poison one has none).
        Only ``_gated``'s bounded wait reads it: behind a gate that cannot wait, the
        pass over the batch (and a poison message's second decode) is not paid."""
        earliest, running = [math.inf] * len(deliveries), math.inf
        if not waits_in_apply(self._gate):
            return earliest
        for index in range(len(deliveries) - 1, -1, -1):
            earliest[index] = running
            delivery = deliveries[index]
            if delivery.envelope is None:
                with suppress(InvalidMessage):  # said when the poller reaches it
                    delivery.envelope = self._transport.decode(delivery)
            if delivery.envelope is not None:
                running = min(running, delivery.envelope.request.deadline)
        return earliest

    async def _expire_due(self, behind: Behind) -> None:
        """Those of ``behind`` whose deadline has passed answered now (the poller passes
        them by when it reaches them); ``behind.earliest`` becomes the rest's earliest."""
        behind.earliest = math.inf
        for delivery in itertools.islice(behind.batch, behind.start, None):
            envelope = delivery.envelope
            if envelope is None or delivery in self._handed_on:
                continue
            if envelope.request.deadline <= time.time():
                await self._expire(delivery, envelope)
            else:
                behind.earliest = min(behind.earliest, envelope.request.deadline)

    async def _wait_ended(self, delivery: Delivery, envelope: Envelope) -> None:
        """Its deadline passed: answered. Else (the gate-wait timeout) handed back like a
        refusal, and the poller goes on with the batch."""
        if envelope.request.deadline <= time.time():
            await self._expire(delivery, envelope)
        else:
            self._metrics.gate_decision(refusal_decision(envelope))
            await self._defer(delivery, REFUSE_DELAY)

    async def _expire(self, delivery: Delivery, envelope: Envelope) -> None:
        self._metrics.exceeded_deadline_total.inc()
        await self._finish(delivery, expired(envelope.id, last_answer(envelope.routing)).result)

    def _forward(self, work: Work) -> None:
        """Into the lane, or in line for it with the batch's rest admitted meanwhile."""
        self._unpicked += 1
        self._line.forward(work)

    def _picked(self) -> None:
        self._unpicked -= 1

    async def _land(self) -> None:
        self._in_flight -= 1
        self._landed.set()
        self._landed = anyio.Event()

    async def _decode(self, delivery: Delivery) -> Envelope | None:
        try:
            if delivery.envelope is None:  # else decoded already (at fetch, or above)
                delivery.envelope = self._transport.decode(delivery)
        except InvalidMessage as exc:
            await self._poison(delivery, exc)
            return None
        return delivery.envelope

    async def _poison(self, delivery: Delivery, exc: InvalidMessage) -> None:
        self._log.warning(
            "message_rejected", reason=exc.reason, request_id=exc.request_id, error=str(exc)
        )
        if exc.request_id:
            self._metrics.failed_total.inc()
            await self._finish(
                delivery, Result.failure(exc.request_id, ErrorCode.INVALID_REQUEST, str(exc))
            )
            return
        self._metrics.dead_letter(exc.reason)
        await self._settler.dead_letter(delivery, exc.reason, str(exc))

    async def _cancelled(self, delivery: Delivery) -> bool:
        try:
            return await self._transport.is_cancelled(delivery)
        except TransportError as exc:
            self._log.warning("cancel_check_failed", error=str(exc))
            return False

    async def _finish(self, delivery: Delivery, result: Result) -> None:
        await self._settler.finish(delivery, result)
        self._handed_on.add(delivery)

    async def _defer(self, delivery: Delivery, delay: float) -> None:
        await self._settler.defer(delivery, delay)
        self._handed_on.add(delivery)

    async def _hand_back(self, deliveries: Sequence[Delivery]) -> None:
        handed = 0
        with anyio.CancelScope(shield=True), anyio.move_on_after(HAND_BACK_TIMEOUT):
            for delivery in deliveries:
                await self._defer(delivery, 0.0)
                handed += 1
        # Not handed back in time (the writer is stuck): let their leases lapse, and give
        # their slots back, since a removed queue's poller stops while the daemon runs on.
        for delivery in deliveries[handed:]:
            abandon(self._transport, delivery, "hand_back_timeout")
            self._settler.release()
