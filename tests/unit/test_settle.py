"""Settler: every exit gives the pool slot back exactly once (docs/architecture.md G12)."""

from __future__ import annotations

from typing import cast

import anyio
import pytest
from anyio.streams.memory import MemoryObjectSendStream

from async_processor.config.queues import QueueSpec
from async_processor.errors import TransportError
from async_processor.messages import Result, decode_envelope
from async_processor.metrics import Metrics, QueueMetrics
from async_processor.pipeline.capacity import PoolCapacity
from async_processor.pipeline.results import Op
from async_processor.pipeline.settle import Settler
from async_processor.retry import Counter, Final, Retry
from async_processor.transports.base import Completion, Deferral, Delivery, Transport
from async_processor.work import Work

pytestmark = pytest.mark.anyio

QUEUE = QueueSpec(id="q", name="q")
SUCCESSFUL = "llm_d_async_async_successful_requests_total"


class FailingDeadLetters:
    """A broker that refuses dead letters; records what it was told to stop leasing."""

    kind = "fake"

    def __init__(self) -> None:
        self.abandoned: list[str] = []

    async def dead_letter(self, delivery: Delivery, reason: str, detail: str) -> None:
        raise TransportError("READONLY You can't write against a read only replica.")

    def abandon(self, delivery: Delivery, reason: str) -> None:
        self.abandoned.append(reason)


async def _taken(slots: int) -> PoolCapacity:
    """A pool with every slot reserved, as while its messages are being settled."""
    capacity = PoolCapacity(slots)
    assert await capacity.reserve(slots) == slots
    return capacity


def _work(request_id: str, metrics: QueueMetrics) -> Work:
    raw = b'{"id":"%s","deadline":4102444800}' % request_id.encode()
    return Work(Delivery(queue=QUEUE, raw=raw), decode_envelope(raw), metrics)


def _settler(
    capacity: PoolCapacity, writer: MemoryObjectSendStream[Op], transport: object = None
) -> Settler:
    return Settler(
        transport=cast(Transport, transport or FailingDeadLetters()),
        writer=writer,
        capacity=capacity,
    )


async def test_a_failed_dead_letter_is_abandoned_and_its_slot_comes_back() -> None:
    transport = FailingDeadLetters()
    capacity = await _taken(1)
    send, receive = anyio.create_memory_object_stream[Op](1)
    async with send, receive:
        settler = _settler(capacity, send, transport)
        await settler.dead_letter(Delivery(queue=QUEUE, raw=b"\xff"), "malformed", "not JSON")
    assert transport.abandoned == ["dead_letter_failed"]
    assert capacity.free == 1


async def test_finish_and_defer_write_then_give_the_slot_back() -> None:
    capacity = await _taken(2)
    send, receive = anyio.create_memory_object_stream[Op](2)
    async with send, receive:
        settler = _settler(capacity, send)
        delivery = Delivery(queue=QUEUE, raw=b"{}")
        await settler.finish(delivery, Result.http("a", 200, b""))
        await settler.defer(delivery, 1.5)
        ops = [receive.receive_nowait(), receive.receive_nowait()]
    assert ops == [Completion(delivery, Result.http("a", 200, b"")), Deferral(delivery, 1.5)]
    assert capacity.free == 2


async def test_a_poller_write_cut_short_keeps_the_slot_for_the_hand_back() -> None:
    """The poller hands the message back after a cut finish; that hand-back gives the slot,
    so giving it here too would count it twice (more fetched than the pool holds)."""
    capacity = await _taken(1)
    send, receive = anyio.create_memory_object_stream[Op](0)  # a writer that never reads
    async with send, receive:
        with anyio.move_on_after(0.05):
            await _settler(capacity, send).finish(
                Delivery(queue=QUEUE, raw=b"{}"), Result.http("p", 200, b"")
            )
    assert capacity.free == 0


async def test_a_worker_settle_cut_short_still_gives_slot_and_permits_back() -> None:
    capacity = await _taken(1)
    permits: list[str] = []

    async def give_back() -> None:
        permits.append("released")

    work = _work("w", Metrics().queue("q", "q", "p"))
    work.releases.add(give_back)
    send, receive = anyio.create_memory_object_stream[Op](0)
    async with send, receive:
        with anyio.move_on_after(0.05, shield=True):
            await _settler(capacity, send).settle(work, Retry(1.0))
    assert capacity.free == 1
    assert permits == ["released"]


async def test_a_worker_final_is_counted_once() -> None:
    metrics = Metrics()
    work = _work("c", metrics.queue("q", "q", "p"))
    send, receive = anyio.create_memory_object_stream[Op](1)
    async with send, receive:
        await _settler(await _taken(1), send).settle(
            work, Final(Result.http("c", 200, b""), Counter.SUCCESS)
        )
        assert isinstance(receive.receive_nowait(), Completion)
    labels = {"queue_id": "q", "queue_name": "q", "pool_name": "p"}
    assert metrics.registry.get_sample_value(SUCCESSFUL, labels) == 1


async def test_a_hand_over_queues_and_counts_once_or_does_nothing_when_the_writer_is_full() -> None:
    """The worker's fast path (no timer): taken at once when the writer has room, else
    nothing is queued or counted and ``settle`` does it (counted once in all)."""
    metrics = Metrics()
    work = _work("h", metrics.queue("q", "q", "p"))
    labels = {"queue_id": "q", "queue_name": "q", "pool_name": "p"}
    final = Final(Result.http("h", 200, b""), Counter.SUCCESS)
    send, receive = anyio.create_memory_object_stream[Op](1)
    async with send, receive:
        settler = _settler(await _taken(1), send)
        send.send_nowait(Deferral(work.delivery, 0.0))  # the writer's buffer is full
        assert not settler.hand_over(work, final)
        assert metrics.registry.get_sample_value(SUCCESSFUL, labels) == 0
        receive.receive_nowait()
        assert settler.hand_over(work, final)
        assert receive.receive_nowait() == Completion(work.delivery, final.result)
    assert metrics.registry.get_sample_value(SUCCESSFUL, labels) == 1
