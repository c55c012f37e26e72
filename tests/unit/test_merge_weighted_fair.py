"""weighted-fair: 200 backlogged tenant queues each get their weighted share; an idle
queue earns no burst; weights from the map, the label or the default."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import anyio
import pytest

from async_processor.config import MergePolicyConfig
from async_processor.config.queues import QueueSpec
from async_processor.merge import build_merge_policy
from async_processor.merge.base import MergeContext, Source
from async_processor.merge.weighted_fair import WeightedFair, WeightedFairParams
from async_processor.transports.base import Delivery
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


def labelled(name: str, count: int, weight: str | None) -> Source:
    """A closed source of ``count`` messages whose queue carries ``weight`` as its label."""
    spec = QueueSpec(id=name, name=name, labels={"weight": weight} if weight else {})
    items = [replace(work(name, i), delivery=Delivery(queue=spec, raw=b"")) for i in range(count)]
    return queue(name, items, size=count)[0]


async def _shares(
    policy: WeightedFair, names: list[str], served: int, backlog: int = 0, **labels: str
) -> Counter[str]:
    """Which queues the first ``served`` dispatches came from, each queue holding
    ``backlog`` messages (default: ``served``, backlogged throughout)."""
    out, received = sink()
    async with anyio.create_task_group() as tg:
        sources = [labelled(n, backlog or served, labels.get(n)) for n in names]
        tg.start_soon(policy.run, "p", sources, out)
        ids = []
        for _ in range(served):
            for _ in range(3):  # every backlogged queue's reader puts its next offer in
                await anyio.sleep(0)
            ids.append((await received.receive()).envelope.id)
        tg.cancel_scope.cancel()
    return Counter(i.split("-")[0] for i in ids)


async def test_an_infinite_label_weight_does_not_starve_the_other_queues() -> None:
    # 1 / inf is a step of 0: such a queue never fell behind and took every dispatch.
    got = await _shares(WeightedFair(WeightedFairParams()), ["inf", "plain"], 200, inf="inf")
    assert got["plain"] == 100, got  # the label is ignored: equal weights


async def test_a_huge_label_weight_is_clamped_to_the_largest_allowed() -> None:
    got = await _shares(WeightedFair(WeightedFairParams()), ["big", "plain"], 2002, big="1e300")
    assert got["plain"] >= 2, got  # weight 1,000 against 1: 2 of 2,002, not only its first


async def test_weights_still_count_after_a_tiny_weighted_queue_ran_alone() -> None:
    # Two queues of 3 messages, one of weight 1e-300: once the other ran out, it was served
    # alone at finish times 1e300 and 2e300, moving the pool's virtual time there, where a
    # later step of 1 or 1/4 is lost in rounding: every queue tied and weights stopped counting.
    policy = WeightedFair(WeightedFairParams(weights={"heavy": 4.0}))
    await _shares(policy, ["tiny", "other"], 6, backlog=3, tiny="1e-300")
    got = await _shares(policy, ["heavy", "light"], 500)
    assert got["heavy"] == 400, got


@pytest.mark.parametrize("field", ["weights", "default_weight"])
@pytest.mark.parametrize("value", [0, 1e-300, 1e300, float("inf")])
def test_configured_weights_out_of_range_are_refused_at_start(field: str, value: float) -> None:
    parameters: dict[str, Any] = {field: {"a": value} if field == "weights" else value}
    with pytest.raises(ValueError, match=r"(greater|less) than or equal"):
        WeightedFairParams(**parameters)
