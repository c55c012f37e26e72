"""A message-named result list on a Redis Cluster: every key its result write touches must
be in the queue's slot, not only the list (real 3-primary cluster)."""

from __future__ import annotations

import itertools

import pytest
from redis.asyncio import RedisCluster

from async_processor.config import SortedSetConfig
from async_processor.config.redis import hash_tag, slot
from async_processor.messages import Result
from async_processor.metrics import Metrics
from async_processor.redis import keys as redis_keys
from async_processor.transports.base import Completion, TransportContext
from tests.fixtures.redis_cluster import RedisClusterNodes
from tests.integration.test_sortedset import GW, fetch_one, future, member, rejected
from tests.integration.test_sortedset_rounds import opened

pytestmark = pytest.mark.anyio


def braced_in_slot(target: int) -> str:
    """A name with a ``{`` but no hash tag (so Redis hashes all of it) in slot ``target``:
    the counter key beside it, ``<name>:pushed``, hashes differently."""
    for n in itertools.count():
        name = f"x{{{n}"
        if slot(name) == target:
            assert hash_tag(name) == name
            return name
    raise AssertionError("unreachable")


async def test_a_routed_list_whose_side_keys_leave_the_slot_is_refused(
    redis_cluster: RedisClusterNodes, unique: str
) -> None:
    queue = f"{unique}-q"
    hostile = braced_in_slot(slot(queue))
    assert slot(redis_keys.result_side_key(hostile, "pushed")) != slot(queue)
    config = SortedSetConfig.model_validate(
        {"url": redis_cluster.url, "mode": "cluster", "lease_seconds": 30,
         "result_queue_name": f"{{{queue}}}:r",
         "queues": [{"queue_name": queue, "igw_base_url": GW}]}
    )  # fmt: skip
    r = RedisCluster.from_url(redis_cluster.url)
    metrics = Metrics()
    try:
        deadline = future()
        await r.zadd(queue, {member(f"{unique}-m", deadline, result_queue=hostile): deadline})
        async with opened(config, TransportContext(metrics=metrics)) as transport:
            delivery = await fetch_one(transport)
            await transport.complete([Completion(delivery, Result.http(f"{unique}-m", 200, b"{}"))])
        # Answered once, in the configured list; nothing left claimed or queued.
        raws = await r.lrange(config.result_queue_name, 0, -1)
        assert [Result.decode(raw).id for raw in raws] == [f"{unique}-m"]
        assert not await r.exists(hostile)
        assert await r.zcard(queue) == 0
        assert await r.zcard(transport._keys.inflight(queue)) == 0
        assert rejected(metrics, queue, "cross_slot") == 1
    finally:
        await r.aclose()
