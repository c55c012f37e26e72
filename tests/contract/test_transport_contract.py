"""The transport contract: every transport, the same cases, the daemon running in-process.

Parametrised over redis-sortedset, redis-pubsub and gcp-pubsub (the real Pub/Sub emulator;
those cases are skipped with the reason when it is not installed, failed under ``CI=true``,
and carry the ``xdist_group("pubsub")`` mark so that one worker's emulator serves them).
Each case drives the ``Processor`` against the simulator (in-process, over real HTTP) through a
``TransportHarness`` (tests/contract/harness.py), which speaks the transport's wire
format. Cases: dispatch, headers, retries, deadlines, results, metrics, drain, bad input
(``check-config`` on each transport's example config: test_check_config.py).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import anyio
import pytest

from async_processor.messages import DEADLINE_EXCEEDED_TEXT
from async_processor.pipeline.processor import Processor
from tests.contract.harness import Result, Submission, TransportHarness, open_harness
from tests.fixtures.inprocess import metric, running
from tests.fixtures.simulator import LocalSimulator

pytestmark = pytest.mark.anyio

M = "llm_d_async_async_"

# The broker is started at run time (``broker``), so its marker is on the parameter.
TRANSPORTS = [
    pytest.param("redis-sortedset", id="sortedset", marks=pytest.mark.redis),
    pytest.param("redis-sortedset-cluster", id="sortedset-cluster", marks=pytest.mark.redis),
    pytest.param("redis-pubsub", id="redis-pubsub", marks=pytest.mark.redis),
    # One xdist worker runs every emulator case: one JVM for the session. (pytest 9.2 with
    # pytest-xdist 3.8 ignores xdist_group, pytest-xdist#1386: then each worker starts one.)
    pytest.param(
        "gcp-pubsub",
        id="gcp-pubsub",
        marks=[pytest.mark.xdist_group("pubsub"), pytest.mark.pubsub, pytest.mark.gcp],
    ),
]


@dataclass(frozen=True)
class Broker:
    transport: str
    redis_url: str = ""
    project: str = ""


# A decorator, not fixture params: pytest drops marks on fixture params (xdist_group).
each_transport = pytest.mark.parametrize("broker", TRANSPORTS, indirect=True)


@pytest.fixture
def broker(request: pytest.FixtureRequest) -> Broker:
    """Start only the broker this case needs (skips with the reason when it is missing)."""
    name: str = request.param
    if name == "gcp-pubsub":
        emulator = request.getfixturevalue("pubsub_env")
        return Broker(name, project=emulator.project)
    if name == "redis-sortedset-cluster":
        return Broker(name, redis_url=request.getfixturevalue("redis_cluster").url)
    return Broker(name, redis_url=request.getfixturevalue("redis_url"))


@pytest.fixture
def sim(local_simulator: LocalSimulator) -> LocalSimulator:
    """The simulator over real HTTP, on the test's own loop (no process to start per case)."""
    return local_simulator


@pytest.fixture
async def harness(broker: Broker, unique: str) -> AsyncIterator[TransportHarness]:
    async with open_harness(
        broker.transport, unique, redis_url=broker.redis_url, project=broker.project
    ) as h:
        yield h


def sub(request_id: str, ttl: float = 300, **fields: Any) -> Submission:
    return Submission(id=request_id, deadline=int(time.time() + ttl), **fields)


def by_id(results: list[Result]) -> dict[str, Result]:
    ids = [r["id"] for r in results]
    assert len(ids) == len(set(ids)), f"duplicate results: {sorted(ids)}"
    return {r["id"]: r for r in results}


def q(harness: TransportHarness) -> dict[str, str]:
    """The labels that pick this case's queue out of the metrics."""
    return {"queue_name": harness.queue_name}


async def wait_for(check: Callable[[], bool], timeout: float, what: str) -> None:
    with anyio.move_on_after(timeout):
        while not check():
            await anyio.sleep(0.02)
    assert check(), f"expected {what} within {timeout} s"


def exceeded_counted(processor: Processor, harness: TransportHarness) -> Callable[[], bool]:
    """The expiry sweep (redis-sortedset) counts a deadline just after writing its result."""
    return lambda: metric(processor, M + "exceeded_deadline_requests_total", **q(harness)) >= 1


def seen_status(sim: LocalSimulator, status: int) -> Callable[[], bool]:
    return lambda: sim.stats()["by_status"].get(str(status), 0) >= 1


# ------------------------------------------------------------------------------ dispatch


@each_transport
async def test_n_messages_get_n_results_with_the_gateway_answers(
    harness: TransportHarness, unique: str, sim: LocalSimulator
) -> None:
    # Each message asks for a different number of tokens, so each answer is traceable.
    subs = [
        sub(f"{unique}-{i}", payload=b'{"prompt":"p","max_tokens":%d}' % (i + 1)) for i in range(8)
    ]
    async with running(harness.config(sim.url)):
        await harness.submit(subs)
        results = by_id(await harness.results(len(subs), 15))
    assert set(results) == {s.id for s in subs}
    for i, s in enumerate(subs):
        result = results[s.id]
        assert result["status_code"] == 200
        answer = json.loads(result["payload"])
        assert answer["object"] == "text_completion"
        assert answer["choices"][0]["text"].split() == ["tok"] * (i + 1)
    assert sim.stats()["total"] == len(subs)


@each_transport
async def test_dispatch_concurrency_follows_the_workers_not_the_batch(
    harness: TransportHarness, unique: str, sim: LocalSimulator
) -> None:
    # 24 workers, batches of 10 (the Go daemon's Pub/Sub subscriber stops at 10 in flight).
    subs = [sub(f"{unique}-c{i}") for i in range(24)]
    sim.configure(latency=1.0)
    async with running(harness.config(sim.url, concurrency=24)):
        await harness.submit(subs)
        results = by_id(await harness.results(len(subs), 15))
    assert len(results) == len(subs)
    assert sim.stats()["max_concurrent_seen"] >= 16


@each_transport
async def test_headers_and_payload_reach_the_gateway_verbatim(
    harness: TransportHarness, unique: str, sim: LocalSimulator
) -> None:
    payload = b'{"z":1,"prompt":"hi","big":12345678901234567890,"max_tokens":2}'
    message = sub(
        f"{unique}-h", payload=payload, headers={"X-Tenant": "t1"}, metadata={"userid": "u7"}
    )
    async with running(harness.config(sim.url, objective="obj-contract")):
        await harness.submit([message])
        [result] = await harness.results(1, 15)
    assert result["status_code"] == 200
    [seen] = sim.requests()
    assert seen["body"] == payload.decode()  # key order and the 20-digit integer survive
    headers = {k.lower(): v for k, v in seen["headers"].items()}
    assert headers["content-type"] == "application/json"
    assert headers["x-gateway-inference-objective"] == "obj-contract"
    assert headers["x-tenant"] == "t1"
    assert headers["x-llm-d-inference-fairness-id"] == "u7"
    assert headers["x-request-deadline"] == str(message.deadline)


# ------------------------------------------------------------------------------ retries


@each_transport
@pytest.mark.parametrize("status", [503, 429])
@pytest.mark.slow  # bound by the 2-4 s first backoff or a 1 s gateway
async def test_failed_attempts_are_retried_until_success(
    harness: TransportHarness, unique: str, sim: LocalSimulator, status: int
) -> None:
    sim.configure(error_rate=1.0, error_status=status)
    async with running(harness.config(sim.url)) as processor:
        await harness.submit([sub(f"{unique}-r")])
        await wait_for(seen_status(sim, status), 10, f"a {status} answer")
        sim.configure(error_rate=0.0)
        [result] = await harness.results(1, 15)
    assert result["status_code"] == 200
    retries = metric(processor, M + "request_retries_total", **q(harness))
    assert retries >= 1
    assert sim.stats()["by_status"][str(status)] == retries
    shed = metric(processor, M + "shedded_requests_total", **q(harness))
    assert shed == (retries if status == 429 else 0)
    assert metric(processor, M + "successful_requests_total", **q(harness)) == 1


@each_transport
@pytest.mark.slow  # bound by the 2-4 s first backoff or a 1 s gateway
async def test_a_retried_request_counts_once(
    harness: TransportHarness, unique: str, sim: LocalSimulator
) -> None:
    sim.configure(error_rate=1.0, error_status=503)
    async with running(harness.config(sim.url)) as processor:
        await harness.submit([sub(f"{unique}-once")])
        retried = M + "request_retries_total"
        # Two failed attempts, both counted (the third is at least 4 s away).
        await wait_for(lambda: metric(processor, retried, **q(harness)) >= 2, 10, "two retries")
        requests = metric(processor, M + "request_total", **q(harness))
    assert sim.stats()["by_status"]["503"] == 2
    assert requests == 1, "a retry was counted as a new request"


# ------------------------------------------------------------------------------ deadlines


@each_transport
async def test_expired_message_is_answered_deadline_exceeded(
    harness: TransportHarness, unique: str, sim: LocalSimulator
) -> None:
    async with running(harness.config(sim.url)) as processor:
        await harness.submit([sub(f"{unique}-old", ttl=-5)])
        [result] = await harness.results(1, 15)
        await wait_for(exceeded_counted(processor, harness), 5, "the deadline counted")
    assert result["error_code"] == "DEADLINE_EXCEEDED"
    assert result["error_message"] == DEADLINE_EXCEEDED_TEXT
    assert sim.stats()["total"] == 0  # never sent
    assert metric(processor, M + "exceeded_deadline_requests_total", **q(harness)) == 1


@each_transport
@pytest.mark.slow  # bound by the 2-4 s first backoff or a 1 s gateway
async def test_deadline_passing_while_the_gateway_fails_ends_the_request(
    harness: TransportHarness, unique: str, sim: LocalSimulator
) -> None:
    sim.configure(error_rate=1.0, error_status=503)
    async with running(harness.config(sim.url)) as processor:
        await harness.submit([sub(f"{unique}-d", ttl=3.5)])  # 2.5-3.5 s: a retry or two
        [result] = await harness.results(1, 15)
        assert await harness.results(1, 1.0) == []  # and only once
        await wait_for(exceeded_counted(processor, harness), 5, "the deadline counted")
    # The last HTTP answer, even when the deadline passed while the retry waited.
    assert result["status_code"] == 503
    assert sim.stats()["by_status"]["503"] >= 1
    assert metric(processor, M + "exceeded_deadline_requests_total", **q(harness)) == 1
    assert metric(processor, M + "successful_requests_total", **q(harness)) == 0


# ------------------------------------------------------------------------------ results


@each_transport
async def test_exactly_one_result_per_id_in_the_reference_shape(
    harness: TransportHarness, unique: str, sim: LocalSimulator
) -> None:
    good = [sub(f"{unique}-ok{i}") for i in range(3)]
    late = sub(f"{unique}-late", ttl=-5)
    async with running(harness.config(sim.url)):
        await harness.submit([*good, late])
        results = by_id(await harness.results(4, 15))
        assert await harness.results(1, 1.0) == []
    assert set(results) == {s.id for s in [*good, late]}
    # redis-sortedset results carry the submission's token, as upstream's since v0.10.
    tokened = {"request_token"} if harness.name == "redis-sortedset" else set()
    for s in good:
        ok = results[s.id]
        assert set(ok) == {"id", "status_code", "payload", *tokened}
        assert ok["status_code"] == 200 and isinstance(ok["payload"], str)
        json.loads(ok["payload"])
    error = results[late.id]
    assert set(error) == {"id", "payload", "error_code", "error_message", *tokened}
    assert error["error_code"] == "DEADLINE_EXCEEDED"
    assert json.loads(error["payload"]) == {"error": error["error_message"]}


# ------------------------------------------------------------------------------ metrics


@each_transport
async def test_outcome_metrics_carry_the_queue_labels(
    harness: TransportHarness, unique: str, sim: LocalSimulator
) -> None:
    good = [sub(f"{unique}-m{i}") for i in range(5)]
    rejected = sub(f"{unique}-bad", payload=b'{"prompt":"p","max_tokens":"many"}')  # a 400
    inflight = M + "inflight_requests"
    sim.configure(latency=0.3)  # long enough to see them in flight
    async with running(harness.config(sim.url)) as processor:
        await harness.submit([*good, rejected])
        await wait_for(lambda: metric(processor, inflight, **q(harness)) >= 1, 5, "in flight")
        results = by_id(await harness.results(6, 15))
        await wait_for(lambda: metric(processor, inflight) == 0, 5, "in-flight back to 0")
    assert results[rejected.id]["status_code"] == 400
    labels = q(harness)
    assert metric(processor, M + "request_total", **labels) == 6
    assert metric(processor, M + "successful_requests_total", **labels) == 5
    assert metric(processor, M + "failed_requests_total", **labels) == 1
    assert metric(processor, inflight, **labels) == 0
    # Nothing was counted under other labels.
    assert metric(processor, M + "request_total") == 6
    assert metric(processor, M + "inference_latency_time_millis_count", **labels) == 6


# ------------------------------------------------------------------------------ drain


@each_transport
@pytest.mark.slow  # bound by the 2-4 s first backoff or a 1 s gateway
async def test_drain_finishes_in_flight_and_loses_nothing_it_held(
    harness: TransportHarness, unique: str, sim: LocalSimulator
) -> None:
    # The prompt is the id, so the gateway's log says which requests were in flight.
    subs = [sub(f"{unique}-dr{i}", payload=b'{"prompt":"%s-dr%d"}' % (unique.encode(), i))
            for i in range(12)]  # fmt: skip
    sim.configure(latency=1.0)
    config = harness.config(sim.url, concurrency=2)
    async with running(config) as processor:
        await harness.submit(subs)
        await wait_for(lambda: sim.stats()["running"] == 2, 10, "two requests in flight")
        in_flight = {json.loads(r["body"])["prompt"] for r in sim.requests()}
        processor.request_stop()
    # Those in flight finished with their answers; the daemon stopped soon after.
    first = by_id(await harness.results(len(subs), 1.5))
    assert len(in_flight) == 2 and in_flight <= set(first)
    assert all(r["status_code"] == 200 for r in first.values())
    parked = await harness.parked()
    # What was not answered is back on the broker (redis-pubsub: in the retry set, where
    # the stopping daemon handed back what it had buffered); Pub/Sub cannot count it.
    assert parked in (len(subs) - len(first), None)
    sim.configure(latency=0.0)
    async with running(config):
        rest = by_id(await harness.results(len(subs) - len(first), 15))
        assert await harness.results(1, 0.5) == []
    assert not set(first) & set(rest), "a request was answered twice"
    assert set(first) | set(rest) == {s.id for s in subs}


@each_transport
@pytest.mark.slow  # bound by the 2-4 s first backoff or a 1 s gateway
async def test_retry_waiting_at_shutdown_is_not_lost(
    harness: TransportHarness, unique: str, sim: LocalSimulator
) -> None:
    sim.configure(error_rate=1.0, error_status=503)
    config = harness.config(sim.url)
    message = sub(f"{unique}-park")
    async with running(config):
        await harness.submit([message])
        await wait_for(seen_status(sim, 503), 10, "a 503 answer")
        await anyio.sleep(0.3)  # the hand-back reaches the broker
    parked = await harness.parked()
    assert parked in (1, None)  # None: Pub/Sub holds it in the subscription
    sim.configure(error_rate=0.0)
    async with running(config) as restarted:
        [result] = await harness.results(1, 15)
    assert result["id"] == message.id and result["status_code"] == 200
    # Where the retry state survives (Redis), the new process sees a retry, not a request.
    counted = metric(restarted, M + "request_total", **q(harness))
    assert counted == (0 if harness.retry_state_survives_restart else 1)


@each_transport
async def test_a_message_sent_while_no_daemon_runs(
    harness: TransportHarness, unique: str, sim: LocalSimulator
) -> None:
    early = sub(f"{unique}-early")
    await harness.submit([early], offline=True)
    durable = harness.keeps_messages_sent_while_down
    async with running(harness.config(sim.url)):
        results = await harness.results(1, 15 if durable else 1.0)
    if durable:
        assert [r["id"] for r in results] == [early.id]
    else:
        assert results == []  # redis-pubsub: nobody was subscribed, so it is gone


# ------------------------------------------------------------------------------ bad input


@each_transport
async def test_bad_input_is_answered_or_dead_lettered_and_the_queue_flows(
    harness: TransportHarness, unique: str, sim: LocalSimulator
) -> None:
    deadline = int(time.time()) + 300
    malformed = b'{"id": "' + unique.encode() + b'-x", "deadline": '  # cut short: no id to read
    not_an_object = b'["' + unique.encode() + b'", 1]'
    not_utf8 = b'{"id": "\xff' + unique.encode() + b'"}'
    no_deadline = json.dumps({"id": f"{unique}-nodl", "payload": {"prompt": "p"}}).encode()
    oversize = json.dumps(
        {"id": f"{unique}-big", "deadline": deadline, "payload": {"prompt": "x" * 5000}}
    ).encode()
    good = sub(f"{unique}-good")
    async with running(harness.config(sim.url, max_message_bytes=4096)) as processor:
        for raw in (malformed, not_an_object, not_utf8, no_deadline, oversize):
            await harness.inject_raw(raw)
        await harness.submit([good])
        results = by_id(await harness.results(3, 15))
        parked = await harness.dead_letters(3, 10)
        after = sub(f"{unique}-after")
        await harness.submit([after])
        [later] = await harness.results(1, 15)
    assert results[f"{unique}-nodl"]["error_code"] == "INVALID_REQUEST"
    assert results[f"{unique}-big"]["error_code"] == "INVALID_REQUEST"
    assert "4096" in results[f"{unique}-big"]["error_message"]
    assert results[good.id]["status_code"] == 200
    assert later["id"] == after.id and later["status_code"] == 200
    # Parked as they came (the Redis lists keep text, so the bad byte reads as U+FFFD).
    assert len(parked) == 3
    assert {malformed, not_an_object} <= set(parked)
    assert any(p.endswith(unique.encode() + b'"}') and p != malformed for p in parked)
    dead = metric(processor, M + "dead_letter_total", reason="malformed", **q(harness))
    assert dead == 3
    assert metric(processor, M + "failed_requests_total", **q(harness)) == 2
    assert sim.stats()["total"] == 2  # only the good ones were sent
