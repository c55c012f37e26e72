"""``endpoint-scrape`` with ``admission: counted``: a headroom gate over a scraped count.

Input: one reading per ``--prometheus-cache-ttl`` of the scraped value (e.g. vLLM's
running requests, or ``absent_value`` when no series matches) and the capacity
(``max_count_per_pod`` × ready pods). Output: a ``Verdict`` per message and a budget.

Upstream's semantics (#484): each reading sets an allowance of
``floor(capacity - value)`` (at least 0) and restarts the count of admissions; every
message admitted counts against it until the next reading, so one stale reading never
lets more in than the free slots it saw (a ``budget`` gate would admit a whole fetch on
one good reading). A failed, NaN or negative reading admits nothing until the next one.
``budget()`` is 1 while a slot remains, else 0. The gate gauges hold the value read
(threshold 0) and whether the source answered.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Protocol

import anyio
import structlog

from async_processor.errors import GateError
from async_processor.gates.base import CONTINUE, REFUSE, GateContext, Releases, Verdict
from async_processor.gates.metric import Sample
from async_processor.gates.shared import Throttle
from async_processor.messages import Envelope

log = structlog.get_logger(__name__)


class CountedSource(Protocol):
    """The raw series (``absent_value`` applied) and the slots they are counted against."""

    async def raw(self) -> list[Sample]: ...

    async def capacity(self) -> float: ...


class CountedScrapeGate:
    def __init__(self, source: CountedSource, ctx: GateContext, queries: Sequence[str]) -> None:
        self._source = source
        self._interval = ctx.prometheus_cache_ttl
        self.queries = list(queries)  # for the logs and check-config --probe
        self.allowance = 0  # admissions the last reading leaves room for
        self.admitted = 0  # admitted since the last reading
        self._until = -math.inf
        self._lock = anyio.Lock()
        self._warn = Throttle()
        self._gauges = None
        if ctx.metrics is not None:
            owner = ctx.owner
            queue = ctx.metrics.queue(owner.queue_id, owner.queue_name, owner.pool)
            self._gauges = queue.gate_gauges("")

    async def budget(self) -> float:
        await self._refresh()
        return 1.0 if self.admitted < self.allowance else 0.0

    async def apply(self, message: Envelope, releases: Releases) -> Verdict:
        await self._refresh()
        if self.admitted >= self.allowance:
            return REFUSE
        self.admitted += 1
        return CONTINUE

    async def _refresh(self) -> None:
        """A new reading once the last one is older than the interval (one at a time)."""
        if time.monotonic() < self._until:
            return
        async with self._lock:
            if time.monotonic() < self._until:  # read by another caller meanwhile
                return
            try:
                allowance = await self._read()
            except GateError as exc:
                allowance = 0
                self._unavailable(str(exc))
            self.allowance, self.admitted = allowance, 0
            self._until = time.monotonic() + self._interval

    async def _read(self) -> int:
        samples = await self._source.raw()
        if not samples:
            raise GateError("the scrape returned no series")
        value = samples[0].value
        if not math.isfinite(value) or value < 0:
            raise GateError(f"the value is {value}")
        capacity = await self._source.capacity()
        if self._gauges is not None:
            gauge_value, threshold, available = self._gauges
            gauge_value.set(value)
            threshold.set(0)
            available.set(1)
        self._warn.reset()
        return max(0, math.floor(capacity - value))

    def _unavailable(self, why: str) -> None:
        if self._gauges is not None:
            self._gauges[2].set(0)
        if self._warn.ready():
            log.warning("gate_using_fallback", gate="endpoint-scrape", reason=why,
                        queries=self.queries, fallback_budget=0)  # fmt: skip
