"""Prometheus gates: ``prometheus-saturation``, ``prometheus-budget``, ``prometheus-query``.

Input: instant PromQL queries against ``--prometheus-url`` (HTTP API ``/api/v1/query``,
aiohttp, one session per process), cached for ``--prometheus-cache-ttl`` (errors too).
Output: a ``MetricGate`` budget. The PromQL keeps the reference's formulas and text
conventions (label matchers sorted by name, values quoted like Go string literals,
``max_concurrency`` printed like Go's ``%g``), but each EPP series is asked for as
``current or legacy`` (``gates.epp``), so old, new and dual-emitting EPPs all work.
"""

from __future__ import annotations

import math
from decimal import Decimal
from typing import Any

import aiohttp
import structlog
from pydantic import Field

from async_processor.errors import ConfigError, GateError, plain
from async_processor.gates.base import GATES, Gate, GateContext
from async_processor.gates.epp import (
    FLOW_CONTROL_QUEUE_SIZE,
    PER_ENDPOINT_QUEUE_SIZE,
    POOL_SATURATION,
    READY_ENDPOINTS,
    EppMetric,
)
from async_processor.gates.metric import CascadeSource, MetricGate, MetricSource, Sample, cached
from async_processor.gates.params import Float, Params, Str

log = structlog.get_logger(__name__)

QUERY_TIMEOUT = 10.0
_GO_ESCAPES = {'"': '\\"', "\\": "\\\\", "\a": "\\a", "\b": "\\b", "\f": "\\f", "\n": "\\n"}
_GO_ESCAPES |= {"\r": "\\r", "\t": "\\t", "\v": "\\v"}


def go_quote(text: str) -> str:
    """``text`` as a Go ``%q`` string literal (what the reference puts in matchers)."""
    out = []
    for ch in text:
        if ch in _GO_ESCAPES:
            out.append(_GO_ESCAPES[ch])
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\x{ord(ch):02x}")
        elif not ch.isprintable():
            out.append(f"\\u{ord(ch):04x}" if ord(ch) <= 0xFFFF else f"\\U{ord(ch):08x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def go_g(value: float) -> str:
    """Go's ``%g`` for a float64: shortest digits, exponent form below 1e-4 or from 1e6."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if value == 0:
        return "-0" if math.copysign(1, value) < 0 else "0"
    sign, digit_tuple, exponent = Decimal(repr(value)).normalize().as_tuple()
    digits = "".join(map(str, digit_tuple))
    exp = len(digits) + int(exponent) - 1  # decimal exponent of the first digit
    prefix = "-" if sign else ""
    if exp < -4 or exp >= 6:
        mantissa = digits[0] + ("." + digits[1:] if len(digits) > 1 else "")
        return f"{prefix}{mantissa}e{'-' if exp < 0 else '+'}{abs(exp):02d}"
    return prefix + format(Decimal(repr(abs(value))).normalize(), "f")


def selector(metric: str, **labels: str) -> str:
    matchers = ",".join(f"{k}={go_quote(v)}" for k, v in sorted(labels.items()) if v)
    return f"{metric}{{{matchers}}}"


def current_or_legacy(metric: EppMetric, aggregate: str = "", **labels: str) -> str:
    """``(agg(current{…}) or agg(legacy{…}))``: the current name wins where both exist.

    ``or`` keeps the right side only for label sets the left lacks (the metric name is
    not compared), so a dual-emitting EPP gives one series, not two. Aggregating each
    side first also makes a renamed label (``model_server_pod``) irrelevant.
    """
    current, legacy = (selector(name, **labels) for name in metric.names)
    if aggregate:
        current, legacy = f"{aggregate}({current})", f"{aggregate}({legacy})"
    return f"({current} or {legacy})"


def saturation_query(pool: str, namespace: str = "") -> str:
    # max over the stage label (prefill, decode, effective = their max) is the effective
    # saturation; an EPP without the label has one series per pool and max changes nothing.
    saturation = current_or_legacy(
        POOL_SATURATION, "max by(inference_pool)", inference_pool=pool, namespace=namespace
    )
    return f"1 - {saturation}"


def budget_queries(pool: str, namespace: str, max_concurrency: float) -> list[str]:
    mc = go_g(max_concurrency)
    # max, not sum: every EPP replica reports the same pool-wide count (upstream #489);
    # without an aggregate, two replicas made ``/ on()`` fail on duplicate series.
    ready = current_or_legacy(READY_ENDPOINTS, "max", name=pool, namespace=namespace)
    queue = current_or_legacy(
        FLOW_CONTROL_QUEUE_SIZE, "sum by(inference_pool)", inference_pool=pool, namespace=namespace
    )
    per_pod = current_or_legacy(
        PER_ENDPOINT_QUEUE_SIZE, "avg by(name)", name=pool, namespace=namespace
    )
    running = selector("vllm:num_requests_running", inference_pool=pool, namespace=namespace)
    return [
        f"1 - ({queue} / on() ({ready} * {mc}))",
        f"1 - ({per_pod} / {mc})",
        f"1 - (sum({running}) / on() ({ready} * {mc}))",
    ]


def metrics_session(ctx: GateContext) -> aiohttp.ClientSession:
    """One HTTP session per process for every metric gate (made lazily inside the loop)."""
    session: aiohttp.ClientSession | None = ctx.shared.get("http:metrics")
    if session is None or session.closed:
        session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=QUERY_TIMEOUT))
        ctx.shared["http:metrics"] = session
        ctx.closers.append(session.close)
    return session


class PromQLSource:
    """An instant query at "now"; the result must be a vector."""

    def __init__(self, ctx: GateContext, base_url: str, query: str) -> None:
        self._ctx = ctx
        self.url = base_url.rstrip("/") + "/api/v1/query"
        self.query_text = query

    async def query(self) -> list[Sample]:
        try:
            async with metrics_session(self._ctx).get(
                self.url, params={"query": self.query_text}
            ) as r:
                body: Any = await r.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            raise GateError(f"prometheus at {self.url} failed: {plain(exc)}") from exc
        if not isinstance(body, dict) or body.get("status") != "success":
            error = body.get("error") if isinstance(body, dict) else None
            raise GateError(f"prometheus query failed (HTTP {r.status}): {error or body!r}")
        for warning in body.get("warnings") or []:
            log.warning("prometheus_query_warning", query=self.query_text, warning=warning)
        return _vector(body.get("data"))


def _vector(data: Any) -> list[Sample]:
    """Samples of an instant-vector result; anything else is a GateError."""
    kind = data.get("resultType") if isinstance(data, dict) else None
    if kind != "vector":
        raise GateError(f"prometheus result is {kind!r}, not a vector")
    try:
        return [Sample(float(s["value"][1]), dict(s.get("metric") or {})) for s in data["result"]]
    except (AttributeError, KeyError, IndexError, TypeError, ValueError) as exc:
        raise GateError(f"malformed prometheus vector: {plain(exc)}") from exc


def _require_url(ctx: GateContext, gate: str) -> str:
    if not ctx.prometheus_url:
        raise ConfigError(f"gate {gate!r} requires --prometheus-url flag to be set")
    return ctx.prometheus_url


def _source(ctx: GateContext, query: str) -> MetricSource:
    return cached(
        PromQLSource(ctx, _require_url(ctx, "prometheus"), query), ctx.prometheus_cache_ttl
    )


class SaturationParams(Params):
    pool: Str = Field(min_length=1)
    namespace: Str = ""
    threshold: Float = 0.8
    fallback: Float = 0.0  # a saturation: 0 means budget 1, the gate fails OPEN


@GATES.register("prometheus-saturation", SaturationParams)
def _saturation(params: SaturationParams, ctx: GateContext) -> Gate:
    _require_url(ctx, "prometheus-saturation")
    query = saturation_query(params.pool, params.namespace)
    log.info("prometheus_saturation_metric_source", query=query)
    return MetricGate(
        _source(ctx, query),
        threshold=1 - params.threshold,
        fallback=1 - params.fallback,
        ctx=ctx,
        name="prometheus-saturation",
        queries=[query],
        inference_pool=params.pool,
        fails_open=True,
    )


class BudgetParams(Params):
    pool: Str = Field(min_length=1)
    namespace: Str = ""
    max_concurrency: Float = Field(default=100.0, gt=0)
    baseline: Float = Field(default=0.05, ge=0, lt=1)
    fallback: Float = 0.0


@GATES.register("prometheus-budget", BudgetParams)
def _budget(params: BudgetParams, ctx: GateContext) -> Gate:
    _require_url(ctx, "prometheus-budget")
    queries = budget_queries(params.pool, params.namespace, params.max_concurrency)
    for index, query in enumerate(queries):
        log.info("prometheus_budget_metric_source", source_index=index, query=query)
    log.info(
        "prometheus_budget_gate_configured",
        pool=params.pool,
        closes_at_load_per_ready_pod=params.max_concurrency * (1 - params.baseline),
    )
    return MetricGate(
        CascadeSource([_source(ctx, q) for q in queries], "prometheus-budget"),
        threshold=params.baseline,
        fallback=params.fallback,
        ctx=ctx,
        name="prometheus-budget",
        queries=queries,
        inference_pool=params.pool,
    )


class QueryParams(Params):
    query: Str = Field(min_length=1)
    fallback: Float = 0.0
    pool: Str = ""  # labels only: the gauges' inference_pool


@GATES.register("prometheus-query", QueryParams)
def _query(params: QueryParams, ctx: GateContext) -> Gate:
    _require_url(ctx, "prometheus-query")
    log.info("prometheus_query_metric_source", query=params.query)
    return MetricGate(
        _source(ctx, params.query),
        threshold=0.0,
        fallback=params.fallback,
        ctx=ctx,
        name="prometheus-query",
        queries=[params.query],
        inference_pool=params.pool,
    )
