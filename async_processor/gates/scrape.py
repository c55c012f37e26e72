"""``endpoint-scrape``: a metric gate that reads a ``/metrics`` page, no Prometheus server.

Input: the Prometheus text exposition at ``url`` (e.g. vLLM's or the EPP's), filtered by
``labels``; optionally the ready-pod count from ``pods_url``/``pods_metric``. ``metric``
and ``pods_metric`` may list several names, tried in order (the EPP's current name, then
its deprecated twin: the ``current or legacy`` of the PromQL gates). Output: a
``MetricGate`` budget. ``value_type: saturation`` (default) turns the value into a budget
as ``1 - value / (pods × max_count_per_pod)`` (or ``1 - value`` without a capacity);
``value_type: budget`` uses the value as the budget itself. Cached like PromQL sources.
``absent_value`` (when set) is the raw value when the page answers but no series
matches (an idle vLLM exports no series for a model it has not served yet); unset, that
is a fallback. ``admission: counted`` is the headroom gate of ``gates.scrape_counted``.
Unlike the reference, the gauges carry the owner's queue/pool labels.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Annotated, Any, Literal, Self

import aiohttp
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from pydantic import BeforeValidator, Field, model_validator

from async_processor.errors import GateError, plain
from async_processor.gates.base import GATES, Gate, GateContext
from async_processor.gates.metric import MetricGate, Sample, cached
from async_processor.gates.params import Float, Params, Str, StrMap
from async_processor.gates.prometheus import metrics_session
from async_processor.gates.scrape_counted import CountedScrapeGate

_VALUE_TYPES = frozenset(("gauge", "counter", "unknown", "untyped"))


async def scrape(
    ctx: GateContext, url: str, metrics: Sequence[str], labels: dict[str, str]
) -> list[Sample]:
    """Series of the first of ``metrics`` at ``url`` with a series carrying every label pair."""
    return select(await fetch_page(ctx, url), metrics, labels)


async def fetch_page(ctx: GateContext, url: str) -> list[Metric]:
    """The metric families of the ``/metrics`` page at ``url``; GateError when unreadable."""
    try:
        async with metrics_session(ctx).get(url) as response:
            if response.status != 200:
                raise GateError(f"scrape of {url} answered HTTP {response.status}")
            text = await response.text()
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:  # ValueError: bad charset
        raise GateError(f"scrape of {url} failed: {plain(exc)}") from exc
    try:
        return list(text_string_to_metric_families(text))
    except Exception as exc:  # the parser raises several types on malformed pages
        raise GateError(f"scrape of {url}: unparsable exposition: {plain(exc)}") from exc


def select(families: list[Metric], metrics: Sequence[str], labels: dict[str, str]) -> list[Sample]:
    """Series of the first of ``metrics`` with a series carrying every label pair."""
    for metric in metrics:
        samples = [
            Sample(float(s.value), dict(s.labels))
            for family in families
            if family.type in _VALUE_TYPES
            for s in family.samples
            if s.name == metric and all(s.labels.get(k) == v for k, v in labels.items())
        ]
        if samples:
            return samples
    return []


def _to_names(value: Any) -> Any:
    """One metric name, a list of them, or a JSON string of a list (as Helm writes it)."""
    if isinstance(value, str):
        value = json.loads(value) if value.lstrip().startswith("[") else [value]
    return value


# Metric names tried in order; the first with a matching series wins.
Names = Annotated[
    list[Annotated[str, Field(min_length=1)]], Field(min_length=1), BeforeValidator(_to_names)
]


class ScrapeParams(Params):
    url: Str = Field(min_length=1)
    metric: Names
    labels: StrMap = Field(default_factory=dict)
    value_type: Literal["saturation", "budget"] = "saturation"
    max_count_per_pod: Float = Field(default=0.0, ge=0)
    baseline: Float = 0.0
    fallback: Float = 0.0
    pods_url: Str = ""
    pods_metric: Names | None = None
    pods_labels: StrMap = Field(default_factory=dict)
    absent_value: Float | None = None  # set: the raw value when no series matches
    admission: Literal["budget", "counted"] = "budget"

    @model_validator(mode="after")
    def _budget_has_no_capacity(self) -> Self:
        if self.value_type == "budget" and (self.max_count_per_pod or self.pods_url):
            raise ValueError("value_type budget takes no max_count_per_pod or pods_url")
        return self

    @model_validator(mode="after")
    def _counted_counts_slots(self) -> Self:
        """``counted`` turns a reading into slots: it needs a capacity, and a budget
        threshold or fallback would mean nothing to it (upstream's rules)."""
        if self.admission != "counted":
            return self
        if self.max_count_per_pod <= 0:
            raise ValueError("admission counted needs max_count_per_pod > 0")
        if self.value_type != "saturation":
            raise ValueError("admission counted needs value_type saturation")
        extra = sorted({"baseline", "fallback"} & self.model_fields_set)
        if extra:
            raise ValueError(f"admission counted takes no {' or '.join(extra)}")
        return self


class ScrapeSource:
    def __init__(self, ctx: GateContext, params: ScrapeParams) -> None:
        self._ctx = ctx
        self.params = params

    async def query(self) -> list[Sample]:
        p = self.params
        samples = await self.raw()
        if p.value_type == "budget":
            return [Sample(_clamp(s.value), s.labels) for s in samples]
        capacity = await self.capacity() if samples else 0.0
        return [Sample(1 - _clamp(_ratio(s.value, capacity)), s.labels) for s in samples]

    async def raw(self) -> list[Sample]:
        """The matching series as read, or ``absent_value`` when the page has none."""
        p = self.params
        samples = await scrape(self._ctx, p.url, p.metric, p.labels)
        if not samples and p.absent_value is not None:
            return [Sample(p.absent_value)]
        return samples

    async def capacity(self) -> float:
        p = self.params
        if not (p.pods_url and p.pods_metric):
            return p.max_count_per_pod
        pods = await scrape(self._ctx, p.pods_url, p.pods_metric, p.pods_labels)
        if not pods:
            raise GateError(f"pods metric {p.pods_metric!r} not found at {p.pods_url}")
        if pods[0].value <= 0:
            raise GateError(f"ready pods is {pods[0].value:g}")
        return pods[0].value * p.max_count_per_pod


def _ratio(value: float, capacity: float) -> float:
    return value / capacity if capacity > 0 else value


def _clamp(value: float) -> float:
    return min(1.0, max(0.0, value)) if value == value else value  # NaN stays NaN


@GATES.register("endpoint-scrape", ScrapeParams)
def _endpoint_scrape(params: ScrapeParams, ctx: GateContext) -> Gate:
    if params.admission == "counted":
        return CountedScrapeGate(ScrapeSource(ctx, params), ctx, described(params))
    return MetricGate(
        cached(ScrapeSource(ctx, params), ctx.prometheus_cache_ttl),
        threshold=params.baseline,
        fallback=params.fallback,
        ctx=ctx,
        name="endpoint-scrape",
        queries=described(params),
    )


def described(p: ScrapeParams) -> list[str]:
    """What the gate reads, as ``GET <url> <name> or <name>{labels}``."""
    reads = [f"GET {p.url} {' or '.join(p.metric)}{_matchers(p.labels)}"]
    if p.pods_url and p.pods_metric:
        reads.append(f"GET {p.pods_url} {' or '.join(p.pods_metric)}{_matchers(p.pods_labels)}")
    return reads


def _matchers(labels: dict[str, str]) -> str:
    return "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}" if labels else ""
