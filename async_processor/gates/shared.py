"""Helpers shared by gate modules: process-wide gauges, shielded releases, forwarding.

Input: a ``GateContext`` (metrics registry, ``shared`` cache) or inner gates. Output:
gauges bound to the gate's owner, release callables that survive cancellation, the
optional ``observe`` / ``wait_changed`` hooks forwarded through wrapper gates, and
``InnerGate``, the base of a gate that wraps one inner gate.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence

import anyio
import structlog
from prometheus_client import Gauge

from async_processor.errors import GateError
from async_processor.gates.base import (
    WAIT_POLL_INTERVAL,
    Gate,
    GateContext,
    Observes,
    Release,
    Releases,
    Verdict,
    WaitsForChange,
    waits_in_apply,
)
from async_processor.messages import Envelope
from async_processor.metrics import PREFIX, Q_LABELS

log = structlog.get_logger(__name__)

# A release talks to a backend; bound it so shutdown cannot hang on a dead Redis.
RELEASE_TIMEOUT = 5.0
# A failing backend is reported when it starts failing, then at most this often.
WARN_EVERY = 60.0


class Throttle:
    """Lets a repeated warning through once per ``interval``; ``reset`` when it recovers.

    Pool gates are asked every 50 ms by every parked worker: without this a dead backend
    would log thousands of identical lines a second.
    """

    __slots__ = ("_last", "interval")

    def __init__(self, interval: float = WARN_EVERY) -> None:
        self.interval = interval
        self._last = -math.inf

    def ready(self) -> bool:
        now = time.monotonic()
        if now - self._last < self.interval:
            return False
        self._last = now
        return True

    def reset(self) -> None:
        self._last = -math.inf


def owner_gauge(ctx: GateContext, name: str, doc: str) -> Gauge | None:
    """``llm_d_async_async_<name>`` bound to the owner's queue labels (None without metrics).

    The family is registered once per registry and cached in ``ctx.shared``.
    """
    if ctx.metrics is None:
        return None
    registry = ctx.metrics.registry
    key = f"gauge:{PREFIX}{name}:{id(registry)}"
    family = ctx.shared.get(key)
    if family is None:
        family = ctx.shared[key] = Gauge(PREFIX + name, doc, Q_LABELS, registry=registry)
    owner = ctx.owner
    child: Gauge = family.labels(owner.queue_id, owner.queue_name, owner.pool)
    return child


def shielded(release: Callable[[], Awaitable[None]], what: str) -> Release:
    """A release that finishes even when the caller is being cancelled; errors are logged."""

    async def run() -> None:
        with anyio.move_on_after(RELEASE_TIMEOUT, shield=True) as scope:
            try:
                await release()
            except Exception as exc:  # a failed release must not fail the request
                log.warning("gate_release_failed", gate=what, error=str(exc))
        if scope.cancelled_caught:
            log.warning("gate_release_timed_out", gate=what)

    return run


def observe_all(
    gates: Sequence[Gate], message: Envelope, status: int | None, latency: float, reason: str
) -> None:
    """Forward a dispatch outcome to every inner gate that learns from it."""
    for gate in gates:
        if isinstance(gate, Observes):
            gate.observe(message, status, latency, reason)


async def wait_any_changed(gates: Sequence[Gate], timeout: float) -> None:
    """Return when any inner gate may have changed, or after ``timeout``.

    Inner gates that cannot signal a change are polled, so the wait is then capped at
    ``WAIT_POLL_INTERVAL``.
    """
    waiters = [g for g in gates if isinstance(g, WaitsForChange)]
    if len(waiters) < len(gates):
        timeout = min(timeout, WAIT_POLL_INTERVAL)
    if not waiters:
        await anyio.sleep(timeout)
        return
    async with anyio.create_task_group() as tg:

        async def one(gate: WaitsForChange) -> None:
            await gate.wait_changed(timeout)
            tg.cancel_scope.cancel()

        for gate in waiters:
            tg.start_soon(one, gate)


class InnerGate:
    """Base of a gate wrapping one inner gate: budget and the hooks forward to it.

    Subclasses write ``apply`` on top of ``apply_inner``, which names the wrapper's
    role (``failed``) in the inner gate's error.
    """

    failed = "inner gate apply failed"

    def __init__(self, inner: Gate) -> None:
        self.inner = inner
        self.waits_in_apply = waits_in_apply(inner)

    async def budget(self) -> float:
        return await self.inner.budget()

    async def apply_inner(self, message: Envelope, releases: Releases) -> Verdict:
        try:
            return await self.inner.apply(message, releases)
        except GateError as exc:
            raise GateError(f"{self.failed}: {exc}") from exc

    def observe(
        self, message: Envelope, status: int | None, latency: float, dropped_reason: str
    ) -> None:
        observe_all([self.inner], message, status, latency, dropped_reason)

    async def wait_changed(self, timeout: float) -> None:
        await wait_any_changed([self.inner], timeout)


class ChangeSignal:
    """Wakes parked waiters, oldest first: ``notify(n)`` wakes ``n`` of them (None = all).

    A freed slot wakes one waiter, not every parked worker (a thundering herd of
    re-applies for one slot); a waiter that loses the race parks again, and the
    caller's poll interval bounds any missed wake-up.
    """

    __slots__ = ("_waiters",)

    def __init__(self) -> None:
        self._waiters: deque[anyio.Event] = deque()

    def notify(self, n: int | None = None) -> None:
        count = len(self._waiters) if n is None else min(n, len(self._waiters))
        for _ in range(count):
            self._waiters.popleft().set()

    async def wait(self, timeout: float) -> None:
        event = anyio.Event()
        self._waiters.append(event)
        try:
            with anyio.move_on_after(timeout):
                await event.wait()
        finally:
            if not event.is_set():
                self._waiters.remove(event)
