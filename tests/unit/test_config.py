"""Config loading: flags > environment > defaults, REDIS_URL, files, one-line errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from async_processor.config import (
    FLAGS,
    GcpPubSubConfig,
    RedisPubSubConfig,
    SortedSetConfig,
    load_config,
)
from async_processor.errors import ConfigError
from async_processor.gates.base import GateContext, GateOwner, build_gate
from async_processor.gates.headroom import PoolHeadroomGate

QUEUE = {"queue_name": "q1", "igw_base_url": "http://gw:8000"}
SORTEDSET = {"url": "redis://127.0.0.1:6390/0", "queues": [QUEUE]}


def write(tmp_path: Path, name: str, content: Any) -> str:
    path = tmp_path / name
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return str(path)


def sortedset_args(tmp_path: Path, config: Any = None) -> list[str]:
    path = write(tmp_path, "transport.json", SORTEDSET if config is None else config)
    return ["--transport", "redis-sortedset", "--transport-config-file", path]


def error_of(argv: list[str], env: dict[str, str] | None = None) -> str:
    with pytest.raises(ConfigError) as caught:
        load_config(argv, env or {})
    message = str(caught.value)
    assert "\n" not in message
    return message


def test_defaults(tmp_path: Path) -> None:
    cfg = load_config(sortedset_args(tmp_path), {})
    rt = cfg.runtime
    assert (rt.concurrency, rt.request_timeout, rt.drain_timeout) == (64, 300.0, 120.0)
    assert rt.effective_gate_wait_timeout == 300.0
    assert (rt.health_port, rt.metrics_port, rt.bind_address) == (8081, 9090, "0.0.0.0")
    assert (rt.prometheus_cache_ttl, rt.metrics_backlog_poll_interval) == (5.0, 15.0)
    assert rt.deadline_header == "x-request-deadline"
    assert rt.max_message_bytes == 4 * 1024 * 1024
    assert cfg.merge_policy.type == "random-robin"
    assert [p.id for p in cfg.effective_pools()] == ["default"]
    assert cfg.effective_pools()[0].workers == 64


def test_default_transport_is_redis_pubsub() -> None:
    inline = json.dumps({"url": "redis://h:1", "queues": [QUEUE]})
    cfg = load_config(["--transport-config", inline], {})
    assert cfg.transport == "redis-pubsub"
    assert isinstance(cfg.transport_config, RedisPubSubConfig)


def test_flag_beats_env_beats_default(tmp_path: Path) -> None:
    args = sortedset_args(tmp_path)
    env = {"ASYNC_PROCESSOR_HEALTH_PORT": "7000", "ASYNC_PROCESSOR_REQUEST_TIMEOUT": "90s"}
    cfg = load_config(args, env)
    assert cfg.runtime.health_port == 7000
    assert cfg.runtime.request_timeout == 90.0
    assert cfg.runtime.effective_gate_wait_timeout == 90.0
    cfg = load_config([*args, "--health-port", "7001", "--request-timeout=1h30m"], env)
    assert cfg.runtime.health_port == 7001
    assert cfg.runtime.request_timeout == 5400.0
    assert cfg.runtime.metrics_port == 9090


def test_every_flag_has_its_env_variable(tmp_path: Path) -> None:
    names = {flag.option: flag.env for flag in FLAGS}
    assert names["--health-port"] == "ASYNC_PROCESSOR_HEALTH_PORT"
    assert names["--request-merge-policy-config-file"] == (
        "ASYNC_PROCESSOR_REQUEST_MERGE_POLICY_CONFIG_FILE"
    )
    path = write(tmp_path, "t.json", SORTEDSET)
    env = {
        "ASYNC_PROCESSOR_TRANSPORT": "redis-sortedset",
        "ASYNC_PROCESSOR_TRANSPORT_CONFIG_FILE": path,
        "ASYNC_PROCESSOR_TLS_INSECURE_SKIP_VERIFY": "true",
        "ASYNC_PROCESSOR_DEADLINE_HEADER": "x-deadline",
        "ASYNC_PROCESSOR_GATE_WAIT_TIMEOUT": "500ms",
    }
    cfg = load_config([], env)
    assert isinstance(cfg.transport_config, SortedSetConfig)
    assert cfg.runtime.tls.insecure_skip_verify is True
    assert cfg.runtime.deadline_header == "x-deadline"
    assert cfg.runtime.effective_gate_wait_timeout == 0.5


def test_boolean_flag_forms(tmp_path: Path) -> None:
    args = sortedset_args(tmp_path)
    assert load_config([*args, "--tls-insecure-skip-verify"], {}).runtime.tls.insecure_skip_verify
    env = {"ASYNC_PROCESSOR_TLS_INSECURE_SKIP_VERIFY": "true"}
    cfg = load_config([*args, "--tls-insecure-skip-verify=false"], env)
    assert cfg.runtime.tls.insecure_skip_verify is False


def test_empty_deadline_header_flag_disables_it(tmp_path: Path) -> None:
    cfg = load_config([*sortedset_args(tmp_path), "--deadline-header="], {})
    assert cfg.runtime.deadline_header == ""


def test_redis_url_fills_only_an_empty_url() -> None:
    env = {"REDIS_URL": "redis://from-env:6379/2"}
    no_url = json.dumps({"queues": [QUEUE]})
    cfg = load_config(["--transport", "redis-sortedset", "--transport-config", no_url], env)
    assert cfg.transport_config.url == "redis://from-env:6379/2"  # type: ignore[union-attr]
    explicit = json.dumps({"url": "redis://explicit:1/0", "queues": [QUEUE]})
    cfg = load_config(["--transport", "redis-sortedset", "--transport-config", explicit], env)
    assert cfg.transport_config.url == "redis://explicit:1/0"  # type: ignore[union-attr]


def test_gcp_transport_ignores_redis_url() -> None:
    gcp = {"project_id": "p", "result_topic_id": "r", "topics": [
        {"subscriber_id": "s1", "igw_base_url": "http://gw"}]}  # fmt: skip
    cfg = load_config(
        ["--transport", "gcp-pubsub", "--transport-config", json.dumps(gcp)],
        {"REDIS_URL": "redis://x:1"},
    )
    assert isinstance(cfg.transport_config, GcpPubSubConfig)
    assert [s.name for s in cfg.queue_specs()] == ["s1"]


def test_env_transport_source_hidden_by_a_flag_for_the_other(tmp_path: Path) -> None:
    env = {"ASYNC_PROCESSOR_TRANSPORT_CONFIG_FILE": "/nonexistent.json"}
    inline = json.dumps(SORTEDSET)
    cfg = load_config(["--transport", "redis-sortedset", "--transport-config", inline], env)
    assert [spec.name for spec in cfg.queue_specs()] == ["q1"]


def test_pools_merge_and_transform_files(tmp_path: Path) -> None:
    pools = write(tmp_path, "pools.json", [
        {"id": "default", "workers": 4},
        {"id": "batch", "workers": 2, "gate_type": "constant"},
    ])  # fmt: skip
    queues = [QUEUE, {**QUEUE, "queue_name": "q2", "worker_pool_id": "batch"}]
    merge = write(tmp_path, "merge.json", {"type": "tier-priority", "parameters": {"x": 1}})
    entry = {"name": "gcs", "type": "gcs_uri_multipart", "parameters": {"providers": ["a"]}}
    transforms = write(tmp_path, "tr.json", {"requestTransforms": [entry]})
    cfg = load_config(
        [*sortedset_args(tmp_path, {**SORTEDSET, "queues": queues}),
         "--pool-config-file", pools, "--request-merge-policy-config-file", merge,
         "--transform-config-file", transforms],
        {},
    )  # fmt: skip
    assert [(p.id, p.workers) for p in cfg.effective_pools()] == [("default", 4), ("batch", 2)]
    assert [s.pool for s in cfg.queue_specs()] == ["default", "batch"]
    assert cfg.merge_policy.type == "tier-priority"
    assert cfg.transforms.request_transforms[0].type == "gcs_uri_multipart"


def test_bearer_token_file(tmp_path: Path) -> None:
    token = write(tmp_path, "token", "abc123\n")
    cfg = load_config([*sortedset_args(tmp_path), "--metrics-bearer-token-file", token], {})
    assert cfg.runtime.metrics_bearer_token == "abc123"


@pytest.mark.parametrize(
    ("extra", "env", "expected"),
    [
        (["--concurrency", "0"], {}, "--concurrency='0'"),
        (["--health-port", "http"], {}, "--health-port='http'"),
        (["--metrics-port", "70000"], {}, "--metrics-port='70000'"),
        ([], {"ASYNC_PROCESSOR_DRAIN_TIMEOUT": "2 minutes"}, "ASYNC_PROCESSOR_DRAIN_TIMEOUT="),
        (["--request-timeout", "10"], {}, "invalid duration '10'"),
        (["--request-timeout=-5s"], {}, "--request-timeout='-5s': Input should be greater than 0"),
        # 0 handed a Wait-ed message back at once, to be re-claimed at once: a hot loop.
        (["--gate-wait-timeout=0s"], {}, "--gate-wait-timeout='0s': Input should be greater"),
        (["--prometheus-url", "prom:9090"], {}, "--prometheus-url"),
        (["--deadline-header", "bad header"], {}, "not a legal HTTP header name"),
        (["--tls-cert", "/etc/hosts"], {}, "--tls-cert and --tls-key must be given together"),
        (["--tls-ca-cert", "/nonexistent/ca.pem"], {}, "--tls-ca-cert /nonexistent/ca.pem"),
        (["--log-format", "xml"], {}, "--log-format: 'xml' is not one of"),
        (["--metrics-bearer-token-file", "/nonexistent"], {}, "cannot read"),
        (["--no-such-flag"], {}, "unrecognized arguments: --no-such-flag"),
        (["--transport", "kafka"], {}, "--transport: 'kafka' is not one of"),
    ],
)
def test_flag_errors_name_the_flag(
    tmp_path: Path, extra: list[str], env: dict[str, str], expected: str
) -> None:
    assert expected in error_of([*sortedset_args(tmp_path), *extra], env)


def test_transport_source_errors(tmp_path: Path) -> None:
    assert "one of --transport-config or --transport-config-file is required" in error_of([])
    path = write(tmp_path, "t.json", SORTEDSET)
    both = ["--transport-config", "{}", "--transport-config-file", path]
    assert "mutually exclusive" in error_of(both)
    assert "cannot read" in error_of(["--transport-config-file", str(tmp_path / "missing.json")])


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ('{"url": "redis://h:1", "queues": [', "malformed JSON: Expecting value at line 1"),
        ({**SORTEDSET, "queuez": []}, "queuez: Extra inputs are not permitted"),
        ({**SORTEDSET, "queues": [{**QUEUE, "gate_tipe": "x"}]}, "queues.0.gate_tipe"),
        ({**SORTEDSET, "queues": [{"queue_name": "q"}]}, "queues.0.igw_base_url: Field required"),
        ({**SORTEDSET, "queues": [{**QUEUE, "igw_base_url": "gw:80"}]}, "not an http(s) URL"),
        # A bad port or IPv6 literal failed every request at send time instead of here.
        ({**SORTEDSET, "queues": [{**QUEUE, "igw_base_url": "http://gw:80a"}]}, "not an http"),
        ({**SORTEDSET, "queues": [{**QUEUE, "igw_base_url": "http://[::1"}]}, "not an http"),
        ({**SORTEDSET, "url": "localhost:6379"}, "url: must be a redis://"),
        ({**SORTEDSET, "queues": [QUEUE, QUEUE]}, "duplicate 'q1'"),
        ({"queues": [QUEUE]}, "url is required for redis-sortedset (or set REDIS_URL)"),
        ({**SORTEDSET, "queues": [{**QUEUE, "worker_pool_id": "gpu"}]},
         "queue 'q1' names unknown worker_pool_id 'gpu' (pools: default)"),
    ],
)  # fmt: skip
def test_transport_file_errors_name_file_and_field(
    tmp_path: Path, config: Any, expected: str
) -> None:
    message = error_of(sortedset_args(tmp_path, config))
    assert message.startswith("--transport-config-file ")
    assert "transport.json" in message
    assert expected in message


@pytest.mark.parametrize(
    ("pools", "expected"),
    [
        ([{"id": "a", "workers": 1}, {"id": "a", "workers": 2}], "duplicate 'a'"),
        ([{"id": "default", "workers": 0}], "0.workers: Input should be greater than 0"),
        ([{"id": "default", "workers": 1, "extra": 1}], "0.extra: Extra inputs"),
        ({"id": "default"}, "Input should be a valid list"),
        ([], "at least one pool is required"),
        ([{"id": "other", "workers": 1}], "unknown worker_pool_id 'default' (pools: other)"),
    ],
)
def test_pool_file_errors(tmp_path: Path, pools: Any, expected: str) -> None:
    path = write(tmp_path, "pools.json", pools)
    message = error_of([*sortedset_args(tmp_path), "--pool-config-file", path])
    assert expected in message


def test_merge_and_transform_file_errors(tmp_path: Path) -> None:
    merge = write(tmp_path, "merge.json", {"type": "random-robin", "params": {}})
    message = error_of([*sortedset_args(tmp_path), "--request-merge-policy-config-file", merge])
    assert message.startswith("--request-merge-policy-config-file ")
    assert "params: Extra inputs are not permitted" in message
    entry = {"name": "a", "type": "t"}
    transforms = write(tmp_path, "tr.json", {"requestTransforms": [entry, entry]})
    message = error_of([*sortedset_args(tmp_path), "--transform-config-file", transforms])
    assert "requestTransforms[].name: duplicate 'a'" in message
    reserved = write(tmp_path, "tr2.json", {"responseTransforms": []})
    message = error_of([*sortedset_args(tmp_path), "--transform-config-file", reserved])
    assert "responseTransforms: Extra inputs are not permitted" in message


EXAMPLES = Path(__file__).resolve().parents[2] / "config"


@pytest.mark.parametrize(
    ("transport", "name", "queues"),
    [
        ("redis-sortedset", "sortedset.json", ["requests-interactive", "requests-batch"]),
        ("redis-sortedset", "harvest-sortedset.json", ["requests-batch"]),
        ("redis-pubsub", "redis-pubsub.json", ["request-queue"]),
        ("gcp-pubsub", "gcp-pubsub.json", ["async-requests-sub"]),
    ],
)
def test_example_transport_configs_load(transport: str, name: str, queues: list[str]) -> None:
    path = str(EXAMPLES / name)
    cfg = load_config(["--transport", transport, "--transport-config-file", path], {})
    assert [spec.name for spec in cfg.queue_specs()] == queues


@pytest.mark.parametrize("merge", ["merge-random-robin.json", "merge-tier-priority.json"])
def test_example_files_load_together(merge: str) -> None:
    cfg = load_config(
        ["--transport", "redis-sortedset",
         "--transport-config-file", str(EXAMPLES / "sortedset.json"),
         "--pool-config-file", str(EXAMPLES / "pools.json"),
         "--request-merge-policy-config-file", str(EXAMPLES / merge),
         "--transform-config-file", str(EXAMPLES / "transforms.json")],
        {},
    )  # fmt: skip
    assert [p.id for p in cfg.effective_pools()] == ["default", "bulk"]
    assert cfg.merge_policy.type == json.loads((EXAMPLES / merge).read_text())["type"]
    assert [t.name for t in cfg.transforms.request_transforms] == ["gcs-multipart"]
    specs = {spec.id: spec for spec in cfg.queue_specs()}
    assert specs["batch"].result_queue_name == "results-batch"
    assert specs["interactive"].labels == {"tier": "interactive"}


def test_the_harvest_recommendation_loads() -> None:
    cfg = load_config(
        ["--transport", "redis-sortedset",
         "--transport-config-file", str(EXAMPLES / "harvest-sortedset.json"),
         "--pool-config-file", str(EXAMPLES / "harvest-pools.json")],
        {},
    )  # fmt: skip
    (pool,) = cfg.effective_pools()
    assert [spec.pool for spec in cfg.queue_specs()] == [pool.id]
    gate = build_gate(pool.gate_type, pool.gate_params, GateContext(GateOwner(pool=pool.id)))
    assert isinstance(gate, PoolHeadroomGate)


def test_every_example_is_described_and_tested() -> None:
    readme = (EXAMPLES / "README.md").read_text()
    source = Path(__file__).read_text()
    for example in sorted(EXAMPLES.glob("*.json")):
        assert f"`{example.name}`" in readme
        assert f'"{example.name}"' in source


def test_kubernetes_service_link_env_is_not_taken_for_a_flag() -> None:
    from async_processor.config import parse_settings

    env = {
        "ASYNC_PROCESSOR_METRICS_PORT": "tcp://10.96.0.12:9090",
        "ASYNC_PROCESSOR_HEALTH_PORT": "9999",
    }
    settings = parse_settings([], env)
    assert "metrics_port" not in settings.values  # left to the default, not the link
    assert settings.get("health_port") == "9999"


@pytest.mark.parametrize("content", [{}, {"parameters": {"fairness_header": ""}}])
def test_merge_policy_file_without_type_is_a_startup_error(tmp_path: Path, content: Any) -> None:
    # The reference rejects it; taking it for random-robin would hide a forgotten type.
    merge = write(tmp_path, "merge.json", content)
    message = error_of([*sortedset_args(tmp_path), "--request-merge-policy-config-file", merge])
    assert message.startswith("--request-merge-policy-config-file ")
    assert "type: Field required" in message


def test_a_gate_param_of_exactly_env_name_comes_from_the_environment(tmp_path: Path) -> None:
    """So a gate's Redis password can come from a Secret, not the (ConfigMap) file."""
    params = {"address": "${QUOTA_URL}", "note": "cost ${QUOTA_URL}", "limit": 3}
    queue = {**QUEUE, "gate_type": "redis-quota", "gate_params": params}
    pool = {"id": "default", "workers": 2, "gate_type": "redis"}
    pools = write(tmp_path, "pools.json", [{**pool, "gate_params": '{"address": "${POOL_URL}"}'}])
    argv = [
        *sortedset_args(tmp_path, {**SORTEDSET, "queues": [queue]}),
        "--pool-config-file",
        pools,
    ]
    env = {"QUOTA_URL": "redis://u:secret@quota:6379/0", "POOL_URL": "redis://pool:6379/1"}
    cfg = load_config(argv, env)
    assert cfg.transport_config.queues[0].gate_params == {
        "address": env["QUOTA_URL"],
        "note": "cost ${QUOTA_URL}",
        "limit": 3,
    }
    assert cfg.pools[0].gate_params == {"address": env["POOL_URL"]}
    message = error_of(argv, {"QUOTA_URL": env["QUOTA_URL"]})
    assert "POOL_URL is not set" in message and "--pool-config-file" in message
    assert "QUOTA_URL is not set" in error_of(argv, {"QUOTA_URL": "", "POOL_URL": "x"})


def test_upstreams_claim_settings_load_and_set_the_lease_and_reclaim_interval() -> None:
    """A Go v0.9.1+ transport config names its claim lease and reclaim interval: it loads
    unchanged (a pod-by-pod switch uses one config), and the values are used."""
    queues = [{"queue_name": "q", "igw_base_url": "http://g"}]
    go = {"url": "redis://h:1", "queues": queues}
    upstream = SortedSetConfig.model_validate(
        {**go, "claim_lease_ttl_seconds": 300, "claim_reclaim_interval_ms": 15000}
    )
    assert (upstream.lease_seconds, upstream.reclaim_interval()) == (300.0, 15.0)
    ours = SortedSetConfig.model_validate(
        {**go, "lease_seconds": 5, "claim_lease_ttl_seconds": 300}
    )
    assert (ours.lease_seconds, ours.reclaim_interval()) == (5.0, 2.5)  # ours wins
    defaults = SortedSetConfig.model_validate({**go, "claim_lease_ttl_seconds": 0})
    assert (defaults.lease_seconds, defaults.reclaim_interval()) == (30.0, 15.0)
    for name in ("claim_lease_ttl_seconds", "claim_reclaim_interval_ms"):
        with pytest.raises(ValidationError, match=name):
            SortedSetConfig.model_validate({**go, name: -1})
