"""The simulator's load-dependent pool as its own process over real HTTP: latency rising
with load, batch shed with a reason while interactive work never is, per-pod vLLM gauges
and per-class counters, and the fixed-latency flags untouched."""

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

BODY = {"model": "m", "prompt": "hello", "max_tokens": 20}  # 20 x 10 ms of decode
BATCH = {"x-gateway-priority": "-1"}


@pytest.fixture
def pooled() -> SimulatorProcess:
    sim = start_simulator(
        "--pods", "2", "--max-num-seqs", "4", "--inter-token-latency", "0.01",
        "--prefill-overhead", "0.05", "--time-factor-under-load", "3",
        "--scheduling-policy", "priority", "--shed-queue-depth", "1",
    )  # fmt: skip
    yield sim
    stop_process(sim.proc)


async def post(
    session: aiohttp.ClientSession, url: str, headers: dict[str, str] | None = None
) -> tuple[int, float, dict[str, str]]:
    started = time.monotonic()
    async with session.post(url + "/v1/completions", json=BODY, headers=headers) as r:
        await r.read()
        return r.status, time.monotonic() - started, dict(r.headers)


async def test_latency_rises_with_load_and_only_batch_is_shed(pooled: SimulatorProcess) -> None:
    async with aiohttp.ClientSession() as session:
        _, alone, headers = await post(session, pooled.url)
        assert float(headers["x-sim-ttft-seconds"]) == pytest.approx(0.05, abs=0.01)
        batch: list[tuple[int, float, dict[str, str]]] = []
        interactive: list[int] = []

        async def one_batch() -> None:
            batch.append(await post(session, pooled.url, BATCH))

        async def one_interactive() -> None:
            interactive.append((await post(session, pooled.url))[0])

        async with anyio.create_task_group() as tg:
            for _ in range(12):  # 8 fill both pods (KV use 1.0); the rest is shed
                tg.start_soon(one_batch)
            await anyio.sleep(0.1)
            for _ in range(3):  # the pool is saturated now: never shed all the same
                tg.start_soon(one_interactive)
        async with session.get(pooled.url + "/metrics") as r:
            families = {f.name: f for f in text_string_to_metric_families(await r.text())}
        async with session.get(pooled.url + "/admin/pool") as r:
            snapshot = await r.json()
    statuses = Counter(status for status, _, _ in batch)
    assert statuses == {200: 8, 429: 4}
    shed = [h for status, _, h in batch if status == 429]
    assert all(h["x-llm-d-request-dropped-reason"] == "pool-saturated" for h in shed)
    assert interactive == [200, 200, 200]
    slowest = max(elapsed for status, elapsed, _ in batch if status == 200)
    assert alone < 0.5 and slowest > 2 * alone  # the load factor and the queue
    pods = {s.labels["pod"] for s in families["vllm:num_requests_running"].samples}
    assert pods == {"sim-0", "sim-1"}
    assert "vllm:kv_cache_usage_perc" in families
    assert "vllm:num_requests_waiting" in families
    completed = {s.labels["class"]: s.value for s in families["sim_requests_completed"].samples}
    assert completed == {"interactive": 4.0, "batch": 8.0}
    assert snapshot["shed"] == {"interactive": 0, "batch": 4}
    assert snapshot["completed_slot_seconds"]["batch"] > 0


async def test_without_max_num_seqs_the_fixed_latency_flags_still_rule() -> None:
    sim = start_simulator("--latency", "0.2")
    try:
        async with aiohttp.ClientSession() as session:
            status, elapsed, headers = await post(session, sim.url, BATCH)
            async with session.get(sim.url + "/admin/pool") as r:
                assert r.status == 404
    finally:
        stop_process(sim.proc)
    assert status == 200 and 0.2 <= elapsed < 1.0
    assert "x-sim-ttft-seconds" not in headers
