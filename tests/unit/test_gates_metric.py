"""The metric gate: budget formula, fallback, gauges, TTL cache (errors too), cascade, PromQL."""

from __future__ import annotations

import math
from typing import Any

import anyio
import pytest
from prometheus_client import CollectorRegistry

from async_processor.errors import GateError
from async_processor.gates import metric as metric_module
from async_processor.gates import shared as shared_module
from async_processor.gates.base import CONTINUE, REFUSE, GateContext, GateOwner, Releases
from async_processor.gates.metric import CachedSource, CascadeSource, MetricGate, Reading, Sample
from async_processor.gates.prometheus import budget_queries, go_g, go_quote, saturation_query
from async_processor.messages import Envelope, Request
from async_processor.metrics import Metrics


class LogRecorder:
    """Stands in for the module's logger (other tests may configure structlog globally)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []
        self.fields: list[dict[str, Any]] = []

    def __getattr__(self, level: str) -> Any:
        def record(event: str, **kw: Any) -> None:
            self.events.append((level, event))
            self.fields.append(kw)

        return record


@pytest.fixture
def logs(monkeypatch: pytest.MonkeyPatch) -> LogRecorder:
    recorder = LogRecorder()
    monkeypatch.setattr(metric_module, "log", recorder)
    return recorder


class Source:
    """Answers the next scripted reading (a value list or an error) and counts calls."""

    def __init__(self, *answers: list[float] | Exception) -> None:
        self.answers = list(answers)
        self.calls = 0

    async def query(self) -> list[Sample]:
        self.calls += 1
        answer = self.answers[min(self.calls, len(self.answers)) - 1]
        if isinstance(answer, Exception):
            raise answer
        return [Sample(v) for v in answer]


def gate(source: Source, threshold: float, fallback: float, **kw: Any) -> MetricGate:
    context = GateContext(owner=GateOwner("q1", "queue-1", "pool-a"), metrics=kw.pop("m", None))
    return MetricGate(source, threshold=threshold, fallback=fallback, ctx=context, name="t", **kw)


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("value", "threshold", "expected"),
    [(0.9, 0.2, 0.7), (0.2, 0.2, 0.0), (0.1, 0.2, 0.0), (5.0, 0.0, 1.0), (0.5, -1.0, 1.0)],
)
async def test_budget_formula(value: float, threshold: float, expected: float) -> None:
    g = gate(Source([value, 0.0]), threshold, 0.0)
    assert await g.budget() == pytest.approx(expected)  # only the first sample counts
    assert await g.apply(Envelope(Request("r", 1)), Releases()) == (
        CONTINUE if expected > 0 else REFUSE
    )


@pytest.mark.anyio
@pytest.mark.parametrize("answer", [GateError("down"), [], [math.nan], [math.inf]])
async def test_fallback_on_error_empty_or_non_finite(answer: list[float] | Exception) -> None:
    assert await gate(Source(answer), 0.1, 0.25).budget() == 0.25
    assert await gate(Source(answer), 0.1, 7.0).budget() == 1.0  # fallback is clamped


@pytest.mark.anyio
async def test_gauges_follow_readings_and_go_stale_on_fallback() -> None:
    metrics = Metrics(CollectorRegistry())
    g = gate(Source([0.75], GateError("down")), 0.05, 0.0, m=metrics, inference_pool="ip")
    labels = {"queue_id": "q1", "queue_name": "queue-1", "pool_name": "pool-a"}
    labels["inference_pool"] = "ip"

    def value(name: str) -> float | None:
        return metrics.registry.get_sample_value(f"llm_d_async_async_gate_metric_{name}", labels)

    await g.budget()
    assert (value("value"), value("threshold"), value("source_available")) == (0.75, 0.05, 1.0)
    await g.budget()
    assert (value("value"), value("source_available")) == (0.75, 0.0)


@pytest.mark.anyio
async def test_fail_open_gates_warn_at_start_and_on_fallback(logs: LogRecorder) -> None:
    g = gate(Source([0.5], GateError("down"), GateError("down")), 0.2, 1.0, fails_open=True)
    await g.budget()
    await g.budget()
    await g.budget()  # still falling back: no repeat within the minute
    warnings = [event for level, event in logs.events if level == "warning"]
    assert warnings == ["gate_fails_open", "gate_failing_open"]


@pytest.mark.anyio
async def test_a_blind_gate_warns_with_query_and_reason_once_a_minute(
    logs: LogRecorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = [1000.0]
    monkeypatch.setattr(shared_module.time, "monotonic", lambda: clock[0])
    answers = [GateError("connection refused")] * 4 + [[0.5], GateError("down again")]
    g = gate(Source(*answers), 0.2, 0.0, queries=["1 - up"])
    for seconds in (0, 30, 59.9, 60.1):  # the first, then not again within the minute
        clock[0] = 1000.0 + seconds
        assert await g.budget() == 0.0
    await g.budget()  # a good reading ends the episode: the next fallback warns at once
    await g.budget()
    assert logs.events == [("warning", "gate_using_fallback")] * 3
    assert logs.fields[0] == {
        "gate": "t",
        "reason": "connection refused",
        "queries": ["1 - up"],
        "fallback_budget": 0.0,
    }
    assert logs.fields[2]["reason"] == "down again"


@pytest.mark.anyio
async def test_read_says_why_it_would_fall_back() -> None:
    assert await gate(Source([0.9]), 0.2, 0.3).read() == Reading(pytest.approx(0.7), 0.9)
    empty = await gate(Source([]), 0.2, 0.3).read()
    assert empty == Reading(0.3, None, "the query returned no series")
    nan = await gate(Source([math.nan]), 0.2, 0.3).read()
    assert (nan.budget, nan.fallback_reason) == (0.3, "the value is nan")


@pytest.mark.anyio
async def test_cascade_error_names_each_source() -> None:
    cascade = CascadeSource([Source([]), Source(GateError("HTTP 400: bad"))], "b")
    with pytest.raises(GateError, match=r"unavailable: \[0\] no series; \[1\] HTTP 400: bad"):
        await cascade.query()


@pytest.mark.anyio
async def test_cache_keeps_samples_and_errors_for_the_ttl() -> None:
    inner = Source(GateError("down"), [0.5])
    cached = CachedSource(inner, ttl=0.5)
    for _ in range(3):
        with pytest.raises(GateError):
            await cached.query()
    assert inner.calls == 1  # the error was cached too
    await anyio.sleep(0.55)
    assert [s.value for s in await cached.query()] == [0.5]
    assert [s.value for s in await cached.query()] == [0.5]
    assert inner.calls == 2


@pytest.mark.anyio
async def test_cache_lets_one_caller_hit_the_backend() -> None:
    class Slow(Source):
        async def query(self) -> list[Sample]:
            await anyio.sleep(0.05)
            return await super().query()

    inner = Slow([1.0])
    cached = CachedSource(inner, ttl=10)
    async with anyio.create_task_group() as tg:
        for _ in range(20):
            tg.start_soon(cached.query)
    assert inner.calls == 1


@pytest.mark.anyio
async def test_cascade_takes_the_first_source_with_samples(logs: LogRecorder) -> None:
    first, second, third = Source(GateError("x"), [0.9]), Source([], [0.4]), Source([0.3])
    cascade = CascadeSource([first, second, third], "t")
    assert [s.value for s in await cascade.query()] == [0.3]
    assert cascade.active == 2
    assert [s.value for s in await cascade.query()] == [0.9]
    assert cascade.active == 0
    events = [event for _, event in logs.events]
    assert events == ["metric_source_resolved", "primary_metric_source_recovered"]
    with pytest.raises(GateError, match="all metric sources unavailable"):
        await CascadeSource([Source([]), Source(GateError("y"))], "t").query()
    with pytest.raises(ValueError, match="at least two"):
        CascadeSource([Source([])], "t")


def test_go_number_and_string_formatting() -> None:
    assert [go_g(v) for v in (100.0, 2.5, 1e6, 1234567.0, 100000.0, 1e-5, 0.0001)] == [
        "100",
        "2.5",
        "1e+06",
        "1.234567e+06",
        "100000",
        "1e-05",
        "0.0001",
    ]
    assert go_quote('a"b\\c\n\x01é') == '"a\\"b\\\\c\\n\\x01é"'


def test_exact_promql() -> None:
    # Current llm_d_epp_* name first, the deprecated twin as the `or` fallback.
    assert saturation_query("pool-1") == (
        "1 - (max by(inference_pool)(llm_d_epp_flow_control_pool_saturation"
        '{inference_pool="pool-1"}) or max by(inference_pool)'
        '(inference_extension_flow_control_pool_saturation{inference_pool="pool-1"}))'
    )
    assert saturation_query("p", "ns") == (
        "1 - (max by(inference_pool)(llm_d_epp_flow_control_pool_saturation"
        '{inference_pool="p",namespace="ns"}) or max by(inference_pool)'
        '(inference_extension_flow_control_pool_saturation{inference_pool="p",namespace="ns"}))'
    )
    ready = '(max(llm_d_epp_ready_endpoints{name="p"}) or max(inference_pool_ready_pods{name="p"}))'
    assert budget_queries("p", "", 1e6) == [
        "1 - ((sum by(inference_pool)(llm_d_epp_flow_control_queue_size"
        '{inference_pool="p"}) or sum by(inference_pool)'
        '(inference_extension_flow_control_queue_size{inference_pool="p"}))'
        f" / on() ({ready} * 1e+06))",
        '1 - ((avg by(name)(llm_d_epp_per_endpoint_queue_size{name="p"})'
        ' or avg by(name)(inference_pool_per_pod_queue_size{name="p"})) / 1e+06)',
        f'1 - (sum(vllm:num_requests_running{{inference_pool="p"}}) / on() ({ready} * 1e+06))',
    ]
    assert budget_queries("p", "ns", 2.5)[1] == (
        '1 - ((avg by(name)(llm_d_epp_per_endpoint_queue_size{name="p",namespace="ns"})'
        ' or avg by(name)(inference_pool_per_pod_queue_size{name="p",namespace="ns"})) / 2.5)'
    )
