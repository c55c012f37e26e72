"""The daemon as a process against a real redis-server and the simulator over real HTTP.

Covers: volume, kill -9 twice, Redis restart with AOF, SIGTERM with
in-flight work, poison messages, deadline order at concurrency 1, three replicas.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import redis

from async_processor.messages import Result
from tests.fixtures.daemon import DaemonFactory, sortedset_config
from tests.fixtures.servers import RedisServer
from tests.fixtures.simulator import SimulatorProcess

pytestmark = [pytest.mark.slow]


def _envelope(request_id: str, deadline: int, queue: str, result_list: str, **data: Any) -> bytes:
    body = {"id": request_id, "deadline": deadline, "payload": {"prompt": request_id}, **data}
    routing = {"request_queue_name": queue, "result_queue_name": result_list}
    return json.dumps({"internal": routing, "request_kind": "redis", "data": body}).encode()


def _submit(r: redis.Redis, queue: str, result_list: str, ids: list[str], deadline: int) -> None:
    pipe = r.pipeline(transaction=False)
    for request_id in ids:
        pipe.zadd(queue, {_envelope(request_id, deadline, queue, result_list): deadline})
    pipe.execute()


def _collect(r: redis.Redis, result_list: str, expected: int, timeout: float) -> list[Result]:
    results: list[Result] = []
    end = time.monotonic() + timeout
    while len(results) < expected and time.monotonic() < end:
        batch = r.rpop(result_list, 500)
        if batch:
            results += [Result.decode(raw) for raw in batch]
        else:
            time.sleep(0.05)
    return results


def _wait_results(r: redis.Redis, result_list: str, at_least: int, timeout: float) -> None:
    end = time.monotonic() + timeout
    while r.llen(result_list) < at_least and time.monotonic() < end:
        time.sleep(0.02)


def _seed(url: str, unique: str, prefix: str, n: int) -> tuple[redis.Redis, str, str, list[str]]:
    """A client, this test's queue and result list, and ``n`` requests due in 10 minutes."""
    r = _sync(url)
    queue, results = f"{unique}:q", f"{unique}:results"
    ids = [f"{prefix}{i}" for i in range(n)]
    _submit(r, queue, results, ids, int(time.time()) + 600)
    return r, queue, results, ids


def _sync(url: str) -> redis.Redis:
    return redis.Redis.from_url(url)


def test_thousand_messages_thousand_results(
    redis_url: str, unique: str, simulator: SimulatorProcess, daemon_factory: DaemonFactory
) -> None:
    simulator.configure(latency=0.01)
    r, queue, results, ids = _seed(redis_url, unique, "m", 1000)
    daemon = daemon_factory.start(
        sortedset_config(redis_url, simulator.url, [queue], result_list=results),
        "--concurrency",
        "64",
    )
    got = _collect(r, results, 1000, 60)
    assert sorted(x.id for x in got) == sorted(ids)
    assert {x.status_code for x in got} == {200}
    assert daemon.metric("llm_d_async_async_successful_requests_total", queue_name=queue) == 1000
    assert r.zcard(queue) == 0


def test_kill9_twice_then_restart_every_id_exactly_one_result(
    redis_url: str, unique: str, simulator: SimulatorProcess, daemon_factory: DaemonFactory
) -> None:
    simulator.configure(latency=0.05)
    r, queue, results, ids = _seed(redis_url, unique, "k", 1500)
    config = sortedset_config(
        redis_url, simulator.url, [queue], result_list=results, lease_seconds=2
    )
    for at_least in (200, 600):
        daemon = daemon_factory.start(config, "--concurrency", "32")
        _wait_results(r, results, at_least, 60)
        daemon.kill9()  # with requests in flight and leases held
    daemon_factory.start(config, "--concurrency", "64")
    got = _collect(r, results, len(ids), 90)
    time.sleep(1.0)  # anything extra would show up now
    got += [Result.decode(x) for x in (r.rpop(results, 10_000) or [])]
    counts = Counter(x.id for x in got)
    assert set(counts) == set(ids)
    assert max(counts.values()) == 1, [k for k, v in counts.items() if v > 1][:5]


def test_redis_restart_with_aof_loses_nothing(
    private_redis: RedisServer,
    unique: str,
    simulator: SimulatorProcess,
    daemon_factory: DaemonFactory,
) -> None:
    simulator.configure(latency=0.02)
    r, queue, results, ids = _seed(private_redis.url, unique, "a", 800)
    daemon_factory.start(
        sortedset_config(
            private_redis.url, simulator.url, [queue], result_list=results, lease_seconds=3
        ),
        "--concurrency",
        "16",
    )
    _wait_results(r, results, 150, 60)
    private_redis.restart()  # same port and AOF: the daemon must reconnect and carry on
    r = _sync(private_redis.url)
    got = _collect(r, results, len(ids), 90)
    counts = Counter(x.id for x in got)
    assert set(counts) == set(ids)
    assert max(counts.values()) == 1


def test_sigterm_finishes_in_flight_and_hands_back_the_rest(
    redis_url: str, unique: str, simulator: SimulatorProcess, daemon_factory: DaemonFactory
) -> None:
    simulator.configure(latency=1.5)
    r, queue, results, ids = _seed(redis_url, unique, "s", 200)
    config = sortedset_config(redis_url, simulator.url, [queue], result_list=results)
    daemon = daemon_factory.start(config, "--concurrency", "8", "--drain-timeout", "10s")
    end = time.monotonic() + 10
    while simulator.stats()["running"] < 8 and time.monotonic() < end:
        time.sleep(0.05)
    started = time.monotonic()
    assert daemon.terminate() == 0
    assert time.monotonic() - started < 8
    done = [Result.decode(x) for x in (r.rpop(results, 1000) or [])]
    assert len(done) >= 8  # the in-flight ones finished, with their real answers
    assert {x.status_code for x in done} == {200}
    # Everything else is back on the queue at once (not left to lease expiry).
    assert r.zcard(queue) + len(done) == len(ids)
    # A restarted daemon finishes the rest: every id exactly once overall.
    simulator.configure(latency=0.0)
    daemon_factory.start(config, "--concurrency", "32")
    rest = _collect(r, results, len(ids) - len(done), 60)
    assert Counter(x.id for x in done + rest) == Counter(ids)


def test_poison_messages_get_results_or_dead_letters_and_do_not_block(
    redis_url: str, unique: str, simulator: SimulatorProcess, daemon_factory: DaemonFactory
) -> None:
    r = _sync(redis_url)
    queue, results = f"{unique}:q", f"{unique}:results"
    soon = int(time.time()) + 600
    poison = {
        b"{not json": 1.0,
        b'{"request_kind":"weird","data":{"id":"p-kind","deadline":1}}': 2.0,
        json.dumps({"request_kind": "plain", "data": {"id": "p-nodeadline"}}).encode(): 3.0,
        json.dumps(
            {"request_kind": "plain", "data": {"id": "p-expired", "deadline": 1000, "payload": {}}}
        ).encode(): 4.0,
        json.dumps({"id": "p-bare", "deadline": soon, "payload": {}}).encode(): 5.0,
        json.dumps({"request_kind": "plain", "data": {"deadline": soon}}).encode(): 6.0,
    }
    r.zadd(queue, poison)
    _submit(r, queue, results, ["good"], soon)
    daemon = daemon_factory.start(
        sortedset_config(redis_url, simulator.url, [queue], result_list=results)
    )
    got = {x.id: x for x in _collect(r, results, 5, 30)}
    assert got["good"].status_code == 200
    assert got["p-bare"].status_code == 200  # a bare request object is taken as plain
    assert got["p-kind"].error_code == "INVALID_REQUEST"
    assert got["p-nodeadline"].error_code == "INVALID_REQUEST"
    assert got["p-expired"].error_code == "DEADLINE_EXCEEDED"
    end = time.monotonic() + 10
    while r.llen(f"{queue}:dead-letter") < 2 and time.monotonic() < end:
        time.sleep(0.05)
    dead = [json.loads(x) for x in r.lrange(f"{queue}:dead-letter", 0, -1)]
    assert len(dead) == 2
    assert {d["raw"] for d in dead} == {
        "{not json",
        json.dumps({"request_kind": "plain", "data": {"deadline": soon}}),
    }
    assert all(d["reason"] for d in dead)
    assert daemon.metric("llm_d_async_async_dead_letter_total", queue_name=queue) == 2
    assert r.zcard(queue) == 0


def test_deadline_order_at_concurrency_one(
    redis_url: str, unique: str, simulator: SimulatorProcess, daemon_factory: DaemonFactory
) -> None:
    r = _sync(redis_url)
    queue, results = f"{unique}:q", f"{unique}:results"
    base = int(time.time()) + 1000
    ids = [f"o{i:04d}" for i in range(2000)]
    pipe = r.pipeline(transaction=False)
    for i in reversed(range(2000)):  # inserted in reverse: order must come from the deadline
        pipe.zadd(queue, {_envelope(ids[i], base + i, queue, results): base + i})
    pipe.execute()
    daemon_factory.start(
        sortedset_config(redis_url, simulator.url, [queue], result_list=results),
        "--concurrency",
        "1",
    )
    got = _collect(r, results, 2000, 120)
    # LPUSH + RPOP: results come out in completion order.
    assert [x.id for x in got] == ids


def test_three_replicas_share_the_work_without_double_dispatch(
    redis_url: str, unique: str, simulator: SimulatorProcess, daemon_factory: DaemonFactory
) -> None:
    simulator.configure(latency=0.02)
    before = simulator.stats()["total"]
    r = _sync(redis_url)
    queue, results = f"{unique}:q", f"{unique}:results"
    ids = [f"x{i}" for i in range(3000)]
    config = sortedset_config(redis_url, simulator.url, [queue], result_list=results)
    daemons = [daemon_factory.start(config, "--concurrency", "32") for _ in range(3)]
    _submit(r, queue, results, ids, int(time.time()) + 600)
    got = _collect(r, results, 3000, 90)
    assert Counter(x.id for x in got) == Counter(ids)
    assert simulator.stats()["total"] - before == 3000  # no message dispatched twice
    shares = [d.metric("llm_d_async_async_request_total", queue_name=queue) for d in daemons]
    assert sum(shares) == 3000
    assert min(shares) > 300, shares  # every replica took part


@pytest.mark.redis  # starts its own redis-server, later than the daemon
def test_redis_down_at_start_is_not_ready_then_recovers(
    tmp_path: Path, unique: str, simulator: SimulatorProcess, daemon_factory: DaemonFactory
) -> None:
    server = RedisServer(dir=tmp_path)  # its port is chosen but nothing listens yet
    queue, results = f"{unique}:q", f"{unique}:results"
    config = sortedset_config(server.url, simulator.url, [queue], result_list=results)
    daemon = daemon_factory.start(config, wait=False)
    time.sleep(3)
    assert daemon.proc.poll() is None  # retrying, not crashed
    assert not daemon.ready()  # /readyz says 503 while Redis is unreachable
    server.start()
    try:
        daemon.wait_ready(20)
        r = _sync(server.url)
        _submit(r, queue, results, ["late"], int(time.time()) + 600)
        [got] = _collect(r, results, 1, 30)
        assert got.status_code == 200
    finally:
        server.stop()
