"""``gate_group``: queues that send to one endpoint share one queue-gate instance, so a
concurrency limit covers them together instead of once per queue (real Redis and the
simulator over HTTP)."""

from __future__ import annotations

import time
from typing import Any

import pytest
from pydantic import ValidationError

from async_processor.config import PoolConfig
from tests.fixtures.inprocess import running, sortedset_config, submit
from tests.fixtures.simulator import SimulatorProcess

pytestmark = pytest.mark.anyio


def _two_queues(redis_url: str, gateway: str, unique: str, group: str, **params: Any) -> Any:
    gate = {"gate_type": "local-max-concurrency", "gate_params": {"limit": 1, **params}}
    config = sortedset_config(
        redis_url, gateway, f"{unique}-a", pools=[PoolConfig(id="p", workers=4)],
        queue_extra={**gate, "gate_group": group},
    )  # fmt: skip
    transport = config.transport_config
    second = transport.queues[0].model_copy(update={"queue_name": f"{unique}-b"})
    queues = [transport.queues[0], second]
    return config.model_copy(
        update={"transport_config": transport.model_copy(update={"queues": queues})}
    )


@pytest.mark.parametrize(("group", "peak"), [("shared", 1), ("", 2)])
async def test_a_gate_group_limits_its_queues_together(
    redis_url: str, unique: str, simulator: SimulatorProcess, group: str, peak: int
) -> None:
    simulator.configure(latency=0.3)
    config = _two_queues(redis_url, simulator.url, unique, group)
    deadline = int(time.time()) + 60
    async with running(config) as processor:
        assert (processor.queue_gates[f"{unique}-a"] is processor.queue_gates[f"{unique}-b"]) == (
            group != ""
        )
        client_a = await submit(redis_url, f"{unique}-a")
        client_b = await submit(redis_url, f"{unique}-b")
        for n in range(3):
            await client_a.submit({"id": f"a{n}", "deadline": deadline, "payload": {}})
            await client_b.submit({"id": f"b{n}", "deadline": deadline, "payload": {}})
        done = await client_a.drain_results(3, 30) + await client_b.drain_results(3, 30)
    assert sorted(r.id for r in done) == ["a0", "a1", "a2", "b0", "b1", "b2"]
    assert simulator.stats()["max_concurrent_seen"] == peak


def test_a_group_must_share_endpoint_and_gate(redis_url: str, unique: str) -> None:
    config = _two_queues(redis_url, "http://gw:1", unique, "shared")
    data = config.model_dump(exclude={"runtime"})
    data["transport_config"]["queues"][1]["gate_params"] = {"limit": 2}
    with pytest.raises(ValidationError, match="gate_group 'shared'"):
        type(config).model_validate(data)
    data["transport_config"]["queues"][1]["gate_params"] = {"limit": 1}
    data["transport_config"]["queues"][1]["igw_base_url"] = "http://other:1"
    with pytest.raises(ValidationError, match="one endpoint"):
        type(config).model_validate(data)
