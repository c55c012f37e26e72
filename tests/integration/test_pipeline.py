"""The pipeline in-process (Processor) against a real redis-server and the simulator process.

Dispatch behaviour over real HTTP: headers and deadline reach the gateway, 5xx / 429 /
connection failures are retried with backoff until they succeed or the deadline comes,
queue and pool gates defer instead of hot-looping, pool Wait parks without spinning.
"""

from __future__ import annotations

import io
import json
import resource
import time
from collections.abc import Callable, Iterator
from typing import Any

import anyio
import pytest
import redis.asyncio as aioredis

from async_processor.client.redis_sortedset import SortedSetClient
from async_processor.config import AppConfig, PoolConfig, RuntimeConfig, SortedSetConfig
from async_processor.gates.base import (
    CONTINUE,
    GATES,
    REFUSE,
    WAIT,
    GateContext,
    GateParams,
    Releases,
    Verdict,
)
from async_processor.logs import configure_logging
from async_processor.messages import Envelope, Result
from async_processor.pipeline.processor import Processor
from tests.fixtures.inprocess import metric, running, sortedset_config, submit
from tests.fixtures.servers import free_port
from tests.fixtures.simulator import SimulatorProcess

EXCEEDED = "llm_d_async_async_exceeded_deadline_requests_total"
REQUEUES = "llm_d_async_async_gate_wait_requeues_total"

pytestmark = pytest.mark.anyio


def _req(request_id: str, ttl: float = 600, **extra: Any) -> dict[str, Any]:
    return {"id": request_id, "deadline": int(time.time() + ttl), "payload": {"p": 1}, **extra}


async def test_headers_and_deadline_reach_the_gateway(
    redis_url: str, unique: str, simulator: SimulatorProcess
) -> None:
    config = sortedset_config(
        redis_url, simulator.url, unique, queue_extra={"inference_objective": "obj-a"}
    )
    request = _req("h1", headers={"X-Tenant": "t1"}, metadata={"userid": "u7"})
    raw_payload = '{"z":1,"a":12345678901234567890123}'
    async with running(config):
        client = await submit(redis_url, unique)
        # A hand-made member keeps the payload's exact text (key order, 23-digit integer).
        envelope = json.dumps(
            {
                "internal": {},
                "request_kind": "plain",
                "data": {
                    "id": "h1",
                    "deadline": request["deadline"],
                    "payload": "PAYLOAD",
                    "headers": request["headers"],
                    "metadata": request["metadata"],
                },
            }
        )
        member = envelope.replace('"PAYLOAD"', raw_payload)
        r = aioredis.Redis.from_url(redis_url)
        await r.zadd(unique, {member: request["deadline"]})
        [result] = await client.drain_results(1, 20)
    assert result.status_code == 200
    [seen] = [x for x in simulator.requests() if x["body"] == raw_payload]
    headers = {k.lower(): v for k, v in seen["headers"].items()}
    assert headers["x-request-deadline"] == str(request["deadline"])
    assert headers["x-gateway-inference-objective"] == "obj-a"
    assert headers["x-tenant"] == "t1"
    assert headers["x-llm-d-inference-fairness-id"] == "u7"
    assert headers["content-type"] == "application/json"


async def test_server_errors_are_retried_until_success(
    redis_url: str, unique: str, simulator: SimulatorProcess
) -> None:
    simulator.configure(error_rate=1.0, error_status=503)
    async with running(sortedset_config(redis_url, simulator.url, unique)) as processor:
        client = await submit(redis_url, unique, _req("e1"))
        await anyio.sleep(2.5)  # first attempt fails; the retry waits 2–4 s (equal jitter)
        simulator.configure(error_rate=0.0)
        [result] = await client.drain_results(1, 15)
        retries = metric(processor, "llm_d_async_async_request_retries_total", queue_name=unique)
        sent = metric(processor, "llm_d_async_async_dispatched_requests_total", queue_name=unique)
    assert result.status_code == 200
    assert retries >= 1
    assert simulator.stats()["by_status"].get("503", 0) == retries
    assert sent == retries + 1 == sum(simulator.stats()["by_status"].values())  # every attempt


async def test_429_counts_shed_and_honours_retry_after(
    redis_url: str, unique: str, simulator: SimulatorProcess
) -> None:
    simulator.configure(error_rate=1.0, error_status=429)
    async with running(sortedset_config(redis_url, simulator.url, unique)) as processor:
        # The deadline must leave room for a first attempt on a loaded machine: it is whole
        # seconds (ttl 3 left 2-3 s, and a message first sent after it has no 429 to give).
        client = await submit(redis_url, unique, _req("s1", ttl=8))
        [result] = await client.drain_results(1, 30)
        shed = metric(processor, "llm_d_async_async_shedded_requests_total", queue_name=unique)
        # A retry whose deadline passes while it waits in its queue is answered by the expiry
        # sweep, which counts it just after the result is written: wait for the count.
        exceeded = 0.0
        with anyio.move_on_after(10):
            while not (exceeded := metric(processor, EXCEEDED, queue_name=unique)):
                await anyio.sleep(0.05)
    assert shed >= 1
    # The deadline ran out while retrying: the last HTTP answer is the result.
    assert result.status_code == 429
    assert exceeded == 1


async def test_connection_refused_retries_until_deadline(redis_url: str, unique: str) -> None:
    dead_gateway = f"http://127.0.0.1:{free_port()}"
    async with running(sortedset_config(redis_url, dead_gateway, unique)) as processor:
        client = await submit(redis_url, unique, _req("c1", ttl=3))
        [result] = await client.drain_results(1, 15)
        retries = metric(processor, "llm_d_async_async_request_retries_total", queue_name=unique)
    assert result.error_code == "DEADLINE_EXCEEDED"  # not a fatal INFERENCE_ERROR
    assert retries >= 1


async def test_attempt_cut_at_request_timeout_then_retried(
    redis_url: str, unique: str, simulator: SimulatorProcess
) -> None:
    simulator.configure(hang_rate=1.0)
    config = sortedset_config(redis_url, simulator.url, unique, request_timeout="300ms")
    async with running(config) as processor:
        client = await submit(redis_url, unique, _req("t1"))
        await anyio.sleep(1.0)
        simulator.configure(hang_rate=0.0)
        [result] = await client.drain_results(1, 15)
        retries = metric(processor, "llm_d_async_async_request_retries_total", queue_name=unique)
    assert result.status_code == 200
    assert retries >= 1


async def test_invalid_endpoint_and_header_are_invalid_request(
    redis_url: str, unique: str, simulator: SimulatorProcess
) -> None:
    async with running(sortedset_config(redis_url, simulator.url, unique)):
        client = await submit(
            redis_url,
            unique,
            _req("bad-endpoint", endpoint="http://elsewhere/v1/completions"),
            _req("bad-header", headers={"X-A": "x\r\nInjected: 1"}),
        )
        results = {r.id: r for r in await client.drain_results(2, 15)}
    assert results["bad-endpoint"].error_code == "INVALID_REQUEST"
    assert results["bad-header"].error_code == "INVALID_REQUEST"
    assert simulator.stats()["total"] == 0  # never sent


async def test_a_huge_id_is_cut_in_log_lines_but_whole_in_its_result(
    redis_url: str, unique: str, simulator: SimulatorProcess
) -> None:
    # Every event about the message carried its multi-MB id in full: one bad producer
    # could multiply the log volume by the id's size.
    huge = "i" * (3 * 1024 * 1024)
    out = io.StringIO()
    configure_logging("debug", "json", stream=out)
    async with running(sortedset_config(redis_url, simulator.url, unique)):
        client = await submit(redis_url, unique, _req(huge, endpoint="/v1/nowhere"))
        results = await client.drain_results(1, 15)
    assert [(r.id, r.status_code) for r in results] == [(huge, 404)]
    lines = out.getvalue().splitlines()
    failed = [json.loads(line) for line in lines if '"request_failed"' in line]
    assert failed[0]["request_id"] == f"{huge[:128]}…(+{len(huge) - 128})"
    assert max(map(len, lines)) < 8192


class _ScriptedParams(GateParams):
    name: str


# A gate for these tests whose verdicts the test scripts (the real gates have their own tests).
SCRIPTS: dict[str, Callable[[Envelope], Verdict]] = {}
CALLS: dict[str, int] = {}


class _ScriptedGate:
    def __init__(self, name: str) -> None:
        self.name = name

    async def budget(self) -> float:
        return 1.0

    async def apply(self, message: Envelope, releases: Releases) -> Verdict:
        CALLS[self.name] = CALLS.get(self.name, 0) + 1
        return SCRIPTS[self.name](message)


def _scripted(params: _ScriptedParams, ctx: GateContext) -> _ScriptedGate:
    return _ScriptedGate(params.name)


@pytest.fixture(autouse=True)
def scripted_gate() -> Iterator[None]:
    """Registered only while these tests run: the gate library's own tests list every type."""
    GATES.register("test-scripted", _ScriptedParams)(_scripted)
    yield
    GATES._entries.pop("test-scripted")


async def test_queue_gate_refusal_defers_without_hot_loop_or_blocking_others(
    redis_url: str, unique: str, simulator: SimulatorProcess
) -> None:
    SCRIPTS[unique] = lambda m: REFUSE if m.id == "blocked" else CONTINUE
    config = sortedset_config(
        redis_url,
        simulator.url,
        unique,
        queue_extra={"gate_type": "test-scripted", "gate_params": {"name": unique}},
    )
    async with running(config) as processor:
        # "blocked" has the earliest deadline: it sits at the head of the queue.
        client = await submit(
            redis_url,
            unique,
            _req("blocked", ttl=100),
            *[_req(f"ok{i}", ttl=200) for i in range(20)],
        )
        results = await client.drain_results(20, 15)
        await anyio.sleep(1.5)
        refused = metric(
            processor,
            "llm_d_async_async_gate_decisions_total",
            queue_name=unique,
            reason="gate_closed",
        )
    assert sorted(r.id for r in results) == sorted(f"ok{i}" for i in range(20))
    # Deferred about once a second, not re-popped hundreds of times.
    assert 1 <= refused <= 6
    assert CALLS[unique] <= 30


async def test_pool_gate_wait_parks_workers_without_spinning(
    redis_url: str, unique: str, simulator: SimulatorProcess
) -> None:
    gate_open = anyio.Event()
    SCRIPTS[unique] = lambda m: CONTINUE if gate_open.is_set() else WAIT
    pools = [
        PoolConfig(id="p", workers=64, gate_type="test-scripted", gate_params={"name": unique})
    ]
    async with running(
        sortedset_config(redis_url, simulator.url, unique, pools=pools)
    ) as processor:
        client = await submit(redis_url, unique, *[_req(f"w{i}") for i in range(64)])
        await anyio.sleep(0.5)
        cpu0 = resource.getrusage(resource.RUSAGE_SELF)
        await anyio.sleep(2.0)
        cpu1 = resource.getrusage(resource.RUSAGE_SELF)
        assert simulator.stats()["total"] == 0  # nothing dispatched while closed
        gate_open.set()
        results = await client.drain_results(64, 20)
        waits = metric(
            processor,
            "llm_d_async_async_gate_decisions_total",
            pool_name="p",
            queue_name="",
            reason="gate_closed",
        )
    used = (cpu1.ru_utime + cpu1.ru_stime) - (cpu0.ru_utime + cpu0.ru_stime)
    assert len(results) == 64
    assert waits == 64  # counted once per message, not once per re-check
    # 64 parked workers re-checking every 50 ms: well under a core (a spin would use ~1.0).
    assert used < 1.0, used


async def test_pool_gate_wait_limit_hands_back_instead_of_failing(
    redis_url: str, unique: str, simulator: SimulatorProcess
) -> None:
    SCRIPTS[unique] = lambda m: WAIT
    pools = [PoolConfig(id="p", workers=2, gate_type="test-scripted", gate_params={"name": unique})]
    config = sortedset_config(
        redis_url, simulator.url, unique, pools=pools, gate_wait_timeout="300ms"
    )
    async with running(config) as processor:
        client = await submit(redis_url, unique, _req("w1"))
        # Each admission of the message counts one gate_closed decision: a second one means
        # the wait limit ended the first wait with a hand-back (a failure would have ended
        # it for good). Polled, not slept on: under load a round takes longer.
        with anyio.fail_after(30):
            while metric(processor, "llm_d_async_async_gate_decisions_total",
                         pool_name="p", reason="gate_closed") < 2:  # fmt: skip
                await anyio.sleep(0.05)
        assert await client.result_depth() == 0  # no terminal result
        r = aioredis.Redis.from_url(redis_url)
        # One transaction: read one at a time, a claim or hand-back between the two reads
        # counted the message twice or not at all.
        async with r.pipeline(transaction=True) as pipe:
            waiting, claimed = await pipe.zcard(unique).zcard(f"{unique}:claims-idx").execute()
        await r.aclose()
        requeues = metric(processor, REQUEUES, queue_name=unique)
        assert metric(processor, "llm_d_async_async_dispatched_requests_total") == 0
    assert waiting + claimed == 1  # still on the broker, unharmed
    assert requeues >= 1  # each hand-back at the wait limit counted, as upstream


async def test_result_routing_to_message_result_queue(
    redis_url: str, unique: str, simulator: SimulatorProcess
) -> None:
    async with running(sortedset_config(redis_url, simulator.url, unique)):
        client = SortedSetClient(redis_url, request_queue=unique, result_queue=f"{unique}:mine")
        await client.submit(_req("routed"))
        [result] = await client.drain_results(1, 10)
    assert isinstance(result, Result)
    assert result.id == "routed"


async def test_urgent_queue_served_promptly_behind_a_deep_batch_backlog(
    redis_url: str, unique: str, simulator: SimulatorProcess
) -> None:
    from async_processor.config import MergePolicyConfig

    simulator.configure(latency=0.01)
    batch_q, urgent_q = f"{unique}:batch", f"{unique}:urgent"
    transport = SortedSetConfig.model_validate({
        "url": redis_url, "result_queue_name": f"{unique}:results",
        "retry_queue_name": f"{unique}:retry", "poll_interval_ms": 50,
        "queues": [
            {"queue_name": batch_q, "igw_base_url": simulator.url, "labels": {"tier": "batch"}},
            {"queue_name": urgent_q, "igw_base_url": simulator.url,
             "labels": {"tier": "interactive"}},
        ],
    })  # fmt: skip
    config = AppConfig(
        transport="redis-sortedset", transport_config=transport,
        runtime=RuntimeConfig(health_port=0, metrics_port=0,  # the OS's ports: no race
                              bind_address="127.0.0.1", concurrency=1),
        merge_policy=MergePolicyConfig(type="tier-priority"),
    )  # fmt: skip
    client = SortedSetClient(redis_url, request_queue=batch_q, result_queue=f"{unique}:results")
    await client.submit_many([_req(f"b{i}") for i in range(150)])
    async with running(config):
        await anyio.sleep(0.5)  # the batch backlog is now buffered in its lane
        await client.submit(_req("urgent"), queue=urgent_q)
        results = await client.drain_results(151, 60)
    order = [r.id for r in results]
    assert len(order) == 151
    # One worker, 150 batch messages ahead of it: since fetching follows free slots and
    # queues take turns at them, it comes out within a few (the reference buffers up to
    # 1000 per lane ahead of it).
    assert order.index("urgent") < 75, order  # well ahead of the 150 queued before it


async def test_drain_timeout_cuts_in_flight_and_hands_everything_back_at_once(
    redis_url: str, unique: str, simulator: SimulatorProcess
) -> None:
    from async_processor.config import MergePolicyConfig

    simulator.configure(hang_rate=1.0)
    config = sortedset_config(
        redis_url, simulator.url, unique, concurrency=4, drain_timeout="500ms"
    )
    config = config.model_copy(update={"merge_policy": MergePolicyConfig(type="tier-priority")})
    client = await submit(redis_url, unique, *[_req(f"d{i}") for i in range(20)])
    processor = Processor(config)
    async with anyio.create_task_group() as tg:
        await tg.start(processor.run)
        while simulator.stats()["running"] < 4:
            await anyio.sleep(0.05)
        started = time.monotonic()
        processor.request_stop()
    took = time.monotonic() - started
    r = aioredis.Redis.from_url(redis_url)
    queued = await r.zcard(unique)
    inflight = await r.zcard(f"{unique}:claims-idx")
    assert took < 5, took  # 0.5 s drain timeout, not a 30 s lease
    assert (queued, inflight) == (20, 0)  # in flight and buffered: all back on the queue
    assert await client.result_depth() == 0


async def test_an_unexpected_error_ends_the_request_instead_of_the_daemon(
    redis_url: str, unique: str, simulator: SimulatorProcess
) -> None:
    from async_processor.config import TransformConfig
    from async_processor.transforms.base import TRANSFORMS

    class Broken:
        name = "broken"

        def validate(self, envelope: Envelope) -> None:
            return None

        async def apply(self, envelope: Envelope, out: object) -> None:
            if envelope.id == "boom":
                raise RuntimeError("bug in a plugin")

    TRANSFORMS.register("test-broken", GateParams)(lambda params, ctx: Broken())  # type: ignore[arg-type,return-value]
    try:
        config = sortedset_config(redis_url, simulator.url, unique).model_copy(update={
            "transforms": TransformConfig.model_validate(
                {"requestTransforms": [{"name": "b", "type": "test-broken"}]})})  # fmt: skip
        async with running(config):
            client = await submit(redis_url, unique, _req("boom"), _req("fine"))
            results = {r.id: r for r in await client.drain_results(2, 15)}
    finally:
        TRANSFORMS._entries.pop("test-broken")
    assert results["boom"].error_code == "INFERENCE_ERROR"
    assert "bug in a plugin" in results["boom"].error_message
    assert results["fine"].status_code == 200
