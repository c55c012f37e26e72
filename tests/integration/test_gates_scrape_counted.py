"""endpoint-scrape's ``absent_value`` and ``admission: counted`` (upstream #484), against a
real /metrics endpoint over HTTP whose text the test changes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anyio
import pytest
from prometheus_client import CollectorRegistry

from async_processor.gates.base import Action, GateContext, GateOwner, Releases, build_gate
from async_processor.messages import decode_envelope
from async_processor.metrics import Metrics
from tests.integration.test_gates_scrape import Page, ctx, page

__all__ = ["ctx", "page"]  # fixtures used below

RUNNING = '# TYPE running gauge\nrunning{{model="m"}} {value}\n# TYPE ready gauge\nready 2\n'
NO_SERIES = "# TYPE other gauge\nother 1\n"
MESSAGE = decode_envelope(b'{"id":"r1","deadline":4102444800,"payload":{}}')


@pytest.mark.anyio
async def test_absent_value_is_the_reading_when_no_series_matches(
    page: Page, ctx: GateContext
) -> None:
    page.text = NO_SERIES
    params: dict[str, Any] = {"url": page.url, "metric": "running", "max_count_per_pod": 4}
    without = build_gate("endpoint-scrape", {**params, "fallback": 0.33}, ctx)
    assert await without.budget() == 0.33  # unset: no series is a fallback, as before
    idle = build_gate("endpoint-scrape", {**params, "absent_value": 0, "fallback": 0.33}, ctx)
    assert await idle.budget() == 1.0  # set, even to 0: the raw value, 1 - 0/4
    busy = build_gate("endpoint-scrape", {**params, "absent_value": "3"}, ctx)
    assert await busy.budget() == pytest.approx(0.25)  # through the capacity like a reading
    page.text = RUNNING.format(value=1)
    assert await busy.budget() == pytest.approx(0.75)  # a series present wins
    page.status = 500
    assert await busy.budget() == 0.0  # a failed scrape is not "absent": the fallback


async def admissions(gate: Any, tries: int) -> int:
    admitted = 0
    for _ in range(tries):
        verdict = await gate.apply(MESSAGE, Releases())
        admitted += verdict.action is Action.CONTINUE
    return admitted


@pytest.fixture
def counted(page: Page) -> Callable[..., tuple[Any, Metrics]]:
    def make(ttl: float = 3600.0, **extra: Any) -> tuple[Any, Metrics]:
        metrics = Metrics(CollectorRegistry())
        context = GateContext(
            owner=GateOwner("q", "q", "pool-a"), metrics=metrics, prometheus_cache_ttl=ttl
        )
        params = {"url": page.url, "metric": "running", "admission": "counted"}
        gate = build_gate("endpoint-scrape", {**params, "max_count_per_pod": 5, **extra}, context)
        return gate, metrics

    return make


def gauge(metrics: Metrics, name: str) -> float | None:
    labels = {"queue_id": "q", "queue_name": "q", "pool_name": "pool-a", "inference_pool": ""}
    return metrics.registry.get_sample_value(f"llm_d_async_async_{name}", labels)


@pytest.mark.anyio
async def test_counted_admits_the_free_slots_of_one_reading(
    page: Page, counted: Callable[..., tuple[Any, Metrics]]
) -> None:
    page.text = RUNNING.format(value=2.5)
    gate, metrics = counted()
    assert await gate.budget() == 1.0
    # floor(5 - 2.5) = 2 slots for this reading, whatever the page says until the next one.
    assert await admissions(gate, 5) == 2
    assert await gate.budget() == 0.0
    page.text = RUNNING.format(value=0)
    assert await admissions(gate, 3) == 0  # same reading: nothing more
    assert gauge(metrics, "gate_metric_value") == 2.5
    assert gauge(metrics, "gate_metric_threshold") == 0
    assert gauge(metrics, "gate_metric_source_available") == 1


@pytest.mark.anyio
async def test_counted_reads_again_each_interval_and_scales_with_pods(
    page: Page, counted: Callable[..., tuple[Any, Metrics]]
) -> None:
    page.text = RUNNING.format(value=7)
    gate, _ = counted(ttl=0.2, pods_url=page.url, pods_metric="ready")  # capacity 2 x 5
    assert await admissions(gate, 10) == 3
    page.text = RUNNING.format(value=9)
    with anyio.fail_after(10):
        while await gate.budget() != 1.0 or gate.allowance != 1:
            await anyio.sleep(0.05)  # the next interval's reading: a fresh count
    assert await admissions(gate, 10) == 1


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("status", "text"),
    [
        (500, RUNNING.format(value=0)),
        (200, NO_SERIES),
        (200, RUNNING.format(value="NaN")),
        (200, RUNNING.format(value=-1)),
    ],
)
async def test_counted_admits_nothing_on_a_bad_reading(
    page: Page, counted: Callable[..., tuple[Any, Metrics]], status: int, text: str
) -> None:
    page.status, page.text = status, text
    gate, metrics = counted()
    assert await gate.budget() == 0.0
    assert await admissions(gate, 3) == 0
    assert gauge(metrics, "gate_metric_source_available") == 0


@pytest.mark.anyio
async def test_counted_with_absent_value_admits_on_an_idle_page(
    page: Page, counted: Callable[..., tuple[Any, Metrics]]
) -> None:
    page.text = NO_SERIES
    gate, _ = counted(absent_value=0)
    assert await admissions(gate, 9) == 5
