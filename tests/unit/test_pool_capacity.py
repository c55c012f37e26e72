"""Pool slots: first come, first served, and a cancelled waiter never strands a slot."""

from __future__ import annotations

import anyio
import pytest
from anyio import wait_all_tasks_blocked
from anyio.lowlevel import checkpoint

from async_processor.config import PoolConfig
from async_processor.pipeline.capacity import MAX_PREFETCH, PoolCapacity
from async_processor.pipeline.processor import Processor
from tests.fixtures.inprocess import sortedset_config

pytestmark = pytest.mark.anyio


async def test_a_releasing_poller_cannot_jump_the_queue() -> None:
    capacity = PoolCapacity(2)
    assert await capacity.reserve(2) == 2
    order: list[tuple[str, int]] = []

    async def waiting_poller() -> None:
        taken = await capacity.reserve(2)
        order.append(("waiting", taken))
        capacity.release(taken)

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(waiting_poller)
            await wait_all_tasks_blocked()
            # An empty queue's poller gives its slots back and asks again at once.
            capacity.release(2)
            order.append(("releasing", await capacity.reserve(2)))
    # First in turn, and it leaves a slot for the poller waiting behind it.
    assert order == [("waiting", 1), ("releasing", 2)]


async def test_a_waiter_cancelled_as_it_is_woken_strands_no_slot() -> None:
    """Cancelled while being woken, a waiter either passes its turn on or (if the wake-up
    won the race) takes the slot and gives it back as a poller does: the next one gets it."""
    capacity = PoolCapacity(1)
    assert await capacity.reserve(1) == 1
    got: list[int] = []
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            first = anyio.CancelScope()

            async def cancelled_waiter() -> None:
                with first:
                    taken = await capacity.reserve(1)
                    capacity.release(taken)  # what the poller does when cancelled after reserve

            async def next_waiter() -> None:
                got.append(await capacity.reserve(1))

            tg.start_soon(cancelled_waiter)
            await wait_all_tasks_blocked()
            tg.start_soon(next_waiter)
            await wait_all_tasks_blocked()
            capacity.release(1)  # wakes the first waiter ...
            first.cancel()  # ... which is cancelled as it wakes
            await checkpoint()
    assert got == [1]
    assert capacity.free == 0


async def test_takes_at_most_what_is_free() -> None:
    capacity = PoolCapacity(3)
    assert await capacity.reserve(10) == 3
    capacity.release(1)
    assert await capacity.reserve(10) == 1


@pytest.mark.parametrize(
    ("workers", "slots"), [(1, 2), (8, 10), (1024, 1280), (10_000, 10_000 + MAX_PREFETCH)]
)
def test_a_pools_prefetch_is_a_quarter_of_its_workers_but_bounded(workers: int, slots: int) -> None:
    # Every prefetched message is held in memory and leased from the other replicas: at
    # 10,000 workers a quarter (2,500) cost ~25 MB and hid nothing a few hundred do not.
    config = sortedset_config(
        "redis://127.0.0.1:1",
        "http://127.0.0.1:1",
        "q",
        pools=[PoolConfig(id="p", workers=workers)],
    )
    [pool] = Processor(config).pools
    assert pool.capacity.slots == slots


async def test_a_queue_the_merge_just_served_refills_first() -> None:
    """Waiters are ordered by their messages not yet taken by the merge, read when a slot
    frees: a queue served while it waited goes ahead of earlier ones that still hold one."""
    capacity = PoolCapacity(1)
    assert await capacity.reserve(1) == 1
    waiting = {"early": 1, "served": 1}
    order: list[str] = []

    async def poller(name: str) -> None:
        await capacity.reserve(1, lambda: waiting[name])
        order.append(name)
        capacity.release(1)

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(poller, "early")
            await wait_all_tasks_blocked()
            tg.start_soon(poller, "served")
            await wait_all_tasks_blocked()
            waiting["served"] = 0  # the merge took its only message
            capacity.release(1)
    assert order == ["served", "early"]


async def test_a_batch_leaves_a_slot_for_each_poller_still_waiting() -> None:
    """200 queues fetching batches of 10 left most of them with nothing to offer the merge."""
    capacity = PoolCapacity(3)
    assert await capacity.reserve(3) == 3
    got: list[int] = []

    async def poller() -> None:
        got.append(await capacity.reserve(10))

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            for _ in range(3):
                tg.start_soon(poller)
            await wait_all_tasks_blocked()
            capacity.release(3)
    assert got == [1, 1, 1]


async def test_a_slot_taken_away_between_a_wake_up_and_its_waiter_is_not_taken() -> None:
    """A queue removed (resize -1) after a waiter was woken for a freed slot but before it
    resumed: the waiter waits again instead of taking a slot that no longer exists."""
    capacity = PoolCapacity(2)
    assert await capacity.reserve(2) == 2
    got: list[int] = []

    async def waiter() -> None:
        got.append(await capacity.reserve(1))

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(waiter)
            await wait_all_tasks_blocked()
            capacity.release(1)  # wakes the waiter for the freed slot...
            capacity.resize(-1)  # ...which goes before it resumes
            await wait_all_tasks_blocked()
            assert (capacity.free, got) == (0, [])  # never -1
            capacity.release(1)
    assert got == [1] and capacity.free == 0
