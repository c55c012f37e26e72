"""Gates inside the running pipeline (Processor, real redis-server, simulator process).

A quota slot taken at queue level comes back on the retry path (the reference leaked it
there), and a classifying quota feeds tier-priority-admission at pool level.
"""

from __future__ import annotations

import time
from typing import Any

import anyio
import pytest
import redis.asyncio as aioredis

from async_processor.config import AppConfig, PoolConfig
from async_processor.gates.tiers import TOO_MANY_REQUESTS
from tests.fixtures.inprocess import running, sortedset_config, submit
from tests.fixtures.simulator import SimulatorProcess

pytestmark = [pytest.mark.anyio, pytest.mark.slow]


def config(
    redis_url: str,
    gateway: str,
    queue: str,
    gate: dict[str, Any],
    pools: list[PoolConfig],
    gate_wait_timeout: str = "500ms",
) -> AppConfig:
    return sortedset_config(
        redis_url,
        gateway,
        queue,
        pools=pools,
        queue_extra={"labels": {"tier": "interactive"}, **gate},
        gate_wait_timeout=gate_wait_timeout,
    )


def request(request_id: str, user: str, ttl: float = 60) -> dict[str, Any]:
    deadline = int(time.time() + ttl)
    return {
        "id": request_id,
        "deadline": deadline,
        "payload": {"p": 1},
        "metadata": {"userid": user},
    }


async def count_when_settled(r: aioredis.Redis, key: str) -> str | None:
    """The quota count once releases have run (they follow the result write)."""
    value: Any = None
    with anyio.move_on_after(2.0):
        while (value := await r.get(key)) not in ("0", None):
            await anyio.sleep(0.05)
    return None if value is None else str(value)


def quota_gate(redis_url: str, unique: str, limit: int, gating_mode: str) -> dict[str, Any]:
    params = {
        "address": redis_url,
        "prefix": f"{unique}:",
        "mode": "concurrency",
        "limit": limit,
        "gating_mode": gating_mode,
    }
    return {"gate_type": "redis-quota", "gate_params": params}


async def test_quota_slot_comes_back_on_the_retry_path(
    redis_url: str, unique: str, simulator: SimulatorProcess
) -> None:
    simulator.configure(error_rate=1.0, error_status=503, latency=0.2)
    cfg = config(redis_url, simulator.url, unique, quota_gate(redis_url, unique, 1, "blocking"), [])
    r = aioredis.Redis.from_url(redis_url, decode_responses=True)
    async with running(cfg):
        client = await submit(redis_url, unique, request("a", "ann"), request("b", "ann"))
        await anyio.sleep(1.0)  # the first attempt failed with 503 and went to retry
        simulator.configure(error_rate=0.0)
        results = await client.drain_results(2, 20)
        key_after = await count_when_settled(r, f"{unique}:userid:ann")
    await r.aclose()
    assert sorted(res.status_code for res in results) == [200, 200]
    stats = simulator.stats()
    assert stats["by_status"].get("503", 0) >= 1  # at least one attempt went to retry
    assert stats["max_concurrent_seen"] == 1  # the quota held: one at a time
    assert key_after == "0"  # every slot given back, including the retried attempt's


async def test_classifying_quota_drives_tier_admission(
    redis_url: str, unique: str, simulator: SimulatorProcess
) -> None:
    closed = {"saturation_gate": "constant", "saturation_gate_params": {"value": 0}}
    pools = [PoolConfig(id="p", workers=4, gate_type="tier-priority-admission", gate_params=closed)]
    gate = quota_gate(redis_url, unique, 1, "classifying")
    cfg = config(redis_url, simulator.url, unique, gate, pools)
    r = aioredis.Redis.from_url(redis_url, decode_responses=True)
    async with running(cfg):
        client = await submit(redis_url, unique, request("held", "bo"))
        await anyio.sleep(0.3)  # "held" takes bo's only slot: reserved, parked at the pool
        await client.submit_many([request("extra", "bo")])
        [dropped] = await client.drain_results(1, 10)
        await anyio.sleep(0.8)  # past the gate-wait limit: "held" goes back to the broker
        extra_results = await client.drain_results(1, 0.5)
        depth = await r.zcard(unique) + await r.zcard(f"{unique}:claims-idx")
    key_after = await r.get(f"{unique}:userid:bo")
    await r.aclose()
    # Interactive overflow under saturation: dropped with the 429 payload, no HTTP call.
    assert dropped.id == "extra" and dropped.payload == TOO_MANY_REQUESTS
    assert (dropped.status_code, dropped.error_code) == (0, "")
    assert extra_results == []  # the reserved request got no result: it waits or is handed back
    assert depth == 1
    assert simulator.stats()["total"] == 0
    assert key_after == "0"  # handed back at shutdown or wait timeout: the slot is free


@pytest.mark.parametrize(
    ("pool_gate", "ttl", "error_code"),
    [
        # The pool gate's backend is down: a terminal GATE_ERROR, as the reference.
        (
            {"gate_type": "redis-quota", "gate_params": {"address": "127.0.0.1:1", "limit": 1}},
            60,
            "GATE_ERROR",
        ),
        # Parked at a closed pool gate until the deadline passes.
        (
            {
                "gate_type": "wait-on-refuse",
                "gate_params": {"gate": {"gate_type": "constant", "gate_params": {"value": 0}}},
            },
            2,
            "DEADLINE_EXCEEDED",
        ),
    ],
)
async def test_queue_quota_slot_comes_back_when_the_pool_gate_ends_the_request(
    redis_url: str,
    unique: str,
    simulator: SimulatorProcess,
    pool_gate: dict[str, Any],
    ttl: float,
    error_code: str,
) -> None:
    pools = [PoolConfig(id="p", workers=2, **pool_gate)]
    gate = quota_gate(redis_url, unique, 1, "blocking")
    cfg = config(redis_url, simulator.url, unique, gate, pools, gate_wait_timeout="1m")
    r = aioredis.Redis.from_url(redis_url, decode_responses=True)
    async with running(cfg):
        client = await submit(redis_url, unique, request("x", "cy", ttl=ttl))
        [result] = await client.drain_results(1, 10)
        key_after = await count_when_settled(r, f"{unique}:userid:cy")
    await r.aclose()
    assert result.error_code == error_code
    assert simulator.stats()["total"] == 0
    assert key_after == "0"


async def test_local_limit_at_pool_level_parks_workers_and_holds_the_cap(
    redis_url: str, unique: str, simulator: SimulatorProcess
) -> None:
    simulator.configure(latency=0.1)
    inner = {"gate_type": "local-max-concurrency", "gate_params": {"limit": 2}}
    pools = [
        PoolConfig(id="p", workers=16, gate_type="wait-on-refuse", gate_params={"gate": inner})
    ]
    cfg = config(redis_url, simulator.url, unique, {}, pools, gate_wait_timeout="1m")
    async with running(cfg):
        client = await submit(redis_url, unique, *[request(f"l{i}", "x") for i in range(20)])
        results = await client.drain_results(20, 15)
    assert sorted(r.status_code for r in results) == [200] * 20
    assert simulator.stats()["max_concurrent_seen"] == 2


async def test_leased_rate_ceiling_paces_the_pool(
    redis_url: str, unique: str, simulator: SimulatorProcess
) -> None:
    r = aioredis.Redis.from_url(redis_url, decode_responses=True)
    secs, micros = await r.time()
    lease = {
        "api_version": "llm-d.ai/v1alpha1",
        "pool_id": "p",
        "max_admission_rps": "10",
        "valid_until_unix_ms": str(secs * 1000 + micros // 1000 + 60_000),
        "decision_id": "d-7",
    }
    await r.hset(f"{unique}:lease", mapping=lease)  # type: ignore[arg-type]
    leased = {"address": redis_url, "control_key": f"{unique}:lease", "burst_seconds": 0.5}
    inner = {"gate_type": "redis-leased-rate", "gate_params": leased}
    pools = [
        PoolConfig(id="p", workers=16, gate_type="wait-on-refuse", gate_params={"gate": inner})
    ]
    cfg = config(redis_url, simulator.url, unique, {}, pools, gate_wait_timeout="1m")
    async with running(cfg):
        start = time.monotonic()
        client = await submit(redis_url, unique, *[request(f"z{i}", "x") for i in range(15)])
        results = await client.drain_results(15, 15)
        took = time.monotonic() - start
    await r.aclose()
    assert sorted(res.status_code for res in results) == [200] * 15
    # A burst of 5 then 10/s: the last of 15 cannot leave before ~1 s.
    assert 0.9 <= took < 5, took
