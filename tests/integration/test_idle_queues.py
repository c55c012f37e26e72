"""Idle queues on real Redis (redis-sortedset): a poller of an empty queue waits for the
idle probe to see a message, holding no pool slot, instead of cycling every poll
interval; its gate is read when the message comes; and the probing, sent by one waiter
for all, passes on when that waiter leaves."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import anyio
import pytest
from anyio.streams.memory import MemoryObjectReceiveStream
from redis.asyncio import Redis

from async_processor.gates.base import CONTINUE, REFUSE, Releases, Verdict
from async_processor.messages import Envelope
from async_processor.metrics import Metrics
from async_processor.pipeline.capacity import PoolCapacity
from async_processor.pipeline.held import HeldWork
from async_processor.pipeline.poller import Poller
from async_processor.pipeline.results import Op
from async_processor.pipeline.settle import Settler
from async_processor.transports.base import Delivery
from async_processor.transports.redis_sortedset.transport import SortedSetTransport
from async_processor.work import Work
from tests.integration.test_sortedset import future, member
from tests.integration.test_sortedset_rounds import config_for, ids_of_raw, names_of, opened

pytestmark = pytest.mark.anyio
SLOTS = 4


@pytest.fixture
async def r(redis_url: str) -> AsyncIterator[Redis]:
    client = Redis.from_url(redis_url)
    yield client
    await client.aclose()


@dataclass
class CountingGate:
    """A queue gate whose budget the test sets; refuses at 0 (as ``constant`` does)."""

    value: float = 1.0
    budget_reads: int = 0
    judged: list[str] = field(default_factory=list)

    async def budget(self) -> float:
        self.budget_reads += 1
        return self.value

    async def apply(self, message: Envelope, releases: Releases) -> Verdict:
        self.judged.append(message.id)
        return REFUSE if self.value <= 0 else CONTINUE


@dataclass
class Running:
    transport: SortedSetTransport
    gate: CountingGate
    capacity: PoolCapacity
    lane: MemoryObjectReceiveStream[Work]
    writer: MemoryObjectReceiveStream[Op]

    async def idle(self) -> None:
        """Until a claim has found the queue empty, and the poller has settled into its
        wait (a few probe steps)."""
        with anyio.fail_after(10):
            while not self.transport._fetcher._empty:
                await anyio.sleep(0.01)
        await anyio.sleep(0.3)


@asynccontextmanager
async def polling(url: str, name: str, poll_ms: int) -> AsyncIterator[Running]:
    """One real transport and one poller of queue ``name``, cancelled on exit."""
    config = config_for(url, "standalone", [name], poll_interval_ms=poll_ms)
    lane_in, lane_out = anyio.create_memory_object_stream[Work](SLOTS)
    writer_in, writer_out = anyio.create_memory_object_stream[Op](SLOTS)
    capacity, gate = PoolCapacity(SLOTS), CountingGate()
    async with opened(config) as transport, lane_out, writer_out:
        [queue] = transport.queues
        settler = Settler(transport=transport, writer=writer_in, capacity=capacity)
        poller = Poller(
            queue=queue,
            transport=transport,
            gate=gate,
            settler=settler,
            lane=lane_in,
            metrics=Metrics().queue(queue.id, queue.name, queue.pool),
            held=HeldWork(settler),
        )
        async with anyio.create_task_group() as tg:
            tg.start_soon(poller.run)
            yield Running(transport, gate, capacity, lane_out, writer_out)
            tg.cancel_scope.cancel()


async def test_an_idle_queue_waits_without_cycling_and_picks_up_its_next_message(
    redis_url: str, r: Redis, unique: str
) -> None:
    async with polling(redis_url, unique, poll_ms=50) as run:
        await run.idle()
        reads = run.gate.budget_reads
        await anyio.sleep(1.0)  # 20 poll intervals, 10 probe steps
        # No cycle while nothing came (one a poll interval before: 20 budget reads here),
        # and no slot held meanwhile (before: one, taken again each cycle), so the pool's
        # busy queues have it.
        assert run.gate.budget_reads == reads
        assert run.capacity.free == SLOTS
        deadline = future()
        await r.zadd(unique, {member("late", deadline): deadline})
        with anyio.fail_after(10):
            work = await run.lane.receive()
    assert work.envelope.id == "late"
    assert run.gate.budget_reads > reads  # read again once it came


async def test_a_gate_closed_while_its_queue_idles_keeps_the_next_message_queued(
    redis_url: str, r: Redis, unique: str
) -> None:
    """The budget read before a long wait is not the one obeyed when the message comes:
    with the gate closed by then, the message is not claimed (before: claimed on the
    stale budget, refused by the gate and handed back)."""
    async with polling(redis_url, unique, poll_ms=2000) as run:
        await run.idle()
        run.gate.value = 0.0
        deadline = future()
        await r.zadd(unique, {member("closed", deadline): deadline})
        await anyio.sleep(1.0)  # 10 probe steps, inside one poll interval
        assert await r.zcard(unique) == 1  # still queued, not claimed
        assert run.gate.judged == []
        assert run.capacity.free == SLOTS  # no slot taken with the gate closed
        run.gate.value = 1.0
        with anyio.fail_after(10):  # the next poll interval sees the gate open again
            work = await run.lane.receive()
    assert work.envelope.id == "closed"
    assert run.gate.judged == ["closed"]


async def test_the_probing_passes_on_when_its_lead_waiter_leaves(
    redis_url: str, r: Redis, unique: str
) -> None:
    """The first idle fetch sends the probes for all; once its queue wakes it, the next
    waiter takes over, so a queue that waited behind it still wakes for its message."""
    names = names_of(unique, 3)
    async with opened(config_for(redis_url, "standalone", names)) as transport:
        got: dict[str, list[Delivery]] = {}

        async def fetch(index: int) -> None:
            queue = transport.queues[index]
            assert await transport.fetch(queue, 1, 0) == []  # found empty: now idle
            got[queue.name] = await transport.fetch(queue, 1, 30.0)

        async with anyio.create_task_group() as tg:
            for index in range(3):
                tg.start_soon(fetch, index)
            with anyio.fail_after(10):
                while len(transport._fetcher._waiters) < 3:
                    await anyio.sleep(0.01)
            lead = transport._fetcher._lead
            assert lead is not None
            deadline = future()
            await r.zadd(lead.name, {member("first", deadline): deadline})
            with anyio.fail_after(10):
                while lead.name not in got:
                    await anyio.sleep(0.01)
            assert transport._fetcher._lead not in (None, lead)
            last = [n for n in names if n not in got][-1]
            await r.zadd(last, {member("second", deadline): deadline})
            with anyio.fail_after(10):
                while last not in got:
                    await anyio.sleep(0.01)
            tg.cancel_scope.cancel()
    assert [ids_of_raw(d) for d in got[lead.name]] == ["first"]
    assert [ids_of_raw(d) for d in got[last]] == ["second"]
    assert not transport._fetcher._waiters and transport._fetcher._lead is None
