"""random-robin and tier-priority: shares, strict lanes, lane bounds, stamping, closing."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence

import anyio
import pytest
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from async_processor.config import MergePolicyConfig
from async_processor.config.queues import QueueSpec
from async_processor.errors import ConfigError
from async_processor.merge import build_merge_policy
from async_processor.merge.base import MergeContext, MergePolicy, Source
from async_processor.merge.random_robin import RandomRobin, RandomRobinParams
from async_processor.merge.tier_priority import TierPriority, TierPriorityParams, _Lane, lane_of
from async_processor.merge.weighted_fair import WeightedFair, WeightedFairParams
from async_processor.messages import Envelope, Request, Routing
from async_processor.metrics import Metrics
from async_processor.transports.base import Delivery
from async_processor.work import Work

pytestmark = pytest.mark.anyio


METRICS = Metrics()


def work(queue: str, n: int, labels: dict[str, str] | None = None, **metadata: str) -> Work:
    spec = QueueSpec(id=queue, name=queue)
    envelope = Envelope(
        request=Request(id=f"{queue}-{n}", deadline=1, metadata=dict(metadata)),
        routing=Routing(labels=dict(labels or {})),
    )
    return Work(
        delivery=Delivery(queue=spec, raw=b""),
        envelope=envelope,
        metrics=METRICS.queue(queue, queue, "p"),
    )


def queue(
    name: str, items: Sequence[Work], *, close: bool = True, size: int = 2000
) -> tuple[Source, MemoryObjectSendStream[Work]]:
    send, receive = anyio.create_memory_object_stream[Work](size)
    for item in items:
        send.send_nowait(item)
    if close:
        send.close()
    return Source(QueueSpec(id=name, name=name), receive), send


def sink() -> tuple[MemoryObjectSendStream[Work], MemoryObjectReceiveStream[Work]]:
    return anyio.create_memory_object_stream[Work](0)


async def wait_until_empty(stream: MemoryObjectSendStream[Work]) -> None:
    with anyio.fail_after(5):
        while stream.statistics().current_buffer_used:
            await anyio.sleep(0.001)


async def take(receive: MemoryObjectReceiveStream[Work], count: int) -> list[str]:
    return [(await receive.receive()).envelope.id for _ in range(count)]


def rr(seed: int = 1) -> RandomRobin:
    return RandomRobin(RandomRobinParams(), random.Random(seed))


# ----------------------------------------------------------------------------- random-robin


async def test_random_robin_gives_two_floods_equal_shares() -> None:
    a, _ = queue("a", [work("a", i) for i in range(1000)])
    b, _ = queue("b", [work("b", i) for i in range(1000)])
    out, received = sink()
    async with anyio.create_task_group() as tg:
        tg.start_soon(rr().run, "p", [a, b], out)
        ids = await take(received, 400)
        tg.cancel_scope.cancel()
    shares = Counter(i.split("-")[0] for i in ids)
    assert 160 <= shares["a"] <= 240, shares


async def test_random_robin_flood_does_not_starve_a_trickle() -> None:
    flood, _ = queue("flood", [work("flood", i) for i in range(1000)])
    trickle, trickle_send = queue("trickle", [], close=False)
    out, received = sink()
    async with anyio.create_task_group() as tg:
        tg.start_soon(rr().run, "p", [flood, trickle], out)
        await take(received, 50)  # the flood has the pool to itself
        for i in range(10):
            trickle_send.send_nowait(work("trickle", i))
        ids = await take(received, 60)
        tg.cancel_scope.cancel()
    # Uniform choice among ready queues: the trickle gets about half of the next picks.
    assert sum(i.startswith("trickle") for i in ids) == 10, ids


async def test_random_robin_empty_open_queue_never_delays_others() -> None:
    busy, _ = queue("busy", [work("busy", i) for i in range(100)])
    idle, _idle_send = queue("idle", [], close=False)
    out, received = sink()
    async with anyio.create_task_group() as tg:
        tg.start_soon(rr().run, "p", [busy, idle], out)
        with anyio.fail_after(2):
            ids = await take(received, 100)
        tg.cancel_scope.cancel()
    assert ids[0] == "busy-0" and len(set(ids)) == 100


async def test_random_robin_keeps_fifo_per_queue_and_closes_sink_when_sources_close() -> None:
    a, _ = queue("a", [work("a", i) for i in range(50)])
    b, _ = queue("b", [work("b", i) for i in range(50)])
    out, received = sink()
    async with anyio.create_task_group() as tg:
        tg.start_soon(rr().run, "p", [a, b], out)
        with anyio.fail_after(5):
            ids = [w.envelope.id async for w in received]  # ends only if the sink closes
    assert [i for i in ids if i.startswith("a")] == [f"a-{i}" for i in range(50)]
    assert len(ids) == 100


async def test_random_robin_with_no_sources_closes_the_sink() -> None:
    out, received = sink()
    with anyio.fail_after(2):
        await rr().run("p", [], out)
        assert [w async for w in received] == []


async def test_random_robin_stamps_fairness_and_counts_queue_depth() -> None:
    a, _ = queue("depth-q", [work("depth-q", 0, userid="u1"), work("depth-q", 1)])
    out, received = anyio.create_memory_object_stream[Work](10)
    await rr().run("p", [a], out)
    items = [w async for w in received]
    assert items[0].stamped_headers == [("x-llm-d-inference-fairness-id", "u1")]
    assert items[1].stamped_headers == []
    labels = {"queue_id": "depth-q", "queue_name": "depth-q", "pool_name": "p"}
    assert METRICS.registry.get_sample_value("llm_d_async_async_queue_depth", labels) == 2


# ----------------------------------------------------------------------------- tier-priority

RESERVED_INTERACTIVE = {"classification": "reserved", "tier": "interactive"}


@pytest.mark.parametrize(
    ("labels", "lane"),
    [
        ({"classification": "reserved", "tier": "interactive"}, 0),
        ({"classification": "reserved", "tier": "async"}, 1),
        ({"classification": "reserved", "tier": "batch"}, 2),
        ({"classification": "overflow", "tier": "interactive"}, 3),
        ({"tier": "async"}, 4),  # unclassified = overflow
        ({"classification": "overflow", "tier": "standard"}, 5),  # unknown tier = batch
        ({}, 5),
    ],
)
def test_lane_mapping(labels: dict[str, str], lane: int) -> None:
    assert lane_of(labels, "tier") == lane


def test_lane_mapping_uses_configured_tier_label() -> None:
    assert lane_of({"tier": "interactive", "class": "interactive"}, "class") == 3
    assert lane_of({"tier": "batch", "class": "interactive"}, "class") == 3


async def test_reserved_interactive_overtakes_a_thousand_queued_batch_messages() -> None:
    batch, batch_send = queue("batch", [work("batch", i) for i in range(1000)])
    urgent, urgent_send = queue("urgent", [], close=False)
    out, received = sink()
    policy = TierPriority(TierPriorityParams())
    async with anyio.create_task_group() as tg:
        tg.start_soon(policy.run, "p", [batch, urgent], out)
        await wait_until_empty(batch_send)
        urgent_send.send_nowait(work("urgent", 0, RESERVED_INTERACTIVE))
        await wait_until_empty(urgent_send)
        urgent_send.close()
        with anyio.fail_after(5):
            items = [w async for w in received]
    ids = [w.envelope.id for w in items]
    # The emitter already held one batch message, blocked on the full pool stream.
    assert ids.index("urgent-0") <= 1
    assert len(ids) == 1001
    assert items[ids.index("urgent-0")].stamped_headers == []  # no priority header by default


async def test_lane_bound_is_backpressure_not_memory_growth() -> None:
    send, receive = anyio.create_memory_object_stream[Work](200)
    for i in range(100):
        send.send_nowait(work("batch", i))
    urgent, urgent_send = queue("urgent", [], close=False)
    out, received = sink()
    policy = TierPriority(TierPriorityParams(lane_capacity=10))
    async with anyio.create_task_group() as tg:
        tg.start_soon(policy.run, "p", [Source(QueueSpec(id="b", name="b"), receive), urgent], out)
        # Lane of 10 + one message in the emitter + one in the blocked reader, and no more.
        with anyio.fail_after(5):
            while send.statistics().current_buffer_used > 100 - 12:
                await anyio.sleep(0.001)
        await anyio.sleep(0.05)
        assert send.statistics().current_buffer_used == 100 - 12
        # A full batch lane does not block another lane's reader.
        urgent_send.send_nowait(work("urgent", 0, RESERVED_INTERACTIVE))
        await wait_until_empty(urgent_send)
        ids = await take(received, 2)
        assert "urgent-0" in ids
        tg.cancel_scope.cancel()


async def test_lane_serves_queues_round_robin_in_first_seen_order() -> None:
    lane = _Lane(capacity=10)
    for key, item in [(0, "a-0"), (0, "a-1"), (0, "a-2"), (1, "b-0"), (1, "b-1"), (2, "c-0")]:
        await lane.push(key, work(item[0], int(item[2])))
    ids = [lane.pop().envelope.id for _ in range(6)]
    assert ids == ["a-0", "b-0", "c-0", "a-1", "b-1", "a-2"]
    assert lane.count == 0
    await lane.push(1, work("b", 9))  # a drained queue rejoins at the back of the rotation
    assert lane.pop().envelope.id == "b-9"


async def test_tier_priority_keeps_fifo_per_queue() -> None:
    a, _ = queue("a", [work("a", i) for i in range(20)])
    b, _ = queue("b", [work("b", i) for i in range(20)])
    out, received = anyio.create_memory_object_stream[Work](100)
    await TierPriority(TierPriorityParams()).run("p", [a, b], out)
    ids = [w.envelope.id async for w in received]
    assert [i for i in ids if i[0] == "a"] == [f"a-{i}" for i in range(20)]
    assert [i for i in ids if i[0] == "b"] == [f"b-{i}" for i in range(20)]


async def test_tier_priority_stamps_fairness_priority_and_lane_objective_in_order() -> None:
    params = TierPriorityParams(
        lane_objectives={"overflow-batch": "batch-objective"},
        priority_header="x-prio",
        fairness_header="x-tenant",
    )
    labelled, _ = queue("q", [work("q", 0, {"tier": "nope"}, userid="t1")])
    reserved, _ = queue("r", [work("r", 0, {"classification": "reserved", "tier": "async"})])
    out, received = anyio.create_memory_object_stream[Work](10)
    await TierPriority(params).run("p", [labelled, reserved], out)
    stamped = {w.envelope.id: w.stamped_headers async for w in received}
    assert stamped["r-0"] == [("x-prio", "1")]
    assert stamped["q-0"] == [
        ("x-tenant", "t1"),
        ("x-prio", "5"),
        ("x-llm-d-inference-objective", "batch-objective"),
    ]


async def test_tier_priority_closes_sink_once_sources_close_and_lanes_drain() -> None:
    a, _ = queue("a", [work("a", i, RESERVED_INTERACTIVE) for i in range(5)])
    b, _ = queue("b", [work("b", i) for i in range(5)])
    out, received = sink()
    async with anyio.create_task_group() as tg:
        tg.start_soon(TierPriority(TierPriorityParams()).run, "p", [a, b], out)
        with anyio.fail_after(5):
            ids = [w.envelope.id async for w in received]
    assert sorted(ids) == sorted([f"a-{i}" for i in range(5)] + [f"b-{i}" for i in range(5)])


# ----------------------------------------------------------------------------- config


def test_build_merge_policy_defaults_to_random_robin() -> None:
    assert isinstance(build_merge_policy(MergePolicyConfig(), MergeContext()), RandomRobin)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"type": "round-robin"}, "unknown merge policy type 'round-robin'"),
        ({"type": "tier-priority", "parameters": {"priority_header": "a b"}}, "priority_header"),
        ({"type": "tier-priority", "parameters": {"objective_header": "a:b"}}, "objective_header"),
        ({"type": "tier-priority", "parameters": {"lane_objectives": {"gold": "x"}}}, "gold"),
        ({"type": "tier-priority", "parameters": {"lane_capacity": 0}}, "lane_capacity"),
        ({"type": "random-robin", "parameters": {"fairness_header": "a\nb"}}, "fairness_header"),
        ({"type": "random-robin", "parameters": {"priority_header": "x"}}, "priority_header"),
    ],
)
def test_bad_merge_config_fails_at_startup_in_one_line(
    config: dict[str, object], message: str
) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        build_merge_policy(MergePolicyConfig.model_validate(config), MergeContext())
    assert "\n" not in str(info.value)


def test_empty_header_params_mean_defaults() -> None:
    def stamps(**parameters: str) -> list[tuple[str, str]]:
        config = MergePolicyConfig(type="tier-priority", parameters=parameters)
        policy: MergePolicy = build_merge_policy(config, MergeContext())
        assert isinstance(policy, TierPriority)
        return policy.stamps(2, work("q", 0))

    # Upstream since v0.10 (#443): no priority header unless one is named.
    assert stamps() == stamps(priority_header="", tier_label="") == []
    assert stamps(priority_header="x-gateway-priority") == [("x-gateway-priority", "2")]


# ----------------------------------------------------------------------------- sources added later


@pytest.mark.parametrize(
    "policy",
    [rr(), TierPriority(TierPriorityParams()), WeightedFair(WeightedFairParams())],
    ids=["random-robin", "tier-priority", "weighted-fair"],
)
async def test_a_source_added_while_running_is_merged_and_the_policy_waits_for_more(
    policy: MergePolicy,
) -> None:
    """A discovered queue joins a running merge; the merge ends only once ``more`` is
    closed as well as every source."""
    first, _ = queue("a", [work("a", 0)])
    later, _ = queue("b", [work("b", 0), work("b", 1)])
    more_in, more = anyio.create_memory_object_stream[Source](1)
    out, received = sink()
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(policy.run, "p", [first], out, more)
            assert await take(received, 1) == ["a-0"]
            await more_in.send(later)
            assert sorted(await take(received, 2)) == ["b-0", "b-1"]
            more_in.close()
            with pytest.raises(anyio.EndOfStream):
                await received.receive()
