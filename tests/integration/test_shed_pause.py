"""--shed-pause: after a 429 the pool sends nothing new for Retry-After, so a saturated
gateway sees a few 429s per pause instead of every free worker firing again at once."""

from __future__ import annotations

import anyio
import pytest

from tests.fixtures.inprocess import running, sortedset_config, submit
from tests.fixtures.simulator import SimulatorProcess
from tests.integration.test_pipeline import _req

pytestmark = pytest.mark.anyio
WORKERS = 16
RUN_SECONDS = 1.5
RETRY_AFTER = 0.5


async def statuses(redis_url: str, queue: str, sim: SimulatorProcess, pause: str) -> dict[str, int]:
    """The simulator's answers while 16 workers drain a deep queue for RUN_SECONDS."""
    config = sortedset_config(redis_url, sim.url, queue, concurrency=WORKERS, shed_pause=pause)
    sim.reset()
    async with running(config):
        await submit(redis_url, queue, *[_req(f"{queue}-{i}", ttl=120) for i in range(300)])
        await anyio.sleep(RUN_SECONDS)
        by_status: dict[str, int] = sim.stats()["by_status"]
    return by_status


async def test_a_pool_pauses_after_a_429_instead_of_hammering(
    redis_url: str, unique: str, simulator: SimulatorProcess
) -> None:
    simulator.configure(latency=0.3, max_concurrent=2, max_waiting=0, retry_after=RETRY_AFTER)
    paused = await statuses(redis_url, f"{unique}p", simulator, "2s")
    hammering = await statuses(redis_url, f"{unique}h", simulator, "0s")
    # One burst of at most WORKERS 429s per Retry-After (not the 2 s cap), plus the first.
    bursts = RUN_SECONDS / RETRY_AFTER + 1
    assert paused.get("429", 0) <= bursts * WORKERS, paused
    assert paused.get("429", 0) * 5 < hammering.get("429", 0), (paused, hammering)
    assert paused.get("200", 0) >= 2  # the slots that were free still got work
