"""The API's /metrics as a batch moves: open batches by status (a gauge read from Redis),
lines by outcome, time to a batch's first result, requests by route. A private
redis-server for this module: the gauge counts every open batch in Redis, so no other
test's batch may be there."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.test_batch_api import line, run_batch, wait_for
from tests.e2e.test_batch_api_results import failing
from tests.fixtures.api import ApiProcess, BatchStack
from tests.fixtures.servers import RedisServer

pytestmark = [pytest.mark.slow]


@pytest.fixture
def redis_url(tmp_path: Path) -> Iterator[str]:
    (tmp_path / "redis").mkdir()
    server = RedisServer(dir=tmp_path / "redis").start()
    yield server.url
    server.stop()


def sample(api: ApiProcess, name: str) -> float:
    found = re.search(rf"^{re.escape(name)} (\S+)$", api.metrics(), re.MULTILINE)
    return float(found.group(1)) if found else -1.0


def wait_sample(api: ApiProcess, name: str, value: float, timeout: float = 30) -> None:
    end = time.monotonic() + timeout
    while (seen := sample(api, name)) != value:
        assert time.monotonic() < end, f"{name} is {seen}, not {value}, after {timeout}s"
        time.sleep(0.2)


def test_metrics_follow_a_batch(batch_stack: BatchStack) -> None:
    api, client = batch_stack.apis[-1], batch_stack.client()
    in_progress = 'async_processor_api_batches{status="in_progress"}'
    assert sample(api, in_progress) == 0  # at 0 from the start: an alert sees the series
    batch_stack.simulator.configure(latency=30)
    held = run_batch(client, [line("h0"), line("h1")])
    wait_sample(api, in_progress, 1)
    client.batches.cancel(held.id)
    wait_for(client, held.id, timeout=20)
    wait_sample(api, in_progress, 0)
    batch_stack.simulator.configure(latency=0)
    done = wait_for(client, run_batch(client, [line("a"), line("b"), failing("c")]).id)
    assert done.status == "completed"
    lines = 'async_processor_api_lines_total{{outcome="{}"}}'
    assert sample(api, lines.format("completed")) == 2
    assert sample(api, lines.format("failed")) == 1
    assert sample(api, lines.format("cancelled")) == 2
    assert sample(api, lines.format("expired")) == 0
    assert sample(api, "async_processor_api_first_result_seconds_count") == 1
    text = api.metrics()
    assert 'route="/v1/batches/{batch_id}/cancel",status="200"' in text
