"""Upstream's wire on a Redis Cluster (upstream-v0.10.md §6 with §2, §4, §5): a Go producer
in cluster mode (markers and payload key by single-key commands, counter
``request-seq:{Q}:<deadline>`` and ``ZADD`` in one script on the queue's slot), our client
library in cluster mode, a Go result reader, the daemon with ``mode: cluster``, on a real
3-primary cluster."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import pytest
from redis.asyncio import RedisCluster

from async_processor.client.redis_sortedset import SortedSetClient
from async_processor.config import SortedSetConfig
from async_processor.config.redis import RedisConnection, slot
from async_processor.messages import Result
from async_processor.transports.base import Completion
from tests.conformance.go_side import GoProducer, GoRequest, GoResultReader, go_score
from tests.conformance.support import GoSide, deadline_in, upstream
from tests.fixtures.inprocess import running, sortedset_config
from tests.fixtures.redis_modes import RedisClusterNodes
from tests.fixtures.simulator import LocalSimulator
from tests.integration.test_sortedset import opened

pytestmark = pytest.mark.anyio
PAYLOAD = b'{"model": "sim-model",  "prompt": "<hi>", "n": 1.10}'


@pytest.fixture
async def rc(redis_cluster: RedisClusterNodes) -> AsyncIterator[RedisCluster]:
    client = RedisCluster.from_url(redis_cluster.url)
    yield client
    await client.aclose()


@pytest.fixture
async def go_cluster(rc: RedisCluster, unique: str) -> GoSide:
    """The queue carries a hash tag, so its result list ``<queue>:results`` shares its slot
    (our daemon writes a result and its ack in one script)."""
    queue = f"{{{unique}}}q"
    results = f"{queue}:results"
    producer = GoProducer(rc, queue, results, payload_keys=True, cluster=True)  # type: ignore[arg-type]
    reader = GoResultReader(rc, results, cluster=True)  # type: ignore[arg-type]
    return GoSide(queue, results, producer, reader)


def cluster_config(url: str, sim: LocalSimulator, queue: str):  # type: ignore[no-untyped-def]
    return sortedset_config(url, sim.url, queue, transport_extra={"mode": "cluster"})


@upstream("§6", "§4", "§5", "§2")
async def test_a_go_producer_on_a_cluster_is_answered_with_its_stored_payload(
    redis_cluster: RedisClusterNodes, rc: RedisCluster, go_cluster: GoSide,
    local_simulator: LocalSimulator,
) -> None:  # fmt: skip
    deadline = deadline_in(300)
    sent = [await go_cluster.producer.submit(GoRequest(f"c{n}", deadline, PAYLOAD)) for n in (1, 2)]
    members = await rc.zrange(go_cluster.queue, 0, -1, withscores=True)
    assert [s for _, s in members] == [go_score(deadline, 1), go_score(deadline, 2)]
    assert await rc.exists(f"request-seq:{go_cluster.queue}:{deadline}")  # its own tag kept
    assert slot(f"request-payload:c1:{sent[0].token}") != slot(go_cluster.queue)
    async with running(cluster_config(redis_cluster.url, local_simulator, go_cluster.queue)):
        results = await go_cluster.reader.receive_all(2)
    assert [r["body"].encode() for r in local_simulator.requests()] == [PAYLOAD, PAYLOAD]
    for n, submitted in zip((1, 2), sent, strict=True):
        assert results[f"c{n}"]["request_token"] == submitted.token
        assert not await rc.exists(f"request-payload:c{n}:{submitted.token}")


@upstream("§6", "§1.4")
async def test_a_go_cancel_on_a_cluster_is_honoured(
    redis_cluster: RedisClusterNodes, rc: RedisCluster, go_cluster: GoSide,
    local_simulator: LocalSimulator,
) -> None:  # fmt: skip
    """Upstream's cluster-mode markers keep their standalone names (``request-cancel:<id>``,
    no hash tag); the daemon reads them beside its own ``{Q}:request-cancel:<id>``."""
    submitted = await go_cluster.producer.submit(GoRequest("stop", deadline_in(300), PAYLOAD))
    await go_cluster.producer.cancel("stop")
    assert await rc.get("request-cancel:stop") == submitted.token.encode()
    async with running(cluster_config(redis_cluster.url, local_simulator, go_cluster.queue)):
        result = (await go_cluster.reader.receive_all(1))["stop"]
    assert result["error_code"] == "CANCELLED"
    assert result["request_token"] == submitted.token
    assert local_simulator.requests() == []


@upstream("§6", "§4")
async def test_our_client_on_a_cluster_writes_upstreams_markers_and_payload_keys(
    redis_cluster: RedisClusterNodes, rc: RedisCluster, go_cluster: GoSide,
    local_simulator: LocalSimulator,
) -> None:  # fmt: skip
    """Payload keys per slot (the key in its own slot, written before the envelope), and
    ``request-active:<id>`` under upstream's name, so a Go producer's ``CancelRequests``
    finds our submissions; our ``cancel`` writes upstream's cancel marker too."""
    conn = RedisConnection(url=redis_cluster.url, mode="cluster")
    deadline = deadline_in(300)
    async with SortedSetClient(
        conn, go_cluster.queue, go_cluster.results, payload_keys=True
    ) as ours:
        tokens = [
            await ours.submit({"id": f"p{n}", "deadline": deadline, "payload": json.loads(PAYLOAD)})
            for n in range(3)
        ]
        for n, token in enumerate(tokens):
            [member] = await rc.zrangebyscore(go_cluster.queue, *[go_score(deadline, n + 1)] * 2)
            routing = json.loads(member)["internal"]
            assert routing["payload_ref"] == f"request-payload:p{n}:{token}"
            assert await rc.get(routing["payload_ref"]) is not None
            assert await rc.get(f"request-active:p{n}") == token.encode()
        await go_cluster.producer.cancel("p0")  # a Go producer cancels ours
        assert await ours.cancel(["p1"]) == 1
        assert await rc.get("request-cancel:p1") == tokens[1].encode()
    async with running(cluster_config(redis_cluster.url, local_simulator, go_cluster.queue)):
        results = await go_cluster.reader.receive_all(3)
    assert [results[f"p{n}"].get("error_code") for n in range(3)] == ["CANCELLED", "CANCELLED", ""]
    assert results["p2"]["status_code"] == 200
    assert len(local_simulator.requests()) == 1
    for n, token in enumerate(tokens):
        assert not await rc.exists(f"request-payload:p{n}:{token}")


@upstream("§6", "§1.4")
async def test_go_cancels_on_two_queues_in_two_slots_are_both_honoured(
    redis_cluster: RedisClusterNodes, rc: RedisCluster, unique: str,
    local_simulator: LocalSimulator,
) -> None:  # fmt: skip
    """Markers of several queues are read in one pipeline (an MGET per queue's slot, a
    GET per upstream marker): a cluster pipeline refuses ``mget()``, which failed every
    cancel check of a daemon serving more than one queue."""
    sides = []
    for name in ("a", "b"):
        queue = f"{{{unique}{name}}}q"
        producer = GoProducer(rc, queue, f"{queue}:results", cluster=True)  # type: ignore[arg-type]
        reader = GoResultReader(rc, f"{queue}:results", cluster=True)  # type: ignore[arg-type]
        sides.append(GoSide(queue, f"{queue}:results", producer, reader))
    assert slot(sides[0].queue) != slot(sides[1].queue)
    for side in sides:
        await side.producer.submit(GoRequest(f"{side.queue}-stop", deadline_in(300), PAYLOAD))
        await side.producer.submit(GoRequest(f"{side.queue}-go", deadline_in(300), PAYLOAD))
        await side.producer.cancel(f"{side.queue}-stop")
    queues = [
        {"queue_name": s.queue, "igw_base_url": local_simulator.url, "result_queue_name": s.results}
        for s in sides
    ]
    config = sortedset_config(
        redis_cluster.url, local_simulator.url, sides[0].queue,
        transport_extra={"mode": "cluster", "queues": queues},
    )  # fmt: skip
    async with running(config):
        for side in sides:
            results = await side.reader.receive_all(2)
            assert results[f"{side.queue}-stop"]["error_code"] == "CANCELLED"
            assert results[f"{side.queue}-go"]["status_code"] == 200
    assert len(local_simulator.requests()) == 2


@upstream("§6", "§4")
async def test_a_late_answer_on_a_cluster_leaves_the_reclaimed_requests_payload_key(
    redis_cluster: RedisClusterNodes, rc: RedisCluster, go_cluster: GoSide
) -> None:
    """Our result for a claim another owner took since is refused (fenced ack), and the
    payload key stays: that owner reads the request's body from it."""
    sent = await go_cluster.producer.submit(GoRequest("late", deadline_in(300), PAYLOAD))
    config = SortedSetConfig.model_validate(
        {
            "url": redis_cluster.url,
            "mode": "cluster",
            "result_queue_name": go_cluster.results,
            "queues": [{"queue_name": go_cluster.queue, "igw_base_url": "http://gw.test:8000"}],
        }
    )
    async with opened(config) as transport:
        [held] = await transport.fetch(transport.queues[0], 1, 0)
        # Its lease lapsed, and another owner reclaimed and claimed it.
        await rc.hset(f"{go_cluster.queue}:claim-owners", held.handle.id, "0" * 16)
        await transport.complete([Completion(held, Result.http("late", 200, b"{}"))])
    assert await rc.llen(go_cluster.results) == 0
    assert await rc.exists(f"request-payload:late:{sent.token}")
