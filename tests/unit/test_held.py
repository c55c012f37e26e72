"""HeldWork: what waits in memory for a worker is answered at its deadline, exactly once.

In-process with a real ``Settler`` over a memory stream: a held message past its deadline
becomes one ``DEADLINE_EXCEEDED`` completion and its slot comes back; one a worker took
first is never answered; one held later with an earlier deadline wakes the expiry early;
and taken messages do not pile up in the heap (it stays within twice the live ones).
"""

from __future__ import annotations

import time

import anyio
import pytest
from anyio.streams.memory import MemoryObjectReceiveStream

from async_processor.config.queues import QueueSpec
from async_processor.messages import Envelope, ErrorCode, Request, Routing
from async_processor.metrics import Metrics
from async_processor.pipeline.capacity import PoolCapacity
from async_processor.pipeline.held import SLACK, HeldWork
from async_processor.pipeline.results import Op
from async_processor.pipeline.settle import Settler
from async_processor.transports.base import Completion, Delivery, Transport
from async_processor.work import Work

pytestmark = pytest.mark.anyio

QUEUE = QueueSpec(id="q", name="q", pool="p", igw_base_url="http://gw")
METRICS = Metrics().queue(QUEUE.id, QUEUE.name, QUEUE.pool)


def work(request_id: str, deadline: int) -> Work:
    envelope = Envelope(Request(id=request_id, deadline=deadline), Routing(), kind="redis")
    delivery = Delivery(QUEUE, b"", received_at=time.time())
    delivery.envelope = envelope
    return Work(delivery, envelope, METRICS)


def expiry(slots: int) -> tuple[HeldWork, PoolCapacity, MemoryObjectReceiveStream[Op]]:
    send, receive = anyio.create_memory_object_stream[Op](100)
    capacity = PoolCapacity(slots)
    transport: Transport = None  # type: ignore[assignment]  # never called: no dead letters
    return HeldWork(Settler(transport=transport, writer=send, capacity=capacity)), capacity, receive


async def test_a_held_message_is_answered_at_its_deadline_and_a_taken_one_never() -> None:
    held, capacity, results = expiry(4)
    capacity.free = 1  # three slots taken: one per message
    await anyio.sleep(1 - time.time() % 1)  # deadlines are whole seconds: a second away
    now = int(time.time())
    soon, later, taken = work("soon", now + 1), work("later", now + 2), work("taken", now + 1)
    async with anyio.create_task_group() as tg:
        tg.start_soon(held.run)
        for item in (later, taken):
            held.hold(item)
        await anyio.sleep(0.05)
        held.hold(soon)  # an earlier deadline than the expiry sleeps for: it wakes sooner
        assert held.take(taken)  # a worker has it: the expiry must leave it alone
        with anyio.fail_after(2):
            first = await results.receive()
        answered_at = time.time()
        with anyio.fail_after(2):
            second = await results.receive()
        await anyio.sleep(0.2)  # past taken's deadline: nothing more
        tg.cancel_scope.cancel()
    assert isinstance(first, Completion) and first.result.id == "soon"
    assert answered_at - soon.envelope.request.deadline < 0.2
    assert isinstance(second, Completion) and second.result.id == "later"
    assert first.result.error_code == ErrorCode.DEADLINE_EXCEEDED
    assert results.statistics().current_buffer_used == 0
    assert capacity.free == 3  # the two answered gave their slots back
    assert not held.take(soon)  # a worker meeting it later passes it by
    assert soon.answered and not taken.answered
    assert held.live == 0


async def test_taken_messages_do_not_pile_up_in_the_heap() -> None:
    held, _, _ = expiry(1)
    far = int(time.time()) + 3600
    live = [work(f"live{i}", far) for i in range(100)]
    for item in live:
        held.hold(item)
    for i in range(10_000):  # a long run of messages held and taken at once
        item = work(f"m{i}", far)
        held.hold(item)
        assert held.take(item)
        assert len(held._heap) <= 2 * held.live + SLACK + 1
    assert held.live == 100
