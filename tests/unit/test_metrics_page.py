"""The /metrics page is rendered at most once per RENDER_EVERY per form, however many ask
(issue 30, item 4), and still negotiates as prometheus-client's handler did."""

from __future__ import annotations

import gzip

import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request
from prometheus_client import CollectorRegistry, Counter, Gauge

from async_processor.health import MAX_FORMS, RENDER_EVERY, MetricsPage

pytestmark = pytest.mark.anyio
OPENMETRICS = "application/openmetrics-text; version=1.0.0"


class Clock:
    now = 100.0

    def __call__(self) -> float:
        return self.now


def _page() -> tuple[MetricsPage, Counter, Gauge, Clock]:
    registry = CollectorRegistry()
    renders = Counter("renders", "page renders", registry=registry)
    gauge = Gauge("depth", "a gauge", registry=registry)
    clock = Clock()
    return MetricsPage(registry, renders, clock), renders, gauge, clock


def _get(path: str = "/metrics", **headers: str) -> web.Request:
    return make_mocked_request("GET", path, headers=headers)


async def test_a_thousand_requests_in_one_interval_cost_one_render() -> None:
    page, renders, gauge, clock = _page()
    gauge.set(1)
    bodies = {(await page.handle(_get())).body for _ in range(1000)}
    assert renders._value.get() == 1
    assert len(bodies) == 1 and b"depth 1.0" in bodies.pop()
    gauge.set(2)
    clock.now += RENDER_EVERY / 2
    assert b"depth 1.0" in (await page.handle(_get())).body
    clock.now += RENDER_EVERY / 2
    assert b"depth 2.0" in (await page.handle(_get())).body
    assert renders._value.get() == 2


async def test_forms_negotiate_and_each_is_encoded_once() -> None:
    page, renders, gauge, _ = _page()
    gauge.set(3)
    zipped = await page.handle(_get(**{"Accept-Encoding": "gzip"}))
    assert zipped.headers["Content-Encoding"] == "gzip"
    assert b"depth 3.0" in gzip.decompress(zipped.body)
    open_metrics = await page.handle(_get(Accept=OPENMETRICS))
    assert open_metrics.headers["Content-Type"].startswith("application/openmetrics-text")
    assert open_metrics.body.endswith(b"# EOF\n")
    only = await page.handle(_get("/metrics?name[]=depth"))
    assert b"depth 3.0" in only.body and b"renders" not in only.body
    assert renders._value.get() == 1  # one collection for all three forms


async def test_past_max_forms_a_new_form_waits_for_the_next_render() -> None:
    page, renders, _, clock = _page()
    for i in range(MAX_FORMS):
        assert (await page.handle(_get(f"/metrics?name[]=x{i}"))).status == 200
    refused = await page.handle(_get("/metrics?name[]=another"))
    assert refused.status == 429 and refused.headers["Retry-After"] == f"{RENDER_EVERY:g}"
    assert (await page.handle(_get("/metrics?name[]=x0"))).status == 200
    clock.now += RENDER_EVERY
    assert (await page.handle(_get("/metrics?name[]=another"))).status == 200
    assert renders._value.get() == 2
