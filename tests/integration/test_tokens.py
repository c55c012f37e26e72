"""Token accounting per tenant: the daemon against real Redis and the
simulator over HTTP counts each answer's ``usage`` under the message's tenant, caps the
tenants, and leaves the gateway's body in the result unchanged."""

from __future__ import annotations

import json
import time
from collections import Counter
from typing import Any

import pytest

from async_processor.config import MergePolicyConfig
from tests.fixtures.inprocess import metric, running, sortedset_config, submit
from tests.fixtures.simulator import SimulatorProcess

pytestmark = pytest.mark.anyio

TOKENS = "llm_d_async_async_tokens_total"


def _req(request_id: str, tenant: str | None, prompt: str, max_tokens: int) -> dict[str, Any]:
    metadata = {"team": tenant} if tenant else {}
    payload = {"model": "m", "prompt": prompt, "max_tokens": max_tokens}
    deadline = int(time.time() + 120)
    return {"id": request_id, "deadline": deadline, "payload": payload, "metadata": metadata}


async def test_tokens_are_counted_per_tenant_with_a_cap(
    redis_url: str, unique: str, simulator: SimulatorProcess
) -> None:
    requests = [
        _req("a1", "alpha", "x" * 40, 3),
        _req("a2", "alpha", "y" * 400, 9),
        _req("b1", "beta", "z" * 80, 5),
        _req("c1", "gamma", "w" * 12, 2),  # the third tenant: past the cap of two
        _req("n1", None, "v" * 20, 4),
    ]
    config = sortedset_config(redis_url, simulator.url, unique, tenant_label_limit=2)
    config = config.model_copy(
        update={"merge_policy": MergePolicyConfig(parameters={"fairness_attribute": "team"})}
    )
    async with running(config) as processor:
        client = await submit(redis_url, unique, *requests[:3])  # alpha, beta come first
        results = await client.drain_results(3, 20)
        await client.submit_many(requests[3:])
        results += await client.drain_results(2, 20)
        counted = {
            (tenant, kind): metric(
                processor, TOKENS, queue_name=unique, pool_name="default", tenant=tenant, kind=kind
            )
            for tenant in ("alpha", "beta", "gamma", "other", "none")
            for kind in ("prompt", "completion")
        }
    tenant_of = {"a1": "alpha", "a2": "alpha", "b1": "beta", "c1": "other", "n1": "none"}
    expected: Counter[tuple[str, str]] = Counter()
    for result in results:
        usage = json.loads(result.payload)["usage"]  # the gateway body, as it came
        expected[(tenant_of[result.id], "prompt")] += usage["prompt_tokens"]
        expected[(tenant_of[result.id], "completion")] += usage["completion_tokens"]
    assert expected[("alpha", "completion")] == 12
    assert counted == {key: float(expected[key]) for key in counted}
    # The result keeps the gateway's bytes: the simulator's own json.dumps layout (spaces,
    # key order, usage last), not a re-encoding.
    for result in results:
        assert result.payload == json.dumps(json.loads(result.payload))
        assert result.payload.endswith(f'"total_tokens": {usage_total(result.payload)}}}}}')


def usage_total(payload: str) -> int:
    usage = json.loads(payload)["usage"]
    return int(usage["total_tokens"])
