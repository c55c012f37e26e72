"""The daemon as a process on the real Pub/Sub emulator: volume, 429 storm with
measured backoff, kill -9 with redelivery, a closed gate, more than 10 dispatches at once.

(Dead-letter after max delivery attempts is in tests/integration/test_gcp_pubsub.py: through
the daemon the growing backoff would take minutes to reach five attempts.)
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import threading
import time
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import anyio
import pytest
import redis

from async_processor.messages import Result
from tests.fixtures.daemon import Daemon, DaemonFactory
from tests.fixtures.pubsub import PubSubAdmin, PubSubEmulator, pubsub_admin
from tests.fixtures.simulator import SimulatorProcess

pytestmark = [pytest.mark.slow, pytest.mark.anyio, pytest.mark.xdist_group("pubsub")]


@pytest.fixture
async def admin(pubsub_env: PubSubEmulator) -> AsyncIterator[PubSubAdmin]:
    async with pubsub_admin(pubsub_env.project) as a:
        yield a


def gcp_config(names: dict[str, str], gateway: str, **topic: Any) -> dict[str, Any]:
    return {
        "project_id": "test-project",
        "result_topic_id": names["results"],
        "batch_size": 100,
        "topics": [{"subscriber_id": names["sub"], "igw_base_url": gateway, **topic}],
    }


async def setup(admin: PubSubAdmin, unique: str, **subscription: Any) -> dict[str, str]:
    names = {"req": f"{unique}-req", "sub": f"{unique}-sub", "results": f"{unique}-res"}
    await admin.create_subscription(names["sub"], names["req"], **subscription)
    await admin.create_subscription(f"{unique}-res-sub", names["results"])
    names["results_sub"] = f"{unique}-res-sub"
    return names


def requests_for(ids: list[str], ttl: int = 600) -> list[bytes]:
    deadline = int(time.time()) + ttl
    return [
        json.dumps({"id": i, "deadline": deadline, "payload": {"prompt": i}}).encode() for i in ids
    ]


async def publish(admin: PubSubAdmin, topic: str, ids: list[str]) -> None:
    payloads = requests_for(ids)
    for start in range(0, len(payloads), 500):
        await admin.publish(topic, payloads[start : start + 500])


async def collect(
    admin: PubSubAdmin, subscription: str, count: int, timeout: float
) -> list[Result]:
    messages = await admin.pull_until(subscription, count, timeout=timeout)
    return [Result.decode(m.message.data) for m in messages]


async def start(
    factory: DaemonFactory, emulator: PubSubEmulator, config: dict[str, Any], *args: str
) -> Daemon:
    """The daemon on the emulator, started (and awaited ready) off the event loop."""
    env = {"PUBSUB_EMULATOR_HOST": emulator.host}
    return await anyio.to_thread.run_sync(
        lambda: factory.start(config, *args, transport="gcp-pubsub", env=env)
    )


async def test_thousand_messages_thousand_results_with_many_in_flight(
    admin: PubSubAdmin,
    pubsub_env: PubSubEmulator,
    unique: str,
    simulator: SimulatorProcess,
    daemon_factory: DaemonFactory,
) -> None:
    simulator.configure(latency=0.1)
    simulator.reset()
    names = await setup(admin, unique)
    ids = [f"m{i}" for i in range(1000)]
    await publish(admin, names["req"], ids)
    config = gcp_config(names, simulator.url)
    daemon = await start(daemon_factory, pubsub_env, config, "--concurrency", "64")
    got = await collect(admin, names["results_sub"], 1000, 90)
    assert sorted(r.id for r in got) == sorted(ids)
    assert {r.status_code for r in got} == {200}
    # The reference holds at most 10 per subscription; we follow the pool's 64 workers.
    assert simulator.stats()["max_concurrent_seen"] > 10
    successes = await anyio.to_thread.run_sync(
        lambda: daemon.metric("llm_d_async_async_successful_requests_total")
    )
    assert successes == 1000


class _StormGateway(BaseHTTPRequestHandler):
    """Answers 429 (Retry-After: 1) to the first ``fail_first`` attempts of every prompt."""

    attempts: dict[str, list[float]]
    lock: threading.Lock
    fail_first: int

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        prompt = body["prompt"]
        with self.lock:
            self.attempts[prompt].append(time.monotonic())
            tries = len(self.attempts[prompt])
        status, reply = (
            (429, b'{"error":"busy"}') if tries <= self.fail_first else (200, b'{"ok":true}')
        )
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(reply)))
        if status == 429:
            self.send_header("retry-after", "1")
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, *args: Any) -> None:
        pass


@contextmanager
def storm_gateway(fail_first: int = 2) -> Iterator[tuple[str, dict[str, list[float]]]]:
    """A gateway in a thread; yields its URL and the attempt times per prompt."""
    attempts: dict[str, list[float]] = defaultdict(list)
    members = {"attempts": attempts, "lock": threading.Lock(), "fail_first": fail_first}
    handler = type("Gateway", (_StormGateway,), members)
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", attempts
    finally:
        server.shutdown()
        server.server_close()


async def test_429_storm_backoff_honoured_through_the_ack_deadline(
    admin: PubSubAdmin, pubsub_env: PubSubEmulator, unique: str, daemon_factory: DaemonFactory
) -> None:
    names = await setup(admin, unique)
    ids = [f"s{i}" for i in range(60)]
    with storm_gateway() as (url, attempts):
        await publish(admin, names["req"], ids)
        await start(daemon_factory, pubsub_env, gcp_config(names, url), "--concurrency", "32")
        got = await collect(admin, names["results_sub"], len(ids), 60)
        assert sorted(r.id for r in got) == sorted(ids)
        assert {r.status_code for r in got} == {200}
        gaps = [b - a for times in attempts.values() for a, b in itertools.pairwise(times)]
    assert all(len(attempts[i]) == 3 for i in ids)
    # Retry-After: 1 reached the broker: no redelivery came back sooner. The second
    # retry's backoff is in [4, 8) s, rounded up to whole ack-deadline seconds, plus one
    # pull interval: never the subscription's 10 s default or later.
    assert min(gaps) >= 0.95, min(gaps)
    assert max(gaps) < 9.5, max(gaps)


async def test_kill9_mid_run_every_message_still_gets_a_result(
    admin: PubSubAdmin,
    pubsub_env: PubSubEmulator,
    unique: str,
    simulator: SimulatorProcess,
    daemon_factory: DaemonFactory,
) -> None:
    simulator.configure(latency=0.2)
    names = await setup(admin, unique)
    ids = [f"k{i}" for i in range(300)]
    await publish(admin, names["req"], ids)
    config = gcp_config(names, simulator.url)
    daemon = await start(daemon_factory, pubsub_env, config, "--concurrency", "16")
    got = await collect(admin, names["results_sub"], 40, 30)
    await anyio.to_thread.run_sync(daemon.kill9)  # messages held, leases not yet extended
    simulator.configure(latency=0.01)
    await start(daemon_factory, pubsub_env, config, "--concurrency", "64")
    seen = Counter(r.id for r in got)
    deadline = time.monotonic() + 60
    while set(seen) != set(ids) and time.monotonic() < deadline:
        seen.update(r.id for r in await collect(admin, names["results_sub"], 300, 3))
    assert set(seen) == set(ids)  # duplicates are possible (at-least-once), losses are not


async def test_closed_gate_dispatches_nothing_and_loses_nothing(
    admin: PubSubAdmin,
    pubsub_env: PubSubEmulator,
    unique: str,
    redis_url: str,
    simulator: SimulatorProcess,
    daemon_factory: DaemonFactory,
) -> None:
    r = redis.Redis.from_url(redis_url)
    budget_key = f"{unique}:budget"
    r.set(budget_key, "0")
    names = await setup(admin, unique)
    address = redis_url.removeprefix("redis://").split("/")[0]
    config = gcp_config(
        names,
        simulator.url,
        gate_type="redis",
        gate_params={"address": address, "budget_key": budget_key},
    )
    ids = [f"g{i}" for i in range(50)]
    await publish(admin, names["req"], ids)
    before = simulator.stats()["total"]
    await start(daemon_factory, pubsub_env, config)
    assert await collect(admin, names["results_sub"], 1, 3) == []
    assert simulator.stats()["total"] == before
    r.set(budget_key, "1")
    got = await collect(admin, names["results_sub"], len(ids), 30)
    assert sorted(x.id for x in got) == sorted(ids)


async def test_sigterm_within_drain_timeout_nacks_what_is_left(
    admin: PubSubAdmin,
    pubsub_env: PubSubEmulator,
    unique: str,
    simulator: SimulatorProcess,
    daemon_factory: DaemonFactory,
) -> None:
    simulator.configure(latency=30.0)  # nothing finishes within the drain timeout
    names = await setup(admin, unique)
    ids = [f"d{i}" for i in range(20)]
    await publish(admin, names["req"], ids)
    config = gcp_config(names, simulator.url)
    daemon = await start(
        daemon_factory, pubsub_env, config, "--concurrency", "8", "--drain-timeout", "2s"
    )
    with anyio.fail_after(15):
        while simulator.stats()["running"] < 8:
            await anyio.sleep(0.05)
    started = time.monotonic()
    assert await anyio.to_thread.run_sync(daemon.terminate) == 0
    assert time.monotonic() - started < 8  # bounded by --drain-timeout, not by the gateway
    # The 8 in flight were nacked: available again at once, not after a 60 s lease.
    back = await admin.pull_until(names["sub"], len(ids), timeout=5)
    assert sorted(json.loads(m.message.data)["id"] for m in back) == sorted(ids)


async def test_missing_subscription_keeps_running_unready_then_recovers(
    admin: PubSubAdmin,
    pubsub_env: PubSubEmulator,
    unique: str,
    simulator: SimulatorProcess,
    daemon_factory: DaemonFactory,
) -> None:
    names = {"req": f"{unique}-req", "sub": f"{unique}-sub", "results": f"{unique}-res"}
    await admin.create_subscription(f"{unique}-res-sub", names["results"])
    env = {"PUBSUB_EMULATOR_HOST": pubsub_env.host}
    config = gcp_config(names, simulator.url)
    daemon = await anyio.to_thread.run_sync(
        lambda: daemon_factory.start(config, transport="gcp-pubsub", env=env, wait=False)
    )
    await anyio.sleep(3)
    assert daemon.proc.poll() is None  # still running
    assert not await anyio.to_thread.run_sync(daemon.ready)  # /readyz answers 503
    await admin.create_subscription(names["sub"], names["req"])
    await anyio.to_thread.run_sync(lambda: daemon.wait_ready(30))
    await publish(admin, names["req"], ["late"])
    [result] = await collect(admin, f"{unique}-res-sub", 1, 20)
    assert result.id == "late"


@contextmanager
def frozen(emulator: PubSubEmulator) -> Iterator[None]:
    """The emulator stopped (SIGSTOP to its process group: the launcher and its JVM), as
    a broker that hangs: calls get no answer, connections stay open; let go at the end."""
    os.killpg(emulator.proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.killpg(emulator.proc.pid, signal.SIGCONT)


async def test_a_broker_that_hangs_with_answers_due_loses_none_and_doubles_none(
    admin: PubSubAdmin,
    pubsub_env: PubSubEmulator,
    unique: str,
    simulator: SimulatorProcess,
    daemon_factory: DaemonFactory,
) -> None:
    # Issue 30, item 5 (the broker-away cases ran on redis-sortedset only): Pub/Sub stops
    # answering for 6 s while 16 requests are at a 1 s gateway: their publishes, acks and
    # lease extensions hang or fail and are retried; once it answers again every id gets
    # one result (one process: a redelivery of one it answered is acked without another).
    simulator.configure(latency=1.0)
    names = await setup(admin, unique)
    ids = [f"h{i}" for i in range(40)]
    await publish(admin, names["req"], ids)
    config = gcp_config(names, simulator.url)
    daemon = await start(daemon_factory, pubsub_env, config, "--concurrency", "16")
    with anyio.fail_after(20):
        while await anyio.to_thread.run_sync(
            lambda: daemon.metric("llm_d_async_async_inflight_requests") < 16
        ):
            await anyio.sleep(0.05)
    with frozen(pubsub_env):
        await anyio.sleep(6)
    got = await collect(admin, names["results_sub"], len(ids), 60)
    got += await collect(admin, names["results_sub"], 1, 3)  # nothing more comes
    assert Counter(r.id for r in got) == Counter(ids), daemon.logs()[-2000:]
