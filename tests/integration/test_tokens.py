"""Token accounting per tenant: the daemon against real Redis and the
simulator over HTTP counts each answer's ``usage`` under the message's tenant, caps the
tenants, and leaves the gateway's body in the result unchanged, whatever its usage says."""

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
            for kind in ("prompt", "completion", "total")
        }
    tenant_of = {"a1": "alpha", "a2": "alpha", "b1": "beta", "c1": "other", "n1": "none"}
    expected: Counter[tuple[str, str]] = Counter()
    for result in results:
        usage = json.loads(result.payload)["usage"]  # the gateway body, as it came
        expected[(tenant_of[result.id], "prompt")] += usage["prompt_tokens"]
        expected[(tenant_of[result.id], "completion")] += usage["completion_tokens"]
        expected[(tenant_of[result.id], "total")] += usage["total_tokens"]
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


INVALID = "llm_d_async_async_token_usage_invalid_total"
# (usage the gateway sends, tokens that must be counted by kind, whether it is invalid)
HOSTILE: list[tuple[str, dict[str, int], bool]] = [
    ('{"prompt_tokens": ' + "9" * 401 + ', "completion_tokens": 2}', {"completion": 2}, True),
    ('{"prompt_tokens": 1' + "0" * 300 + ', "total_tokens": 5}', {"total": 5}, True),
    ('{"prompt_tokens": -4, "completion_tokens": 1e300, "total_tokens": true}', {}, True),
    ('{"prompt_tokens": "7", "completion_tokens": {"n": [1]}, "total_tokens": 3.0}', {}, True),
    ('{"prompt_tokens": ' + "[" * 2000 + "]" * 2000 + "}", {}, True),
    ('"lots"', {}, True),
    ("null", {}, False),
    ('{"prompt_tokens": 8, "total_tokens": 8}', {"prompt": 8, "total": 8}, False),  # embeddings
    ('{"prompt_tokens": 3, "completion_tokens": 4}', {"prompt": 3, "completion": 4, "total": 7},
     False),
]  # fmt: skip


async def test_a_hostile_usage_leaves_the_answer_a_success_and_counts_only_valid_fields(
    redis_url: str, unique: str, simulator: SimulatorProcess
) -> None:
    config = sortedset_config(redis_url, simulator.url, unique)
    config = config.model_copy(
        update={"merge_policy": MergePolicyConfig(parameters={"fairness_attribute": "team"})}
    )
    expected: Counter[str] = Counter()
    async with running(config) as processor:
        client = await submit(redis_url, unique)
        for n, (usage, counts, _) in enumerate(HOSTILE):
            simulator.configure(usage_json=usage)
            # "none" as a tenant id: counted as "other", never as the no-tenant series.
            await client.submit_many([_req(f"h{n}", "none", "p" * 20, 2)])
            [result] = await client.drain_results(1, 20)
            assert (result.id, result.status_code, result.error_code) == (f"h{n}", 200, "")
            assert result.payload.endswith(f'"usage": {usage}}}')  # the gateway's bytes
            expected.update(counts)
        counted = {
            kind: metric(processor, TOKENS, queue_name=unique, tenant="other", kind=kind)
            for kind in ("prompt", "completion", "total")
        }
        invalid = metric(processor, INVALID, queue_name=unique, pool_name="default")
        no_tenant = metric(processor, TOKENS, queue_name=unique, tenant="none")
    assert counted == {kind: float(expected[kind]) for kind in counted}
    assert invalid == sum(bad for _, _, bad in HOSTILE)
    assert no_tenant == 0


def token_series(processor: Any, queue: str) -> dict[tuple[str, str, str], float]:
    return {
        (s.labels["direction"], s.labels["tenant"], s.labels["kind"]): s.value
        for family in processor.metrics.registry.collect()
        for s in family.samples
        if s.name == TOKENS and s.labels["queue_name"] == queue
    }


@pytest.mark.parametrize("kind_total", [True, False])
async def test_upstreams_direction_series_exist_from_the_start_and_add_up(
    redis_url: str, unique: str, simulator: SimulatorProcess, kind_total: bool
) -> None:
    config = sortedset_config(redis_url, simulator.url, unique, tokens_kind_total=kind_total)
    async with running(config) as processor:
        # At 0 before the first answer, so increase() and upstream's dashboards see the queue.
        assert token_series(processor, unique) == {
            ("input", "none", "prompt"): 0.0,
            ("output", "none", "completion"): 0.0,
        }
        client = await submit(redis_url, unique, _req("d1", None, "x" * 40, 3))
        [result] = await client.drain_results(1, 20)
        series = token_series(processor, unique)
    usage = json.loads(result.payload)["usage"]
    expected = {
        ("input", "none", "prompt"): float(usage["prompt_tokens"]),
        ("output", "none", "completion"): float(usage["completion_tokens"]),
    }
    if kind_total:  # deprecated, still on by default: no direction, so sum by (direction)
        expected[("", "none", "total")] = float(usage["total_tokens"])  # keeps the pair apart
    assert series == expected
    upstream_sum = sum(v for (direction, _, _), v in series.items() if direction)
    assert upstream_sum == usage["prompt_tokens"] + usage["completion_tokens"]
