"""Processor over the in-memory transport: every fetched message ends as exactly one
result or a hand-back (docs/architecture.md G1, G2, G6, G7), with no broker involved."""

from __future__ import annotations

import time

import anyio
import pytest

from async_processor.messages import ErrorCode, decode_envelope
from async_processor.pipeline.capacity import prefetch
from tests.doubles.daemon import QUEUE, daemon, message

pytestmark = pytest.mark.anyio


async def test_each_message_gets_one_result_and_nothing_stays_held() -> None:
    async with daemon() as (_, transport, simulator):
        transport.put(QUEUE, *(message(f"r{i}", time.time() + 60) for i in range(5)))
        results = await transport.wait_results(5)
        assert simulator.stats["total"] == 5
    assert {r.status_code for r in results.values()} == {200}
    assert transport.held == {} and transport.duplicates == []


async def test_a_message_past_its_deadline_is_answered_without_a_request() -> None:
    async with daemon() as (_, transport, simulator):
        transport.put(QUEUE, message("late", time.time() - 5))
        results = await transport.wait_results(1)
        assert simulator.stats["total"] == 0
    assert results["late"].error_code == ErrorCode.DEADLINE_EXCEEDED.value


async def test_a_5xx_is_handed_back_with_its_retry_counted_then_answered() -> None:
    async with daemon() as (_, transport, simulator):
        simulator.set_config(error_rate=1.0, error_status=503)
        transport.put(QUEUE, message("flaky", time.time() + 60))
        with anyio.fail_after(5):
            while not transport.deferred:
                await anyio.sleep(0.01)
        simulator.set_config(error_rate=0.0)
        results = await transport.wait_results(1, timeout=10)
    deferred = transport.deferred[0].delivery
    assert deferred.envelope is not None and deferred.envelope.routing.retry_count == 1
    assert results["flaky"].status_code == 200


async def test_an_undecodable_message_without_an_id_is_dead_lettered() -> None:
    async with daemon() as (_, transport, _sim):
        transport.put(QUEUE, b"not json", message("ok", time.time() + 60))
        await transport.wait_results(1)
        with anyio.fail_after(5):
            while not transport.dead_letters:
                await anyio.sleep(0.01)
    assert [raw for raw, _ in transport.dead_letters] == [b"not json"]
    assert set(transport.results) == {"ok"}


async def test_stopping_hands_back_what_was_fetched_but_not_started() -> None:
    # One worker held on a slow answer: the rest of the fetch waits in the pool and must go
    # back to the broker at shutdown, not be lost (G13).
    async with daemon(workers=1, drain_timeout="200ms") as (_, transport, simulator):
        simulator.set_config(latency=30.0)
        transport.put(QUEUE, *(message(f"r{i}", time.time() + 60) for i in range(3)))
        with anyio.fail_after(5):
            while len(transport.held) < 2:
                await anyio.sleep(0.01)
    assert transport.held == {}  # every fetched message was settled one way or the other
    assert transport.deferred, "the message in flight at the drain timeout is handed back"
    # Each message ends once: answered, or back on the broker. Counted on the broker, not by
    # hand-backs: a poller whose claim was landing at the stop may fetch a message a worker
    # had just handed back, and hand it back again (two deferrals, one message).
    on_broker = [decode_envelope(raw).id for raw in transport.on_broker(QUEUE)]
    assert sorted([*transport.results, *on_broker]) == ["r0", "r1", "r2"]


async def test_a_pool_keeps_its_prefetch_fetched_beside_busy_workers() -> None:
    # The queue's lane holds the pool's prefetch: with a lane of one batch (10) the poller
    # stayed blocked one batch ahead, most prefetch slots were never fetched, and freed
    # workers waited for fetch round trips instead (#13, Little's law).
    workers = 200
    async with daemon(workers=workers, drain_timeout="200ms") as (_, transport, simulator):
        simulator.set_config(latency=30.0)
        transport.put(QUEUE, *(message(f"r{i}", time.time() + 60) for i in range(400)))
        with anyio.fail_after(10):
            while len(transport.held) < workers + prefetch(workers):
                await anyio.sleep(0.01)
        await anyio.sleep(0.2)
        assert len(transport.held) == workers + prefetch(workers)
