"""Held work: a pool's messages waiting in memory for a worker, answered at their deadline.

Stage: beside the pool, between the poller and the workers. Input: each ``Work`` a poller
hands on (``hold``), and the worker that takes it (``take``). Output: a message whose
deadline passes while it waits (in its poller's line behind a full lane, its queue's lane,
the merge policy, the pool's stream) settled through the pool's ``Settler`` with one
``DEADLINE_EXCEEDED`` result (or its last HTTP answer), its slot and gate permits given
back, at once instead of when a busy worker frees up (up to ``--request-timeout``).

Exactly once: a message is either taken by a worker or answered here, never both. Both
sides decide synchronously on the ``Work``'s own ``held`` state, with no await in between:
what the expiry answered stays where it was (a buffer cannot give an item back) and
whoever meets it later passes it by (``Work.answered``). Once a worker holds a message,
its deadline is the worker's cancel scope (``worker.Worker._watched``).

One task per pool, not one per message: a heap ordered by deadline, one timer set to the
earliest. A message taken by a worker leaves the heap lazily (the heap is rebuilt when
stale entries outnumber live ones), so holding and taking cost a heap push and a flag;
at 10,000 held messages an expiry is O(log n).
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections import deque
from collections.abc import Callable

import anyio
import structlog
from anyio.abc import ObjectSendStream

from async_processor.pipeline.settle import Settler
from async_processor.retry import expired, last_answer
from async_processor.work import ANSWERED, HELD, TAKEN, Work, put, put_nowait

log = structlog.get_logger(__name__)

# Stale entries (taken by a worker) tolerated beyond the live ones before a rebuild.
SLACK = 64


class HeldWork:
    """One pool's held messages by deadline, and the task that answers the late ones."""

    def __init__(self, settler: Settler) -> None:
        self._settler = settler
        self._heap: list[tuple[float, int, Work]] = []
        self._order = itertools.count()  # equal deadlines: first held, first out
        self.live = 0
        self._wake: anyio.CancelScope | None = None  # the task's sleep, until the earliest
        self._wake_at = math.inf  # that sleep's deadline, as a wall-clock time

    def hold(self, work: Work) -> None:
        """``work`` waits in memory from now on, until ``take`` or its deadline."""
        deadline = float(work.envelope.request.deadline)
        work.held = HELD
        heapq.heappush(self._heap, (deadline, next(self._order), work))
        self.live += 1
        if deadline < self._wake_at and self._wake is not None:
            self._sleep_until(self._wake, deadline)

    def take(self, work: Work) -> bool:
        """A worker (or the poller, taking it back) has ``work`` now; False: it was
        answered at its deadline already, pass it by."""
        if work.held != HELD:
            return work.held != ANSWERED  # never held: the taker's
        work.held = TAKEN
        self.live -= 1
        if len(self._heap) > 2 * self.live + SLACK:
            self._heap = [entry for entry in self._heap if entry[2].held == HELD]
            heapq.heapify(self._heap)
        return True

    async def run(self) -> None:
        """Answer held messages at their deadlines until cancelled (the pool's end)."""
        while True:
            with anyio.CancelScope() as self._wake:
                self._sleep_until(self._wake, self._heap[0][0] if self._heap else math.inf)
                await anyio.sleep_forever()
            self._wake = None
            for work in self._due(time.time()):
                await self._answer(work)

    def _sleep_until(self, scope: anyio.CancelScope, deadline: float) -> None:
        """Wake ``run`` at ``deadline`` (wall clock) instead of its current time."""
        self._wake_at = deadline
        if math.isinf(deadline):
            scope.deadline = math.inf
        else:
            scope.deadline = anyio.current_time() + (deadline - time.time())

    def _due(self, now: float) -> list[Work]:
        """Held messages whose deadline has passed, now no longer held (answered)."""
        due = []
        while self._heap and self._heap[0][0] <= now:
            work = heapq.heappop(self._heap)[2]
            if work.held == HELD:
                work.held = ANSWERED
                self.live -= 1
                due.append(work)
        return due

    async def _answer(self, work: Work) -> None:
        """Its result, slot and permits through the pool's settler, as a worker's."""
        envelope = work.envelope
        log.info("held_request_expired", request_id=envelope.id, queue=work.queue.name)
        await self._settler.settle_within(work, expired(envelope.id, last_answer(envelope.routing)))


class HeldLine:
    """A poller's messages that its full lane cannot take yet, in order, each held (so
    answered at its deadline) while the poller admits the rest of its batch, instead of
    the rest waiting unheld behind the first one's blocked send."""

    def __init__(
        self, held: HeldWork, lane: ObjectSendStream[Work], gone: Callable[[], None]
    ) -> None:
        self._held = held
        self._lane = lane
        self._gone = gone  # one of them will never reach the merge
        self._works: deque[Work] = deque()
        self._sending = False

    def forward(self, work: Work) -> None:
        """``work`` held from now on: into the lane if it has room and none waits, else in
        line."""
        self._held.hold(work)
        if self._works or not put_nowait(self._lane, work):
            self._works.append(work)

    async def send(self) -> None:
        """What waits, into the lane in order as it finds room; one answered meanwhile
        leaves the line unsent. One sender at a time (a queue's fetch loops share it)."""
        if self._sending:
            return
        self._sending = True
        try:
            while self._works:
                work = self._works[0]
                if work.answered:
                    self._gone()
                else:
                    await put(self._lane, work)  # cut short: it stays in line
                self._works.popleft()
        finally:
            self._sending = False

    def take_back(self) -> list[Work]:
        """The line emptied, nothing more sent (a stop): those still the poller's, i.e.
        not answered at their deadline."""
        works = list(self._works)
        self._works.clear()
        for _ in works:
            self._gone()
        return [work for work in works if self._held.take(work)]
