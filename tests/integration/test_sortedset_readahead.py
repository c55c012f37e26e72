"""A pool's read-ahead (its prefetch, processor.prefetch) on real Redis: claims made while
workers free up never hold more than the pool's slots (workers + prefetch), and what is
read ahead but not started at a stop goes back to the queue, where another daemon answers
it, each message once."""

from __future__ import annotations

import time
from typing import Any

import anyio
import pytest
from redis.asyncio import Redis

from async_processor.config import AppConfig, PoolConfig
from async_processor.pipeline.capacity import prefetch
from async_processor.redis.keys import claims_idx_key
from tests.fixtures.inprocess import running, sortedset_config, submit
from tests.fixtures.simulator import SimulatorProcess

pytestmark = pytest.mark.anyio
WORKERS = 200  # a prefetch of 50: five batches read ahead


async def held(r: Redis, queue: str) -> int:
    return int(await r.zcard(claims_idx_key(queue)))


def one_pool(
    redis_url: str, simulator: SimulatorProcess, unique: str, latency: float, drain: str
) -> AppConfig:
    """One pool of ``WORKERS`` on the queue, behind a simulator answering in ``latency``."""
    simulator.configure(latency=latency)
    pools = [PoolConfig(id="p", workers=WORKERS)]
    return sortedset_config(redis_url, simulator.url, unique, pools=pools, drain_timeout=drain)


def requests_of(count: int) -> list[dict[str, Any]]:
    deadline = int(time.time()) + 600
    return [{"id": f"m{i}", "deadline": deadline, "payload": {"p": 1}} for i in range(count)]


async def test_several_claims_in_flight_hold_no_more_than_the_pool_slots(
    redis_url: str, unique: str, simulator: SimulatorProcess, redis_client: Redis
) -> None:
    config = one_pool(redis_url, simulator, unique, 30.0, "100ms")
    client = await submit(redis_url, unique, *requests_of(400))
    slots = WORKERS + prefetch(WORKERS)
    async with running(config):
        with anyio.fail_after(10):
            while await held(redis_client, unique) < slots:
                await anyio.sleep(0.02)
        for _ in range(10):  # the claims keep going while slots are free: none may overshoot
            await anyio.sleep(0.05)
            assert await held(redis_client, unique) == slots
        assert await redis_client.zcard(unique) == 400 - slots
    await client.aclose()


async def test_what_is_read_ahead_at_a_stop_is_answered_by_another_daemon_once(
    redis_url: str, unique: str, simulator: SimulatorProcess, redis_client: Redis
) -> None:
    config = one_pool(redis_url, simulator, unique, 3.0, "10s")
    count = WORKERS + prefetch(WORKERS)  # just what the pool holds: the rest is read ahead
    requests = requests_of(count)
    client = await submit(redis_url, unique, *requests)
    async with running(config):
        with anyio.fail_after(10):  # every message claimed: on workers or read ahead
            while await redis_client.zcard(unique):
                await anyio.sleep(0.02)
    # Drained: the workers' requests answered, the read-ahead handed back, none held.
    first = int(await redis_client.llen(f"{unique}:results"))
    assert first < count
    assert await held(redis_client, unique) == 0
    assert await redis_client.zcard(unique) == count - first
    async with running(config):
        with anyio.fail_after(20):
            while await redis_client.llen(f"{unique}:results") < count:
                await anyio.sleep(0.05)
        await anyio.sleep(0.3)
    ids = [r.id for r in await client.drain_results(count + 10, timeout=2)]
    assert sorted(ids) == sorted(str(r["id"]) for r in requests)
    await client.aclose()
