"""redis-sortedset on a 3-primary Redis Cluster, with the daemon as processes.

Three daemons share 3,000 requests over 4 queues (spread over the cluster's nodes):
exactly one result per id. A cancel made with the cluster client reaches the daemon
(slot-aware markers). A queue whose result list sits in another hash slot stops the
daemon at startup with one line naming the queue, the list and a name that works.
"""

from __future__ import annotations

import collections
import time
from typing import Any

import anyio
import redis

from async_processor.client.redis_sortedset import SortedSetClient
from async_processor.config.redis import RedisConnection, slot
from async_processor.messages import Result
from tests.fixtures.daemon import DaemonFactory
from tests.fixtures.redis_cluster import RedisClusterNodes
from tests.fixtures.simulator import SimulatorProcess

PER_QUEUE = 750
QUEUES = 4


def _config(cluster: RedisClusterNodes, gateway: str, queues: list[str], **extra: Any) -> Any:
    return {
        "url": cluster.url,
        "mode": "cluster",
        "poll_interval_ms": 100,
        "batch_size": 32,
        "queues": [
            {"queue_name": q, "igw_base_url": gateway, "result_queue_name": f"{{{q}}}:results"}
            for q in queues
        ],
        **extra,
    }


def _nodes_holding(cluster: RedisClusterNodes, queues: list[str]) -> set[int]:
    client = redis.RedisCluster.from_url(cluster.url)
    try:
        return {client.get_node_from_key(q).port for q in queues}  # type: ignore[no-untyped-call]
    finally:
        client.close()


def test_three_daemons_share_3000_requests_with_one_result_each(
    redis_cluster: RedisClusterNodes,
    simulator: SimulatorProcess,
    daemon_factory: DaemonFactory,
    unique: str,
) -> None:
    queues = [f"{unique}-q{i}" for i in range(QUEUES)]
    assert len(_nodes_holding(redis_cluster, queues)) >= 2, "queues should span nodes"
    config = _config(redis_cluster, simulator.url, queues)
    for _ in range(3):
        daemon_factory.start(config, "--concurrency", "32")
    conn = RedisConnection(url=redis_cluster.url, mode="cluster")
    counts = anyio.run(_submit_and_collect, conn, queues)
    assert len(counts) == PER_QUEUE * QUEUES
    assert max(counts.values()) == 1, [i for i, n in counts.items() if n > 1][:5]


async def _submit_and_collect(conn: RedisConnection, queues: list[str]) -> collections.Counter[str]:
    deadline = int(time.time() + 600)
    counts: collections.Counter[str] = collections.Counter()
    async with anyio.create_task_group() as tg:
        for queue in queues:
            tg.start_soon(_one_queue, conn, queue, deadline, counts)
    return counts


async def _one_queue(
    conn: RedisConnection, queue: str, deadline: int, counts: collections.Counter[str]
) -> None:
    requests = [
        {"id": f"{queue}-{i}", "deadline": deadline, "payload": {"i": i}} for i in range(PER_QUEUE)
    ]
    async with SortedSetClient(conn, queue, f"{{{queue}}}:results") as client:
        await client.submit_many(requests)
        results = await client.drain_results(PER_QUEUE, 90)
        results += await client.drain_results(1, 1)  # a duplicate would show up here
    assert all(r.status_code == 200 for r in results), results[:3]
    counts.update(r.id for r in results)


def test_cancel_reaches_the_daemon_through_slot_aware_markers(
    redis_cluster: RedisClusterNodes,
    simulator: SimulatorProcess,
    daemon_factory: DaemonFactory,
    unique: str,
) -> None:
    queue = f"{unique}-cancel"
    simulator.configure(error_rate=1.0, error_status=503)  # keeps it retrying until cancelled
    daemon_factory.start(_config(redis_cluster, simulator.url, [queue]))
    conn = RedisConnection(url=redis_cluster.url, mode="cluster")
    result = anyio.run(_cancel_one, conn, queue, simulator)
    assert result.id == "c-1" and result.error_code == "CANCELLED"


async def _cancel_one(conn: RedisConnection, queue: str, simulator: SimulatorProcess) -> Result:
    async with SortedSetClient(conn, queue, f"{{{queue}}}:results") as client:
        await client.submit({"id": "c-1", "deadline": int(time.time() + 600), "payload": {}})
        # Claimed and failed at least once: the simulator saw it (a fixed sleep was not
        # enough under load). Generous bounds: a retry waits 2-4 s, then 4-8 s.
        with anyio.fail_after(60):
            while (await anyio.to_thread.run_sync(simulator.stats))["total"] < 1:
                await anyio.sleep(0.1)
        assert await client.cancel(["c-1"]) == 1
        [result] = await client.drain_results(1, 60)
    return result


def test_a_result_list_in_another_slot_stops_the_daemon_at_startup(
    redis_cluster: RedisClusterNodes, daemon_factory: DaemonFactory, unique: str
) -> None:
    queue = f"{unique}-requests"
    config = _config(redis_cluster, "http://127.0.0.1:9", [queue])
    config["queues"][0]["result_queue_name"] = "result-list"
    assert slot("result-list") != slot(queue)
    daemon = daemon_factory.start(config, wait=False)
    assert daemon.proc.wait(30) != 0
    lines = [line for line in daemon.logs().splitlines() if "hash slot" in line]
    assert len(lines) == 1, daemon.logs()[-2000:]
    assert f"queue '{queue}'" in lines[0] and "'result-list'" in lines[0]
    assert f"'{{{queue}}}:results'" in lines[0]
