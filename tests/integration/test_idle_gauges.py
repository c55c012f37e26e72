"""Gauges of an idle queue follow their source (issue 30, item 3): the daemon in-process on
real Redis, its only queue empty (its poller waits on the idle probe), and the gate's
source changed meanwhile: a Redis budget key, a value a real Prometheus scrapes.

Before: an idle queue's gate was read only when a message came, so ``dispatch_budget``,
``gate_metric_value`` and ``gate_metric_source_available`` kept their last values.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import anyio
import pytest
from aiohttp import web
from redis.asyncio import Redis

from async_processor.health import listening
from async_processor.pipeline.processor import Processor
from tests.fixtures.inprocess import metric, running, sortedset_config
from tests.fixtures.prometheus import PrometheusServer
from tests.fixtures.simulator import SimulatorProcess

pytestmark = pytest.mark.anyio
BUDGET = "llm_d_async_async_dispatch_budget"
VALUE = "llm_d_async_async_gate_metric_value"
AVAILABLE = "llm_d_async_async_gate_metric_source_available"


async def _until(processor: Processor, queue: str, wanted: dict[str, float]) -> None:
    """Until each gauge of ``wanted`` reads its value for ``queue`` (10 s at most)."""

    def reads() -> dict[str, float]:
        return {name: metric(processor, name, queue_name=queue) for name in wanted}

    with anyio.move_on_after(10):
        while reads() != wanted:
            await anyio.sleep(0.05)
    assert reads() == wanted


async def _idle(processor: Processor) -> None:
    """Until the queue's poller waits for a message (a claim found the queue empty)."""
    fetcher = processor.transport._fetcher  # type: ignore[attr-defined]
    with anyio.fail_after(10):
        while not fetcher._empty:
            await anyio.sleep(0.02)
    await anyio.sleep(0.3)


async def test_the_budget_gauge_follows_a_redis_key_while_the_queue_is_empty(
    redis_url: str, redis_client: Redis, simulator: SimulatorProcess, unique: str
) -> None:
    key = f"{unique}:budget"
    gate = {"gate_type": "redis", "gate_params": {"address": redis_url, "budget_key": key}}
    config = sortedset_config(redis_url, simulator.url, unique, queue_extra=gate)
    async with running(config) as processor:
        await _until(processor, unique, {BUDGET: 1.0})  # no key: open
        await _idle(processor)
        await redis_client.set(key, "0")
        await _until(processor, unique, {BUDGET: 0.0})
        await redis_client.set(key, "0.25")
        await _until(processor, unique, {BUDGET: 0.25})


async def test_gate_gauges_follow_a_prometheus_value_while_the_queue_is_empty(
    redis_url: str,
    simulator: SimulatorProcess,
    prometheus_factory: Callable[[list[str]], PrometheusServer],
    unique: str,
) -> None:
    value = {"now": 0.7}

    async def exposition(_: web.Request) -> web.Response:
        return web.Response(text=f"gate_test_value {value['now']}\n")

    target = web.Application()
    target.router.add_get("/metrics", exposition)
    async with contextlib.AsyncExitStack() as serving:
        port = await serving.enter_async_context(listening(target, "127.0.0.1", 0))
        prometheus = prometheus_factory([f"127.0.0.1:{port}"])
        gate = {"gate_type": "prometheus-query", "gate_params": {"query": "gate_test_value"}}
        config = sortedset_config(
            redis_url,
            simulator.url,
            unique,
            queue_extra=gate,
            prometheus_url=prometheus.url,
            prometheus_cache_ttl="500ms",
        )
        async with running(config) as processor:
            await _until(processor, unique, {BUDGET: 0.7, VALUE: 0.7, AVAILABLE: 1.0})
            await _idle(processor)
            value["now"] = 0.2
            await _until(processor, unique, {BUDGET: 0.2, VALUE: 0.2, AVAILABLE: 1.0})
            # The target goes: Prometheus marks its series stale at the next failed scrape.
            await serving.aclose()
            await _until(processor, unique, {BUDGET: 0.0, VALUE: 0.2, AVAILABLE: 0.0})
