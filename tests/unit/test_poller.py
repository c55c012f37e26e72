"""Poller: pool slots come back on every path, including cancellation at shutdown."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import TypeVar, cast

import anyio
import pytest
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from async_processor.config.queues import QueueSpec
from async_processor.errors import TransportError
from async_processor.gates.base import ConstantGate, Gate
from async_processor.messages import Envelope, ErrorCode, Result, decode_envelope
from async_processor.metrics import Metrics, QueueMetrics
from async_processor.pipeline.capacity import PoolCapacity
from async_processor.pipeline.held import HeldWork
from async_processor.pipeline.poller import Poller
from async_processor.pipeline.results import Op
from async_processor.pipeline.settle import Settler
from async_processor.transports.base import Completion, Deferral, Delivery, Transport
from async_processor.work import Work

pytestmark = pytest.mark.anyio

T = TypeVar("T")
QUEUE = QueueSpec(id="q", name="q", batch_size=4, poll_interval=0.05)


def _poller(
    queue: QueueSpec,
    transport: Transport,
    gate: Gate,
    capacity: PoolCapacity,
    lane: MemoryObjectSendStream[Work],
    writer: MemoryObjectSendStream[Op],
    metrics: QueueMetrics,
    *,
    bound_in_flight: bool = True,
    gate_wait: float = math.inf,
) -> Poller:
    settler = Settler(transport=transport, writer=writer, capacity=capacity)
    return Poller(
        queue=queue,
        transport=transport,
        gate=gate,
        settler=settler,
        lane=lane,
        metrics=metrics,
        held=HeldWork(settler),
        bound_in_flight=bound_in_flight,
        gate_wait=gate_wait,
    )


class FakeTransport:
    """Serves ``raws`` once, then blocks each fetch until cancelled (``blocked`` is set)."""

    kind = "fake"
    queues = (QUEUE,)

    def __init__(self, raws: Sequence[bytes] = ()) -> None:
        self._raws = list(raws)
        self.blocked = anyio.Event()

    def decode(self, delivery: Delivery) -> Envelope:
        return decode_envelope(delivery.raw)

    async def fetch(self, queue: QueueSpec, limit: int, wait: float) -> list[Delivery]:
        if self._raws:
            taken, self._raws = self._raws[:limit], self._raws[limit:]
            return [Delivery(queue=queue, raw=raw) for raw in taken]
        self.blocked.set()
        await anyio.sleep_forever()
        raise AssertionError("unreachable")

    async def is_cancelled(self, delivery: Delivery) -> bool:
        return False

    async def backlog(self, queue: QueueSpec) -> int | None:
        return 0

    async def dead_letter(self, delivery: Delivery, reason: str, detail: str) -> None:
        return None


def message(request_id: str, deadline: float) -> bytes:
    return b'{"id":"%s","deadline":%d}' % (request_id.encode(), int(deadline))


async def run_until_blocked(
    transport: FakeTransport,
    capacity: PoolCapacity,
    gate: Gate | None = None,
    gate_wait: float = math.inf,
) -> tuple[list[Work], list[Op]]:
    """Run one poller (behind ``gate``, else an open one) until its fetch blocks on an
    empty queue, then cancel it."""
    lane_in, lane_out = anyio.create_memory_object_stream[Work](16)
    writer_in, writer_out = anyio.create_memory_object_stream[Op](16)
    metrics = Metrics().queue("q", "q", "default")
    fake = cast(Transport, transport)  # only the methods a poller calls
    gate = gate or ConstantGate(1.0)
    poller = _poller(QUEUE, fake, gate, capacity, lane_in, writer_in, metrics, gate_wait=gate_wait)
    async with anyio.create_task_group() as tg:
        tg.start_soon(poller.run)
        with anyio.fail_after(5):
            await transport.blocked.wait()
        tg.cancel_scope.cancel()
    async with lane_out, writer_out:
        return list(_drain(lane_out)), list(_drain(writer_out))


def _drain(stream: MemoryObjectReceiveStream[T]) -> list[T]:
    out: list[T] = []
    while True:
        try:
            out.append(stream.receive_nowait())
        except (anyio.WouldBlock, anyio.EndOfStream):
            return out


async def test_cancelled_while_fetching_gives_the_reserved_slots_back() -> None:
    capacity = PoolCapacity(8)
    await run_until_blocked(FakeTransport(), capacity)
    # The fetch held a reservation of min(batch, free) slots when shutdown cancelled it.
    assert capacity.free == 8


async def test_each_message_holds_one_slot_until_its_worker_or_the_writer_has_it() -> None:
    future, past = time.time() + 600, time.time() - 5
    raws = [message("ok", future), message("late", past), b"not json", b'{"id":"x"}']
    capacity = PoolCapacity(8)
    forwarded, ops = await run_until_blocked(FakeTransport(raws), capacity)
    assert [w.envelope.id for w in forwarded] == ["ok"]
    assert sorted(op.result.id for op in ops if isinstance(op, Completion)) == ["late", "x"]
    # "not json" has no id: dead-lettered, no op. Forwarded work keeps its slot.
    assert capacity.free == 8 - len(forwarded)
    assert not [op for op in ops if isinstance(op, Deferral)]


class BrokenBudgetGate(ConstantGate):
    def __init__(self, budget: float | None) -> None:
        super().__init__(1.0)
        self._budget = budget

    async def budget(self) -> float:
        if self._budget is None:
            raise RuntimeError("backend exploded")
        return self._budget


@pytest.mark.parametrize("budget", [None, float("nan")])
async def test_a_failing_or_nan_budget_closes_the_queue_instead_of_crashing(
    budget: float | None,
) -> None:
    # math.floor(batch * nan) raised ValueError and an exception from budget() escaped:
    # either stopped the poller's task group, i.e. the daemon.
    transport = FakeTransport([message("ok", time.time() + 600)])
    lane_in, lane_out = anyio.create_memory_object_stream[Work](16)
    writer_in, writer_out = anyio.create_memory_object_stream[Op](16)
    metrics = Metrics().queue("q", "q", "default")
    gate = BrokenBudgetGate(budget)
    fake = cast(Transport, transport)
    poller = _poller(QUEUE, fake, gate, PoolCapacity(8), lane_in, writer_in, metrics)
    async with lane_out, writer_out, anyio.create_task_group() as tg:
        tg.start_soon(poller.run)
        await anyio.sleep(3 * QUEUE.poll_interval)
        tg.cancel_scope.cancel()
    assert metrics.dispatch_budget._value.get() == 0.0
    assert transport._raws  # nothing fetched while closed


class RecordingTransport(FakeTransport):
    """Records the limit of each fetch (always empty: every fetch blocks)."""

    def __init__(self) -> None:
        super().__init__()
        self.limits: list[int] = []

    async def fetch(self, queue: QueueSpec, limit: int, wait: float) -> list[Delivery]:
        self.limits.append(limit)
        return await super().fetch(queue, limit, wait)


@pytest.mark.parametrize(
    ("max_fetch", "budget", "free", "asked"),
    [
        (0, 1.0, 300, 4),  # Redis: batch_size caps each fetch
        (1000, 1.0, 300, 300),  # Pub/Sub: every free slot, not batch_size
        (1000, 0.5, 300, 150),  # ... times the budget
        (1000, 0.001, 300, 1),  # ... at least one while the budget is open
        (100, 1.0, 300, 100),  # ... up to the pull limit
    ],
)
async def test_a_fetch_sized_by_free_slots_asks_for_free_slots_times_budget(
    max_fetch: int, budget: float, free: int, asked: int
) -> None:
    queue = QueueSpec(id="q", name="q", batch_size=4, poll_interval=0.05, max_fetch=max_fetch)
    transport = RecordingTransport()
    capacity = PoolCapacity(free)
    lane_in, lane_out = anyio.create_memory_object_stream[Work](16)
    writer_in, writer_out = anyio.create_memory_object_stream[Op](16)
    metrics = Metrics().queue("q", "q", "default")
    fake = cast(Transport, transport)
    poller = _poller(queue, fake, ConstantGate(budget), capacity, lane_in, writer_in, metrics)
    async with lane_out, writer_out, anyio.create_task_group() as tg:
        tg.start_soon(poller.run)
        with anyio.fail_after(5):
            await transport.blocked.wait()
        assert capacity.free == free - asked  # the slots not asked for stay free
        tg.cancel_scope.cancel()
    assert transport.limits == [asked]


async def _forwarded_under_budget(
    budget: float, bound_in_flight: bool, release_one: bool = False
) -> int:
    """Messages a poller forwards with plenty queued, 8 pool slots and a constant budget."""
    raws = [message(f"m{i}", time.time() + 600) for i in range(20)]
    lane_in, lane_out = anyio.create_memory_object_stream[Work](16)
    writer_in, _ = anyio.create_memory_object_stream[Op](16)
    poller = _poller(QUEUE, cast(Transport, FakeTransport(raws)), ConstantGate(budget),
                    PoolCapacity(8), lane_in, writer_in, Metrics().queue("q", "q", "default"),
                    bound_in_flight=bound_in_flight)  # fmt: skip
    async with anyio.create_task_group() as tg:
        tg.start_soon(poller.run)
        await anyio.sleep(0.3)  # six poll intervals: time enough to fetch everything allowed
        forwarded = _drain(lane_out)
        if release_one:
            await forwarded[0].releases.release_all()  # a worker finished one
            await anyio.sleep(0.1)
            forwarded += _drain(lane_out)
        tg.cancel_scope.cancel()
    return len(forwarded)


async def test_a_budget_caps_the_queues_messages_in_flight_not_only_each_fetch() -> None:
    # ceil(0.25 x 8 slots) = 2 in flight, though each fetch may take floor(4 x 0.25) = 1
    # and six free slots remain.
    assert await _forwarded_under_budget(0.25, bound_in_flight=True) == 2


async def test_a_finished_message_makes_room_for_the_next_under_the_budget() -> None:
    assert await _forwarded_under_budget(0.25, bound_in_flight=True, release_one=True) == 3


async def test_budget_scope_fetch_only_sizes_fetches_as_the_reference_does() -> None:
    # The same budget fills every free slot, one small fetch after another.
    assert await _forwarded_under_budget(0.25, bound_in_flight=False) == 8


@pytest.mark.parametrize(("in_flight", "limits"), [(1, [300]), (2, [300, 50])])
async def test_slots_freed_during_a_fetch_start_another_when_two_may_be_in_flight(
    in_flight: int, limits: list[int]
) -> None:
    queue = QueueSpec(id="q", name="q", max_fetch=1000, fetches_in_flight=in_flight)
    transport = RecordingTransport()  # every fetch blocks: the first is still in flight
    capacity = PoolCapacity(300)
    lane_in, lane_out = anyio.create_memory_object_stream[Work](16)
    writer_in, writer_out = anyio.create_memory_object_stream[Op](16)
    metrics = Metrics().queue("q", "q", "default")
    fake = cast(Transport, transport)
    # Only free slots size the fetches here: no message of this queue is in flight, so the
    # 50 freed slots stand for another queue's workers finishing.
    poller = _poller(queue, fake, ConstantGate(1.0), capacity, lane_in, writer_in, metrics,
                     bound_in_flight=False)  # fmt: skip
    async with lane_out, writer_out, anyio.create_task_group() as tg:
        tg.start_soon(poller.run)
        with anyio.fail_after(5):
            await transport.blocked.wait()
        capacity.release(50)  # workers finished 50 messages meanwhile
        await anyio.sleep(0.2)
        tg.cancel_scope.cancel()
    assert transport.limits == limits
    assert capacity.free == 350  # every reservation given back at cancellation


class SlowFakeTransport(FakeTransport):
    """A fetch takes a moment, so the queue's two fetch loops overlap."""

    async def fetch(self, queue: QueueSpec, limit: int, wait: float) -> list[Delivery]:
        await anyio.sleep(0.05)
        return await super().fetch(queue, limit, wait)


async def test_two_fetch_loops_together_stay_within_the_in_flight_budget() -> None:
    queue = QueueSpec(id="q", name="q", poll_interval=0.05, max_fetch=1000, fetches_in_flight=2)
    raws = [message(f"m{i}", time.time() + 600) for i in range(20)]
    lane_in, lane_out = anyio.create_memory_object_stream[Work](16)
    writer_in, _ = anyio.create_memory_object_stream[Op](16)
    metrics = Metrics().queue("q", "q", "default")
    poller = _poller(queue, cast(Transport, SlowFakeTransport(raws)), ConstantGate(0.5),
                    PoolCapacity(8), lane_in, writer_in, metrics)  # fmt: skip
    async with anyio.create_task_group() as tg:
        tg.start_soon(poller.run)
        await anyio.sleep(0.3)
        forwarded = _drain(lane_out)
        tg.cancel_scope.cancel()
    assert len(forwarded) == 4  # ceil(0.5 x 8), though each loop saw room for 4


class AbandoningTransport(FakeTransport):
    def __init__(self, raws: Sequence[bytes] = ()) -> None:
        super().__init__(raws)
        self.abandoned: list[str] = []

    def abandon(self, delivery: Delivery, reason: str) -> None:
        self.abandoned.append(self.decode(delivery).id)


async def test_a_hand_back_that_cannot_finish_gives_up_the_rest_and_their_slots(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A removed queue's poller stops while the process runs on: what it could not hand
    back in time (the writer is stuck) is abandoned, so the heartbeat no longer renews it,
    and its slots come back (else the pool shrinks for good)."""
    import async_processor.pipeline.intake as intake_module

    monkeypatch.setattr(intake_module, "HAND_BACK_TIMEOUT", 0.1)
    future = time.time() + 600
    transport = AbandoningTransport([message(i, future) for i in ("a", "b", "c")])
    capacity = PoolCapacity(8)
    lane_in, lane_out = anyio.create_memory_object_stream[Work](0)  # nobody takes them
    writer_in, writer_out = anyio.create_memory_object_stream[Op](0)  # nor the hand-backs
    metrics = Metrics().queue("q", "q", "default")
    fake = cast(Transport, transport)
    poller = _poller(QUEUE, fake, ConstantGate(1.0), capacity, lane_in, writer_in, metrics)
    async with lane_out, writer_out, anyio.create_task_group() as tg:
        tg.start_soon(poller.run)
        await anyio.wait_all_tasks_blocked()
        assert capacity.free == 5  # three fetched, the first waiting on the lane
        tg.cancel_scope.cancel()
    assert sorted(transport.abandoned) == ["a", "b", "c"]
    assert capacity.free == 8


class StoredApartTransport(FakeTransport):
    """Messages whose id starts with ``ref`` keep their payload apart (``LoadsPayloads``):
    loaded in one call per fetch, ``missing`` ones answered, or every load failing."""

    def __init__(self, raws: Sequence[bytes], *, fail: bool = False) -> None:
        super().__init__(raws)
        self.fail = fail
        self.loads: list[list[str]] = []

    def stored_apart(self, delivery: Delivery) -> bool:
        return self.decode(delivery).id.startswith("ref")

    async def load_payloads(self, deliveries: Sequence[Delivery]) -> list[Result | None]:
        ids = [d.envelope.id for d in deliveries if d.envelope is not None]
        self.loads.append(ids)
        if self.fail:
            raise TransportError("redis payload fetch failed: gone")
        for delivery in deliveries:
            assert delivery.envelope is not None
            delivery.envelope.request.payload = b'{"loaded":true}'
        return [
            Result.failure(i, ErrorCode.PAYLOAD_UNAVAILABLE, "missing") if "missing" in i else None
            for i in ids
        ]


async def test_stored_payloads_load_in_one_call_and_a_missing_one_is_answered() -> None:
    future = time.time() + 600
    names = ("inline", "ref-1", "ref-missing", "ref-2")
    transport = StoredApartTransport([message(i, future) for i in names])
    capacity = PoolCapacity(8)
    forwarded, ops = await run_until_blocked(transport, capacity)
    assert transport.loads == [["ref-1", "ref-missing", "ref-2"]]
    assert [w.envelope.id for w in forwarded] == ["inline", "ref-1", "ref-2"]
    assert all(w.envelope.request.payload == b'{"loaded":true}' for w in forwarded[1:])
    [answered] = [op for op in ops if isinstance(op, Completion)]
    assert (answered.result.id, answered.result.error_code) == (
        "ref-missing",
        "PAYLOAD_UNAVAILABLE",
    )
    assert capacity.free == 8 - len(forwarded)


async def test_a_failed_payload_read_hands_the_batch_back_and_frees_its_slots() -> None:
    future = time.time() + 600
    transport = StoredApartTransport([message(i, future) for i in ("ref-a", "ref-b")], fail=True)
    capacity = PoolCapacity(8)
    forwarded, ops = await run_until_blocked(transport, capacity)
    assert forwarded == []
    assert sorted(op.delivery.envelope.id for op in ops if isinstance(op, Deferral)) == [
        "ref-a",
        "ref-b",
    ]
    assert capacity.free == 8


async def test_a_batch_behind_a_full_lane_waits_held_and_a_stop_hands_back_the_rest() -> None:
    # The lane takes one; the other two wait in line, held: the last is answered at its
    # deadline there (it waited unheld behind the first), the other handed back at the
    # stop, and neither twice.
    await anyio.sleep(1 - time.time() % 1)  # deadlines are whole seconds: a second away
    soon, far = int(time.time()) + 1, time.time() + 600
    transport = FakeTransport([message("m0", far), message("m1", far), message("m2", soon)])
    lane_in, lane_out = anyio.create_memory_object_stream[Work](1)
    writer_in, writer_out = anyio.create_memory_object_stream[Op](16)
    metrics = Metrics().queue("q", "q", "default")
    capacity = PoolCapacity(8)
    fake = cast(Transport, transport)
    poller = _poller(QUEUE, fake, ConstantGate(1.0), capacity, lane_in, writer_in, metrics)
    async with anyio.create_task_group() as tg:
        tg.start_soon(poller._line._held.run)
        tg.start_soon(poller.run)
        with anyio.fail_after(10):  # m2's answer at its deadline, however loaded the machine
            first = await writer_out.receive()
        tg.cancel_scope.cancel()
    async with lane_out, writer_out:
        lane, ops = _drain(lane_out), [first, *_drain(writer_out)]
    assert [w.envelope.id for w in lane] == ["m0"]
    assert [(type(op).__name__, op.delivery.envelope.id) for op in ops] == [  # type: ignore[union-attr]
        ("Completion", "m2"),
        ("Deferral", "m1"),
    ]
    assert capacity.free == 8 - 1  # m0's slot stays with it
    assert poller._waiting() == 1 and poller._in_flight == 1


class StuckGate:
    """Open by its budget, but ``apply`` waits until cancelled: a queue gate whose permits
    went elsewhere between the budget read and the message (a ``gate_group``'s other
    queue, the queue's other fetch loop), as ``local-max-concurrency`` in blocking mode."""

    waits_in_apply = True

    async def budget(self) -> float:
        return 1.0

    async def apply(self, message: Envelope, releases: object) -> object:
        await anyio.sleep_forever()
        raise AssertionError("unreachable")


async def _stuck_gate_ops(deadlines: dict[str, float], gate_wait: float) -> list[Op]:
    """A batch of ``deadlines`` against ``StuckGate``: the ops written, once the poller is
    back at its next fetch (it gave up every wait)."""
    transport = FakeTransport([message(i, d) for i, d in deadlines.items()])
    gate = cast(Gate, StuckGate())
    forwarded, ops = await run_until_blocked(transport, PoolCapacity(8), gate, gate_wait)
    assert not forwarded
    return ops


async def test_one_behind_a_queue_gate_that_waits_is_answered_at_its_deadline() -> None:
    # The first waits in the gate; the second, behind it, is due first: it is answered at
    # its deadline while the first waits on, until the gate-wait timeout hands it back.
    soon = time.time() + 1.2
    started = time.monotonic()
    ops = await _stuck_gate_ops({"later": soon + 600, "soon": soon}, gate_wait=2.5)
    assert time.monotonic() - started < 4
    assert [(type(op).__name__, op.delivery.envelope.id) for op in ops] == [  # type: ignore[union-attr]
        ("Completion", "soon"),
        ("Deferral", "later"),
    ]
    assert cast(Completion, ops[0]).result.error_code == ErrorCode.DEADLINE_EXCEEDED


async def test_a_queue_gate_that_waits_answers_its_message_at_its_deadline() -> None:
    ops = await _stuck_gate_ops({"a": time.time() + 1.2}, gate_wait=60)
    [answered] = ops
    assert isinstance(answered, Completion)
    assert answered.result.error_code == ErrorCode.DEADLINE_EXCEEDED


async def test_a_queue_gate_that_waits_hands_back_at_the_gate_wait_timeout() -> None:
    started = time.monotonic()
    ops = await _stuck_gate_ops({"a": time.time() + 600, "b": time.time() + 600}, gate_wait=0.2)
    assert time.monotonic() - started < 2
    assert [type(op).__name__ for op in ops] == ["Deferral", "Deferral"]
