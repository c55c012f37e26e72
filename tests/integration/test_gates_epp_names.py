"""EPP metric names: every EPP-derived gate reads the same budget whether the EPP exports
the current ``llm_d_epp_*`` names, only the legacy ones, or both (a real Prometheus
scraping the simulator in each mode; the endpoint-scrape recipes read it directly)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import anyio
import pytest
from aiohttp import web

from async_processor.gates.base import Gate, GateContext, build_gate
from async_processor.gates.epp import POOL_SATURATION, READY_ENDPOINTS
from async_processor.gates.prometheus import budget_queries
from tests.fixtures.prometheus import PrometheusServer
from tests.fixtures.simulator import SimulatorProcess
from tests.integration.test_gates_prometheus import contexts, load, until
from tests.integration.test_gates_scrape import Page, page

__all__ = ["contexts", "page"]  # fixtures used below


def epp_gates(ctx: GateContext, sim_url: str) -> dict[str, Gate]:
    """The gates of docs/gates.md that read EPP series, as an operator would set them up."""
    pool = {"pool": "sim-pool"}
    gates = {
        "saturation": build_gate("prometheus-saturation", {**pool, "threshold": 0.8}, ctx),
        "budget": build_gate(
            "prometheus-budget", {**pool, "max_concurrency": 10, "baseline": 0.05}, ctx
        ),
        "scrape-vllm": build_gate(  # vLLM load over the EPP's ready-endpoint count
            "endpoint-scrape",
            {
                "url": sim_url + "/metrics",
                "metric": "vllm:num_requests_running",
                "max_count_per_pod": 10,
                "pods_url": sim_url + "/metrics",
                "pods_metric": list(READY_ENDPOINTS.names),
            },
            ctx,
        ),
        "scrape-saturation": build_gate(  # the EPP's own saturation, no Prometheus
            "endpoint-scrape",
            {
                "url": sim_url + "/metrics",
                "metric": list(POOL_SATURATION.names),
                "labels": {"inference_pool": "sim-pool"},
                "baseline": 0.2,
            },
            ctx,
        ),
    }
    # Each prometheus-budget source on its own, so all three are checked, not only [0].
    for index, query in enumerate(budget_queries("sim-pool", "", 10)):
        gates[f"source{index}"] = build_gate("prometheus-query", {"query": query}, ctx)
    return gates


# Running/waiting on a pool of 1 endpoint x 10 slots -> every gate's budget.
IDLE = (0, {"saturation": 0.8, "budget": 0.95, "scrape-vllm": 1.0, "scrape-saturation": 0.8})
IDLE[1].update(source0=1.0, source1=1.0, source2=1.0)
# 10 running + 5 waiting: saturation 1 closes; the queue sources read 1 - 5/10. Counting a
# dual-emitting EPP's series twice would read 1 - 10/10 here.
HALF = (15, {"saturation": 0.0, "budget": 0.45, "scrape-vllm": 0.0, "scrape-saturation": 0.0})
HALF[1].update(source0=0.5, source1=0.5, source2=0.0)
# 10 running + 10 waiting: everything is closed.
FULL = (20, {name: 0.0 for name in IDLE[1]})


@pytest.mark.slow
@pytest.mark.anyio
@pytest.mark.parametrize("names", ["current", "legacy", "both"])
async def test_every_epp_gate_reads_the_same_budget_from_any_epp_generation(
    names: str,
    simulator: SimulatorProcess,
    prometheus_factory: Callable[[list[str]], PrometheusServer],
    contexts: Callable[..., GateContext],
) -> None:
    simulator.configure(
        latency=60.0, max_concurrent=10, max_waiting=100, ready_pods=1, epp_metrics=names
    )
    prometheus = prometheus_factory([f"127.0.0.1:{simulator.port}"])
    gates = epp_gates(contexts(prometheus.url), simulator.url)
    seen: dict[str, float] = {}

    async def reads(expected: dict[str, float]) -> bool:
        for name, gate in gates.items():
            seen[name] = round(await gate.budget(), 3)
        return seen == expected

    for requests, expected in (IDLE, HALF, FULL, IDLE):
        stop, followed = anyio.Event(), True
        async with anyio.create_task_group() as tg:
            if requests:
                tg.start_soon(load, simulator.url, requests, stop)
            try:
                await until(lambda e=expected: reads(e), timeout=20)  # type: ignore[misc]
            except AssertionError:
                followed = False  # fail outside the task group, once the load has stopped
            stop.set()
        assert followed, f"{names}: expected {expected}, last read {seen}"


STAGED = """\
# TYPE llm_d_epp_flow_control_pool_saturation gauge
llm_d_epp_flow_control_pool_saturation{inference_pool="p",stage="decode"} 0.3
llm_d_epp_flow_control_pool_saturation{inference_pool="p",stage="effective"} 0.9
llm_d_epp_flow_control_pool_saturation{inference_pool="p",stage="prefill"} 0.9
"""


@pytest.mark.slow
@pytest.mark.anyio
async def test_saturation_reads_the_effective_stage(
    page: Page,
    prometheus_factory: Callable[[list[str]], PrometheusServer],
    contexts: Callable[..., GateContext],
) -> None:
    # An EPP with P/D stages exports one series per stage; decode sorts first but only
    # effective = max(prefill, decode) says whether the pool is saturated.
    page.text = STAGED
    prometheus = prometheus_factory([page.url.removeprefix("http://").removesuffix("/metrics")])
    gate = build_gate("prometheus-saturation", {"pool": "p"}, contexts(prometheus.url))

    async def closed() -> bool:
        return await gate.budget() == 0.0  # the first sample (decode) would read 0.5

    await until(closed, timeout=20)  # open (the fail-open fallback) until the first scrape


REPLICA = """\
# TYPE llm_d_epp_ready_endpoints gauge
llm_d_epp_ready_endpoints{name="p"} 2
# TYPE llm_d_epp_flow_control_queue_size gauge
llm_d_epp_flow_control_queue_size{inference_pool="p"} 3
"""


@pytest.fixture
async def epp_replicas() -> AsyncIterator[list[str]]:
    """Two EPP replicas of one pool: each reports the same ready count and its own queue."""

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text=REPLICA, content_type="text/plain")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    for _ in range(2):
        await web.TCPSite(runner, "127.0.0.1", 0).start()
    yield [f"127.0.0.1:{address[1]}" for address in runner.addresses]
    await runner.cleanup()


@pytest.mark.slow
@pytest.mark.anyio
async def test_budget_reads_the_ready_count_once_over_epp_replicas(
    epp_replicas: list[str],
    prometheus_factory: Callable[[list[str]], PrometheusServer],
    contexts: Callable[..., GateContext],
) -> None:
    # Prometheus labels each replica's series with its instance: summed they would double the
    # pool (1 - 6/40), unaggregated `/ on()` fails on the duplicates; max reads 2 pods.
    prometheus = prometheus_factory(epp_replicas)
    params = {"pool": "p", "max_concurrency": 10, "baseline": 0.05, "fallback": 0.01}
    gate = build_gate("prometheus-budget", params, contexts(prometheus.url))

    async def reads_both_queues_over_two_pods() -> bool:
        return round(await gate.budget(), 3) == 0.65  # 1 - (3 + 3) / (2 x 10) - 0.05

    await until(reads_both_queues_over_two_pods, timeout=20)
