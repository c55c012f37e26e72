"""``client.results()`` is at-least-once: a result leaves the consumer's processing list
only when the next one is asked for (or on ``ack``), so a consumer killed while handling
one gets it again when it restarts under the same name (real redis-server)."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator

import anyio
import pytest
from redis.asyncio import Redis

from async_processor.client.redis_sortedset import SortedSetClient
from async_processor.messages import Result
from tests.fixtures.lossy_proxy import lossy_proxy
from tests.fixtures.servers import RedisServer

pytestmark = pytest.mark.anyio

# A consumer that takes one result, says which, and is killed while handling it.
_KILLED_WHILE_HANDLING = """
import sys
import anyio
from async_processor.client.redis_sortedset import SortedSetClient

async def main() -> None:
    url, results = sys.argv[1:]
    async with SortedSetClient(url, "unused", results, consumer="c1") as client:
        async for result in client.results(timeout=5):
            print(result.id, flush=True)
            await anyio.sleep(60)  # handling: SIGKILL lands here

anyio.run(main)
"""


@pytest.fixture
async def r(redis_url: str) -> AsyncIterator[Redis]:
    client = Redis.from_url(redis_url)
    yield client
    await client.aclose()


async def test_a_consumer_killed_while_handling_a_result_gets_it_again(
    redis_url: str, r: Redis, unique: str
) -> None:
    results = f"{unique}-results"
    await r.lpush(results, *(Result.http(f"r{i}", 200, b"{}").encode() for i in range(3)))
    with anyio.fail_after(30):
        async with await anyio.open_process(
            [sys.executable, "-c", _KILLED_WHILE_HANDLING, redis_url, results]
        ) as child:
            assert child.stdout is not None
            line = b""
            async for chunk in child.stdout:
                line += chunk
                if line.endswith(b"\n"):
                    break
            child.kill()  # SIGKILL
            await child.wait()
    assert line == b"r0\n"
    async with SortedSetClient(redis_url, "unused", results, consumer="c1") as client:
        got = [x.id async for x in client.results(timeout=0.3)]
    assert got == ["r0", "r1", "r2"]  # r0 again, then the rest
    assert await r.keys(f"*{unique}*processing*") == []


async def test_results_cost_two_round_trips_each_and_leave_nothing_once_acked(
    redis_server: RedisServer, r: Redis, unique: str
) -> None:
    results = f"{unique}-results"
    await r.lpush(results, *(Result.http(f"r{i}", 200, b"{}").encode() for i in range(20)))
    async with (
        lossy_proxy(redis_server.port) as proxy,
        SortedSetClient(proxy.url, "unused", results) as client,
    ):
        await client.result_depth()  # connected
        before = proxy.requests
        got = []
        async for result in client.results(timeout=5):
            got.append(result.id)
            if len(got) == 20:
                break
        round_trips = proxy.requests - before
        assert await r.llen(f"{{{results}}}:processing:{client.consumer}") == 1  # r19: held
        await client.ack()
    assert got == [f"r{i}" for i in range(20)]
    assert round_trips == 2 * 20  # a look then a move; a removal then a move
    assert await r.keys(f"*{unique}*processing*") == []
