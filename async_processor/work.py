"""The unit handed between stages: a fetched, decoded, queue-admitted message.

Input: built by the poller. Output: read by the merge policy (which stamps headers),
the pool admission gate, the transforms and the dispatch worker.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import anyio
from anyio.abc import ObjectReceiveStream, ObjectSendStream
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from async_processor.config.queues import QueueSpec
from async_processor.gates.base import Releases
from async_processor.messages import Envelope
from async_processor.metrics import QueueMetrics
from async_processor.transports.base import Delivery

T = TypeVar("T")


@dataclass(slots=True, eq=False)
class Work:
    delivery: Delivery
    envelope: Envelope
    metrics: QueueMetrics
    # Reservations taken by the queue gate; given back when the message leaves the worker.
    releases: Releases = field(default_factory=Releases)
    # Headers stamped by the merge policy (fairness, priority, lane objective), in order.
    stamped_headers: list[tuple[str, str]] = field(default_factory=list)
    # Called once when the merge policy takes it (the poller counts what still waits).
    picked: Callable[[], None] = field(default=lambda: None)

    @property
    def queue(self) -> QueueSpec:
        return self.delivery.queue


def _none() -> int:
    return 0


class PoolCapacity:
    """Free slots of one pool: pollers reserve before fetching, workers give back when done.

    Slots = workers + a small prefetch, so fetching stops when workers are busy and memory
    is bounded by configuration, not by broker depth (docs/architecture.md G3).

    Waiting pollers are served in turn, the one with the fewest messages ``waiting`` for
    the merge first, then first come, first served: a poller that just gave slots back
    cannot take them again ahead of one already waiting (an empty queue's poller, cycling
    fast, starved a busy queue's poller of the same pool that way), and a queue whose only
    message the merge just took refills before queues that still have one to offer (else
    slots went round-robin over 200 queues and a weight-4 queue got no more than a
    weight-1 one: bench.tenants). A poller takes no slot another waiting poller needs:
    with 200 queues, batches of 10 left most queues with nothing to offer.
    """

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self.free = slots
        # Waiting turns in arrival order, each with its caller's count of waiting messages,
        # read when a slot frees (a queue the merge served while it waited moves up).
        self._waiters: dict[anyio.Event, Callable[[], int]] = {}
        self._woken = 0  # waiters woken and not yet resumed: nobody may take slots first

    async def reserve(self, wanted: int, waiting: Callable[[], int] = _none) -> int:
        """Wait for a free slot in turn, then take up to ``wanted``. ``waiting``: how many
        of the caller's messages the merge has not taken yet (fewer goes first)."""
        if self.free <= 0 or self._waiters or self._woken:
            await self._turn(waiting, first=False)
            while self.free <= 0:  # its slot was taken away (resize) before it resumed
                await self._turn(waiting, first=True)
        # Leave a slot for each poller still waiting: one queue's batch must not take the
        # slots the others need to keep one message each before the merge.
        taken = min(wanted, max(1, self.free - len(self._waiters)))
        self.free -= taken
        self._wake()
        return taken

    async def _turn(self, waiting: Callable[[], int], *, first: bool) -> None:
        """Wait until woken; ``first``: ahead of the others (it had been woken already)."""
        turn = anyio.Event()
        if first:
            self._waiters = {turn: waiting, **self._waiters}
        else:
            self._waiters[turn] = waiting
        try:
            await turn.wait()
        except BaseException:
            if turn.is_set():  # woken but cancelled before taking: pass the turn on
                self._woken -= 1
                self._wake()
            else:
                del self._waiters[turn]
            raise
        self._woken -= 1

    def release(self, count: int = 1) -> None:
        if count <= 0:
            return
        self.free += count
        self._wake()

    def resize(self, delta: int) -> None:
        """Add (or take away) slots: a queue found or removed while running."""
        self.slots += delta
        self.free += delta
        self._wake()

    def _wake(self) -> None:
        if self.free > 0 and self._waiters and not self._woken:
            self._woken += 1
            turn = self._next_turn()
            del self._waiters[turn]
            turn.set()

    def _next_turn(self) -> anyio.Event:
        """The waiter with the fewest waiting messages, the first of equals (arrival
        order). The pass ends at the first with none, as none can have fewer: with 200
        backlogged queues most waiters hold one message in the merge, and a full pass per
        freed slot was 6 % of a daemon's CPU (bench.tenants)."""
        best, fewest = None, 0
        for turn, waiting in self._waiters.items():
            count = waiting()
            if count <= 0:
                return turn
            if best is None or count < fewest:
                best, fewest = turn, count
        assert best is not None  # only called with waiters
        return best


class ShedPause:
    """A pool's brake on gateway sheds: after a 429 (or a drop reason) the pool sends
    nothing new until Retry-After has passed, at most ``cap`` seconds (0 = never pause).

    Without it every worker fires its next request at once into a saturated router, which
    answers 429 again (bench.harvest: thousands of 429s per minute from 64 fixed workers).
    Requests already sent are not touched; the shed one is retried with its own backoff.
    """

    def __init__(self, cap: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.cap = cap
        self._clock = clock
        self.until = 0.0

    def shed(self, retry_after: float | None) -> None:
        if self.cap > 0:
            pause = self.cap if retry_after is None else min(self.cap, retry_after)
            self.until = max(self.until, self._clock() + pause)

    async def wait(self) -> None:
        delay = self.until - self._clock()
        if delay > 0:
            await anyio.sleep(delay)


async def put(stream: ObjectSendStream[T], item: T) -> None:
    """Send; when the buffer has room, without a trip through the event loop.

    anyio's ``send`` always yields to the loop first (a checkpoint). Each message crosses
    three hand-offs, so on the hot path that was three extra loop iterations per message.
    """
    if not put_nowait(stream, item):
        await stream.send(item)


def put_nowait(stream: ObjectSendStream[T], item: T) -> bool:
    """Send if the buffer has room now (a memory stream); False, and nothing sent, if not."""
    if not isinstance(stream, MemoryObjectSendStream):
        return False
    try:
        stream.send_nowait(item)
    except anyio.WouldBlock:
        return False
    return True


async def take(stream: ObjectReceiveStream[T]) -> T:
    """Receive; at once when something is buffered (see ``put``). EndOfStream when done."""
    if isinstance(stream, MemoryObjectReceiveStream):
        try:
            item: T = stream.receive_nowait()
            return item
        except anyio.WouldBlock:
            pass
    return await stream.receive()
