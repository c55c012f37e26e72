"""The metric gate shared by prometheus-saturation/-budget/-query and endpoint-scrape.

Input: a ``MetricSource`` (PromQL or a scraped endpoint), optionally behind a TTL cache
and a cascade of sources. Output: a budget in [0,1] from the first sample,
``0`` if ``v <= threshold`` else ``clamp(v - threshold)``, or the configured fallback
when the source fails, is empty or gives NaN/Inf; plus the gate gauges
(value, threshold, source_available) labelled with the owner and inference pool.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import anyio
import structlog

from async_processor.errors import GateError
from async_processor.gates.base import CONTINUE, REFUSE, GateContext, Releases, Verdict
from async_processor.gates.shared import Throttle
from async_processor.messages import Envelope

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class Sample:
    value: float
    labels: dict[str, str] = field(default_factory=dict)


class MetricSource(Protocol):
    """One instant reading; raises GateError when the backend fails."""

    async def query(self) -> list[Sample]: ...


class CachedSource:
    """Keeps the last answer, samples or error, for ``ttl`` seconds; one caller at a time."""

    def __init__(self, inner: MetricSource, ttl: float) -> None:
        self.inner = inner
        self.ttl = ttl
        self._lock = anyio.Lock()
        self._until = -math.inf
        self._samples: list[Sample] = []
        self._error: GateError | None = None

    async def query(self) -> list[Sample]:
        async with self._lock:
            if time.monotonic() >= self._until:
                try:
                    self._samples, self._error = await self.inner.query(), None
                except GateError as exc:
                    self._samples, self._error = [], exc
                self._until = time.monotonic() + self.ttl
            if self._error is not None:
                raise self._error
            return self._samples


def cached(source: MetricSource, ttl: float) -> MetricSource:
    return CachedSource(source, ttl) if ttl > 0 else source


class CascadeSource:
    """The first source with no error and at least one sample wins."""

    def __init__(self, sources: Sequence[MetricSource], name: str) -> None:
        if len(sources) < 2:
            raise ValueError("a cascade needs at least two sources")
        self.sources = list(sources)
        self.name = name
        self.active = -1

    async def query(self) -> list[Sample]:
        reasons = []
        for index, source in enumerate(self.sources):
            try:
                samples = await source.query()
            except GateError as exc:
                reasons.append(f"[{index}] {exc}")
                continue
            if samples:
                self._resolved(index)
                return samples
            reasons.append(f"[{index}] no series")
        raise GateError("all metric sources unavailable: " + "; ".join(reasons))

    def _resolved(self, index: int) -> None:
        if index == self.active:
            return
        if self.active == -1:
            log.info("metric_source_resolved", gate=self.name, source_index=index)
        elif index == 0:
            log.info("primary_metric_source_recovered", gate=self.name)
        else:
            log.warning("using_fallback_metric_source", gate=self.name, source_index=index)
        self.active = index


@dataclass(frozen=True, slots=True)
class Reading:
    """One look at the source: the budget, and the value read or why there was none."""

    budget: float
    value: float | None = None
    fallback_reason: str | None = None


class MetricGate:
    """Budget from one metric reading; REFUSE when the budget is 0.

    On its fallback the gate is blind, so it says so: a warning with the query and the
    reason at the first fallback and then at most once a minute while it lasts, and
    ``gate_metric_source_available`` 0 (the chart's ``AsyncProcessorGateBlind`` alert).
    """

    def __init__(
        self,
        source: MetricSource,
        *,
        threshold: float,
        fallback: float,
        ctx: GateContext,
        name: str,
        queries: Sequence[str] = (),
        inference_pool: str = "",
        fails_open: bool = False,
    ) -> None:
        self.source = source
        self.threshold = threshold
        self.fallback = min(1.0, max(0.0, fallback))
        self.name = name
        self.queries = list(queries)  # what it reads, for the logs and check-config --probe
        self.fails_open = fails_open and self.fallback > 0
        self._warn = Throttle()
        self._gauges = None
        if ctx.metrics is not None:
            owner = ctx.owner
            queue = ctx.metrics.queue(owner.queue_id, owner.queue_name, owner.pool)
            self._gauges = queue.gate_gauges(inference_pool)
        if self.fails_open:
            log.warning("gate_fails_open", gate=name, fallback_budget=self.fallback)

    async def read(self) -> Reading:
        """Query the source once; no gauges, no logs (``check-config --probe`` uses it)."""
        try:
            samples = await self.source.query()
        except GateError as exc:
            return Reading(self.fallback, fallback_reason=str(exc))
        if not samples:
            return Reading(self.fallback, fallback_reason="the query returned no series")
        value = samples[0].value
        if not math.isfinite(value):
            return Reading(self.fallback, fallback_reason=f"the value is {value}")
        budget = 0.0 if value <= self.threshold else min(1.0, max(0.0, value - self.threshold))
        return Reading(budget, value=value)

    async def budget(self) -> float:
        reading = await self.read()
        if reading.value is None:
            self._use_fallback(reading.fallback_reason or "")
        else:
            self._record(reading.value)
        return reading.budget

    async def apply(self, message: Envelope, releases: Releases) -> Verdict:
        return REFUSE if await self.budget() <= 0 else CONTINUE

    def _record(self, value: float) -> None:
        if self._gauges is not None:
            gauge_value, gauge_threshold, available = self._gauges
            gauge_value.set(value)
            gauge_threshold.set(self.threshold)
            available.set(1)
        self._warn.reset()

    def _use_fallback(self, why: str) -> None:
        if self._gauges is not None:
            self._gauges[2].set(0)
        if self._warn.ready():
            event = "gate_failing_open" if self.fails_open else "gate_using_fallback"
            log.warning(
                event,
                gate=self.name,
                reason=why,
                queries=self.queries,
                fallback_budget=self.fallback,
            )
