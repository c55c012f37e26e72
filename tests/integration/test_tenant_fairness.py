"""Many tenants, end to end: 30 queues found in a Redis set, every one backlogged, a
``weighted-fair`` merge with a weight per queue; the daemon in-process against a real
redis-server and the simulator over HTTP. Every queue gets at least 0.8 of its weighted
share of the results (issue 16: no tenant starved; ``bench.tenants`` measures the same at
200 queues, 3 replicas)."""

from __future__ import annotations

from collections import Counter

import pytest
from redis.asyncio import Redis

from async_processor.config import MergePolicyConfig
from tests.fixtures.inprocess import running
from tests.fixtures.simulator import SimulatorProcess
from tests.integration.test_queue_discovery import (
    daemon_config,
    r,
    results,
    submit,
    transport_config,
)

pytestmark = pytest.mark.anyio
__all__ = ["r"]  # the fixture, shared
WEIGHTS = (1.0, 2.0, 4.0)
QUEUES = 30
WARMUP, WINDOW = 60, 600
TARGET = 0.8  # of each queue's weighted fair share, as bench.tenants


async def test_each_backlogged_queue_gets_its_weighted_share(
    redis_url: str, unique: str, r: Redis, simulator: SimulatorProcess
) -> None:
    # A request takes 0.5 s at the gateway (LLM gateways take seconds). At 0.2 s a claim
    # round was no longer short beside it once other work shared the CPUs (load 12-23):
    # weight 4 flattened to 0.64-0.70 of its share (docs/merge-and-transforms.md, "Few
    # queues: weights flatten"), while at 0.5 s it held 0.8 under two extra busy loops.
    simulator.configure(latency=0.5)
    weights = {f"{unique}-t{i}": WEIGHTS[i % len(WEIGHTS)] for i in range(QUEUES)}
    total = sum(weights.values())
    for name, weight in weights.items():  # backlogged past the window, at twice its share
        count = int(2 * (WARMUP + WINDOW) * weight / total) + 5
        await submit(redis_url, unique, name, *(f"{name}/{n}" for n in range(count)))
    listed = f"{unique}:tenants"
    await r.sadd(listed, *weights)
    config = daemon_config(transport_config(redis_url, unique, set_key=listed), simulator.url, 16)
    merge = MergePolicyConfig(type="weighted-fair", parameters={"weights": weights})
    config = config.model_copy(update={"merge_policy": merge})
    async with running(config):
        ids = await results(r, unique, WARMUP + WINDOW, timeout=60)
    got = Counter(i.rsplit("/", 1)[0] for i in ids[WARMUP:])
    shares = {q: got[q] / (WINDOW * w / total) for q, w in weights.items()}
    assert min(shares.values()) >= TARGET, shares

    # The weights count: a weight-4 queue got well over a weight-1 one's results (the
    # same counts for all, weights ignored, fail here; see docs/merge-and-transforms.md
    # for why it is not the full 4 with few queues).
    def mean(weight: float) -> float:
        counts = [got[q] for q, w in weights.items() if w == weight]
        return sum(counts) / len(counts)

    assert mean(4.0) >= 2 * mean(1.0), got
