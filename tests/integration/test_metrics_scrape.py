"""What a scrape of /metrics carries, daemon and exporter: no ``_created`` series (they
doubled every counter's and histogram's series count), and the exporter has the process
collectors and ``llm_d_async_build_info`` as the daemon does."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
from prometheus_client.parser import text_string_to_metric_families

from async_processor import __version__
from async_processor.health import serve_metrics
from async_processor.metrics import Metrics
from tests.fixtures.servers import RedisServer
from tests.integration.test_exporter import config, exporting, get

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("restore_logging")]


def names(text: str) -> set[str]:
    return {s.name for f in text_string_to_metric_families(text) for s in f.samples}


async def test_the_daemons_metrics_have_no_created_series() -> None:
    m = Metrics()
    m.queue("q", "q", "default").request_total.inc()
    m.set_build_info(__version__, "redis-sortedset")  # as the processor does at start
    async with anyio.create_task_group() as tg:
        port = await tg.start(serve_metrics, "127.0.0.1", 0, m.registry)
        status, text = await get(f"http://127.0.0.1:{port}/metrics")
        tg.cancel_scope.cancel()
    assert status == 200
    exported = names(text)
    assert "llm_d_async_async_request_total" in exported
    assert "process_cpu_seconds_total" in exported and "llm_d_async_build_info" in exported
    assert not [n for n in exported if n.endswith("_created")]


async def test_the_exporter_has_process_metrics_and_build_info(
    tmp_path: Path, private_redis: RedisServer, unique: str
) -> None:
    cfg = config(tmp_path, private_redis.url, f"{unique}-q")
    async with exporting(cfg) as (_, metrics):
        status, text = await get(f"{metrics}/metrics")
    assert status == 200
    exported = names(text)
    assert "process_resident_memory_bytes" in exported and "python_info" in exported
    assert (
        f'llm_d_async_build_info{{transport="redis-sortedset",version="{__version__}"}} 1.0' in text
    )
    assert not [n for n in exported if n.endswith("_created")]
