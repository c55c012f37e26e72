"""Pool capacity: how many messages a pool may hold, who may take the next free slot, and
the brake on gateway sheds.

Input: a pool's workers and queues (sizing); pollers reserving slots before they fetch and
workers giving them back. Output: ``PoolCapacity`` (the pool's slots), ``ShedPause`` (its
pause after a 429), and the sizes of a pool (``pool_slots``) and of a queue's lane
(``lane_size``).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import anyio

from async_processor.config.queues import QueueSpec

# The most a pool prefetches: a round trip's worth of freed workers even at thousands of
# requests in flight (at 10,000 workers a quarter was 2,500 messages held, ~25 MB, for
# nothing: bench.in_flight).
MAX_PREFETCH = 256


def prefetch(workers: int) -> int:
    """Messages a pool holds beyond its workers: a quarter of them, 1..MAX_PREFETCH."""
    return min(max(1, workers // 4), MAX_PREFETCH)


def pool_slots(workers: int, queues: int) -> int:
    """What a pool of ``workers`` serving ``queues`` queues may hold at once.

    A little prefetch beyond the workers hides the fetch round trip. No more: every
    message held here is leased away from the other replicas, and with fetching driven by
    free slots, an urgent queue is served at the next free slot anyway. Plus one slot per
    further queue: a message for the merge from each backlogged queue (and, where the
    transport cannot signal messages, what an idle queue's poller holds while its fetch
    waits).
    """
    return workers + prefetch(workers) + max(0, queues - 1)


def lane_size(queue: QueueSpec, slots: int, workers: int, queues: int) -> int:
    """The buffer of ``queue``'s lane into its pool's merge.

    A fetch sized by free slots is admitted whole, so the next one starts at once.
    Otherwise the lanes share the pool's prefetch: a lane of one batch kept a pool's only
    poller blocked one batch ahead of the workers, most prefetch slots never fetched, and
    freed workers waiting for fetch round trips (issue 13, Little's law).
    """
    shared = prefetch(workers) // max(1, queues)
    return slots if queue.max_fetch else max(queue.batch_size, shared)


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
