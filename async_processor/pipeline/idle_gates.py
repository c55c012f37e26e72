"""Idle gates: the gates of queues whose pollers wait for a message, read all the same.

Input: the gates (with their queues' ``dispatch_budget`` gauges) of the pollers waiting
for their queue's next message (``SignalsMessages``: redis-sortedset's idle probe),
registered for as long as they wait. Output: every ``interval`` (the shortest poll
interval), each of those gates read once and its budget set on its waiting queues'
gauges; a gate's read sets its own gauges too (``gate_metric_value``,
``gate_metric_source_available``).

Why: an idle queue costs no poller cycle, so its gate was not read, and its gauges kept
their last value while the source changed: an alert on a budget of 0 neither fired nor
cleared (issue 30, item 3; the Go daemon reads every queue's gate each poll interval).
As cheap as can be: a gate shared by a ``gate_group``'s queues is read once a round,
however many of them wait; the reads of a round run together, at most ``CONCURRENT`` at
once; gates that read in batches (``ReadsInBatch``: the ``redis`` gates of one connection)
are read with one call per batch (one MGET for 200 idle queues' budget keys, not 200
GETs; issue 30, item 4); a gate's own cache applies (a PromQL result is reused for
``--prometheus-cache-ttl``); a queue that is not waiting is read by its poller, not here.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, cast

import anyio
from prometheus_client import Gauge

from async_processor.gates.base import Gate, ReadsInBatch

CONCURRENT = 16  # gate reads of one round under way at once
BoundLogger = Any  # a queue's structlog logger (bound to its queue and pool)


async def read_budget(gate: Gate, queue_log: BoundLogger) -> float:
    """The gate's budget clamped to [0, 1]; a failing or NaN budget counts as closed
    (as the reference's gates fail closed) instead of stopping the daemon."""
    try:
        budget = await gate.budget()
    except Exception as exc:
        queue_log.warning("queue_gate_budget_failed", error=str(exc))
        return 0.0
    return _clamped(budget)


def _clamped(budget: float) -> float:
    """A gate's budget in [0, 1], NaN as 0 (``max(0.0, nan)`` is 0.0): one rule for a
    budget read alone or in a batch."""
    return min(1.0, max(0.0, budget))


@dataclass
class _Waiting:
    """One gate and the gauges of the queues waiting behind it (a group's share one)."""

    gate: Gate
    queue_log: BoundLogger
    gauges: list[Gauge] = field(default_factory=list)


class IdleGates:
    """The waiting queues' gates, read every ``interval`` by ``run``."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self._waiting: dict[int, _Waiting] = {}  # by id(gate)

    @contextmanager
    def waiting(self, gate: Gate, gauge: Gauge, queue_log: BoundLogger) -> Iterator[None]:
        """Read ``gate`` into ``gauge`` while the block runs (a poller's wait)."""
        entry = self._waiting.setdefault(id(gate), _Waiting(gate, queue_log))
        entry.gauges.append(gauge)
        try:
            yield
        finally:
            entry.gauges.remove(gauge)
            if not entry.gauges:
                del self._waiting[id(gate)]

    async def run(self) -> None:
        while True:
            await anyio.sleep(self.interval)
            await self.read_round()

    async def read_round(self) -> None:
        """Read each waiting gate once and set its queues' gauges."""
        limiter = anyio.CapacityLimiter(CONCURRENT)
        batches: dict[int, list[_Waiting]] = {}
        async with anyio.create_task_group() as tg:
            for entry in list(self._waiting.values()):
                if isinstance(entry.gate, ReadsInBatch):
                    batches.setdefault(id(entry.gate.batch), []).append(entry)
                else:
                    tg.start_soon(self._read, entry, limiter)
            for entries in batches.values():
                tg.start_soon(self._read_batch, entries)

    async def _read(self, entry: _Waiting, limiter: anyio.CapacityLimiter) -> None:
        async with limiter:
            budget = await read_budget(entry.gate, entry.queue_log)
        _set(entry, budget)

    async def _read_batch(self, entries: list[_Waiting]) -> None:
        batch = cast(ReadsInBatch, entries[0].gate).batch  # grouped by it in read_round
        budgets = await batch.budgets([entry.gate for entry in entries])
        for entry, budget in zip(entries, budgets, strict=True):
            _set(entry, _clamped(budget))


def _set(entry: _Waiting, budget: float) -> None:
    for gauge in entry.gauges:  # those still waiting: a poller woken meanwhile sets its own
        gauge.set(budget)
