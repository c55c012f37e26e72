"""The simulator's logic on the test's own loop: response shape, latency model, FIFO capacity,
fault draws, metrics and admin control."""

from __future__ import annotations

import json
import time
from typing import Any

import aiohttp
import anyio
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError

from async_processor.sim import app as simulator_module
from async_processor.sim.app import Simulator
from async_processor.sim.config import SimConfig
from tests.fixtures.simulator import LocalSimulator

pytestmark = pytest.mark.anyio


async def post(
    url: str, path: str = "/v1/completions", body: Any = None, **headers: str
) -> tuple[int, dict[str, str], bytes]:
    payload = json.dumps({"model": "m", "prompt": "hello"} if body is None else body)
    async with (
        aiohttp.ClientSession() as session,
        session.post(url + path, data=payload, headers=headers) as response,
    ):
        return response.status, dict(response.headers), await response.read()


def series(sim: Simulator) -> dict[str, list[tuple[dict[str, str], float]]]:
    text = generate_latest(sim.registry).decode()
    return {
        family.name: [(s.labels, s.value) for s in family.samples]
        for family in text_string_to_metric_families(text)
    }


async def wait_until(predicate: Any, timeout: float = 3.0) -> None:
    with anyio.fail_after(timeout):
        while not predicate():
            await anyio.sleep(0.01)


async def test_text_completion_echoes_model_and_counts_tokens(
    local_simulator: LocalSimulator,
) -> None:
    status, _, raw = await post(
        local_simulator.url, body={"model": "llama-x", "prompt": "p" * 40, "max_tokens": 5}
    )
    body = json.loads(raw)
    assert status == 200
    assert body["model"] == "llama-x"
    assert body["object"] == "text_completion"
    assert body["choices"][0]["text"].split() == ["tok"] * 5
    assert body["usage"] == {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}
    assert body["id"] and isinstance(body["created"], int)


async def test_chat_completion_answers_a_message_with_default_max_tokens(
    local_simulator: LocalSimulator,
) -> None:
    request = {"model": "chat-m", "messages": [{"role": "user", "content": "hi"}]}
    status, _, raw = await post(local_simulator.url, "/v1/chat/completions", request)
    body = json.loads(raw)
    assert status == 200
    assert body["object"] == "chat.completion"
    assert body["model"] == "chat-m"
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert body["usage"]["completion_tokens"] == simulator_module.DEFAULT_MAX_TOKENS


@pytest.mark.parametrize("body", [b"not json", b"[1, 2]", b'{"max_tokens": "many"}'])
async def test_a_bad_body_is_a_400(local_simulator: LocalSimulator, body: bytes) -> None:
    async with (
        aiohttp.ClientSession() as session,
        session.post(local_simulator.url + "/v1/completions", data=body) as response,
    ):
        assert response.status == 400
        assert (await response.json())["error"]["type"] == "invalid_request_error"


async def test_other_paths_are_not_served(local_simulator: LocalSimulator) -> None:
    status, _, _ = await post(local_simulator.url, "/v1/embeddings")
    assert status == 404


def test_delay_adds_fixed_latency_ttft_and_per_token_time() -> None:
    assert SimConfig().delay(100) == 0
    assert SimConfig(latency=0.5).delay(100) == 0.5
    assert SimConfig(ttft=0.1, per_token=0.01).delay(20) == pytest.approx(0.3)


def test_config_rejects_out_of_range_and_unknown_settings() -> None:
    for bad in ({"error_rate": 1.5}, {"latency": -1}, {"max_concurrent": -1}, {"typo": 1}):
        with pytest.raises(ValidationError):
            SimConfig(**bad)


async def test_sleeps_exactly_the_configured_delay_and_never_for_zero(
    local_simulator: LocalSimulator, monkeypatch: pytest.MonkeyPatch
) -> None:
    slept: list[float] = []

    async def spy(delay: float) -> None:
        slept.append(delay)

    monkeypatch.setattr(anyio, "sleep", spy)
    assert (await post(local_simulator.url))[0] == 200
    local_simulator.configure(latency=0.25)
    assert (await post(local_simulator.url))[0] == 200
    local_simulator.configure(latency=0, ttft=0.1, per_token=0.01)
    assert (await post(local_simulator.url, body={"prompt": "p", "max_tokens": 20}))[0] == 200
    assert (await post(local_simulator.url, body={"prompt": "p"}))[0] == 200  # 16 tokens
    assert slept == pytest.approx([0.25, 0.3, 0.26])


async def test_full_capacity_answers_429_with_retry_after_and_reason(
    local_simulator: LocalSimulator,
) -> None:
    local_simulator.configure(max_concurrent=1, max_waiting=1, latency=0.3, retry_after=2.5)
    statuses: list[int] = []

    async def one() -> None:
        statuses.append((await post(local_simulator.url))[0])

    async with anyio.create_task_group() as tg:
        tg.start_soon(one)
        await wait_until(lambda: local_simulator.stats()["running"] == 1)
        tg.start_soon(one)
        await wait_until(lambda: local_simulator.stats()["waiting"] == 1)
        status, headers, _ = await post(local_simulator.url)
    assert status == 429
    assert headers["Retry-After"] == "2.5"
    assert headers["x-llm-d-request-dropped-reason"] == "capacity"
    assert statuses == [200, 200]
    stats = local_simulator.stats()
    assert stats["max_concurrent_seen"] == 1
    assert stats["by_status"] == {"200": 2, "429": 1}


async def test_waiting_requests_run_in_arrival_order(local_simulator: LocalSimulator) -> None:
    local_simulator.configure(max_concurrent=1, max_waiting=10, latency=0.03)
    finished: list[int] = []

    async def one(i: int) -> None:
        await post(local_simulator.url, body={"prompt": str(i)})
        finished.append(i)

    async with anyio.create_task_group() as tg:
        for i in range(6):
            tg.start_soon(one, i)
            await wait_until(lambda i=i: local_simulator.stats()["total"] == i + 1)
    assert finished == list(range(6))


async def test_a_client_leaving_the_queue_gives_its_place_back(
    local_simulator: LocalSimulator,
) -> None:
    local_simulator.configure(max_concurrent=1, max_waiting=1, latency=0.4)
    async with anyio.create_task_group() as tg:
        tg.start_soon(post, local_simulator.url)
        await wait_until(lambda: local_simulator.stats()["running"] == 1)
        with anyio.move_on_after(0.1):
            await post(local_simulator.url)  # queued, then abandoned
        await wait_until(lambda: local_simulator.stats()["waiting"] == 0)
        # The place is free again: the next request queues instead of getting a 429.
        assert (await post(local_simulator.url))[0] == 200
    assert local_simulator.stats()["running"] == 0


async def test_raising_capacity_at_run_time_admits_the_waiting(
    local_simulator: LocalSimulator,
) -> None:
    local_simulator.configure(max_concurrent=1, max_waiting=5, latency=0.5)
    async with anyio.create_task_group() as tg:
        for _ in range(4):
            tg.start_soon(post, local_simulator.url)
        await wait_until(lambda: local_simulator.stats()["waiting"] == 3)
        local_simulator.configure(max_concurrent=10)
        stats = local_simulator.stats()
        assert (stats["running"], stats["waiting"]) == (4, 0)
    assert local_simulator.stats()["max_concurrent_seen"] == 4


def test_faults_follow_their_rates_and_repeat_with_a_seed() -> None:
    config = SimConfig(reset_rate=0.1, hang_rate=0.2, error_rate=0.3, seed=7)
    sim_a, sim_b = Simulator(config), Simulator(config)
    a = [sim_a._draw_fault(config) for _ in range(4000)]
    b = [sim_b._draw_fault(config) for _ in range(4000)]
    assert a == b
    for name, rate in (("reset", 0.1), ("hang", 0.2), ("error", 0.3), ("", 0.4)):
        assert a.count(name) / len(a) == pytest.approx(rate, abs=0.03)


def test_metrics_carry_the_labels_the_gate_queries_select_on() -> None:
    sim = Simulator(SimConfig(pool="p1", namespace="ns", model="m1", ready_pods=3))
    got = series(sim)
    assert got["vllm:num_requests_running"][0][0] == {
        "model_name": "m1",
        "inference_pool": "p1",
        "namespace": "ns",
    }
    assert got["llm_d_epp_ready_endpoints"] == [({"name": "p1", "namespace": "ns"}, 3.0)]
    per_endpoint = got["llm_d_epp_per_endpoint_queue_size"]
    assert len({labels["model_server_endpoint"] for labels, _ in per_endpoint}) == 3
    assert got["llm_d_epp_flow_control_queue_size"][0][0]["inference_pool"] == "p1"
    saturation = got["llm_d_epp_flow_control_pool_saturation"]
    assert saturation == [({"inference_pool": "p1", "namespace": "ns"}, 0.0)]
    assert not [name for name in got if name.startswith(("inference_pool", "inference_ext"))]


@pytest.mark.parametrize("mode", ["legacy", "both"])
def test_legacy_epp_names_behind_a_setting(mode: str) -> None:
    got = series(Simulator(SimConfig(pool="p1", namespace="ns", ready_pods=2, epp_metrics=mode)))
    assert got["inference_pool_ready_pods"] == [({"name": "p1", "namespace": "ns"}, 2.0)]
    per_pod = got["inference_pool_per_pod_queue_size"]
    assert {labels["model_server_pod"] for labels, _ in per_pod} == {"sim-0", "sim-1"}
    assert got["inference_extension_flow_control_queue_size"][0][0]["inference_pool"] == "p1"
    assert got["inference_extension_flow_control_pool_saturation"][0][1] == 0.0
    current = [name for name in got if name.startswith("llm_d_epp_")]
    assert len(current) == (4 if mode == "both" else 0)


async def test_metrics_follow_running_and_waiting(local_simulator: LocalSimulator) -> None:
    local_simulator.configure(max_concurrent=4, max_waiting=10, latency=0.5, ready_pods=2)
    sim = local_simulator.sim
    async with anyio.create_task_group() as tg:
        for _ in range(6):
            tg.start_soon(post, local_simulator.url)
        await wait_until(lambda: sim.stats["waiting"] == 2)
        got = series(sim)
        assert got["vllm:num_requests_running"][0][1] == 4
        assert got["vllm:num_requests_waiting"][0][1] == 2
        assert got["llm_d_epp_flow_control_queue_size"][0][1] == 2
        assert [v for _, v in got["llm_d_epp_per_endpoint_queue_size"]] == [1.0, 1.0]
        assert got["llm_d_epp_flow_control_pool_saturation"][0][1] == 1.0
        tg.cancel_scope.cancel()
    await wait_until(lambda: sim.stats["running"] == 0)
    assert series(sim)["vllm:num_requests_running"][0][1] == 0


async def test_admin_endpoints_change_config_and_report(local_simulator: LocalSimulator) -> None:
    url = local_simulator.url
    async with aiohttp.ClientSession() as session:
        async with session.post(url + "/admin/config", json={"latency": 0.05}) as response:
            assert response.status == 200
            assert (await response.json())["latency"] == 0.05
        async with session.post(url + "/admin/config", json={"error_rate": 2}) as response:
            assert response.status == 400
        assert local_simulator.sim.config.latency == 0.05
        started = time.monotonic()
        await post(url, **{"x-request-tag": "abc"})
        assert time.monotonic() - started >= 0.05
        async with session.get(url + "/admin/stats") as response:
            assert (await response.json())["by_status"] == {"200": 1}
        async with session.get(url + "/admin/requests") as response:
            (recorded,) = await response.json()
        assert recorded["headers"]["x-request-tag"] == "abc"
        assert json.loads(recorded["body"])["prompt"] == "hello"
        async with session.post(url + "/admin/reset") as response:
            assert (await response.json())["total"] == 0
        assert local_simulator.requests() == []
        async with session.get(url + "/healthz") as response:
            assert response.status == 200


async def test_recorded_requests_are_bounded(local_simulator: LocalSimulator) -> None:
    sim = local_simulator.sim
    for i in range(simulator_module.RECORDED_REQUESTS + 5):
        sim._recorded.append(("/v1/completions", {}, str(i).encode()))
    recorded = local_simulator.requests()
    assert len(recorded) == simulator_module.RECORDED_REQUESTS
    assert recorded[-1]["body"] == str(simulator_module.RECORDED_REQUESTS + 4)


def test_main_rejects_invalid_settings(capsys: pytest.CaptureFixture[str]) -> None:
    assert simulator_module.main(["--error-rate", "3"]) == 2
    assert "error_rate" in capsys.readouterr().out


async def test_the_in_flight_integral_counts_every_request_for_its_whole_stay(
    local_simulator: LocalSimulator,
) -> None:
    # A hand-set clock: request-seconds are exact, no timing in the test. One request runs,
    # one waits for the slot; both are in flight at the gateway.
    now = [100.0]
    sim = local_simulator.sim
    sim.occupancy.clock = lambda: now[0]
    local_simulator.reset()
    local_simulator.configure(max_concurrent=1, max_waiting=1, hang_rate=1.0)
    async with anyio.create_task_group() as tg:
        tg.start_soon(post, local_simulator.url)
        await wait_until(lambda: local_simulator.stats()["in_flight"] == 1)
        now[0] = 101.0
        tg.start_soon(post, local_simulator.url)
        await wait_until(lambda: local_simulator.stats()["in_flight"] == 2)
        now[0] = 104.0
        stats = local_simulator.stats()
        assert (stats["clock"], stats["in_flight_seconds"]) == (104.0, 1 * 1 + 2 * 3)
        assert stats["in_flight_peak"] == 2
        tg.cancel_scope.cancel()  # the clients leave; the hung handlers end with them
    await wait_until(lambda: local_simulator.stats()["in_flight"] == 0)
    now[0] = 110.0
    assert local_simulator.stats()["in_flight_seconds"] == 7.0  # nothing since they left
    local_simulator.reset()
    assert local_simulator.stats()["in_flight_seconds"] == 0.0
    assert local_simulator.stats()["in_flight_peak"] == 0  # the peak starts again too
