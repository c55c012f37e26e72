"""The simulator's fixed capacity model: ``max_concurrent`` requests run at once (0: no
limit), up to ``max_waiting`` more queue for a slot in arrival order, the rest are shed.

Limits are passed per call, since the simulator's config changes at run time.
``Occupancy`` counts the requests in the simulator (whatever their state) over time.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import anyio


@dataclass
class _Waiter:
    """One request queued for a running slot; ``granted`` means the slot is now its own."""

    event: anyio.Event = field(default_factory=anyio.Event)
    granted: bool = False


class Slots:
    """Running slots with a FIFO queue in front of them."""

    def __init__(self) -> None:
        self.running = 0
        self.max_running_seen = 0
        self._queue: deque[_Waiter] = deque()

    @property
    def waiting(self) -> int:
        return len(self._queue)

    async def acquire(self, limit: int, max_waiting: int) -> bool:
        """Take a running slot, queueing FIFO; False when the queue is full too."""
        if self._has_free_slot(limit) and not self._queue:
            self._take()
            return True
        if len(self._queue) >= max_waiting:
            return False
        waiter = _Waiter()
        self._queue.append(waiter)
        try:
            await waiter.event.wait()
        except BaseException:
            # The client left: give up the place, or the slot if it was handed over.
            if waiter.granted:
                self.release(limit)
            else:
                self._queue.remove(waiter)
            raise
        return True

    def release(self, limit: int) -> None:
        self.running -= 1
        self.admit(limit)

    def admit(self, limit: int) -> None:
        """Hand free slots to the longest waiters (after a release or a raised limit)."""
        while self._queue and self._has_free_slot(limit):
            waiter = self._queue.popleft()
            waiter.granted = True
            self._take()
            waiter.event.set()

    def _has_free_slot(self, limit: int) -> bool:
        return limit == 0 or self.running < limit

    def _take(self) -> None:
        self.running += 1
        self.max_running_seen = max(self.max_running_seen, self.running)


class Occupancy:
    """Requests in flight at the simulator and the exact integral of that count over time
    (request-seconds), updated at each arrival and departure.

    Benchmarks read the integral at two moments: its growth over the span, divided by the
    span, is the time-averaged number in flight (Little's law's L). Unlike a count of
    results over a window, it has no steps when answers arrive in waves.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.count = 0
        self.peak = 0  # the most in flight at once since the last reset
        self._area = 0.0  # request-seconds up to ``_since``
        self._since = clock()

    def enter(self) -> None:
        self._advance()
        self.count += 1
        self.peak = max(self.peak, self.count)

    def leave(self) -> None:
        self._advance()
        self.count -= 1

    def reading(self) -> tuple[float, float]:
        """(now on ``clock``, request-seconds accumulated up to now)."""
        now = self.clock()
        return now, self._area + self.count * (now - self._since)

    def reset(self) -> None:
        """Start the integral and the peak again; the requests in flight stay counted."""
        self._area, self._since, self.peak = 0.0, self.clock(), self.count

    def _advance(self) -> None:
        self._since, self._area = self.reading()
