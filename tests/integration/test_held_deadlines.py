"""A message held in memory is answered at its deadline, wherever it waits (issue 30, 1-2).

Against a real redis-server and the simulator over real HTTP, whose every answer is slow:
the workers are all busy, so what the daemon fetched beyond them waits in memory — the
pool's stream, the merge (its emitter, a reader's offer, a tier lane), the queue's lane —
or at a pool gate that blocks in ``apply``. Each such message gets exactly one
``DEADLINE_EXCEEDED`` result within 1 s of its deadline, its pool slot comes back, and it
never reaches the gateway. Before, it waited for a worker: up to ``--request-timeout``.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest
from redis.asyncio import Redis

from async_processor.client.redis_sortedset import SortedSetClient
from async_processor.config import AppConfig, MergePolicyConfig, PoolConfig, SortedSetConfig
from async_processor.messages import ErrorCode, Result
from async_processor.pipeline.processor import Processor
from tests.fixtures.inprocess import metric, running, runtime_config, sortedset_config, submit
from tests.fixtures.simulator import SimulatorProcess

pytestmark = pytest.mark.anyio

BUSY_FOR = 5.0  # the gateway's answer time: longer than any late message's deadline


def request(request_id: str, ttl: float) -> dict[str, Any]:
    return {"id": request_id, "deadline": int(time.time() + ttl), "payload": {"tag": request_id}}


async def results_as_they_come(r: Redis, queues: list[str], ids: set[str]) -> dict[str, float]:
    """When each of ``ids`` got its first result (read every 20 ms)."""
    seen: dict[str, float] = {}
    with anyio.fail_after(BUSY_FOR):
        while not ids <= set(seen):
            for result in await all_results(r, queues):
                seen.setdefault(result.id, time.time())
            await anyio.sleep(0.02)
    return seen


async def all_results(r: Redis, queues: list[str]) -> list[Result]:
    """The results on each queue's result list (the client names one per queue)."""
    return [Result.decode(raw) for q in queues for raw in await r.lrange(f"{q}:results", 0, -1)]


async def until_in_flight(processor: Processor, count: int) -> None:
    with anyio.fail_after(5):
        while metric(processor, "llm_d_async_async_inflight_requests") < count:
            await anyio.sleep(0.02)


async def answered_at_deadline(
    r: Redis,
    processor: Processor,
    simulator: SimulatorProcess,
    late: list[dict[str, Any]],
    queues: list[str],
) -> None:
    """``late`` (fetched, waiting behind busy workers) answered once each, within 1 s of
    their deadline, their slots back; then, once the busy workers are free, none of
    them reaches the gateway and none gets a second result."""
    pool = processor.pools[0]
    with anyio.fail_after(3):  # all fetched: none left on the broker
        while sum([await r.zcard(q) for q in queues]):
            await anyio.sleep(0.02)
    seen = await results_as_they_come(r, queues, {x["id"] for x in late})
    for item in late:
        delay = seen[item["id"]] - item["deadline"]
        assert -0.05 < delay < 1.0, f"{item['id']} answered {delay:.2f} s after its deadline"
    by_id = {x.id: x for x in await all_results(r, queues)}
    assert {by_id[x["id"]].error_code for x in late} == {ErrorCode.DEADLINE_EXCEEDED}
    # Their slots back: only the busy ones hold one (a fetch under way may, for a moment).
    busy = metric(processor, "llm_d_async_async_inflight_requests")
    with anyio.fail_after(1):
        while pool.capacity.slots - pool.capacity.free > busy:
            await anyio.sleep(0.02)
    assert pool.held is not None and pool.held.live == 0
    exceeded = metric(processor, "llm_d_async_async_exceeded_deadline_requests_total")
    assert exceeded == len(late)
    # The busy ones answer; the workers then meet the answered messages and pass them by.
    with anyio.fail_after(BUSY_FOR + 3):
        while metric(processor, "llm_d_async_async_inflight_requests"):
            await anyio.sleep(0.05)
    await anyio.sleep(0.3)
    sent = " ".join(x["body"] for x in simulator.requests())
    assert not [x["id"] for x in late if x["id"] in sent]  # never dispatched
    ids = [x.id for x in await all_results(r, queues)]
    assert sorted(x for x in ids if x.startswith("late")) == sorted(x["id"] for x in late)


async def test_prefetched_messages_are_answered_at_their_deadline(
    redis_url: str, unique: str, simulator: SimulatorProcess, redis_client: Redis
) -> None:
    # 16 workers hold 4 more: one in the pool's stream, one in the merge's hand (blocked on
    # that stream), two in the queue's lane.
    simulator.configure(latency=BUSY_FOR)
    config = sortedset_config(
        redis_url, simulator.url, unique, pools=[PoolConfig(id="p", workers=16)],
        drain_timeout="1s",
    )  # fmt: skip
    async with running(config) as processor:
        await submit(redis_url, unique, *[request(f"busy{i}", 600) for i in range(16)])
        await until_in_flight(processor, 16)
        late = [request(f"late{i}", 3) for i in range(4)]
        await submit(redis_url, unique, *late)
        await answered_at_deadline(redis_client, processor, simulator, late, [unique])


def queues_config(
    redis_url: str,
    gateway: str,
    unique: str,
    policy: str,
    workers: int,
    names: tuple[str, ...] = ("a", "b"),
    batch_size: int = 10,
) -> AppConfig:
    """Queues ``<unique>:<name>`` into one pool, fetched ``batch_size`` at a time."""
    queues = [
        {"queue_name": f"{unique}:{name}", "igw_base_url": gateway, "worker_pool_id": "p"}
        for name in names
    ]
    transport = SortedSetConfig.model_validate(
        {
            "url": redis_url,
            "result_queue_name": f"{unique}:{names[0]}:results",
            "retry_queue_name": f"{unique}:retry",
            "poll_interval_ms": 50,
            "batch_size": batch_size,
            "queues": queues,
        }
    )
    return AppConfig(
        transport="redis-sortedset",
        transport_config=transport,
        runtime=runtime_config(
            drain_timeout="1s"  # ports 0 (runtime_config's): the OS's, no race for them
        ),
        pools=[PoolConfig(id="p", workers=workers)],
        merge_policy=MergePolicyConfig(type=policy),
    )


@pytest.mark.parametrize("policy", ["random-robin", "weighted-fair", "tier-priority"])
async def test_messages_held_in_the_merge_are_answered_at_their_deadline(
    redis_url: str, unique: str, simulator: SimulatorProcess, redis_client: Redis, policy: str
) -> None:
    # Two queues into one pool of 8: slots 8 + 2 + 1; what is fetched beyond the busy
    # workers waits in the merge (offers, or a tier lane) and the pool's stream.
    simulator.configure(latency=BUSY_FOR)
    config = queues_config(redis_url, simulator.url, unique, policy, workers=8)
    queues = [f"{unique}:a", f"{unique}:b"]
    async with running(config) as processor:
        busy = [request(f"busy{i}", 600) for i in range(8)]
        await submit(redis_url, queues[0], *busy[:4])
        await submit(redis_url, queues[1], *busy[4:])
        await until_in_flight(processor, 8)
        late = [request(f"late{i}", 3) for i in range(3)]
        await submit(redis_url, queues[0], *late[:2])
        await submit(redis_url, queues[1], *late[2:])
        await answered_at_deadline(redis_client, processor, simulator, late, queues)


async def test_a_batch_behind_a_full_lane_is_answered_at_its_deadline(
    redis_url: str, unique: str, simulator: SimulatorProcess, redis_client: Redis
) -> None:
    # 16 workers, four queues: 16 + 4 + 3 slots. Queue a's lane holds 2 (a batch); with
    # the pool's stream and the merge full, a's last fetch of 2 waits in its poller, both
    # held (the one behind the first waited unheld, for the lane).
    simulator.configure(latency=BUSY_FOR)
    names = ("a", "b", "c", "d")
    config = queues_config(
        redis_url, simulator.url, unique, "random-robin", 16, names, batch_size=2
    )
    queues = [f"{unique}:{name}" for name in names]
    async with running(config) as processor:
        await submit(redis_url, queues[0], *[request(f"busy{i}", 600) for i in range(16)])
        await until_in_flight(processor, 16)
        late = [request(f"late{i}", 3) for i in range(7)]
        await submit(redis_url, queues[0], *late)
        await answered_at_deadline(redis_client, processor, simulator, late, queues)


@asynccontextmanager
async def one_busy_behind_a_blocking_gate(
    redis_url: str, unique: str, simulator: SimulatorProcess, gate_wait_timeout: str
) -> AsyncIterator[Processor]:
    """Two workers behind ``local-max-concurrency`` (limit 1, ``blocking``), the one
    admitted message busy at the gateway: the next one waits inside the gate's apply."""
    simulator.configure(latency=BUSY_FOR)
    gate = {"limit": 1, "gating_mode": "blocking"}
    pool = PoolConfig(id="p", workers=2, gate_type="local-max-concurrency", gate_params=gate)
    config = sortedset_config(
        redis_url, simulator.url, unique, pools=[pool], drain_timeout="1s",
        gate_wait_timeout=gate_wait_timeout,
    )  # fmt: skip
    async with running(config) as processor:
        await submit(redis_url, unique, request("busy", 600))
        await until_in_flight(processor, 1)
        yield processor


async def test_a_blocking_pool_gate_answers_at_the_deadline(
    redis_url: str, unique: str, simulator: SimulatorProcess, redis_client: Redis
) -> None:
    # Nothing bounded the wait inside the gate's apply: the message waited for the busy
    # one's answer, past its deadline.
    async with one_busy_behind_a_blocking_gate(redis_url, unique, simulator, "1m") as processor:
        late = [request("late", 3)]
        await submit(redis_url, unique, *late)
        await answered_at_deadline(redis_client, processor, simulator, late, [unique])


async def test_a_blocking_pool_gate_hands_back_at_the_gate_wait_timeout(
    redis_url: str, unique: str, simulator: SimulatorProcess, redis_client: Redis
) -> None:
    # A deadline far away: the wait ends at --gate-wait-timeout and the message goes back
    # to the broker (then comes again, and waits again), instead of holding a worker.
    async with one_busy_behind_a_blocking_gate(redis_url, unique, simulator, "500ms") as processor:
        await submit(redis_url, unique, request("waiter", 600))
        pulled = "llm_d_async_async_request_total"
        # Each fetch of the waiter is a first pull (a hand-back is no retry).
        with anyio.fail_after(3):
            while metric(processor, pulled) < 4:  # the busy one, the waiter 3 times
                await anyio.sleep(0.05)
        assert not await all_results(redis_client, [unique])
        assert metric(processor, "llm_d_async_async_inflight_requests") == 1


# ------------------------------------------------------------ the poller's own waits
# (issue 30, item 5): a queue gate that waits inside its apply stalled the poller, and a
# message whose payload was still to be loaded was held by nobody.

BLOCKING = {
    "gate_type": "local-max-concurrency",
    "gate_params": {"limit": 1, "gating_mode": "blocking"},
}


async def test_messages_behind_a_blocking_queue_gate_are_answered_at_their_deadline(
    redis_url: str, unique: str, simulator: SimulatorProcess, redis_client: Redis
) -> None:
    # The busy one holds the gate's only permit; the first late one waits inside the
    # gate's apply, the rest on the broker behind the stalled poller. The wait ends at the
    # deadline: each is answered then, not when the busy one finishes (5 s).
    simulator.configure(latency=BUSY_FOR)
    config = sortedset_config(
        redis_url, simulator.url, unique, queue_extra=BLOCKING, drain_timeout="1s"
    )
    async with running(config) as processor:
        await submit(redis_url, unique, request("busy", 600))
        await until_in_flight(processor, 1)
        late = [request(f"late{i}", 3) for i in range(4)]
        await submit(redis_url, unique, *late)
        seen = await results_as_they_come(redis_client, [unique], {x["id"] for x in late})
        for item in late:
            delay = seen[item["id"]] - item["deadline"]
            assert -0.05 < delay < 1.0, f"{item['id']} answered {delay:.2f} s after its deadline"
        by_id = {x.id: x for x in await all_results(redis_client, [unique])}
        assert {by_id[x["id"]].error_code for x in late} == {ErrorCode.DEADLINE_EXCEEDED}
        exceeded = metric(processor, "llm_d_async_async_exceeded_deadline_requests_total")
        assert exceeded == len(late)
    assert not [
        x["id"] for x in late if x["id"] in " ".join(r["body"] for r in simulator.requests())
    ]


async def test_a_payload_being_loaded_is_answered_at_its_deadline(
    redis_url: str, unique: str, simulator: SimulatorProcess, redis_client: Redis
) -> None:
    # One batch, payloads stored apart: the first message takes the queue gate's only
    # permit and waits for the batch's payload read; the second waits inside the gate for
    # that permit, so the first never got past the load: both stuck until the second's
    # deadline (10 minutes). Held from its admission, the first is answered at its
    # deadline, which gives its permit back, and the second goes on.
    simulator.configure(latency=0.1)
    late, after = request("late0", 3), request("after", 600)
    async with SortedSetClient(
        redis_url, unique, f"{unique}:results", payload_keys=True
    ) as producer:
        await producer.submit_many([late, after])
    config = sortedset_config(
        redis_url, simulator.url, unique, queue_extra=BLOCKING, drain_timeout="1s",
        transport_extra={"batch_size": 10},
    )  # fmt: skip
    async with running(config) as processor:
        seen = await results_as_they_come(redis_client, [unique], {"late0", "after"})
        assert -0.05 < seen["late0"] - late["deadline"] < 1.0
        by_id = {x.id: x for x in await all_results(redis_client, [unique])}
        assert by_id["late0"].error_code == ErrorCode.DEADLINE_EXCEEDED
        assert (by_id["after"].error_code, by_id["after"].status_code) == ("", 200)
        assert metric(processor, "llm_d_async_async_exceeded_deadline_requests_total") == 1
        pool = processor.pools[0]
        assert pool.held is not None and pool.held.live == 0
    assert "late0" not in " ".join(x["body"] for x in simulator.requests())
