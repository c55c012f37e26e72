"""endpoint-scrape: against the simulator's /metrics under load, and edge cases on a tiny app."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import anyio
import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry

from async_processor.errors import ConfigError
from async_processor.gates.base import GateContext, GateOwner, build_gate
from async_processor.metrics import Metrics
from tests.fixtures.simulator import SimulatorProcess
from tests.integration.test_gates_prometheus import load, until


@pytest.fixture
async def ctx() -> AsyncIterator[GateContext]:
    context = GateContext(
        owner=GateOwner("q", "q", "pool-a"),
        metrics=Metrics(CollectorRegistry()),
        prometheus_cache_ttl=0,
    )
    yield context
    for close in context.closers:
        await close()


@pytest.mark.slow
@pytest.mark.anyio
async def test_scrape_follows_simulator_load(simulator: SimulatorProcess, ctx: GateContext) -> None:
    simulator.configure(latency=60.0, max_concurrent=50, ready_pods=2)
    metrics_url = simulator.url + "/metrics"
    params: dict[str, Any] = {
        "url": metrics_url,
        "metric": "vllm:num_requests_running",
        "labels": '{"model_name": "sim-model"}',
        "max_count_per_pod": "5",
        "pods_url": metrics_url,
        "pods_metric": ["llm_d_epp_ready_endpoints", "inference_pool_ready_pods"],
        "baseline": 0.1,
    }
    gate = build_gate("endpoint-scrape", params, ctx)
    other = build_gate("endpoint-scrape", {**params, "labels": {"model_name": "x"}}, ctx)
    assert await gate.budget() == pytest.approx(0.9)  # idle: 1 - 0/10 - baseline
    assert await other.budget() == 0.0  # no series matches the filter: fallback

    async def budget_is(expected: float) -> bool:
        return round(await gate.budget(), 3) == expected

    for running, expected in ((5, 0.4), (12, 0.0)):  # capacity = 2 pods x 5
        stop = anyio.Event()
        async with anyio.create_task_group() as tg:
            tg.start_soon(load, simulator.url, running, stop)
            await until(lambda e=expected: budget_is(e), timeout=5)  # type: ignore[misc]
            stop.set()
    await until(lambda: budget_is(0.9), timeout=5)
    labels = {"queue_id": "q", "queue_name": "q", "pool_name": "pool-a", "inference_pool": ""}
    assert ctx.metrics is not None
    value = ctx.metrics.registry.get_sample_value("llm_d_async_async_gate_metric_value", labels)
    assert value == 1.0  # 1 - saturation at the last reading, under the owner's labels


@dataclass
class Page:
    """A /metrics endpoint whose text and status a test sets."""

    text: str = ""
    status: int = 200
    url: str = ""
    delay: float = 0.0  # seconds before it answers


@pytest.fixture
async def page() -> AsyncIterator[Page]:
    current = Page()

    async def metrics(request: web.Request) -> web.Response:
        await anyio.sleep(current.delay)
        return web.Response(text=current.text, status=current.status, content_type="text/plain")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    current.url = f"http://127.0.0.1:{runner.addresses[0][1]}/metrics"
    yield current
    await runner.cleanup()


EXPOSITION = """\
# TYPE free_share gauge
free_share{pool="a"} 0.7
free_share{pool="b"} 0.2
# TYPE lat histogram
lat_bucket{le="1"} 3
lat_bucket{le="+Inf"} 3
lat_sum 2
lat_count 3
# TYPE ready gauge
ready 0
running_total 3
"""


@pytest.mark.anyio
async def test_scrape_value_types_filters_and_types(page: Page, ctx: GateContext) -> None:
    page.text = EXPOSITION
    base = {"url": page.url, "fallback": 0.05}
    budget = {**base, "metric": "free_share", "value_type": "budget", "labels": {"pool": "b"}}
    assert await build_gate("endpoint-scrape", budget, ctx).budget() == pytest.approx(0.2)
    saturation = {**base, "metric": "free_share", "labels": {"pool": "b"}}
    assert await build_gate("endpoint-scrape", saturation, ctx).budget() == pytest.approx(0.8)
    untyped = {**base, "metric": "running_total", "max_count_per_pod": 4}
    assert await build_gate("endpoint-scrape", untyped, ctx).budget() == pytest.approx(0.25)
    histogram = {**base, "metric": "lat_bucket"}  # histogram series are skipped
    assert await build_gate("endpoint-scrape", histogram, ctx).budget() == 0.05


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("status", "text", "extra"),
    [
        (500, EXPOSITION, {}),
        (200, "this is { not the format", {}),
        (200, EXPOSITION, {"pods_url": "P", "pods_metric": "absent"}),
        (200, EXPOSITION, {"pods_url": "P", "pods_metric": "ready"}),  # 0 ready pods
    ],
)
async def test_scrape_failures_use_the_fallback(
    page: Page, ctx: GateContext, status: int, text: str, extra: dict[str, str]
) -> None:
    page.status, page.text = status, text
    extra = {k: page.url if v == "P" else v for k, v in extra.items()}
    params = {"url": page.url, "metric": "free_share", "max_count_per_pod": 1, **extra}
    gate = build_gate("endpoint-scrape", {**params, "fallback": 0.33}, ctx)
    assert await gate.budget() == 0.33


@pytest.mark.anyio
async def test_scrape_tries_metric_names_in_order(page: Page, ctx: GateContext) -> None:
    page.text = EXPOSITION
    names = ["absent_current", "free_share"]  # current name missing: the legacy one answers
    both = {"url": page.url, "metric": names, "labels": {"pool": "a"}, "value_type": "budget"}
    assert await build_gate("endpoint-scrape", both, ctx).budget() == pytest.approx(0.7)
    as_helm_writes_it = {**both, "metric": '["free_share", "running_total"]'}
    assert await build_gate("endpoint-scrape", as_helm_writes_it, ctx).budget() == 0.7
    # The first name with a matching series wins, even when a later one also has one.
    first = {**both, "metric": ["running_total", "free_share"], "labels": {}}
    assert await build_gate("endpoint-scrape", first, ctx).budget() == 1.0  # 3 clamps to 1
    pods = {"url": page.url, "metric": "running_total", "max_count_per_pod": 10}
    pods |= {"pods_url": page.url, "pods_metric": ["no_such_pods", "free_share"]}
    assert await build_gate("endpoint-scrape", pods, ctx).budget() == pytest.approx(1 - 3 / 7)


@pytest.mark.anyio
@pytest.mark.parametrize("metric", [[], [""], "[1", '["ok", ""]'])
async def test_scrape_rejects_bad_metric_name_lists(metric: Any, ctx: GateContext) -> None:
    with pytest.raises(ConfigError, match="metric"):
        build_gate("endpoint-scrape", {"url": "http://x/metrics", "metric": metric}, ctx)
