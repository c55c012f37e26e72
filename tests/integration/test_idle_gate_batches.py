"""The budget keys of idle queues' ``redis`` gates are read together (issue 30, item 4):
200 idle queues, each with its own budget key on one gate Redis (a real redis-server of
its own, so its ``INFO commandstats`` counts the gates' reads alone), cost one MGET a
poll interval, not 200 GETs; and each gauge still follows its own key.
"""

from __future__ import annotations

import time

import anyio
import pytest
from redis.asyncio import Redis

from async_processor.config import AppConfig, SortedSetConfig
from async_processor.config.redis import RedisConnection
from async_processor.gates.redis import BudgetKeys, RedisBudgetGate, RedisBudgetParams
from async_processor.redis.conn import connect
from tests.fixtures.inprocess import metric, running, runtime_config
from tests.fixtures.redis_cluster import RedisClusterNodes
from tests.fixtures.servers import RedisServer
from tests.fixtures.simulator import SimulatorProcess

pytestmark = pytest.mark.anyio
QUEUES = 200
INTERVAL = 0.2
BUDGET = "llm_d_async_async_dispatch_budget"


def _config(redis_url: str, gate_url: str, gateway: str, queues: list[str]) -> AppConfig:
    transport = SortedSetConfig.model_validate(
        {
            "url": redis_url,
            "result_queue_name": f"{queues[0]}:results",
            "retry_queue_name": f"{queues[0]}:retry",
            "poll_interval_ms": int(INTERVAL * 1000),
            "queues": [
                {"queue_name": q, "igw_base_url": gateway, "gate_type": "redis",
                 "gate_params": {"address": gate_url, "budget_key": f"{q}:budget"}}
                for q in queues
            ],
        }
    )  # fmt: skip
    runtime = runtime_config()  # ports 0: the OS's, no race for them
    return AppConfig(transport="redis-sortedset", transport_config=transport, runtime=runtime)


async def test_200_idle_queues_read_their_budget_keys_in_one_mget_a_round(
    redis_url: str, private_redis: RedisServer, simulator: SimulatorProcess, unique: str
) -> None:
    queues = [f"{unique}-{i}" for i in range(QUEUES)]
    gate_redis = Redis.from_url(private_redis.url)
    config = _config(redis_url, private_redis.url, simulator.url, queues)
    try:
        async with running(config) as processor:
            waiting = processor._idle_gates._waiting
            with anyio.fail_after(60):
                while len(waiting) < QUEUES:  # every poller waits for its queue's next message
                    await anyio.sleep(0.05)
            await gate_redis.config_resetstat()
            started = time.monotonic()
            await gate_redis.set(f"{queues[7]}:budget", "0.25")
            await gate_redis.set(f"{queues[150]}:budget", "0")
            with anyio.fail_after(20):
                while (
                    metric(processor, BUDGET, queue_name=queues[7]) != 0.25
                    or metric(processor, BUDGET, queue_name=queues[150]) != 0.0
                ):
                    await anyio.sleep(0.05)
            await anyio.sleep(1.0)  # a few more rounds to count
            elapsed = time.monotonic() - started
            stats = await gate_redis.info("commandstats")
            assert metric(processor, BUDGET, queue_name=queues[8]) == 1.0  # no key: open
    finally:
        await gate_redis.aclose()
    rounds = stats.get("cmdstat_mget", {}).get("calls", 0)
    assert 3 <= rounds <= elapsed / INTERVAL + 2, (rounds, elapsed)
    assert stats.get("cmdstat_get", {}).get("calls", 0) == 0, stats.get("cmdstat_get")


async def test_budget_keys_in_many_slots_are_read_together_on_a_cluster(
    redis_cluster: RedisClusterNodes, unique: str
) -> None:
    """In cluster mode the keys' MGET is split by hash slot; each gate gets its own value."""
    client = connect(RedisConnection(url=redis_cluster.url, mode="cluster"))
    batch = BudgetKeys(client)
    gates = [
        RedisBudgetGate(
            client,
            RedisBudgetParams(address=redis_cluster.url, budget_key=f"{unique}-{i}:b"),
            batch,
        )
        for i in range(6)
    ]
    try:
        assert len({client.keyslot(gate.key) for gate in gates}) > 1  # type: ignore[attr-defined]
        await client.set(gates[1].key, "0")
        await client.set(gates[2].key, "0.5")
        await client.set(gates[3].key, "not a number")
        assert await batch.budgets(gates) == [1.0, 0.0, 0.5, 1.0, 1.0, 1.0]
    finally:
        await client.aclose()
