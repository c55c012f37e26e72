"""The Go-shaped worker (tests/interop/go_worker.py) keeps upstream's claim protocol on a
real redis-server: the rolling-switch and conformance tests rely on it behaving as a Go
daemon does, so its own steps are pinned here (claim keys and values, fenced ack and
renew, reclaim at the queue score, release, kill -9 of a worker process).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
import redis

from tests.integration.test_upstream_wire import go_envelope
from tests.interop.go_worker import GoShapedWorker, claim_key, claim_keys, queue_score

TOKEN = "9f3c2a1b7d6e5f40"


@pytest.fixture
def client(redis_url: str) -> Iterator[redis.Redis]:
    c = redis.Redis.from_url(redis_url)
    yield c
    c.close()


def queued(client: redis.Redis, queue: str, count: int, deadline: int) -> list[bytes]:
    members = [go_envelope(f"m{i}", deadline, token=f"{TOKEN}{i:02d}") for i in range(count)]
    client.zadd(queue, {m: deadline + (i + 1) / 2097152 for i, m in enumerate(members)})
    return members


def results(client: redis.Redis, name: str) -> list[dict[str, object]]:
    return [json.loads(raw) for raw in client.lrange(name, 0, -1)]


def test_claim_layout_and_fenced_ack(client: redis.Redis, unique: str) -> None:
    queue, out = f"{unique}-q", f"{unique}-r"
    deadline = int(time.time()) + 600
    [member] = queued(client, queue, 1, deadline)
    worker = GoShapedWorker(client, queue, out, lease=30)
    [held] = worker.poll(10)
    claimed, owners, idx = claim_keys(queue)
    key = claim_key("m0", f"{TOKEN}00")
    assert claimed == f"{queue}:claimed" and owners == f"{queue}:claim-owners"
    assert idx == f"{queue}:claims-idx"
    assert client.hget(claimed, key) == member
    owner = client.hget(owners, key)
    assert owner is not None and len(owner) == 16 and int(owner, 16) >= 0
    expiry = client.zscore(idx, key)
    assert expiry is not None and time.time() + 25 < expiry <= time.time() + 31
    assert client.zcard(queue) == 0
    # A stale owner's ack pushes nothing and leaves the claim alone.
    assert not worker.ack(held, worker.result_of(held), owner="0123456789abcdef")
    assert client.llen(out) == 0 and client.hget(claimed, key) == member
    assert worker.ack(held, worker.result_of(held))
    [result] = results(client, out)
    assert result["id"] == "m0" and result["request_token"] == f"{TOKEN}00"
    assert not any(client.exists(k) for k in (claimed, owners, idx))


def test_expiry_is_capped_by_the_deadline(client: redis.Redis, unique: str) -> None:
    queue = f"{unique}-q"
    deadline = int(time.time()) + 10
    queued(client, queue, 1, deadline)
    GoShapedWorker(client, queue, f"{unique}-r", lease=3600).poll(1)
    [(_, expiry)] = client.zrange(claim_keys(queue)[2], 0, -1, withscores=True)
    assert expiry == deadline + 300


def test_late_ack_of_a_reclaimed_claim_is_fenced(client: redis.Redis, unique: str) -> None:
    """A paused Go pod's lease lapses; another reclaims and answers; the first one's ack is
    refused (one result) and its heartbeat learns it lost the claim."""
    queue, out = f"{unique}-q", f"{unique}-r"
    [member] = queued(client, queue, 1, int(time.time()) + 600)
    slow = GoShapedWorker(client, queue, out, lease=1)
    [held] = slow.poll(1)
    other = GoShapedWorker(client, queue, out, lease=30)
    deadline = time.monotonic() + 10
    while not other.reclaim():
        assert time.monotonic() < deadline, "the lapsed claim was never reclaimed"
        time.sleep(0.2)
    assert client.zscore(queue, member) == queue_score(json.loads(member))
    [taken] = other.poll(1)
    assert slow.heartbeat() == 1 and held.key not in slow.held  # owned by another: -1
    assert not slow.ack(held, slow.result_of(held))
    assert other.ack(taken, other.result_of(taken))
    [result] = results(client, out)
    assert result["payload"] == json.dumps({"answered_by": f"go:{other.owner}"})
    assert slow.fenced == 1


def test_release_puts_the_member_back_at_its_score(client: redis.Redis, unique: str) -> None:
    queue = f"{unique}-q"
    members = queued(client, queue, 3, int(time.time()) + 600)
    worker = GoShapedWorker(client, queue, f"{unique}-r")
    assert len(worker.poll(3)) == 3 and client.zcard(queue) == 0
    assert worker.release_all() == 3
    assert client.zrange(queue, 0, -1) == members
    assert not client.exists(*claim_keys(queue))


def test_kill_9_leaves_claims_that_another_worker_reclaims(
    client: redis.Redis, redis_url: str, unique: str
) -> None:
    queue, out = f"{unique}-q", f"{unique}-r"
    queued(client, queue, 20, int(time.time()) + 600)
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.interop.go_worker", "--url", redis_url, "--queue", queue,
         "--results", out, "--batch", "20", "--lease", "2", "--work", "60"],
        stdout=subprocess.PIPE,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while client.hlen(claim_keys(queue)[0]) < 20:
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.05)
    finally:
        proc.kill()
        proc.wait()
    survivor = GoShapedWorker(client, queue, out, lease=30)
    deadline = time.monotonic() + 20
    while client.llen(out) < 20:
        assert time.monotonic() < deadline, "the dead worker's claims were not answered"
        survivor.reclaim()
        survivor.step(20)
        time.sleep(0.1)
    ids = sorted(str(r["id"]) for r in results(client, out))
    assert ids == sorted(f"m{i}" for i in range(20))
    assert not client.exists(*claim_keys(queue))
