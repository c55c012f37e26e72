"""Redis Cluster failovers under load, in the form of the Sentinel test
(test_sentinel_failover.py): the daemon as a process against 3 primaries with a replica
each, ``lease_seconds: 3`` (leases lapse during each outage), 2,000 requests over three
queues, one on each primary. Every 15 s a primary is killed with SIGKILL, its replica
promoted by the cluster (2 s node timeout), and the killed node brought back empty, as the
new primary's replica (an operator's restart: its nodes.conf makes it one), so the next
kill fails over again, each time another node. Every id must be answered exactly once,
and no data set reported lost (each promoted replica had the data). Issue 30, "Also".

Results are read from the final result lists (``LRANGE``), not popped as they come: a
cluster has no ``wait_replicas`` (WAIT is per node), so a pop the killed primary took and
had not yet sent to its replica comes back with the promotion; that is the client's read
lost, not a second answer, and popping would count it as one.
"""

from __future__ import annotations

import collections
import json
import time
from typing import Any

import anyio
import redis
from redis.cluster import ClusterNode
from redis.crc import key_slot

from async_processor.client.redis_sortedset import SortedSetClient
from async_processor.config.redis import RedisConnection
from tests.fixtures.daemon import DaemonFactory, assert_answered_once
from tests.fixtures.redis_cluster import RedisClusterNodes
from tests.fixtures.simulator import SimulatorProcess

TOTAL = 2000
WORKERS = 16
LATENCY = 0.3  # 16 workers at 0.3 s: ~53 results/s, a run of ~45 s, so 2 kills or more
KILL_EVERY = 15.0
GIVE_UP = 120.0  # seconds for every id to get its result


def _queues(cluster: RedisClusterNodes, unique: str) -> list[str]:
    """One queue on each primary (the three slot ranges ``--cluster create`` makes)."""
    by_range: dict[int, str] = {}
    for i in range(1000):
        name = f"{unique}-{i}"
        by_range.setdefault(key_slot(name.encode()) * 3 // 16384, name)
        if len(by_range) == 3:
            break
    return [by_range[r] for r in sorted(by_range)]


def test_every_id_is_answered_once_across_a_cluster_failover_every_15_s(
    redis_cluster_replicated: RedisClusterNodes,
    simulator: SimulatorProcess,
    daemon_factory: DaemonFactory,
    unique: str,
    record_property: Any,
) -> None:
    cluster = redis_cluster_replicated
    simulator.configure(latency=LATENCY)
    queues = _queues(cluster, unique)
    config = {
        "url": cluster.url,
        "mode": "cluster",
        "addrs": cluster.seeds[1:],  # the url's node is killed in its turn
        "poll_interval_ms": 100,
        "lease_seconds": 3,
        "queues": [
            {"queue_name": q, "igw_base_url": simulator.url, "result_queue_name": f"{{{q}}}:r"}
            for q in queues
        ],
    }
    anyio.run(_submit, RedisConnection(url=cluster.url, mode="cluster"), queues)
    daemon = daemon_factory.start(config, "--concurrency", str(WORKERS))
    failovers = _kill_until_answered(cluster, queues)
    assert daemon.terminate() == 0  # in-flight work ends: a late second answer would show
    seen = _answers(cluster, queues)
    assert_answered_once(seen, TOTAL, failovers, daemon, record_property)


async def _submit(conn: RedisConnection, queues: list[str]) -> None:
    deadline = int(time.time() + 600)
    for n, queue in enumerate(queues):
        mine = range(n, TOTAL, len(queues))
        requests = [{"id": f"c-{i}", "deadline": deadline, "payload": {"i": i}} for i in mine]
        async with SortedSetClient(conn, queue, f"{{{queue}}}:r") as client:
            await client.submit_many(requests)


def _kill_until_answered(cluster: RedisClusterNodes, queues: list[str]) -> list[float]:
    """Fail a primary over every ``KILL_EVERY`` s (another each time) until every id has
    an answer; the seconds each promotion took."""
    failovers: list[float] = []
    started = time.monotonic()
    next_kill = started + KILL_EVERY
    while len(_answers(cluster, queues)) < TOTAL and time.monotonic() < started + GIVE_UP:
        if time.monotonic() >= next_kill:
            primaries = cluster.primaries()
            failovers.append(cluster.fail_over(primaries[len(failovers) % len(primaries)]))
            next_kill = time.monotonic() + KILL_EVERY
        time.sleep(0.5)
    return failovers


def _answers(cluster: RedisClusterNodes, queues: list[str]) -> collections.Counter[str]:
    """Answers by id in the result lists, as the cluster serves them now."""
    seen: collections.Counter[str] = collections.Counter()
    for _ in range(100):
        nodes = [ClusterNode("127.0.0.1", port) for port in cluster.ports]
        client = redis.RedisCluster(startup_nodes=nodes)
        try:
            for queue in queues:
                seen.update(json.loads(raw)["id"] for raw in client.lrange(f"{{{queue}}}:r", 0, -1))
            return seen
        except (redis.RedisError, redis.exceptions.RedisClusterException, OSError):
            seen.clear()  # a node is away: ask again once the cluster has moved on
            time.sleep(0.2)
        finally:
            client.close()
    raise TimeoutError("the cluster never served every result list")
