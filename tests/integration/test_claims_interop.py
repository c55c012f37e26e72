"""Our redis-sortedset transport and a Go daemon (v0.9.1+) on one queue: upstream's claim
layout (#412; shared/reference/upstream-v0.10.md §1, §14 row 1), on a real redis-server.

The Go side is tests/interop/go_worker.py, which follows upstream's claim, renew, fenced
ack, reclaim and release steps. Covered: our claims are upstream's keys and values; claims
left by a crashed Go pod are reclaimed by ours and answered once; a Go pod's late ack of a
claim we took over is refused; ours, left by a crashed daemon, are reclaimed by a Go pod and
our late answer is refused; the previous release's claims are migrated at start-up.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import anyio
import pytest
import redis
from structlog.testing import capture_logs

from async_processor.config import SortedSetConfig
from async_processor.messages import Result
from async_processor.metrics import Metrics
from async_processor.redis import keys as redis_keys
from async_processor.transports.base import Completion, TransportContext
from async_processor.transports.redis_sortedset.transport import SortedSetTransport
from tests.integration import test_sortedset as sortedset
from tests.integration.test_sortedset import opened, results_of
from tests.integration.test_upstream_wire import go_envelope
from tests.interop.go_worker import GoShapedWorker, claim_key, claim_keys, queue_score

pytestmark = pytest.mark.anyio
GW = "http://gw.test:8000"
TOKEN = "9f3c2a1b7d6e5f40"
r = sortedset.r  # the transport tests' client of this test's Redis


@pytest.fixture
def sync(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


def config_for(redis_url: str, unique: str, lease: float = 5) -> SortedSetConfig:
    return SortedSetConfig.model_validate(
        {
            "url": redis_url,
            "retry_queue_name": f"{unique}-retry",
            "result_queue_name": f"{unique}-results",
            "lease_seconds": lease,
            "queues": [{"queue_name": f"{unique}-q", "igw_base_url": GW}],
        }
    )


def go_queued(sync: redis.Redis, queue: str, count: int, deadline: int) -> list[bytes]:
    """``count`` envelopes as a Go producer queues them (token, ``enqueue_seq`` score), ids
    ``<queue>/m<i>`` (the dedup markers are server-wide)."""
    members = [
        go_envelope(f"{queue}/m{i}", deadline, token=f"{TOKEN}{i:02d}") for i in range(count)
    ]
    sync.zadd(queue, {m: deadline + (i + 1) / 2097152 for i, m in enumerate(members)})
    return members


def answered(transport: SortedSetTransport, deliveries: list) -> list[Completion]:
    return [
        Completion(d, Result.http(transport.decode(d).id, 200, b'{"by":"ours"}'))
        for d in deliveries
    ]


async def wait_until_past(sync: redis.Redis, idx: str, slack: float = 0.05) -> None:
    """Until every lease in ``idx`` has run out (Unix seconds), and ``slack`` more."""
    latest = max(score for _, score in sync.zrange(idx, 0, -1, withscores=True))
    await anyio.sleep(max(0.0, latest - time.time()) + slack)


async def test_our_claims_are_upstreams_keys_and_values(redis_url, r, sync, unique) -> None:
    config = config_for(redis_url, unique, lease=30)
    q = f"{unique}-q"
    deadline = int(time.time()) + 600
    [member] = go_queued(sync, q, 1, deadline)
    async with opened(config) as transport:
        [delivery] = await transport.fetch(transport.queues[0], 5, 0)
        claimed, owners, idx = claim_keys(q)
        key = claim_key(f"{q}/m0", f"{TOKEN}00")
        assert delivery.handle.id == key
        assert sync.hgetall(claimed) == {key.encode(): member}
        owner = sync.hget(owners, key)
        assert owner is not None and len(owner) == 16 and int(owner, 16) >= 0
        expiry = sync.zscore(idx, key)
        assert expiry is not None and time.time() + 28 < expiry <= time.time() + 30.5
        await transport.complete(answered(transport, [delivery]))
    [result] = await results_of(r, f"{unique}-results")
    assert result.request_token == f"{TOKEN}00"
    assert not sync.exists(claimed, owners, idx)


async def test_claims_left_by_a_crashed_go_pod_are_reclaimed_by_ours(
    redis_url, r, sync, unique
) -> None:
    q = f"{unique}-q"
    members = go_queued(sync, q, 5, int(time.time()) + 600)
    crashed = GoShapedWorker(sync, q, f"{unique}-results", lease=1)
    assert len(crashed.poll(5)) == 5  # then it dies: no ack, no release
    await wait_until_past(sync, claim_keys(q)[2])
    async with opened(config_for(redis_url, unique)) as transport:
        await transport.reap()
        back = sync.zrange(q, 0, -1, withscores=True)
        assert back == [(m, queue_score(json.loads(m))) for m in members]  # §5 scores kept
        deliveries = await transport.fetch(transport.queues[0], 10, 0)
        await transport.complete(answered(transport, deliveries))
    results = await results_of(r, f"{unique}-results")
    assert sorted(x.id for x in results) == [f"{q}/m{i}" for i in range(5)]
    assert all(x.payload == '{"by":"ours"}' for x in results)
    assert not sync.exists(*claim_keys(q))


async def test_a_go_pods_late_ack_is_refused(redis_url, r, sync, unique) -> None:
    q = f"{unique}-q"
    go_queued(sync, q, 1, int(time.time()) + 600)
    paused = GoShapedWorker(sync, q, f"{unique}-results", lease=1)
    [held] = paused.poll(1)
    await wait_until_past(sync, claim_keys(q)[2])
    async with opened(config_for(redis_url, unique)) as transport:
        await transport.reap()
        [ours] = await transport.fetch(transport.queues[0], 1, 0)
        assert ours.handle.id == held.key  # the same claim key, now ours
        assert paused.heartbeat() == 1  # its renew tells it the claim is lost (-1)
        assert not paused.ack(held, paused.result_of(held))  # fenced: nothing pushed
        await transport.complete(answered(transport, [ours]))
    [result] = await results_of(r, f"{unique}-results")
    assert result.payload == '{"by":"ours"}'


async def test_ours_left_by_a_crashed_daemon_are_reclaimed_by_go_and_our_late_answer_is_refused(
    redis_url, r, sync, unique
) -> None:
    q = f"{unique}-q"
    go_queued(sync, q, 3, int(time.time()) + 600)
    async with opened(config_for(redis_url, unique, lease=1)) as stalled:
        deliveries = await stalled.fetch(stalled.queues[0], 3, 0)  # no heartbeat runs
        # Upstream's reclaimer compares with whole seconds of its clock: up to 1 s later.
        await wait_until_past(sync, claim_keys(q)[2], slack=1.05)
        go = GoShapedWorker(sync, q, f"{unique}-results", lease=30)
        assert go.reclaim() == 3
        assert go.step(10) == 3
        with capture_logs() as logs:
            await stalled.complete(answered(stalled, deliveries))
    assert [e["count"] for e in logs if e["event"] == "lease_expired_before_complete"] == [3]
    results = await results_of(r, f"{unique}-results")
    assert sorted(x.id for x in results) == [f"{q}/m{i}" for i in range(3)]
    assert {x.payload for x in results} == {json.dumps({"answered_by": f"go:{go.owner}"})}


async def test_the_previous_releases_claims_are_migrated_at_start_up(
    redis_url, r, sync, unique
) -> None:
    """Claims the current release left in ``Q:inflight`` / ``Q:inflight:meta``: expired
    ones go back to ``Q`` at start-up (logged, counted, once), live ones stay with the
    pod of that release still holding them until their lease runs out."""
    q = f"{unique}-q"
    deadline = int(time.time()) + 600
    expired, live = go_envelope("old", deadline), go_envelope("busy", deadline)
    now = time.time()
    sync.zadd(redis_keys.inflight_key(q), {"p:1": now - 5, "p:2": now + 60})
    sync.hset(
        redis_keys.inflight_meta_key(q),
        mapping={"p:1": f"{deadline}|".encode() + expired, "p:2": f"{deadline}|".encode() + live},
    )
    metrics = Metrics()
    transport = SortedSetTransport(config_for(redis_url, unique), TransportContext(metrics=metrics))
    try:
        with capture_logs() as logs:
            await transport.migrate_legacy()
            await transport.migrate_legacy()  # idempotent: nothing moves twice
        assert sync.zrange(q, 0, -1, withscores=True) == [(expired, float(deadline))]
        assert sync.zrange(redis_keys.inflight_key(q), 0, -1) == [b"p:2"]
        migrated = [e["count"] for e in logs if e["event"] == "legacy_claims_migrated"]
        assert migrated == [1, 0]
        labels = {"queue_name": q}
        name = "llm_d_async_async_legacy_claims_returned_total"
        assert metrics.registry.get_sample_value(name, labels) == 1
    finally:
        await transport.aclose()
