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
        for index, source in enumerate(self.sources):
            try:
                samples = await source.query()
            except GateError:
                continue
            if samples:
                self._resolved(index)
                return samples
        raise GateError("all metric sources unavailable")

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


class MetricGate:
    """Budget from one metric reading; REFUSE when the budget is 0."""

    def __init__(
        self,
        source: MetricSource,
        *,
        threshold: float,
        fallback: float,
        ctx: GateContext,
        name: str,
        inference_pool: str = "",
        fails_open: bool = False,
    ) -> None:
        self.source = source
        self.threshold = threshold
        self.fallback = min(1.0, max(0.0, fallback))
        self.name = name
        self._fails_open = fails_open and self.fallback > 0
        self._warn = Throttle()
        self._gauges = None
        if ctx.metrics is not None:
            owner = ctx.owner
            queue = ctx.metrics.queue(owner.queue_id, owner.queue_name, owner.pool)
            self._gauges = queue.gate_gauges(inference_pool)
        if self._fails_open:
            log.warning("gate_fails_open", gate=name, fallback_budget=self.fallback)

    async def budget(self) -> float:
        try:
            samples = await self.source.query()
        except GateError as exc:
            return self._use_fallback(str(exc))
        if not samples or not math.isfinite(samples[0].value):
            return self._use_fallback("no usable sample")
        value = samples[0].value
        if self._gauges is not None:
            gauge_value, gauge_threshold, available = self._gauges
            gauge_value.set(value)
            gauge_threshold.set(self.threshold)
            available.set(1)
        self._warn.reset()
        if value <= self.threshold:
            return 0.0
        return min(1.0, max(0.0, value - self.threshold))

    async def apply(self, message: Envelope, releases: Releases) -> Verdict:
        return REFUSE if await self.budget() <= 0 else CONTINUE

    def _use_fallback(self, why: str) -> float:
        if self._gauges is not None:
            self._gauges[2].set(0)
        if self._warn.ready():
            event = "gate_failing_open" if self._fails_open else "gate_using_fallback"
            log.warning(event, gate=self.name, reason=why, fallback_budget=self.fallback)
        return self.fallback
