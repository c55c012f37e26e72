"""The daemon as a process with ``--transport redis-pubsub`` against a real redis-server."""

from __future__ import annotations

import json
import time
from collections import Counter

import pytest
import redis

from async_processor.messages import Result
from tests.fixtures.daemon import DaemonFactory
from tests.fixtures.simulator import SimulatorProcess

pytestmark = [pytest.mark.slow]


def _config(redis_url: str, gateway: str, unique: str) -> dict[str, object]:
    return {
        "url": redis_url,
        "retry_queue_name": f"{unique}:retry",
        "result_queue_name": f"{unique}:results",
        "queues": [{"queue_name": f"{unique}:in", "igw_base_url": gateway}],
    }


def _collect(pubsub: redis.client.PubSub, count: int, timeout: float) -> list[Result]:
    out: list[Result] = []
    end = time.monotonic() + timeout
    while len(out) < count and time.monotonic() < end:
        message = pubsub.get_message(ignore_subscribe_messages=True, timeout=0.2)
        if message is not None:
            out.append(Result.decode(message["data"]))
    return out


def test_burst_with_retries_every_message_one_result(
    redis_url: str, unique: str, simulator: SimulatorProcess, daemon_factory: DaemonFactory
) -> None:
    # One in twenty attempts fails with 500: those come back through the retry set.
    simulator.configure(latency=0.01, error_rate=0.05, seed=7)
    r = redis.Redis.from_url(redis_url)
    results = r.pubsub()  # type: ignore[no-untyped-call]
    results.subscribe(f"{unique}:results")
    daemon = daemon_factory.start(
        _config(redis_url, simulator.url, unique), "--concurrency", "16", transport="redis-pubsub"
    )
    assert "redis_pubsub_deprecated" in daemon.logs()
    ids = [f"p{i}" for i in range(300)]
    deadline = int(time.time()) + 600
    pipe = r.pipeline(transaction=False)
    for request_id in ids:  # a burst far larger than the 100-message buffer
        body = {"id": request_id, "deadline": deadline, "payload": {"prompt": request_id}}
        pipe.publish(f"{unique}:in", json.dumps(body))
    assert all(n == 1 for n in pipe.execute())
    got = _collect(results, len(ids), 60)
    counts = Counter(x.id for x in got)
    assert set(counts) == set(ids)
    assert max(counts.values()) == 1
    assert {x.status_code for x in got} == {200}
    assert daemon.metric("llm_d_async_async_request_retries_total") > 0
    assert r.zcard(f"{unique}:retry") == 0


def test_two_replicas_fan_out_but_publish_one_result_per_id(
    redis_url: str, unique: str, simulator: SimulatorProcess, daemon_factory: DaemonFactory
) -> None:
    simulator.configure(latency=0.01, error_rate=0.0)
    before = simulator.stats()["total"]
    r = redis.Redis.from_url(redis_url)
    results = r.pubsub()  # type: ignore[no-untyped-call]
    results.subscribe(f"{unique}:results")
    config = _config(redis_url, simulator.url, unique)
    for _ in range(2):
        daemon_factory.start(config, "--concurrency", "16", transport="redis-pubsub")
    ids = [f"f{i}" for i in range(100)]
    deadline = int(time.time()) + 600
    for request_id in ids:
        body = {"id": request_id, "deadline": deadline, "payload": {"prompt": request_id}}
        assert r.publish(f"{unique}:in", json.dumps(body)) == 2  # both replicas subscribed
    got = _collect(results, len(ids), 20)
    end = time.monotonic() + 10
    while simulator.stats()["total"] - before < 2 * len(ids) and time.monotonic() < end:
        time.sleep(0.05)
    # The documented limit: every replica did the work ...
    assert simulator.stats()["total"] - before == 2 * len(ids)
    # ... but only one result per id went out.
    got += _collect(results, 1, 1.0)
    assert Counter(x.id for x in got) == Counter(ids)
