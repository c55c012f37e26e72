"""The simulator as its own process over real HTTP: latency, capacity 429s, faults at their
rates, metrics following load, and run-time configuration."""

from __future__ import annotations

import time
from collections import Counter

import aiohttp
import anyio
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.fixtures.servers import stop_process
from tests.fixtures.simulator import SimulatorProcess, start_simulator

pytestmark = pytest.mark.anyio

BODY = {"model": "m", "prompt": "hello", "max_tokens": 10}


async def timed_post(session: aiohttp.ClientSession, url: str) -> tuple[int, float]:
    started = time.monotonic()
    async with session.post(url + "/v1/completions", json=BODY) as response:
        await response.read()
        return response.status, time.monotonic() - started


async def gauges(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with session.get(url + "/metrics") as response:
        text = await response.text()
    return {
        family.name: sum(s.value for s in family.samples)
        for family in text_string_to_metric_families(text)
    }


async def test_fixed_latency_and_token_latency_are_honoured(simulator: SimulatorProcess) -> None:
    # Lower bounds are exact (the server sleeps at least that long); upper bounds leave
    # room for a busy machine. The exact delay per setting is checked in the unit tests.
    slack = 2.0
    async with aiohttp.ClientSession() as session:
        status, fast = await timed_post(session, simulator.url)
        assert status == 200 and fast < slack
        simulator.configure(latency=0.3)
        status, slow = await timed_post(session, simulator.url)
        assert status == 200 and 0.3 <= slow < 0.3 + slack
        simulator.configure(latency=0, ttft=0.1, per_token=0.03)  # 0.1 + 10 × 0.03
        status, tokens = await timed_post(session, simulator.url)
        assert status == 200 and 0.4 <= tokens < 0.4 + slack


async def test_full_capacity_gives_429_with_retry_after(simulator: SimulatorProcess) -> None:
    simulator.configure(max_concurrent=2, max_waiting=1, latency=1.0, retry_after=3)
    results: list[tuple[int, dict[str, str]]] = []

    async def one(session: aiohttp.ClientSession) -> None:
        async with session.post(simulator.url + "/v1/completions", json=BODY) as response:
            results.append((response.status, dict(response.headers)))

    async with aiohttp.ClientSession() as session, anyio.create_task_group() as tg:
        for _ in range(3):
            tg.start_soon(one, session)
        with anyio.fail_after(5):  # two running, one waiting: now the server is full
            while simulator.stats()["waiting"] < 1:
                await anyio.sleep(0.02)
        for _ in range(2):
            tg.start_soon(one, session)
    statuses = Counter(status for status, _ in results)
    assert statuses == {200: 3, 429: 2}
    for status, headers in results:
        if status == 429:
            assert headers["Retry-After"] == "3"
            assert headers["x-llm-d-request-dropped-reason"] == "capacity"
    assert simulator.stats()["max_concurrent_seen"] == 2


async def test_error_rate_and_status(simulator: SimulatorProcess) -> None:
    simulator.configure(error_rate=0.3, error_status=503, seed=11)
    async with aiohttp.ClientSession() as session:
        statuses = Counter([(await timed_post(session, simulator.url))[0] for _ in range(300)])
    assert set(statuses) == {200, 503}
    assert 60 <= statuses[503] <= 120
    assert simulator.stats()["by_status"]["503"] == statuses[503]


async def test_reset_aborts_the_connection(simulator: SimulatorProcess) -> None:
    simulator.configure(reset_rate=1)
    async with aiohttp.ClientSession() as session:
        with pytest.raises(aiohttp.ClientError):
            await timed_post(session, simulator.url)
    assert simulator.stats()["by_status"] == {"reset": 1}


async def test_hang_holds_until_the_client_leaves(simulator: SimulatorProcess) -> None:
    simulator.configure(hang_rate=1)
    timeout = aiohttp.ClientTimeout(total=0.4)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        with pytest.raises(TimeoutError):
            await timed_post(session, simulator.url)
    with anyio.fail_after(3):
        while simulator.stats()["running"]:
            await anyio.sleep(0.05)
    assert simulator.stats()["by_status"] == {"hang": 1}


async def test_metrics_follow_load_up_and_down(simulator: SimulatorProcess) -> None:
    simulator.configure(max_concurrent=4, max_waiting=10, hang_rate=1)
    async with aiohttp.ClientSession() as session:
        assert (await gauges(session, simulator.url))["vllm:num_requests_running"] == 0
        async with anyio.create_task_group() as tg:
            for _ in range(6):
                tg.start_soon(timed_post, session, simulator.url)
            with anyio.fail_after(3):
                while simulator.stats()["waiting"] < 2:
                    await anyio.sleep(0.02)
            loaded = await gauges(session, simulator.url)
            tg.cancel_scope.cancel()  # the clients go away
        assert loaded["vllm:num_requests_running"] == 4
        assert loaded["vllm:num_requests_waiting"] == 2
        assert loaded["llm_d_epp_flow_control_pool_saturation"] == 1.0
        assert loaded["llm_d_epp_per_endpoint_queue_size"] == 2
        with anyio.fail_after(3):
            while (await gauges(session, simulator.url))["vllm:num_requests_running"]:
                await anyio.sleep(0.05)
        idle = await gauges(session, simulator.url)
    assert idle["vllm:num_requests_waiting"] == 0
    assert idle["llm_d_epp_flow_control_pool_saturation"] == 0


async def test_command_line_settings_and_recorded_headers() -> None:
    sim = start_simulator(
        "--latency", "0.2", "--max-concurrent", "3", "--pool", "gpu-a", "--epp-metrics", "both"
    )  # fmt: skip
    try:
        config = sim.configure()
        assert (config["latency"], config["max_concurrent"], config["pool"]) == (0.2, 3, "gpu-a")
        assert config["epp_metrics"] == "both"
        async with aiohttp.ClientSession() as session:
            headers = {"x-llm-d-inference-fairness-id": "tenant-1"}
            async with session.post(
                sim.url + "/v1/chat/completions", json=BODY, headers=headers
            ) as response:
                assert response.status == 200
        (recorded,) = sim.requests()
        assert recorded["path"] == "/v1/chat/completions"
        assert recorded["headers"]["x-llm-d-inference-fairness-id"] == "tenant-1"
        assert sim.reset()["total"] == 0
    finally:
        stop_process(sim.proc)
