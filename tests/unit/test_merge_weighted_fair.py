"""weighted-fair: 200 backlogged tenant queues each get their weighted share; an idle
queue earns no burst; weights from the map, the label or the default."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace
from typing import Any

import anyio
import pytest

from async_processor.config import MergePolicyConfig
from async_processor.merge import build_merge_policy
from async_processor.merge.base import MergeContext
from async_processor.merge.weighted_fair import WeightedFair, WeightedFairParams
from async_processor.transports.base import QueueSpec
from tests.unit.test_merge_policies import queue, sink, take, work

pytestmark = pytest.mark.anyio


async def test_two_hundred_backlogged_queues_each_get_their_weighted_share() -> None:
    names = [f"t{i:03d}" for i in range(200)]
    weights = {name: 3.0 for name in names[::4]}  # a quarter of the tenants pay triple
    sources = [queue(n, [work(n, i) for i in range(100)])[0] for n in names]
    policy = WeightedFair(WeightedFairParams(weights=weights))
    out, received = sink()
    served = 6000
    async with anyio.create_task_group() as tg:
        tg.start_soon(policy.run, "p", sources, out)
        ids = await take(received, served)
        tg.cancel_scope.cancel()
    got = Counter(i.split("-")[0] for i in ids)
    total_weight = sum(weights.get(n, 1.0) for n in names)
    ratios = {n: got[n] / (served * weights.get(n, 1.0) / total_weight) for n in names}
    assert min(ratios.values()) >= 0.8, sorted(ratios.items(), key=lambda kv: kv[1])[:5]
    assert max(ratios.values()) <= 1.2


async def test_an_idle_queue_earns_no_burst_when_it_returns() -> None:
    busy, _ = queue("busy", [work("busy", i) for i in range(1000)])
    idle, idle_send = queue("idle", [], close=False)
    out, received = sink()
    async with anyio.create_task_group() as tg:
        tg.start_soon(WeightedFair(WeightedFairParams()).run, "p", [busy, idle], out)
        await take(received, 300)  # the busy queue alone for a while
        for i in range(100):
            idle_send.send_nowait(work("idle", i))
        ids = await take(received, 40)
        tg.cancel_scope.cancel()
    # Equal weights: it alternates with the busy queue at once, no catch-up run of 300.
    assert 18 <= sum(i.startswith("idle") for i in ids) <= 22, ids


def test_weights_from_the_map_then_the_label_then_the_default() -> None:
    policy = build_merge_policy(
        MergePolicyConfig(
            type="weighted-fair",
            parameters={"weights": {"a": 5}, "weight_label": "share", "default_weight": 2},
        ),
        MergeContext(),
    )
    assert isinstance(policy, WeightedFair)
    assert policy.weight(QueueSpec(id="a", name="a", labels={"share": "9"})) == 5
    assert policy.weight(QueueSpec(id="b", name="b", labels={"share": "9"})) == 9
    assert policy.weight(QueueSpec(id="c", name="c", labels={"share": "x"})) == 2
    assert policy.weight(QueueSpec(id="d", name="d")) == 2


def offer(name: str, pool: str) -> Any:
    spec = QueueSpec(id=name, name=name, pool=pool)
    return SimpleNamespace(work=SimpleNamespace(delivery=SimpleNamespace(queue=spec)))


async def test_pools_keep_their_own_virtual_time() -> None:
    # One policy object serves every pool: a busy pool must not reset another's shares.
    policy = WeightedFair(WeightedFairParams())
    pool_a, pool_b = policy._offers("A", 1), policy._offers("B", 1)
    a1, a2 = offer("a1", "A"), offer("a2", "A")
    pool_a.put(a1)
    pool_a.put(a2)
    assert await pool_a.take() is a1
    for _ in range(10):
        pool_b.put(offer("b", "B"))
        await pool_b.take()
    pool_a.put(a1)  # served once: behind a2
    assert await pool_a.take() is a2  # a2's turn, not a1 again
    assert policy.finish(a2.work.delivery.queue) == 1.0  # A's time, not B's (10)
