"""Shutdown against a real redis-server: a stop ends the daemon in bounded time, losing nothing.

The soak (bench/soak.py) hung at exit about once in 40 cycles: at a stop every message a
worker takes is handed back to its queue at once, so the queue never empties and the
poller finds members at every claim. Its loop waited only inside the shielded claim (the
hot path skips the event loop wherever it can: issue 13), so the stop's cancellation never
reached it, and it claimed again what the workers had just handed back, forever.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable

import anyio
import pytest
import redis.asyncio as aioredis

from async_processor.pipeline import processor as processor_module
from async_processor.pipeline.daemon import HARD_STOP_EXIT
from async_processor.pipeline.processor import Processor
from tests.fixtures.inprocess import running, sortedset_config, submit
from tests.fixtures.servers import RedisServer
from tests.fixtures.simulator import SimulatorProcess

pytestmark = pytest.mark.anyio

BACKLOG = 2000  # far more than a stop hands back before the poller claims again
STOP_BOUND = 20.0  # seconds: drains of 1 s at most, claims and hand-backs of 5 s, and room


def _requests(count: int) -> list[dict[str, object]]:
    deadline = int(time.time() + 600)
    return [{"id": f"s{i}", "deadline": deadline, "payload": {}} for i in range(count)]


async def _stop(
    processor: Processor,
    ready: Callable[[], Awaitable[None]],
    unstick: Callable[[], Awaitable[None]],
) -> float:
    """Run, stop once ``ready`` returns; the seconds the stop took. Past ``STOP_BOUND``,
    ``unstick`` undoes what hangs it, so a hang fails the test instead of hanging it."""
    stopped = anyio.Event()

    async def run() -> None:
        await processor.run()
        stopped.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(run)
        while not processor.ready:
            await anyio.sleep(0.01)
        await ready()
        processor.request_stop()
        started = time.monotonic()
        with anyio.move_on_after(STOP_BOUND):
            await stopped.wait()
        took = time.monotonic() - started
        if not stopped.is_set():
            await unstick()
    return took


async def test_stop_ends_while_hand_backs_keep_the_queue_full(
    redis_url: str, unique: str, simulator: SimulatorProcess
) -> None:
    config = sortedset_config(redis_url, simulator.url, unique, concurrency=16, drain_timeout="1s")
    await submit(redis_url, unique, *_requests(BACKLOG))
    r = aioredis.Redis.from_url(redis_url)

    async def now() -> None:
        pass

    async def empty_the_queue() -> None:  # a claim that comes back empty waits, and is cut
        await r.delete(unique)

    took = await _stop(Processor(config), now, empty_the_queue)
    queued, claimed = await r.zcard(unique), await r.zcard(f"{unique}:claims-idx")
    results = await r.llen(f"{unique}:results")
    await r.aclose()
    assert took < STOP_BOUND, took
    assert queued + results == BACKLOG and claimed == 0, (queued, results, claimed)


async def test_stop_ends_in_bounded_time_when_redis_stops_answering_and_loses_nothing(
    private_redis: RedisServer,
    unique: str,
    simulator: SimulatorProcess,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Redis paused (SIGSTOP) at the stop: the hand-backs cannot land, the stop ends anyway
    (claims, hand-backs and the writer's flush are all bounded), and what was never handed
    back comes back with its lease: a second daemon answers every request."""
    monkeypatch.setattr(processor_module, "WRITER_FLUSH_TIMEOUT", 2.0)
    url, proc = private_redis.url, private_redis.proc
    assert proc is not None
    simulator.configure(hang_rate=1.0)  # every call in flight until the drain timeout cuts it
    lease = {"lease_seconds": 2}
    config = sortedset_config(
        url, simulator.url, unique, concurrency=8, drain_timeout="500ms", transport_extra=lease
    )
    client = await submit(url, unique, *_requests(40))

    async def pause_redis() -> None:
        while simulator.stats()["running"] < 8:
            await anyio.sleep(0.05)
        os.kill(proc.pid, signal.SIGSTOP)

    async def resume_redis() -> None:
        os.kill(proc.pid, signal.SIGCONT)

    try:
        took = await _stop(Processor(config), pause_redis, resume_redis)
    finally:
        await resume_redis()  # the stop's own end: Redis answers the next daemon
    assert took < STOP_BOUND, took
    simulator.configure(hang_rate=0.0)
    async with running(sortedset_config(url, simulator.url, unique, transport_extra=lease)):
        results = await client.drain_results(40, 30)
    assert sorted(r.id for r in results) == sorted(f"s{i}" for i in range(40))


def test_a_stop_that_hangs_anyway_exits_at_the_hard_stop_with_the_stacks() -> None:
    """The last resort (armed at the first signal): a process whose event loop is stuck
    still exits, with 124, and leaves every thread's stack for the bug report."""
    stuck = (
        "import time; from async_processor.pipeline.daemon import hard_stop_after; "
        "hard_stop_after(0.2); time.sleep(60)"
    )
    done = subprocess.run(
        [sys.executable, "-c", stuck], capture_output=True, timeout=30, check=False
    )
    assert done.returncode == HARD_STOP_EXIT
    assert b"hard_stop" in done.stdout
    assert b"in <module>" in done.stderr  # faulthandler's dump: where the main thread hung
