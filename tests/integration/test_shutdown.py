"""Shutdown against a real redis-server: a stop ends the daemon however busy its queue is.

The soak (bench/soak.py) hung at exit about once in 40 cycles: at a stop every message a
worker takes is handed back to its queue at once, so the queue never empties and the
poller finds members at every claim. Its loop waited only inside the shielded claim (the
hot path skips the event loop wherever it can: issue 13), so the stop's cancellation never
reached it, and it claimed again what the workers had just handed back, forever.
"""

from __future__ import annotations

import time

import anyio
import pytest
import redis.asyncio as aioredis

from async_processor.processor import Processor
from tests.fixtures.inprocess import sortedset_config, submit
from tests.fixtures.simulator import SimulatorProcess

pytestmark = pytest.mark.anyio

BACKLOG = 2000  # far more than a stop hands back before the poller claims again
STOP_BOUND = 20.0  # seconds: a drain of 1 s, hand-backs of 5 s at most, with room to spare


async def test_stop_ends_while_hand_backs_keep_the_queue_full(
    redis_url: str, unique: str, simulator: SimulatorProcess
) -> None:
    config = sortedset_config(redis_url, simulator.url, unique, concurrency=16, drain_timeout="1s")
    deadline = int(time.time() + 600)
    await submit(
        redis_url,
        unique,
        *[{"id": f"s{i}", "deadline": deadline, "payload": {}} for i in range(BACKLOG)],
    )
    processor = Processor(config)
    stopped = anyio.Event()
    r = aioredis.Redis.from_url(redis_url)
    async with anyio.create_task_group() as tg:

        async def run() -> None:
            await processor.run()
            stopped.set()

        tg.start_soon(run)
        while not processor.ready:
            await anyio.sleep(0.01)
        processor.request_stop()
        started = time.monotonic()
        with anyio.move_on_after(STOP_BOUND):
            await stopped.wait()
        took = time.monotonic() - started
        if not stopped.is_set():
            # Hung: empty the queue so the poller's claim comes back empty, waits (where a
            # cancellation reaches it) and the test ends in a failure rather than a hang.
            await r.delete(unique)
    queued, claimed = await r.zcard(unique), await r.zcard(f"{unique}:inflight")
    await r.aclose()
    assert took < STOP_BOUND, took
    results = await aioredis.Redis.from_url(redis_url).llen(f"{unique}:results")
    assert queued + results == BACKLOG and claimed == 0, (queued, results, claimed)
