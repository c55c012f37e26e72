"""Prometheus gates: exact PromQL against a recording fake, and budgets following a real
Prometheus that scrapes the simulator while its load goes up and down."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import anyio
import pytest
from prometheus_client import CollectorRegistry

from async_processor.gates.base import Gate, GateContext, GateOwner, build_gate
from async_processor.gates.prometheus import budget_queries, saturation_query
from async_processor.metrics import Metrics
from tests.fixtures.prometheus import FakePrometheus, PrometheusServer
from tests.fixtures.simulator import SimulatorProcess


@pytest.fixture
async def contexts() -> AsyncIterator[Callable[..., GateContext]]:
    made: list[GateContext] = []

    def make(url: str, ttl: float = 0.0) -> GateContext:
        context = GateContext(
            owner=GateOwner("q", "q", "pool-a"),
            metrics=Metrics(CollectorRegistry()),
            prometheus_url=url,
            prometheus_cache_ttl=ttl,
        )
        made.append(context)
        return context

    yield make
    for context in made:
        for close in context.closers:
            await close()


# ------------------------------------------------------------------- recording fake


@pytest.mark.anyio
async def test_saturation_sends_the_exact_query(
    fake_prometheus: FakePrometheus, contexts: Callable[..., GateContext]
) -> None:
    ctx = contexts(fake_prometheus.url)
    params = {"pool": 'pool "x"', "namespace": "llm", "threshold": "0.7"}
    gate = build_gate("prometheus-saturation", params, ctx)
    matchers = '{inference_pool="pool \\"x\\"",namespace="llm"}'
    expected = (
        f"1 - (max by(inference_pool)(llm_d_epp_flow_control_pool_saturation{matchers})"
        f" or max by(inference_pool)(inference_extension_flow_control_pool_saturation{matchers}))"
    )
    assert saturation_query('pool "x"', "llm") == expected
    fake_prometheus.answers[expected] = [({"inference_pool": "x"}, 0.5)]  # 1 - S: S = 0.5
    assert await gate.budget() == pytest.approx(0.2)
    assert fake_prometheus.queries == [expected]
    labels = {"queue_id": "q", "queue_name": "q", "pool_name": "pool-a"}
    labels["inference_pool"] = 'pool "x"'
    assert ctx.metrics is not None
    registry = ctx.metrics.registry
    value = registry.get_sample_value("llm_d_async_async_gate_metric_value", labels)
    threshold = registry.get_sample_value("llm_d_async_async_gate_metric_threshold", labels)
    assert value == 0.5 and threshold == pytest.approx(0.3)


@pytest.mark.anyio
async def test_saturation_fails_open_and_budget_fails_closed(
    fake_prometheus: FakePrometheus, contexts: Callable[..., GateContext]
) -> None:
    ctx = contexts(fake_prometheus.url)
    fake_prometheus.failure = (400, {"status": "error", "error": "bad query"})
    saturation = build_gate("prometheus-saturation", {"pool": "p"}, ctx)
    budget = build_gate("prometheus-budget", {"pool": "p"}, ctx)
    assert await saturation.budget() == 1.0
    assert await budget.budget() == 0.0
    assert (
        await build_gate("prometheus-budget", {"pool": "p", "fallback": 0.3}, ctx).budget() == 0.3
    )


@pytest.mark.anyio
async def test_budget_cascade_queries_in_order(
    fake_prometheus: FakePrometheus, contexts: Callable[..., GateContext]
) -> None:
    ctx = contexts(fake_prometheus.url)
    gate = build_gate(
        "prometheus-budget", {"pool": "p", "max_concurrency": "2.5", "baseline": 0.1}, ctx
    )
    queries = budget_queries("p", "", 2.5)
    assert queries[0].endswith("* 2.5))")
    fake_prometheus.answers[queries[1]] = [({"name": "p"}, 0.6)]
    assert await gate.budget() == pytest.approx(0.5)
    assert fake_prometheus.queries == queries[:2]  # [0] was empty, [1] answered
    fake_prometheus.queries.clear()
    fake_prometheus.answers[queries[0]] = [({"inference_pool": "p"}, 0.05)]
    assert await gate.budget() == 0.0  # D <= baseline closes
    assert fake_prometheus.queries == queries[:1]


@pytest.mark.anyio
async def test_query_gate_and_cache(
    fake_prometheus: FakePrometheus, contexts: Callable[..., GateContext]
) -> None:
    ctx = contexts(fake_prometheus.url + "/", ttl=30.0)  # a trailing slash is fine
    query = 'scalar(up{job="x"}) * 2'
    gate = build_gate("prometheus-query", {"query": query, "pool": "ip"}, ctx)
    fake_prometheus.answers[query] = [({}, 3.0)]
    for _ in range(5):
        assert await gate.budget() == 1.0  # clamped
    assert fake_prometheus.queries == [query]  # cached for the TTL
    fake_prometheus.failure = (200, {"status": "success", "data": {"resultType": "scalar"}})
    fresh = build_gate(
        "prometheus-query", {"query": query, "fallback": "0.2"}, contexts(ctx.prometheus_url)
    )
    assert await fresh.budget() == 0.2  # a scalar result is an error


# ------------------------------------------------------------- real Prometheus + simulator


async def load(sim_url: str, n: int, stop: anyio.Event) -> None:
    """Hold ``n`` requests open on the simulator until ``stop`` (cancelling them ends them)."""
    body = {"model": "m", "prompt": "x", "max_tokens": 1}
    async with aiohttp.ClientSession() as session, anyio.create_task_group() as tg:

        async def one() -> None:
            async with session.post(sim_url + "/v1/completions", json=body) as response:
                await response.read()

        for _ in range(n):
            tg.start_soon(one)
        await stop.wait()
        tg.cancel_scope.cancel()


async def until(check: Callable[[], Awaitable[bool]], timeout: float = 15.0) -> float:
    start = time.monotonic()
    while not await check():
        assert time.monotonic() - start < timeout, "budget did not follow the load"
        await anyio.sleep(0.2)
    return time.monotonic() - start


@pytest.mark.slow
@pytest.mark.anyio
async def test_budgets_follow_simulator_load_through_real_prometheus(
    simulator: SimulatorProcess,
    prometheus_factory: Callable[[list[str]], PrometheusServer],
    contexts: Callable[..., GateContext],
) -> None:
    simulator.configure(latency=60.0, max_concurrent=10, max_waiting=100, ready_pods=1)
    prometheus = prometheus_factory([f"127.0.0.1:{simulator.port}"])
    ctx = contexts(prometheus.url)
    saturation = build_gate("prometheus-saturation", {"pool": "sim-pool", "threshold": 0.8}, ctx)
    budget = build_gate(
        "prometheus-budget", {"pool": "sim-pool", "max_concurrency": 10, "baseline": 0.05}, ctx
    )
    query = build_gate(
        "prometheus-query", {"query": "1 - sum(vllm:num_requests_running) / 10"}, ctx
    )
    readings: dict[str, float] = {}

    async def read() -> dict[str, float]:
        gates: dict[str, Gate] = {"sat": saturation, "budget": budget, "query": query}
        for name, gate in gates.items():
            readings[name] = round(await gate.budget(), 3)
        return readings

    async def idle() -> bool:
        return await read() == {"sat": 0.8, "budget": 0.95, "query": 1.0}

    await until(idle, timeout=20)  # Prometheus has scraped the idle simulator

    stop = anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(load, simulator.url, 15, stop)  # 10 running + 5 waiting

        async def loaded() -> bool:
            # S = 1 closes saturation; D = 1 - 5/10 from the flow-control queue; 1 - 10/10.
            return await read() == {"sat": 0.0, "budget": 0.45, "query": 0.0}

        await until(loaded)
        stop.set()
    await until(idle)
    labels = {"queue_id": "q", "queue_name": "q", "pool_name": "pool-a"}
    labels["inference_pool"] = "sim-pool"
    assert ctx.metrics is not None
    available = ctx.metrics.registry.get_sample_value(
        "llm_d_async_async_gate_metric_source_available", labels
    )
    assert available == 1.0


@pytest.mark.anyio
@pytest.mark.parametrize(
    "body",
    [
        {"status": "success", "data": "oops"},
        {"status": "success", "data": {"resultType": "matrix", "result": []}},
        {"status": "success", "data": {"resultType": "vector", "result": [{"value": "x"}]}},
        {"status": "success", "data": {"resultType": "vector", "result": [{"value": [1, "?"]}]}},
        ["not", "an", "object"],
    ],
)
async def test_malformed_answers_use_the_fallback(
    fake_prometheus: FakePrometheus, contexts: Callable[..., GateContext], body: Any
) -> None:
    fake_prometheus.failure = (200, body)
    gate = build_gate(
        "prometheus-query", {"query": "q", "fallback": 0.4}, contexts(fake_prometheus.url)
    )
    assert await gate.budget() == 0.4
    assert fake_prometheus.queries == ["q"]
