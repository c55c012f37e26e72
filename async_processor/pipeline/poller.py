"""Poller, one per queue: budget -> fetch -> decode -> queue gate -> into the pool's lane.

Input: the transport and the queue's gate. Output: ``Work`` items into the queue's
bounded stream (read by the pool's merge policy), results for messages that end here
(poison, expired, cancelled, dropped) and deferrals for refused ones, all through the
poller's ``Settler``, which also gives back the pool slots a fetch did not use.

Fetching is demand-driven (docs/architecture.md G4): it waits for free pool slots, fetches at
most min(free slots, floor(batch_size x budget)) in one call, and fetches again at once
after a full batch; the poll interval only paces an empty or gated queue (an empty queue
waits for its next message instead where the transport can tell: ``SignalsMessages``,
redis-sortedset's idle probe). The budget also
caps the queue's messages in flight at ceil(budget x pool slots) (``--budget-scope
in-flight``): sizing fetches alone let a budget of 0.3 fill the pool all the same, since
the next fetch follows at once (measured by ``bench.harvest``). A refused
message is deferred briefly instead of re-popped at once (G5). Nothing fetched is
dropped (G6): each message ends as a Work item, a result, a dead letter or a deferral.
"""

from __future__ import annotations

import math
from contextlib import AbstractContextManager, aclosing, nullcontext

import anyio
import structlog
from anyio.abc import ObjectSendStream

from async_processor.config.queues import QueueSpec
from async_processor.errors import TransportError
from async_processor.gates.base import Gate
from async_processor.metrics import QueueMetrics
from async_processor.pipeline.held import HeldLine, HeldWork
from async_processor.pipeline.idle_gates import IdleGates, read_budget
from async_processor.pipeline.intake import Intake
from async_processor.pipeline.settle import Settler
from async_processor.transports.base import (
    Delivery,
    LoadsPayloads,
    SignalsMessages,
    Transport,
)
from async_processor.work import Work

log = structlog.get_logger(__name__)

MAX_ERROR_BACKOFF = 5.0


class Poller(Intake):
    def __init__(
        self,
        *,
        queue: QueueSpec,
        transport: Transport,
        gate: Gate,
        settler: Settler,
        lane: ObjectSendStream[Work],
        metrics: QueueMetrics,
        held: HeldWork,
        idle_gates: IdleGates | None = None,
        bound_in_flight: bool = True,
        gate_wait: float = math.inf,
    ) -> None:
        self.queue = queue
        self._transport = transport
        self._gate = gate
        self._gate_wait = gate_wait
        self._settler = settler  # this poller's own: it closes the writer's sender when done
        self._capacity = settler.capacity
        self._lane = lane
        # What waits for the lane is held by the pool's expiry: answered at its deadline.
        self._held = held
        self._line = HeldLine(held, lane, self._picked)
        self._metrics = metrics
        self._log = log.bind(queue=queue.name, pool=queue.pool)
        self._error_backoff = 0.0
        self._idle = False
        self._signals = transport if isinstance(transport, SignalsMessages) else None
        self._payloads = transport if isinstance(transport, LoadsPayloads) else None
        self._idle_gates = idle_gates  # reads the gate while the queue waits for a message
        self._bound_in_flight = bound_in_flight
        self._in_flight = 0  # forwarded to the lane, not yet released by the worker
        self._fetching = 0  # slots of fetches under way, not yet admitted
        self._unpicked = 0  # forwarded to the lane, not yet taken by the merge policy
        self._landed = anyio.Event()  # set when one of them is released
        # Deliveries handed on (to the lane or the writer) by an _admit still running: they
        # are no longer ours. A set, because several fetches of one queue may be admitting.
        self._handed_on: set[Delivery] = set()

    async def run(self) -> None:
        """Poll until cancelled; closes the lane so the merge policy can finish."""
        async with self._lane, aclosing(self._settler), anyio.create_task_group() as tg:
            for index in range(self.queue.fetches_in_flight):
                tg.start_soon(self._poll, index)

    async def _poll(self, index: int) -> None:
        """One of the queue's concurrent fetch loops; only the first waits on an idle queue."""
        while True:
            # A cycle may wait only inside its shielded claim (free slots, room in the lane
            # and a fresh cancel reading cost no trip through the loop), so a stop's
            # cancellation would never reach it: at a stop, with the workers handing every
            # message back, it claimed them again forever (the soak's hang at exit).
            await anyio.lowlevel.checkpoint_if_cancelled()
            if index and self._idle:
                await anyio.sleep(self.queue.poll_interval)
                continue
            await self._cycle()

    async def _cycle(self) -> None:
        if self._idle and self._signals is not None:
            # An empty queue waits for its next message, as long as that takes, holding no
            # slot: cycling every poll interval instead (a budget read, a slot taken and
            # given back, a fetch's wait) made 200 idle queues 2,000 cycles a second, and
            # a slot held through the wait is one the pool's busy queues lack (with 20 of
            # 200 queues busy their lanes then held one offer each, and the merge found a
            # weight-4 queue empty at its turn). The budget is read after the wait: a gate
            # closed meanwhile is obeyed; meanwhile IdleGates reads it for the gauges.
            with self._waiting_read():
                await self._signals.until_ready(self.queue)
        budget = await read_budget(self._gate, self._log)
        self._metrics.dispatch_budget.set(budget)
        wanted = self._wanted(budget)
        if wanted <= 0:
            await self._note_gate_closed()
            await anyio.sleep(self.queue.poll_interval)
            return
        room = self._room(budget)
        if room <= 0:  # at the budget's share of the pool: wait for one to finish
            with anyio.move_on_after(self.queue.poll_interval):
                await self._landed.wait()
            return
        reserved = await self._reserve(wanted, budget)
        # Room again: another fetch loop of this queue may have taken it while we waited.
        room = max(0, self._room(budget))
        if reserved > room:
            self._settler.release(reserved - room)
            reserved = room
        if reserved:
            # Counted until admitted, so a concurrent loop cannot fetch the same room.
            self._fetching += reserved
            try:
                await self._fetch_and_admit(reserved)
            finally:
                self._fetching -= reserved

    def _waiting_read(self) -> AbstractContextManager[None]:
        """The gate read (and its gauges set) by ``IdleGates`` while the queue is idle."""
        if self._idle_gates is None:
            return nullcontext()
        return self._idle_gates.waiting(self._gate, self._metrics.dispatch_budget, self._log)

    async def _fetch_and_admit(self, reserved: int) -> None:
        # Where the transport signals messages, an empty queue waits in _cycle, not here.
        wait = 0.0 if self._signals is not None else self.queue.poll_interval
        try:
            deliveries = await self._transport.fetch(self.queue, reserved, wait)
        except BaseException as exc:  # also cancellation: the slots must not leak
            self._settler.release(reserved)
            if not isinstance(exc, TransportError):
                raise
            await self._back_off(exc)
            return
        self._error_backoff = 0.0
        self._idle = not deliveries
        self._settler.release(reserved - len(deliveries))
        await self._admit_all(deliveries)

    def _wanted(self, budget: float) -> int:
        """The most one fetch may ask for, before the free slots are known."""
        if self.queue.max_fetch:  # scaled by the budget once the free slots are known
            wanted = self.queue.max_fetch if budget > 0 else 0
        else:
            wanted = min(self.queue.batch_size, math.floor(self.queue.batch_size * budget))
        if self._idle:  # an empty queue claims one when its next message comes, not a batch
            wanted = min(wanted, 1)
        return wanted

    async def _reserve(self, wanted: int, budget: float) -> int:
        """Slots for one fetch; with ``max_fetch``, the free slots x budget (at least one)."""
        reserved = await self._capacity.reserve(wanted, self._waiting)
        if self.queue.max_fetch:
            kept = max(1, math.floor(reserved * budget))
            self._settler.release(reserved - kept)
            reserved = kept
        return reserved

    def _room(self, budget: float) -> int:
        """How many more of this queue's messages may be in flight under the budget."""
        if not self._bound_in_flight:
            return self._capacity.slots
        return math.ceil(budget * self._capacity.slots) - self._in_flight - self._fetching

    def _waiting(self) -> int:
        """This queue's messages the merge has not taken yet (fetching ones included)."""
        return self._fetching + self._unpicked

    async def _note_gate_closed(self) -> None:
        try:
            backlog = await self._transport.backlog(self.queue)
        except TransportError:
            return
        if backlog:
            self._metrics.gate_decision("gate_closed")

    async def _back_off(self, exc: TransportError) -> None:
        self._error_backoff = min(MAX_ERROR_BACKOFF, max(0.1, self._error_backoff * 2))
        self._log.warning("fetch_failed", error=str(exc), retry_in=self._error_backoff)
        await anyio.sleep(self._error_backoff)
