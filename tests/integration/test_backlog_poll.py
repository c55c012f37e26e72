"""The backlog poll on real Redis (standalone and a 3-master cluster): each queue's depth,
``broker_backlog_source_available`` and upstream's ``deadline_proximity_millis`` snapshot,
read for every queue at once; and queue by queue for a transport without that."""

from __future__ import annotations

import time
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from async_processor.backlog_metrics import PROXIMITY_BUCKETS
from async_processor.config.queues import QueueSpec
from async_processor.metrics import Metrics
from async_processor.pipeline.backlog import read_backlogs
from tests.doubles.memory_transport import MemoryTransport
from tests.integration.test_sortedset_rounds import config_for, names_of, opened

pytestmark = pytest.mark.anyio
PROXIMITY = "llm_d_async_async_deadline_proximity_millis"


def sample(metrics: Metrics, name: str, queue: str, **extra: str) -> float | None:
    labels = {"queue_id": queue, "queue_name": queue, "pool_name": "default", **extra}
    return metrics.registry.get_sample_value(name, labels)


def buckets(metrics: Metrics, queue: str) -> list[float | None]:
    got: list[float | None] = []
    for family in metrics.registry.collect():
        if family.name == PROXIMITY:
            got = [
                s.value
                for s in family.samples
                if s.name.endswith("_bucket") and s.labels["queue_name"] == queue
            ]
    return got


async def commands(r: Any, name: str) -> int:
    stats = await r.info("commandstats")
    return int(stats.get(f"cmdstat_{name}", {}).get("calls", 0))


async def test_one_poll_reads_every_queue_and_counts_only_busy_ones(
    mode: str, redis_for: tuple[str, Any], unique: str
) -> None:
    url, r = redis_for
    busy, idle, broken = names_of(unique, 3)
    now = int(time.time())
    # Overdue, due in 3 s, in 100 s, in two days (scores: deadlines in Unix seconds).
    await r.zadd(busy, {b"a": now - 5, b"b": now + 3, b"c": now + 100, b"d": now + 172800})
    await r.set(broken, "not a sorted set")
    metrics = Metrics(CollectorRegistry())
    async with opened(config_for(url, mode, [busy, idle, broken])) as transport:
        before = await commands(r, "zcount") if mode == "standalone" else 0
        await read_backlogs(transport, list(transport.queues), metrics)
        after = await commands(r, "zcount") if mode == "standalone" else 0
    # le: 0, 1 s, 5 s, 15 s, 30 s, 1 m, 2 m, 5 m, 10 m, 30 m, 1 h, 2 h, 6 h, 1 d, +Inf
    assert buckets(metrics, busy) == [1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3, 4]
    assert sample(metrics, PROXIMITY + "_count", busy) == 4
    assert sample(metrics, "llm_d_async_async_broker_backlog", busy) == 4
    assert buckets(metrics, idle) == [0] * 15  # an empty queue: zeros, and no ZCOUNT
    assert sample(metrics, "llm_d_async_async_broker_backlog", idle) == 0
    for queue, available in ((busy, 1), (idle, 1), (broken, 0)):
        got = sample(metrics, "llm_d_async_async_broker_backlog_source_available", queue)
        assert got == available, queue
    assert buckets(metrics, broken) == [0] * 15  # a failed read: all zeros, as upstream
    if mode == "standalone":
        assert after - before == len(PROXIMITY_BUCKETS)  # the busy queue's only


async def test_a_broker_away_marks_every_queue_unavailable(unique: str) -> None:
    url = "redis://127.0.0.1:1"  # nothing listens there
    metrics = Metrics(CollectorRegistry())
    [queue] = names_of(unique, 1)
    async with opened(config_for(url, "standalone", [queue])) as transport:
        await read_backlogs(transport, list(transport.queues), metrics)
    assert sample(metrics, "llm_d_async_async_broker_backlog_source_available", queue) == 0
    assert buckets(metrics, queue) == [0] * 15


class _Failing(MemoryTransport):
    async def backlog(self, queue: QueueSpec) -> int | None:
        if queue.name == "down":
            raise ConnectionError("broker away")
        return None if queue.name == "unknown" else await super().backlog(queue)


async def test_other_transports_are_read_queue_by_queue() -> None:
    specs = [QueueSpec(id=n, name=n, pool="default") for n in ("up", "down", "unknown")]
    transport = _Failing(specs)
    transport.put("up", b"{}", b"{}")
    metrics = Metrics(CollectorRegistry())
    await read_backlogs(transport, specs, metrics)  # type: ignore[arg-type]
    available = "llm_d_async_async_broker_backlog_source_available"
    assert sample(metrics, available, "up") == 1
    assert sample(metrics, "llm_d_async_async_broker_backlog", "up") == 2
    assert sample(metrics, available, "down") == 0
    assert sample(metrics, available, "unknown") is None  # the transport cannot tell
    assert buckets(metrics, "up") == []  # no proximity without a sorted set
