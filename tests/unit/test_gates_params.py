"""Gate config: param coercion as the reference does it, and one clear line per error."""

from __future__ import annotations

from typing import Any

import pytest

from async_processor.errors import ConfigError
from async_processor.gates.base import GATES, GateContext, GateOwner, build_gate
from async_processor.gates.basic import CompositeGate, LocalMaxConcurrencyGate, WaitOnRefuseGate
from async_processor.gates.leased_rate import LeasedRateParams
from async_processor.gates.redis import QuotaParams, RedisQuotaGate
from async_processor.gates.scrape import ScrapeParams
from async_processor.gates.tiers import TierPriorityAdmissionGate

ALL_TYPES = {
    "adaptive-concurrency",
    "composite",
    "constant",
    "endpoint-scrape",
    "local-max-concurrency",
    "prometheus-budget",
    "prometheus-query",
    "prometheus-saturation",
    "pool-headroom",
    "redis",
    "redis-leased-rate",
    "redis-quota",
    "tier-priority-admission",
    "wait-on-refuse",
}


def ctx(prometheus_url: str = "http://127.0.0.1:1") -> GateContext:
    return GateContext(owner=GateOwner("q", "q", "pool-a"), prometheus_url=prometheus_url)


def error_of(gate_type: str, params: dict[str, Any], context: GateContext | None = None) -> str:
    with pytest.raises(ConfigError) as info:
        build_gate(gate_type, params, context or ctx())
    text = str(info.value)
    assert "\n" not in text, text
    return text


def test_every_gate_type_registers() -> None:
    build_gate("constant", {}, ctx())  # loads the modules
    assert set(GATES.known()) == ALL_TYPES


def test_unknown_type_names_the_known_types() -> None:
    text = error_of("redis-quotaa", {})
    assert "unknown gate type 'redis-quotaa'" in text
    assert "redis-quota" in text and "wait-on-refuse" in text


@pytest.mark.parametrize(
    ("gate_type", "params", "expected"),
    [
        ("redis", {}, "address: Field required"),
        ("redis", {"address": "localhost"}, "address"),
        ("redis", {"address": "http://x:1"}, "redis://"),
        ("redis-quota", {"address": "h:1"}, "limit: Field required"),
        ("redis-quota", {"address": "h:1", "limit": 0}, "limit"),
        ("redis-quota", {"address": "h:1", "limit": "2", "window": "60"}, "window"),
        ("redis-quota", {"address": "h:1", "limit": "2", "window": 60}, "no unit"),
        ("redis-quota", {"address": "h:1", "limit": "2", "mode": "leaky"}, "mode"),
        ("redis-quota", {"address": "h:1", "limit": "2", "gating_mode": "x"}, "gating_mode"),
        # Upstream's strict checks (#452), in our one-line style with the closest choice.
        (
            "redis-quota",
            {"address": "h:1", "limit": 2, "mode": "rate_limit"},
            "mode: Input should be 'rate-limit' or 'concurrency' (did you mean 'rate-limit'?)",
        ),
        (
            "redis-quota",
            {"address": "h:1", "limit": 2, "gating_mode": "classify"},
            "'blocking' or 'classifying' (did you mean 'classifying'?)",
        ),
        ("redis-quota", {"address": "h:1", "limit": -1}, "limit: Input should be greater than 0"),
        (
            "redis-quota",
            {"address": "h:1", "limit": 2, "window": "0s"},
            "window: must be greater than 0 in mode rate-limit",
        ),
        (
            "endpoint-scrape",
            {"url": "u", "metric": "m", "admission": "count"},
            "admission: Input should be 'budget' or 'counted' (did you mean 'counted'?)",
        ),
        (
            "endpoint-scrape",
            {"url": "u", "metric": "m", "admission": "counted"},
            "admission counted needs max_count_per_pod > 0",
        ),
        (
            "endpoint-scrape",
            {
                "url": "u",
                "metric": "m",
                "admission": "counted",
                "max_count_per_pod": 2,
                "fallback": 0,
            },
            "takes no fallback",
        ),
        (
            "endpoint-scrape",
            {
                "url": "u",
                "metric": "m",
                "admission": "counted",
                "max_count_per_pod": 2,
                "baseline": "0.1",
            },
            "takes no baseline",
        ),
        ("endpoint-scrape", {"url": "u", "metric": "m", "absent_value": "idle"}, "absent_value"),
        ("local-max-concurrency", {"limit": "1.0"}, "not a base-10 integer"),
        ("local-max-concurrency", {"limit": 2.5}, "not an integer"),
        ("local-max-concurrency", {"limit": True}, "integer"),
        ("local-max-concurrency", {"limit": 3, "gating_mode": "fast"}, "gating_mode"),
        ("local-max-concurrency", {"limit": 3, "mode": "x"}, "mode: Extra inputs are not"),
        ("composite", {}, "gates: Field required"),
        ("composite", {"gates": "[]"}, "gates"),
        ("composite", {"gates": "not json"}, "not valid JSON"),
        ("composite", {"gates": [{"gate_type": "nope"}]}, "composite gate failed to create"),
        ("wait-on-refuse", {}, "gate: Field required"),
        ("prometheus-saturation", {}, "pool: Field required"),
        ("prometheus-saturation", {"pool": "p", "threshold": "high"}, "threshold"),
        ("prometheus-budget", {"pool": "p", "max_concurrency": 0}, "max_concurrency"),
        ("prometheus-budget", {"pool": "p", "baseline": 1}, "baseline"),
        ("prometheus-query", {}, "query: Field required"),
        ("endpoint-scrape", {"url": "http://x"}, "metric: Field required"),
        ("endpoint-scrape", {"url": "u", "metric": "m", "labels": "[1]"}, "labels"),
        ("endpoint-scrape", {"url": "u", "metric": "m", "value_type": "ratio"}, "value_type"),
        (
            "endpoint-scrape",
            {"url": "u", "metric": "m", "value_type": "budget", "max_count_per_pod": 4},
            "value_type budget",
        ),
        ("tier-priority-admission", {}, "saturation_gate: Field required"),
        ("tier-priority-admission", {"saturation_gate": "bogus"}, "unknown gate type"),
        ("redis-leased-rate", {"address": "h:1"}, "control_key: Field required"),
        ("redis-leased-rate", {"address": "h:1", "control_key": "c", "burst_seconds": 0}, "burst"),
        ("adaptive-concurrency", {"decrease_factor": 1}, "decrease_factor"),
        ("adaptive-concurrency", {"min_limit": 10, "initial_limit": 5}, "min_limit"),
        ("adaptive-concurrency", {"latency_target": "fast"}, "latency_target"),
    ],
)
def test_invalid_params_fail_with_one_line(
    gate_type: str, params: dict[str, Any], expected: str
) -> None:
    text = error_of(gate_type, params)
    assert expected in text
    assert gate_type in text or "composite" in text or "tier" in text


@pytest.mark.parametrize("gate_type", ["prometheus-saturation", "prometheus-budget"])
def test_prometheus_gates_need_the_url(gate_type: str) -> None:
    text = error_of(gate_type, {"pool": "p"}, ctx(prometheus_url=""))
    assert "requires --prometheus-url flag to be set" in text


def test_prometheus_query_needs_the_url() -> None:
    assert "--prometheus-url" in error_of("prometheus-query", {"query": "up"}, ctx(""))


def test_leased_rate_needs_a_pool() -> None:
    context = GateContext(owner=GateOwner("q", "q", ""))
    text = error_of("redis-leased-rate", {"address": "h:1", "control_key": "c"}, context)
    assert "pool_id" in text


def test_strings_and_numbers_are_coerced_like_the_reference() -> None:
    params = QuotaParams.model_validate(
        {"address": "h:6379", "limit": "5", "window": "1m30s", "attribute": 7, "prefix": ""}
    )
    assert params.limit == 5 and params.window == 90.0
    assert params.attribute == "7"  # a number becomes its text
    assert params.prefix == "quota:"  # empty string means the default
    assert QuotaParams.model_validate({"address": "h:1", "limit": 4.0}).limit == 4


def test_string_maps_may_be_json_strings() -> None:
    params = ScrapeParams.model_validate(
        {"url": "u", "metric": "m", "labels": '{"model_name": "x", "n": 1}', "pods_labels": ""}
    )
    assert params.labels == {"model_name": "x", "n": "1"}
    assert params.pods_labels == {}


def test_nested_gate_configs_may_be_strings_or_objects() -> None:
    gates = '[{"gate_type": "local-max-concurrency", "gate_params": "{\\"limit\\": \\"2\\"}"}]'
    composite = build_gate("composite", {"gates": gates}, ctx())
    assert isinstance(composite, CompositeGate)
    inner = composite.gates[0]
    assert isinstance(inner, LocalMaxConcurrencyGate) and inner.limit == 2
    wrapped = build_gate("wait-on-refuse", {"gate": {"gate_type": "constant"}}, ctx())
    assert isinstance(wrapped, WaitOnRefuseGate)
    tiers = build_gate(
        "tier-priority-admission",
        {"saturation_gate": "local-max-concurrency", "saturation_gate_params": '{"limit": 1}'},
        ctx(),
    )
    assert isinstance(tiers, TierPriorityAdmissionGate)
    assert isinstance(tiers.inner, LocalMaxConcurrencyGate)


def test_defaults_match_the_reference() -> None:
    quota = build_gate("redis-quota", {"address": "127.0.0.1:1", "limit": 1}, ctx())
    assert isinstance(quota, RedisQuotaGate)
    p = quota.params
    assert (p.attribute, p.mode, p.window, p.prefix, p.gating_mode) == (
        "userid",
        "rate-limit",
        60.0,
        "quota:",
        "blocking",
    )
    leased = LeasedRateParams.model_validate({"address": "h:1", "control_key": "ctl"})
    assert leased.state_key == "ctl:state" and leased.burst_seconds == 1.0
    local = build_gate("local-max-concurrency", {"limit": 3}, ctx())
    assert isinstance(local, LocalMaxConcurrencyGate)


def test_clients_are_shared_per_address_and_closed() -> None:
    context = ctx()
    a = build_gate("redis", {"address": "127.0.0.1:1"}, context)
    b = build_gate("redis-quota", {"address": "127.0.0.1:1", "limit": 1}, context)
    c = build_gate("redis", {"address": "redis://127.0.0.1:1/2"}, context)
    assert a._client is b._client  # type: ignore[attr-defined]
    assert a._client is not c._client  # type: ignore[attr-defined]
    assert len(context.closers) == 2
