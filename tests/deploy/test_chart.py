"""Helm chart: render every example, lint, schema, render-time checks, rules and dashboard.

Rendering and linting use helm-python-sdk (Helm's Go SDK bundled in the wheel; no helm
binary). The rendered args and files are fed to the daemon's own config loader, the alert
rules to ``promtool``, and the dashboard's metric names are compared with what
``async_processor.metrics.Metrics`` registers and with a live /metrics. One slow test runs
the rendered container spec as a real daemon process (private Redis, simulator).
Not covered: applying the objects to a cluster (no API server here).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from async_processor.config import (
    GcpPubSubConfig,
    MergePolicyConfig,
    PoolConfig,
    PubSubTopic,
    RedisPubSubConfig,
    RedisQueue,
    SortedSetConfig,
    SortedSetQueue,
    TransformConfig,
    TransformEntry,
    load_config,
)
from async_processor.durations import parse_duration
from async_processor.gates.base import GateContext, GateOwner, build_gate
from async_processor.health import serve_metrics
from async_processor.messages import ErrorCode, Result
from async_processor.metrics import Metrics
from async_processor.pipeline.daemon import HARD_STOP_GRACE
from async_processor.pipeline.reload import ReloadMetrics
from tests.fixtures.servers import free_port, require_binary, require_module, stop_process
from tests.fixtures.simulator import SimulatorProcess

helm = require_module("helm_python", "helm-python-sdk is a dev dependency")
helm.disable_logging()

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "async-processor"
DOCS = [ROOT / "docs" / f"{name}.md" for name in (
    "operations", "sizing-and-backpressure", "security", "migrating-from-go", "metrics-and-alerts"
)]  # fmt: skip
EXAMPLES = sorted((CHART / "ci").glob("*.yaml"))
NAMESPACE = "batch"
CONFIG_DIR = "/etc/async-processor/config"
METRIC_NAME = re.compile(r"\bllm_d_async_[a-z0-9_]+")
MINIMAL: dict[str, Any] = {
    "ap": {
        "igwBaseURL": "http://gateway.llm-d.svc",
        "transportConfig": {"queues": [{"queue_name": "q"}]},
        "redis": {"enabled": True, "secretName": "redis-creds"},
    }
}


# ----------------------------------------------------------------------------- helpers


def parse_docs(text: str) -> Iterator[dict[str, Any]]:
    """Every non-empty YAML document of a multi-document stream (parsed by Helm's parser)."""
    for doc in re.split(r"^---\s*$", text, flags=re.MULTILINE):
        if doc.strip() and not all(
            line.lstrip().startswith("#") for line in doc.strip().splitlines()
        ):
            yield helm.values_from_yaml(doc)


def load_values(path: Path) -> dict[str, Any]:
    values: dict[str, Any] = helm.values_from_yaml(path.read_text())
    return values


def render(values: dict[str, Any], name: str = "demo") -> dict[str, dict[str, Any]]:
    """Rendered objects keyed by kind (the chart makes at most one of each, but ConfigMaps)."""
    with helm.Chart.load(str(CHART)) as chart:
        manifests = chart.render(values, name=name, namespace=NAMESPACE, is_install=True)
    objects: dict[str, dict[str, Any]] = {}
    for path, text in manifests.items():
        if path.endswith("NOTES.txt"):
            continue
        for obj in parse_docs(text):
            key = obj["kind"]
            suffix = obj["metadata"]["name"].rsplit("-", 1)[-1]
            if key == "ConfigMap" or suffix in ("epp", "modelserver", "exporter", "api"):
                key += ":" + suffix
            assert key not in objects, f"two {key} objects"
            objects[key] = obj
    return objects


def with_ap(**ap: Any) -> dict[str, Any]:
    return {"ap": {**MINIMAL["ap"], **ap}}


def container(objects: dict[str, dict[str, Any]]) -> dict[str, Any]:
    pod = objects["Deployment"]["spec"]["template"]["spec"]
    assert len(pod["containers"]) == 1
    c: dict[str, Any] = pod["containers"][0]
    return c


def env_of(c: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c.get("env") or []}


def populated_metrics() -> Metrics:
    """A fresh Metrics() with one of every label set in use, so every family has samples."""
    m = Metrics()
    queue = m.queue("q", "q", "default")
    queue.dead_letter("no_id")
    queue.no_answer("cut_short")  # bound at the first attempt without an answer
    queue.message_latency.observe(1)  # registered by the first Pub/Sub ack
    queue.gate_gauges("pool")
    queue.result_written(Result.failure("r", ErrorCode.GATE_DROPPED, ""), None, 0.0)
    m.set_build_info("0", "redis-sortedset")
    m.result_route_rejected_total.labels("q", "reserved_key")  # made by the sorted-set transport
    m.abandoned_total.labels("q", "write_failed")
    m.dead_letter_trimmed_total.labels("q")
    m.legacy_claims_returned_total.labels("q")
    m.duplicates_suppressed_total.labels("q", "q", "default")
    m.pool_worker_limit.labels("default").set(1)
    m.tokens_total.labels("q", "q", "default", "", "none", "total")  # deprecated kind="total"
    m.token_usage_invalid_total.labels("q", "default")  # the first answer with junk usage
    m.results_trimmed_total.labels("result-list")  # made by the sorted-set transport
    m.discovery_refused_total.labels("daemon_key")  # made by sorted-set queue discovery
    ReloadMetrics(m.registry)  # registered when --transport-config-watch-interval is on
    m.backlog.failed(queue.labels, proximity=True)  # the first backlog poll
    # Gate gauges register when their gate is built: build one of each kind that has them.
    ctx = GateContext(owner=GateOwner("", "", "default"), metrics=m)
    build_gate("adaptive-concurrency", None, ctx)
    build_gate("redis-leased-rate", {"address": "127.0.0.1:1", "control_key": "k"}, ctx)
    build_gate("pool-headroom", {"url": "http://127.0.0.1:1/metrics", "max_num_seqs": 1}, ctx)
    return m


def exported_names() -> set[str]:
    """The daemon's series names and the exporter's families (new and deprecated)."""
    from prometheus_client import CollectorRegistry

    from async_processor.ops.exporter import Exporter

    daemon = {s.name for family in populated_metrics().registry.collect() for s in family.samples}
    queues = [{"queue_name": "q", "igw_base_url": "http://gw"}]
    transport = json.dumps({"url": "redis://r:6379/0", "queues": queues})
    config = load_config(["--transport", "redis-sortedset", "--transport-config", transport], {})
    registry = CollectorRegistry()
    Exporter(config, registry)
    return daemon | {family.name for family in registry.collect()}


# ---------------------------------------------------------------- every example renders


def test_there_are_examples() -> None:
    assert len(EXAMPLES) >= 4


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_example_lints_clean(example: Path) -> None:
    report = helm.lint(str(CHART), load_values(example), strict=True, namespace=NAMESPACE)
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_example_passes_the_schema(example: Path) -> None:
    with helm.Chart.load(str(CHART)) as chart:
        chart.validate_schema(load_values(example))


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_example_renders_args_and_files_the_daemon_accepts(example: Path, tmp_path: Path) -> None:
    """The rendered args + ConfigMap files go through the daemon's own config loader."""
    values = load_values(example)
    objects = render(values)
    for name, text in objects["ConfigMap:config"]["data"].items():
        (tmp_path / name).write_text(text)
    for secret_file in ("ca.crt", "tls.crt", "tls.key", "token"):
        (tmp_path / secret_file).write_text("x")
    mounts = (CONFIG_DIR, "/etc/tls", "/etc/async-processor/metrics-token")
    args = container(objects)["args"]
    assert args[0] == "run"
    local = [re.sub("|".join(map(re.escape, mounts)), str(tmp_path), a) for a in args[1:]]
    config = load_config(local, {"REDIS_URL": "redis://redis:6379"})
    ap = values["ap"]
    assert config.transport == ap["transport"]
    entries = ap["transportConfig"].get("queues") or ap["transportConfig"]["topics"]
    assert len(config.queue_specs()) == len(entries)
    assert [p.id for p in config.pools] == [p["id"] for p in ap.get("workerPools", [])]
    assert config.runtime.drain_timeout == parse_duration(ap.get("drainTimeout", "2m"))


def test_gate_secrets_reach_the_gate_params_through_the_environment(tmp_path: Path) -> None:
    """The ConfigMap holds "${QUOTA_URL}"; the Secret's value arrives through the env."""
    quota = {"address": "${QUOTA_URL}", "attribute": "user", "limit": 4}
    queue = {"queue_name": "q", "gate_type": "redis-quota", "gate_params": quota}
    secret = {"env": "QUOTA_URL", "secretName": "quota-redis", "secretKey": "url"}
    objects = render(with_ap(transportConfig={"queues": [queue]}, gateSecrets=[secret]))
    assert env_of(container(objects))["QUOTA_URL"] == {
        "secretKeyRef": {"name": "quota-redis", "key": "url"}
    }
    files = objects["ConfigMap:config"]["data"]
    assert "${QUOTA_URL}" in files["transport-config.json"] and "@" not in str(files)
    (tmp_path / "t.json").write_text(files["transport-config.json"])
    env = {"REDIS_URL": "redis://redis:6379", "QUOTA_URL": "redis://app:pw@quota:6379/0"}
    argv = ["--transport", "redis-sortedset", "--transport-config-file", str(tmp_path / "t.json")]
    config = load_config(argv, env)
    assert config.transport_config.queues[0].gate_params["address"] == env["QUOTA_URL"]


@pytest.mark.parametrize(
    "where",
    [
        {"transportConfig": {"queues": [{"queue_name": "q", "gate_type": "redis-quota",
                                         "gate_params": {"address": "redis://u:pw@h:6379/0"}}]}},
        {"workerPools": [{"id": "default", "workers": 1, "gate_type": "redis",
                          "gate_params": '{"address": "rediss://:pw@h:6379"}'}]},
    ],
    ids=["queue", "pool-json-string"],
)  # fmt: skip
def test_a_password_in_gate_params_fails_the_render(where: dict[str, Any]) -> None:
    with pytest.raises(Exception, match=r"carries a password.*ap\.gateSecrets"):
        render(with_ap(**where))
    without = json.loads(re.sub(r"//[^/@]*:pw@", "//", json.dumps(where)))  # no password
    render(with_ap(**without))


# ------------------------------------------------------------------ the Deployment shape


def test_deployment_args_env_mounts_and_probes() -> None:
    objects = render(load_values(CHART / "ci" / "sortedset-values.yaml"))
    c = container(objects)
    assert c["args"] == [
        "run",
        "--transport=redis-sortedset",
        f"--transport-config-file={CONFIG_DIR}/transport-config.json",
        f"--pool-config-file={CONFIG_DIR}/worker-pools.json",
        f"--request-merge-policy-config-file={CONFIG_DIR}/request-merge-policy.json",
        "--drain-timeout=3m",  # no --concurrency: the pools size themselves
        "--request-timeout=10m",
        "--prometheus-url=http://prometheus-operated.monitoring.svc:9090",
        "--prometheus-cache-ttl=5s",
        "--health-port=8081",
        "--metrics-port=9090",
        "--log-level=info",
        "--log-format=json",
    ]
    assert env_of(c)["REDIS_URL"] == {"secretKeyRef": {"name": "redis-creds", "key": "url"}}
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    assert mounts["config"] == {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True}
    assert mounts["tmp"]["mountPath"] == "/tmp"
    pod = objects["Deployment"]["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["config"]["configMap"]["name"] == "demo-async-processor-config"
    assert "emptyDir" in volumes["tmp"]
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "health"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert c["startupProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"metrics": 9090, "health": 8081}
    assert pod["terminationGracePeriodSeconds"] == 250
    assert pod["affinity"]["podAntiAffinity"]
    assert pod["serviceAccountName"] == objects["ServiceAccount"]["metadata"]["name"]
    # The metrics Service would otherwise inject ASYNC_PROCESSOR_METRICS_PORT=tcp://...
    assert pod["enableServiceLinks"] is False


def test_concurrency_is_passed_only_without_pools() -> None:
    assert "--concurrency=12" in container(render(with_ap(concurrency=12)))["args"]
    pools = [{"id": "default", "workers": 8}]
    args = container(render(with_ap(concurrency=12, workerPools=pools)))["args"]
    assert not [a for a in args if a.startswith("--concurrency")]


def test_env_from_whole_secrets_and_config_maps() -> None:
    env_from = [{"secretRef": {"name": "gate-creds"}}, {"configMapRef": {"name": "flags"}}]
    assert container(render(with_ap(envFrom=env_from)))["envFrom"] == env_from
    assert "envFrom" not in container(render(MINIMAL))


def test_service_monitor_scrapes_the_metrics_service_with_the_release_label() -> None:
    values = with_ap(
        serviceMonitor={"enabled": True, "interval": "15s", "labels": {"release": "prom"}},
        metrics={"service": {"enabled": False}, "bearerToken": {"secretName": "tok"}},
    )
    objects = render(values)
    monitor = objects["ServiceMonitor"]
    assert monitor["metadata"]["labels"]["release"] == "prom"
    service = objects["Service"]  # rendered for the ServiceMonitor although disabled
    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    )
    [endpoint] = monitor["spec"]["endpoints"]
    assert endpoint["port"] == service["spec"]["ports"][0]["name"] == "metrics"
    assert endpoint["interval"] == "15s"
    assert endpoint["relabelings"][0]["targetLabel"] == "release"
    bearer = {"type": "Bearer", "credentials": {"name": "tok", "key": "token"}}
    assert endpoint["authorization"] == bearer and "bearerTokenSecret" not in endpoint
    assert "ServiceMonitor" not in render(MINIMAL)


def test_container_runs_non_root_with_a_read_only_root_filesystem() -> None:
    objects = render(MINIMAL)
    sc = container(objects)["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["runAsNonRoot"] is True
    assert sc["capabilities"]["drop"] == ["ALL"]
    pod_sc = objects["Deployment"]["spec"]["template"]["spec"]["securityContext"]
    assert pod_sc["runAsUser"] != 0
    assert pod_sc["seccompProfile"] == {"type": "RuntimeDefault"}
    assert container(objects)["resources"]["limits"]["memory"]


@pytest.mark.parametrize("drain", ["2m", "90s", "1m30s", "1.5m", "1h30m", "0", "500ms", "2m0.5s"])
def test_grace_period_covers_the_longest_stop(drain: str) -> None:
    """Kubernetes' SIGKILL must not come before the daemon's own hard stop (drain timeout
    + HARD_STOP_GRACE, which the writer's 30 s flush with Redis hung ends within)."""
    pod = render(with_ap(drainTimeout=drain))["Deployment"]["spec"]["template"]["spec"]
    hard_stop = math.ceil(parse_duration(drain) + HARD_STOP_GRACE)
    assert pod["terminationGracePeriodSeconds"] == hard_stop + 10


def test_config_checksum_follows_the_config_files_only() -> None:
    def checksum(values: dict[str, Any]) -> str:
        pod = render(values)["Deployment"]["spec"]["template"]
        return str(pod["metadata"]["annotations"]["checksum/config"])

    base = checksum(MINIMAL)
    assert checksum(with_ap(transportConfig={"queues": [{"queue_name": "other"}]})) != base
    assert checksum(with_ap(workerPools=[{"id": "default", "workers": 3}])) != base
    assert checksum(with_ap(concurrency=3)) == base


def test_gateway_url_is_filled_only_where_missing() -> None:
    values = with_ap(
        transportConfig={
            "queues": [
                {"queue_name": "a"},
                {"queue_name": "b", "igw_base_url": "https://own.example"},
            ]
        }
    )
    data = render(values)["ConfigMap:config"]["data"]
    queues = json.loads(data["transport-config.json"])["queues"]
    assert [q["igw_base_url"] for q in queues] == [
        "http://gateway.llm-d.svc",
        "https://own.example",
    ]
    assert set(data) == {"transport-config.json"}


def test_gcp_example_traces_and_mounts_the_tls_secret() -> None:
    objects = render(load_values(CHART / "ci" / "gcp-pubsub-values.yaml"))
    c = container(objects)
    env = env_of(c)
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector.observability.svc:4317"
    assert env["OTEL_TRACES_SAMPLER_ARG"] == "0.1"
    assert env["OTEL_SERVICE_NAME"] == "async-processor"
    assert "k8s.pod.name=$(POD_NAME)" in env["OTEL_RESOURCE_ATTRIBUTES"]
    assert "REDIS_URL" not in env
    assert {"--tls-ca-cert=/etc/tls/ca.crt", "--tls-cert=/etc/tls/tls.crt"} <= set(c["args"])
    assert {"--tls-key=/etc/tls/tls.key", "--log-level=debug"} <= set(c["args"])
    tls = next(m for m in c["volumeMounts"] if m["name"] == "tls")
    assert tls["mountPath"] == "/etc/tls" and tls["readOnly"] is True
    sa = objects["ServiceAccount"]["metadata"]["annotations"]
    assert sa["iam.gke.io/gcp-service-account"].startswith("async-processor@")


def test_redis_modes_reach_the_daemon_with_tls_files_from_a_secret(tmp_path: Path) -> None:
    """Sentinel mode, TLS files from ``ap.redis.tlsSecretName`` (mounted read-only) and
    the URL with the ACL password from the Redis Secret, not the ConfigMap."""
    transport = {
        "mode": "sentinel",
        "sentinels": ["sentinel-0.redis:26379", "sentinel-1.redis:26379"],
        "sentinel_master": "mymaster",
        "tls_ca_cert": "/etc/redis-tls/ca.crt",
        "wait_replicas": 1,
        "queues": [{"queue_name": "q"}],
    }
    values = with_ap(
        transportConfig=transport,
        redis={"enabled": True, "secretName": "redis-creds", "tlsSecretName": "redis-tls"},
    )
    with helm.Chart.load(str(CHART)) as chart:
        chart.validate_schema(values)
    objects = render(values)
    c = container(objects)
    mount = next(m for m in c["volumeMounts"] if m["name"] == "redis-tls")
    assert mount == {"name": "redis-tls", "mountPath": "/etc/redis-tls", "readOnly": True}
    volumes = objects["Deployment"]["spec"]["template"]["spec"]["volumes"]
    assert {"name": "redis-tls", "secret": {"secretName": "redis-tls"}} in volumes
    assert env_of(c)["REDIS_URL"]["secretKeyRef"]["name"] == "redis-creds"
    for name, text in objects["ConfigMap:config"]["data"].items():
        (tmp_path / name).write_text(text)
    args = [a.replace(CONFIG_DIR, str(tmp_path)) for a in c["args"][1:]]
    config = load_config(args, {"REDIS_URL": "rediss://daemon:pw@ignored:6379/0"})
    conn = config.transport_config.redis_connection()  # type: ignore[union-attr]
    assert (conn.mode, conn.sentinel_master, conn.tls_ca_cert) == (
        "sentinel",
        "mymaster",
        "/etc/redis-tls/ca.crt",
    )


def test_custom_image_and_pull_secrets_reach_the_pod() -> None:
    objects = render(load_values(CHART / "ci" / "redis-pubsub-values.yaml"))
    pod = objects["Deployment"]["spec"]["template"]["spec"]
    assert pod["imagePullSecrets"] == [{"name": "regcred"}]
    c = container(objects)
    assert c["image"] == "registry.example.com/async-processor:0.1.0-rc1"
    assert c["imagePullPolicy"] == "Always"
    assert c["args"][-1] == "--gate-wait-timeout=30s"  # extraArgs come last
    assert {"Service", "PodDisruptionBudget"}.isdisjoint(objects)


def test_otel_env_is_absent_without_an_endpoint() -> None:
    assert not [k for k in env_of(container(render(MINIMAL))) if k.startswith("OTEL_")]


def test_env_is_omitted_when_empty_and_extra_env_passes_through() -> None:
    redis_in_config = {
        "redis": {"enabled": False},
        "transportConfig": {"url": "redis://r:6379", "queues": [{"queue_name": "q"}]},
    }
    assert "env" not in container(render(with_ap(**redis_in_config)))
    extra = [{"name": "FOO", "value": "bar"}]
    env = env_of(container(render(with_ap(extraEnv=extra))))
    assert list(env) == ["REDIS_URL", "FOO"]
    assert env["FOO"] == "bar"


def test_insecure_skip_verify_is_passed_as_a_flag() -> None:
    values = with_ap(tls={"insecureSkipVerify": True})
    assert "--tls-insecure-skip-verify=true" in container(render(values))["args"]


def test_inference_ttl_header_is_a_flag_when_asked_for() -> None:
    assert (
        "--inference-ttl-header=true" in container(render(with_ap(inferenceTTLHeader=True)))["args"]
    )
    assert not any("inference-ttl" in a for a in container(render(with_ap()))["args"])


def test_tokens_kind_total_is_turned_off_by_a_flag() -> None:
    assert "--tokens-kind-total=false" in container(render(with_ap(tokensKindTotal=False)))["args"]
    assert not any("tokens-kind" in a for a in container(render(with_ap()))["args"])


def test_keda_example_scales_on_the_broker_backlog() -> None:
    objects = render(load_values(CHART / "ci" / "keda-values.yaml"))
    assert "replicas" not in objects["Deployment"]["spec"]  # KEDA owns the count
    scaled = objects["ScaledObject"]["spec"]
    assert scaled["scaleTargetRef"]["name"] == objects["Deployment"]["metadata"]["name"]
    assert (scaled["minReplicaCount"], scaled["maxReplicaCount"]) == (2, 20)
    trigger = scaled["triggers"][0]
    assert trigger["type"] == "prometheus"
    assert "llm_d_async_async_broker_backlog" in trigger["metadata"]["query"]
    assert f'namespace="{NAMESPACE}"' in trigger["metadata"]["query"]
    assert trigger["metadata"]["threshold"] == "500"
    assert objects["PodDisruptionBudget"]["spec"] == {
        "minAvailable": 1,
        "selector": objects["Deployment"]["spec"]["selector"],
    }


SCALE_TO_ZERO = CHART / "ci" / "scale-to-zero-values.yaml"


def test_scale_to_zero_reads_the_exporters_backlog() -> None:
    objects = render(load_values(SCALE_TO_ZERO))
    scaled = objects["ScaledObject"]["spec"]
    assert scaled["minReplicaCount"] == 0
    [trigger] = scaled["triggers"]
    assert trigger["type"] == "metrics-api"
    service = objects["Service:exporter"]
    port = service["spec"]["ports"][0]["port"]
    name = service["metadata"]["name"]
    assert trigger["metadata"]["url"] == f"http://{name}.{NAMESPACE}.svc:{port}/backlog"
    assert trigger["metadata"]["valueLocation"] == "backlog"
    assert trigger["metadata"]["targetValue"] == "300"
    assert trigger["metadata"]["authMode"] == "bearer"  # the exporter checks the metrics token
    assert trigger["authenticationRef"] == {"name": "async-processor-exporter-token"}
    # Zero daemons is normal here: no absent() alert.
    assert "AsyncProcessorDown" not in {r["alert"] for r in rules_of(objects)}


def test_exporter_is_one_replica_of_the_same_image_on_the_same_config(tmp_path: Path) -> None:
    from async_processor.config import parse_settings
    from async_processor.ops.exporter import _flags

    objects = render(load_values(SCALE_TO_ZERO))
    exporter = objects["Deployment:exporter"]
    assert exporter["spec"]["replicas"] == 1
    [c] = exporter["spec"]["template"]["spec"]["containers"]
    assert c["image"] == container(objects)["image"]
    assert env_of(c)["REDIS_URL"] == env_of(container(objects))["REDIS_URL"]
    assert c["args"][0] == "exporter"
    # Its args go through the exporter's own parser and the daemon's config loader.
    for name, text in objects["ConfigMap:config"]["data"].items():
        (tmp_path / name).write_text(text)
    (tmp_path / "token").write_text("t")
    mounts = (CONFIG_DIR, "/etc/async-processor/metrics-token")
    local = [re.sub("|".join(map(re.escape, mounts)), str(tmp_path), a) for a in c["args"][1:]]
    settings = parse_settings(local, {}, extend=_flags)
    assert settings.extra["interval"] == 10.0
    assert settings.extra["no_legacy_metric_names"] is True
    own = ("--interval", "--no-legacy-metric-names")  # the exporter's, not the daemon's
    config = load_config([a for a in local if not a.startswith(own)], {"REDIS_URL": "redis://r"})
    assert config.runtime.metrics_bearer_token == "t"
    # The daemon's selectors (Service, PDB, PodMonitor) never pick the exporter's pod.
    pod_labels = exporter["spec"]["template"]["metadata"]["labels"]
    daemon = objects["Deployment"]["spec"]["selector"]["matchLabels"]
    assert not daemon.items() <= pod_labels.items()
    service = objects["Service:exporter"]["spec"]["selector"]
    assert service.items() <= pod_labels.items()


def test_exporter_serves_the_deprecated_names_until_turned_off() -> None:
    from async_processor.ops.exporter import _flags

    values = load_values(SCALE_TO_ZERO)
    [c] = render(values)["Deployment:exporter"]["spec"]["template"]["spec"]["containers"]
    assert "--no-legacy-metric-names" in c["args"]  # the example turns them off
    del values["ap"]["exporter"]["legacyMetricNames"]
    [c] = render(values)["Deployment:exporter"]["spec"]["template"]["spec"]["containers"]
    assert "--no-legacy-metric-names" not in c["args"]  # by default: one release with both
    parser = argparse.ArgumentParser()
    _flags(parser)
    assert parser.parse_args(["--no-legacy-metric-names"]).no_legacy_metric_names is True


def test_gcp_scales_on_keda_own_pubsub_scaler_per_subscription() -> None:
    values = load_values(CHART / "ci" / "gcp-pubsub-values.yaml")
    values["ap"]["keda"] = {"enabled": True, "minReplicaCount": 0, "authenticationRef": "gcp"}
    scaled = render(values)["ScaledObject"]["spec"]
    topics = values["ap"]["transportConfig"]["topics"]
    project = values["ap"]["transportConfig"]["project_id"]
    assert [t["type"] for t in scaled["triggers"]] == ["gcp-pubsub"] * len(topics)
    names = [t["metadata"]["subscriptionName"] for t in scaled["triggers"]]
    assert names == [f"projects/{project}/subscriptions/{t['subscriber_id']}" for t in topics]
    assert all(t["metadata"]["mode"] == "SubscriptionSize" for t in scaled["triggers"])
    assert all(t["authenticationRef"] == {"name": "gcp"} for t in scaled["triggers"])


def test_metrics_bearer_token_reaches_daemon_and_pod_monitor() -> None:
    objects = render(load_values(CHART / "ci" / "keda-values.yaml"))
    args = container(objects)["args"]
    assert "--metrics-bearer-token-file=/etc/async-processor/metrics-token/token" in args
    endpoint = objects["PodMonitor"]["spec"]["podMetricsEndpoints"][0]
    # authorization, not the Prometheus Operator's deprecated bearerTokenSecret.
    assert endpoint["authorization"] == {
        "type": "Bearer",
        "credentials": {"name": "async-processor-metrics-token", "key": "token"},
    }
    assert "bearerTokenSecret" not in endpoint
    assert endpoint["port"] == "metrics"


def test_gate_source_monitors_scrape_the_epp_and_the_model_servers() -> None:
    epp = {"enabled": True, "selector": {"llm-d-router-standalone": "router"}}
    epp |= {"namespaceSelector": {"matchNames": ["llm-d"]}}
    epp |= {"bearerTokenSecret": {"name": "epp-metrics-reader"}}
    model = {"enabled": True, "poolLabel": "llm-d.ai/pool", "inferencePool": "llama"}
    objects = render(with_ap(eppMonitor=epp, modelServerMonitor=model))
    assert "PodMonitor" not in objects  # the daemon's own monitor stays off
    spec = objects["PodMonitor:epp"]["spec"]
    assert spec["selector"] == {"matchLabels": {"llm-d-router-standalone": "router"}}
    assert spec["namespaceSelector"] == {"matchNames": ["llm-d"]}
    (endpoint,) = spec["podMetricsEndpoints"]
    assert (endpoint["port"], endpoint["path"], endpoint["interval"]) == (
        "metrics",
        "/metrics",
        "15s",
    )
    assert endpoint["authorization"] == {
        "type": "Bearer",
        "credentials": {"name": "epp-metrics-reader", "key": "token"},
    }
    assert "relabelings" not in endpoint
    spec = objects["PodMonitor:modelserver"]["spec"]
    assert spec["selector"] == {"matchLabels": {"llm-d.ai/role": "decode"}}  # the Go default
    assert "namespaceSelector" not in spec
    (endpoint,) = spec["podMetricsEndpoints"]
    assert endpoint["port"] == "modelserver" and "authorization" not in endpoint
    # The pod label (sanitised as Prometheus does) becomes inference_pool, else "llama".
    pool = {"targetLabel": "inference_pool"}
    assert endpoint["relabelings"] == [
        {"sourceLabels": ["__meta_kubernetes_pod_label_llm_d_ai_pool"], **pool},
        {"sourceLabels": ["inference_pool"], "regex": "^$", "replacement": "llama", **pool},
    ]


def test_redis_url_lives_only_in_the_secret() -> None:
    url = "redis://:s3cret@redis.example:6379/0"
    objects = render(with_ap(redis={"enabled": True, "url": url}))
    assert objects["Secret"]["stringData"] == {"url": url}
    ref = env_of(container(objects))["REDIS_URL"]["secretKeyRef"]
    assert ref == {"name": objects["Secret"]["metadata"]["name"], "key": "url"}
    others = [o for k, o in objects.items() if k != "Secret"]
    assert "s3cret" not in json.dumps(others)


def test_install_notes_name_the_release() -> None:
    with helm.Chart.load(str(CHART)) as chart:
        manifests = chart.render(MINIMAL, name="demo", namespace=NAMESPACE, is_install=True)
    notes = manifests["async-processor/templates/NOTES.txt"]
    assert f"kubectl -n {NAMESPACE} rollout status deploy/demo-async-processor" in notes
    assert "curl -s localhost:8081/readyz" in notes


def test_optional_objects_are_off_by_default() -> None:
    kinds = set(render(MINIMAL))
    optional = {"PodMonitor", "PodMonitor:epp", "PodMonitor:modelserver", "PrometheusRule"}
    assert (optional | {"ScaledObject", "ConfigMap:dashboards"}).isdisjoint(kinds)
    assert {"Deployment", "ServiceAccount", "Service", "PodDisruptionBudget"} <= kinds


def test_metrics_service_targets_the_pods() -> None:
    objects = render(MINIMAL)
    service = objects["Service"]["spec"]
    assert service["ports"] == [
        {"name": "metrics", "port": 9090, "targetPort": "metrics", "protocol": "TCP"},
        {"name": "health", "port": 8081, "targetPort": "health", "protocol": "TCP"},  # helm test
    ]
    assert service["selector"] == objects["Deployment"]["spec"]["selector"]["matchLabels"]


# ----------------------------------------------------------------- render-time failures


@pytest.mark.parametrize(
    ("ap", "message"),
    [
        ({"igwBaseURL": ""}, "has no igw_base_url and ap.igwBaseURL is empty"),
        ({"transportConfig": {}}, "ap.transportConfig.queues is empty"),
        ({"redis": {"enabled": True}}, "neither ap.redis.url nor ap.redis.secretName"),
        ({"redis": {"enabled": False}}, "needs the URL of your Redis (this chart installs none)"),
        (
            {
                "redis": {"enabled": False},
                "transportConfig": {"url": "redis://:pw@r:6379", "queues": [{"queue_name": "q"}]},
            },
            "carries credentials",
        ),
        (
            {
                "transport": "gcp-pubsub",
                "transportConfig": {"result_topic_id": "r", "topics": [{"subscriber_id": "s"}]},
            },
            "project_id is required",
        ),
        ({"metrics": {"port": 8081}}, "need their own ports"),
        ({"tls": {"secretName": "t", "certKey": "tls.crt"}}, "must be set together"),
        ({"tls": {"caCertKey": "ca.crt"}}, "ap.tls.secretName, which is empty"),
        ({"keda": {"enabled": True}}, "needs ap.keda.serverAddress"),
        ({"eppMonitor": {"enabled": True}}, "ap.eppMonitor.selector is empty"),
        (
            {"keda": {"enabled": True, "serverAddress": "http://p", "minReplicaCount": 0}},
            "minReplicaCount 0 needs ap.exporter.enabled",
        ),
        (
            {
                "transport": "redis-pubsub",
                "exporter": {"enabled": True},
                "keda": {"enabled": True, "minReplicaCount": 0},
            },
            "not possible with redis-pubsub",
        ),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_bad_values_fail_at_render_with_a_clear_message(ap: dict[str, Any], message: str) -> None:
    with pytest.raises(helm.HelmRenderError, match=re.escape(message)):
        render(with_ap(**ap))


def test_default_values_fail_until_a_queue_is_configured() -> None:
    with helm.Chart.load(str(CHART)) as chart:
        chart.validate_schema({})  # the defaults themselves are valid
    with pytest.raises(helm.HelmRenderError, match=r"transportConfig\.queues is empty"):
        render({})


@pytest.mark.parametrize(
    ("ap", "where"),
    [
        ({"drainTimeout": "2 minutes"}, "/ap/drainTimeout"),
        ({"transport": "kafka"}, "/ap/transport"),
        ({"concurrency": 0}, "/ap/concurrency"),
        ({"concurrencyy": 8}, "concurrencyy"),
        ({"transportConfig": {"queues": [{"queue_name": "q", "igw_url": "x"}]}}, "igw_url"),
        ({"workerPools": [{"id": "p"}]}, "/ap/workerPools/0"),
        ({"requestMergePolicyConfig": {"type": "round-robin"}}, "requestMergePolicyConfig"),
        ({"logging": {"level": "verbose"}}, "/ap/logging/level"),
        ({"health": {"port": 70000}}, "/ap/health/port"),
    ],
)
def test_schema_rejects_bad_values(ap: dict[str, Any], where: str) -> None:
    with helm.Chart.load(str(CHART)) as chart, pytest.raises(helm.HelmValuesError, match=where):
        chart.validate_schema(with_ap(**ap))


def test_schema_knows_exactly_the_daemon_config_fields() -> None:
    """The schema's strict objects list the fields the daemon's models accept."""
    schema = json.loads((CHART / "values.schema.json").read_text())["properties"]["ap"]
    props = schema["properties"]

    def fields(*models: Any) -> set[str]:
        return {f.alias or name for m in models for name, f in m.model_fields.items()}

    transport = props["transportConfig"]["properties"]
    assert set(transport) == fields(SortedSetConfig, RedisPubSubConfig, GcpPubSubConfig)
    assert set(transport["queues"]["items"]["properties"]) == fields(
        SortedSetQueue, RedisQueue, PubSubTopic
    )
    assert set(props["workerPools"]["items"]["properties"]) == fields(PoolConfig)
    assert set(props["requestMergePolicyConfig"]["properties"]) == fields(MergePolicyConfig)
    transforms = props["transformConfig"]["properties"]
    assert set(transforms) == fields(TransformConfig)
    assert set(transforms["requestTransforms"]["items"]["properties"]) == fields(TransformEntry)


# ------------------------------------------------------------------ alerts and dashboard


def rules_of(objects: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    groups: list[dict[str, Any]] = objects["PrometheusRule"]["spec"]["groups"]
    return [rule for group in groups for rule in group["rules"]]


ALERTS = {
    "AsyncProcessorDown": "absent(up{",
    "AsyncProcessorScrapeFailing": "== 0",
    "AsyncProcessorHighRetryRate": "0.5",
    "AsyncProcessorHighDeadlineExceededRate": "0.1",
    "AsyncProcessorLowSuccessRate": "0.9",
    "AsyncProcessorHighShedRate": "0.1",
    "AsyncProcessorBacklogGrowing": "100",
    "AsyncProcessorDispatchBudgetZero": "== 0",
    "AsyncProcessorGateBlind": "== 0",
    "AsyncProcessorDeadLetters": "> 0",
    "AsyncProcessorAbandonedClaims": "abandoned_claims_total",
    "AsyncProcessorResultsTrimmed": "results_trimmed_total",
    "AsyncProcessorBrokerErrors": "broker_errors_total",
    "AsyncProcessorRedisDatasetLost": "redis_dataset_lost_total",
    "AsyncProcessorQueueConfigReloadFailing": 'result="error"',
}


def test_rules_carry_the_reference_alerts_and_ours() -> None:
    rules = rules_of(render(with_ap(prometheusRule={"enabled": True})))
    by_name = {r["alert"]: r for r in rules}
    assert set(by_name) == set(ALERTS)
    for name, threshold in ALERTS.items():
        assert threshold in by_name[name]["expr"], name
        # Every selector is scoped to the release as well as the namespace.
        for selector in re.findall(
            r"(?:llm_d_async_[a-z0-9_]+|up)\{([^}]*)\}", by_name[name]["expr"]
        ):
            assert selector.startswith(f'namespace="{NAMESPACE}",release="demo"'), (name, selector)
    assert by_name["AsyncProcessorLowSuccessRate"]["labels"]["severity"] == "critical"
    assert by_name["AsyncProcessorHighRetryRate"]["for"] == "15m"


def anchors(markdown: str) -> set[str]:
    """GitHub's heading anchors: lower case, spaces to dashes, punctuation dropped."""
    headings = re.findall(r"^#+ (.+)$", markdown, flags=re.MULTILINE)
    return {re.sub(r"[^a-z0-9 _-]", "", h.lower()).replace(" ", "-") for h in headings}


def test_every_rule_has_a_runbook_section_in_operations_md() -> None:
    values = with_ap(prometheusRule={"enabled": True, "runbookBaseURL": "https://docs/ops.md"})
    rules = rules_of(render(values))
    sections = anchors((ROOT / "docs" / "operations.md").read_text())
    for rule in rules:
        base, _, anchor = rule["annotations"]["runbook_url"].partition("#")
        assert base == "https://docs/ops.md"
        assert anchor == rule["alert"].lower() and anchor in sections, rule["alert"]


def test_rules_scope_by_namespace_only_when_asked() -> None:
    values = with_ap(prometheusRule={"enabled": True, "scopeByRelease": False})
    for rule in rules_of(render(values)):
        assert "release=" not in rule["expr"], rule["alert"]


def test_pod_monitor_labels_series_with_the_release() -> None:
    endpoint = render(with_ap(podMonitor={"enabled": True}))["PodMonitor"]["spec"][
        "podMetricsEndpoints"
    ][0]
    assert endpoint["relabelings"] == [
        {
            "action": "replace",
            "sourceLabels": ["__meta_kubernetes_pod_label_app_kubernetes_io_instance"],
            "targetLabel": "release",
        }
    ]


def test_each_alert_can_be_turned_off_or_retuned() -> None:
    rules = {"highShedRate": {"enabled": False}, "lowSuccessRate": {"threshold": 0.75}}
    by_name = {
        r["alert"]: r
        for r in rules_of(render(with_ap(prometheusRule={"enabled": True, "rules": rules})))
    }
    assert "AsyncProcessorHighShedRate" not in by_name
    assert by_name["AsyncProcessorLowSuccessRate"]["expr"].endswith("< 0.75")


def promtool() -> str:
    return require_binary("promtool")  # skips locally, fails under CI=true


def write_rules(tmp_path: Path) -> list[dict[str, Any]]:
    rules = render(load_values(CHART / "ci" / "sortedset-values.yaml"))["PrometheusRule"]
    groups: list[dict[str, Any]] = rules["spec"]["groups"]
    (tmp_path / "rules.yaml").write_text(json.dumps({"groups": groups}))  # JSON is YAML
    return [rule for group in groups for rule in group["rules"]]


def test_promtool_accepts_the_rendered_rules(tmp_path: Path) -> None:
    tool = promtool()
    rules = write_rules(tmp_path)
    done = subprocess.run(
        [tool, "check", "rules", str(tmp_path / "rules.yaml")], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(rules)} rules found" in done.stdout


def series(name: str, values: str, **labels: str) -> dict[str, str]:
    scope = {"namespace": NAMESPACE, "release": "demo"}  # render()'s release name
    text = ",".join(f'{k}="{v}"' for k, v in {**scope, **labels}.items())
    return {"series": f"{name}{{{text}}}", "values": values}


def expected(rule: dict[str, Any], **labels: str) -> dict[str, Any]:
    """The alert promtool should see: labels, and annotations with $labels expanded."""

    def expand(text: str) -> str:
        return re.sub(r"\{\{ \$labels\.(\w+) \}\}", lambda m: labels.get(m.group(1), ""), text)

    annotations = {k: expand(v) for k, v in rule["annotations"].items()}
    return {"exp_labels": {**labels, **rule["labels"]}, "exp_annotations": annotations}


def test_promtool_rule_tests_fire_the_alerts(tmp_path: Path) -> None:
    """Synthetic series drive each alert over its threshold; blips stay quiet."""
    tool = promtool()
    rules = {r["alert"]: r for r in write_rules(tmp_path)}
    p = "llm_d_async_async_"
    q = {"queue_id": "q", "queue_name": "q", "pool_name": "default"}
    blip = {**q, "pool_name": "blip"}
    inputs = [
        series(p + "request_total", "0+10x60", **q),
        series(p + "request_retries_total", "0+6x60", **q),
        series(p + "successful_requests_total", "0+10x60", **q),
        series(p + "broker_backlog", "0+50x60", **q, pod="a"),
        series(p + "dispatch_budget", "0x60", **q, pod="a"),
        series(p + "dead_letter_total", "0x20 1x40", **q, reason="no_id"),
        # The daemon's first failure: series at 0 from startup, so one event is an increase.
        series(
            p + "abandoned_claims_total", "0x20 1x40", queue_name="q", reason="lease_entry_missing"
        ),
        series(p + "results_trimmed_total", "0x20 3x40", result_list="results"),
        # Redis away from minute 20 on; a single error at minute 5 does not last 5m.
        series(p + "broker_errors_total", "0x5 1x15 2+2x40", operation="claim"),
        # Both replicas see the same loss at minute 20 (a node came back empty).
        series(p + "redis_dataset_lost_total", "0x20 1x40", pod="a"),
        series(p + "redis_dataset_lost_total", "0x20 1x40", pod="b"),
        # A bad file from minute 10 on (counted at every pass); a blip at minute 2.
        series(p + "queue_config_reloads_total", "0 1x8 1+2x50", result="error", pod="a"),
        # Blind from minute 10 on one replica; a one-minute blip on pool "blip" stays quiet.
        series(p + "gate_metric_source_available", "1x10 0x50", **q, inference_pool="ip", pod="a"),
        series(p + "gate_metric_source_available", "1x60", **q, inference_pool="ip", pod="b"),
        series(p + "gate_metric_source_available", "1x10 0 1x49", **blip, inference_pool="ip"),
        # Replica a crash-loops from minute 20; b is fine; another release's pod is ignored.
        series("up", "1x20 0x40", pod="a"),
        series("up", "1x60", pod="b"),
        series("up", "0x60", pod="other", release="other"),
    ]
    queue = {"queue_id": "q", "queue_name": "q"}
    cases = [
        ("AsyncProcessorHighRetryRate", "30m", [expected(rules["AsyncProcessorHighRetryRate"])]),
        ("AsyncProcessorLowSuccessRate", "30m", []),
        ("AsyncProcessorBacklogGrowing", "50m",
         [expected(rules["AsyncProcessorBacklogGrowing"], **queue)]),
        ("AsyncProcessorDispatchBudgetZero", "30m",
         [expected(rules["AsyncProcessorDispatchBudgetZero"], **q)]),
        ("AsyncProcessorGateBlind", "11m", []),  # blind for 1m only: not yet
        ("AsyncProcessorGateBlind", "13m",
         [expected(rules["AsyncProcessorGateBlind"], queue_name="q", pool_name="default",
                   inference_pool="ip")]),
        ("AsyncProcessorDeadLetters", "25m",
         [expected(rules["AsyncProcessorDeadLetters"], queue_name="q", reason="no_id")]),
        ("AsyncProcessorAbandonedClaims", "25m",
         [expected(rules["AsyncProcessorAbandonedClaims"], queue_name="q",
                   reason="lease_entry_missing")]),
        ("AsyncProcessorResultsTrimmed", "25m",
         [expected(rules["AsyncProcessorResultsTrimmed"], result_list="results")]),
        ("AsyncProcessorBrokerErrors", "12m", []),  # one error at minute 5: not lasting
        ("AsyncProcessorBrokerErrors", "27m",
         [expected(rules["AsyncProcessorBrokerErrors"], operation="claim")]),
        ("AsyncProcessorRedisDatasetLost", "19m", []),
        ("AsyncProcessorRedisDatasetLost", "21m",
         [expected(rules["AsyncProcessorRedisDatasetLost"])]),
        ("AsyncProcessorQueueConfigReloadFailing", "8m", []),  # one refused pass
        ("AsyncProcessorQueueConfigReloadFailing", "13m", []),  # refused for 3m: not yet
        ("AsyncProcessorQueueConfigReloadFailing", "17m",
         [expected(rules["AsyncProcessorQueueConfigReloadFailing"])]),
        ("AsyncProcessorScrapeFailing", "30m",
         [expected(rules["AsyncProcessorScrapeFailing"], pod="a")]),
        ("AsyncProcessorDown", "30m", []),  # b is still up
    ]  # fmt: skip
    suite = {
        "rule_files": ["rules.yaml"],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": inputs,
                "alert_rule_test": [
                    {"eval_time": at, "alertname": name, "exp_alerts": alerts}
                    for name, at, alerts in cases
                ],
            }
        ],
    }
    (tmp_path / "test.yaml").write_text(json.dumps(suite))
    done = subprocess.run(
        [tool, "test", "rules", "test.yaml"], capture_output=True, text=True, cwd=tmp_path
    )
    assert done.returncode == 0, done.stdout + done.stderr


def dashboard() -> dict[str, Any]:
    board: dict[str, Any] = json.loads((CHART / "dashboards" / "async-processor.json").read_text())
    return board


def queried_metrics(exprs: list[str]) -> set[str]:
    names = {n for e in exprs for n in METRIC_NAME.findall(e)}
    assert names, "no metric names found"
    return names


def dashboard_exprs(board: dict[str, Any]) -> list[str]:
    return [t["expr"] for p in board["panels"] for t in p.get("targets", [])]


def test_dashboard_queries_only_metrics_the_daemon_exports() -> None:
    board = dashboard()
    assert board["uid"] == "async-processor"
    names = queried_metrics(dashboard_exprs(board))
    assert names <= exported_names(), names - exported_names()
    families = {n.removesuffix("_bucket") for n in names}
    for wanted in (
        "inference_latency_time_millis",
        "queue_residence_time_millis",
        "broker_backlog",
        "dispatch_budget",
        "inflight_requests",
        "dead_letter_total",
    ):
        assert "llm_d_async_async_" + wanted in families, wanted


def test_every_dashboard_query_is_scoped_to_the_dashboard_variables() -> None:
    board = dashboard()
    scope = '{namespace="$namespace", release=~"$release", pod=~"$pod"'
    for expr in dashboard_exprs(board):
        for name, selector in re.findall(r"(llm_d_async_[a-z0-9_]+)(\{[^}]*\})?", expr):
            assert selector.startswith(scope), expr
            if name.removesuffix("_bucket") in QUEUE_FAMILIES:
                assert selector.endswith(', queue_name=~"$queue", pool_name=~"$pool"}'), expr
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert {"namespace", "datasource", "release", "pod", "queue", "pool"} <= set(variables)
    for name in ("release", "pod", "queue", "pool"):  # "All" must match series without it
        assert variables[name]["includeAll"] and variables[name]["allValue"] == ".*"


# Families with the (queue_id, queue_name, pool_name) labels.
QUEUE_FAMILIES = {
    f.name if f.type != "counter" else f.name + "_total"
    for f in Metrics().registry.collect()
    if f.name.startswith("llm_d_async_async_")
    and f.name != "llm_d_async_async_pool_worker_limit"
    and not f.name.startswith("llm_d_async_async_drain_limit")
    and not f.name.startswith("llm_d_async_async_adaptive")
}


def test_alert_rules_query_only_metrics_the_daemon_exports() -> None:
    rules = rules_of(render(with_ap(prometheusRule={"enabled": True})))
    names = queried_metrics([r["expr"] for r in rules])
    assert names <= exported_names(), names - exported_names()


def test_dashboard_configmap_carries_the_dashboard_file() -> None:
    values = with_ap(grafana={"dashboards": {"enabled": True, "labelValue": "yes"}})
    config_map = render(values)["ConfigMap:dashboards"]
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "yes"
    assert json.loads(config_map["data"]["async-processor.json"]) == dashboard()


@pytest.mark.anyio
async def test_dashboard_and_rules_match_a_live_metrics_endpoint() -> None:
    """The names queried exist on a real /metrics server fed by the daemon's Metrics."""
    metrics = populated_metrics()
    async with anyio.create_task_group() as tg:
        port = await tg.start(serve_metrics, "127.0.0.1", 0, metrics.registry)
        url = f"http://127.0.0.1:{port}/metrics"
        async with aiohttp.ClientSession() as session, session.get(url) as response:
            assert response.status == 200
            text = await response.text()
        tg.cancel_scope.cancel()
    live = {s.name for family in text_string_to_metric_families(text) for s in family.samples}
    rules = rules_of(render(with_ap(prometheusRule={"enabled": True})))
    queried = queried_metrics(dashboard_exprs(dashboard()) + [r["expr"] for r in rules])
    assert queried <= live, queried - live


def doc_promql() -> list[str]:
    """PromQL in the operator docs: ```promql blocks and inline code that calls a function."""
    found: list[str] = []
    for doc in DOCS:
        text = doc.read_text()
        for block in re.findall(r"```promql\n(.*?)```", text, flags=re.DOTALL):
            # A block may hold several queries, separated by blank lines, with # comments.
            for chunk in re.split(r"\n\s*\n", block):
                lines = [ln for ln in chunk.splitlines() if not ln.lstrip().startswith("#")]
                found.append("\n".join(lines))
        inline = re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.DOTALL))
        found += [c for c in inline if "llm_d_async_async_" in c and "(" in c]
    return [q.strip() for q in found if q.strip()]


def test_docs_promql_parses_and_names_exported_metrics(tmp_path: Path) -> None:
    tool = promtool()
    queries = doc_promql()
    assert len(queries) >= 15
    rules = [{"record": f"doc:query:{i}", "expr": q} for i, q in enumerate(queries)]
    (tmp_path / "docs.yaml").write_text(json.dumps({"groups": [{"name": "docs", "rules": rules}]}))
    done = subprocess.run([tool, "check", "rules", str(tmp_path / "docs.yaml")],
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    exported = exported_names()
    families = exported | {re.sub(r"_(bucket|sum|count)$", "", n) for n in exported}
    mentioned = {n for doc in DOCS for n in METRIC_NAME.findall(doc.read_text())}
    mentioned = {n for n in mentioned if not n.endswith("_")}  # the bare prefix
    assert mentioned <= families, mentioned - families


def test_docs_links_and_repo_paths_exist() -> None:
    """Relative links and the repository paths the guides name point at real files."""
    for doc in DOCS:
        text = doc.read_text()
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", text):
            assert (doc.parent / target).exists(), f"{doc.name}: {target}"
        for path in re.findall(r"`((?:charts|deploy|config|docs|bench|tests)/[\w./-]*)`", text):
            assert (ROOT / path).exists(), f"{doc.name}: {path}"


def http_get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return int(response.status), response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, ""
    except OSError:
        return 0, ""


def wait_for(check: Any, what: str, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"daemon exited:\n{log.read_text()[-3000:]}"
        if check():
            return
        time.sleep(0.1)
    raise AssertionError(f"{what} not seen in 20 s:\n{log.read_text()[-3000:]}")


@pytest.mark.slow
def test_rendered_pod_spec_runs_and_serves_every_queried_metric(
    tmp_path: Path, redis_url: str, simulator: SimulatorProcess, unique: str
) -> None:
    """The chart's container (args, env, probes, Service port) run as a real process."""
    queue = f"{unique}:requests"
    ports = {"health": free_port(), "metrics": free_port()}
    values = with_ap(
        igwBaseURL=simulator.url,
        transportConfig={
            "result_queue_name": f"{unique}:results",
            "retry_queue_name": f"{unique}:retry",
            "poll_interval_ms": 100,
            "queues": [
                {
                    "queue_name": queue,
                    "gate_type": "endpoint-scrape",
                    "gate_params": {
                        "url": simulator.url + "/metrics",
                        "metric": "vllm:num_requests_running",
                    },
                }
            ],
        },
        health={"port": ports["health"]},
        metrics={"port": ports["metrics"]},
        bindAddress="127.0.0.1",
        metricsBacklogPollInterval="1s",
        drainTimeout="5s",
        transportConfigWatchInterval="30s",  # its alert's series too
    )
    objects = render(values)
    for name, text in objects["ConfigMap:config"]["data"].items():
        (tmp_path / name).write_text(text)
    c = container(objects)
    args = [a.replace(CONFIG_DIR, str(tmp_path)) for a in c["args"]]
    env = {k: v for k, v in os.environ.items() if not k.startswith("ASYNC_PROCESSOR_")}
    assert env_of(c)["REDIS_URL"]["secretKeyRef"]["name"] == "redis-creds"
    env["REDIS_URL"] = redis_url  # what the Secret would hold
    log = tmp_path / "daemon.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "async_processor", *args],
                                stdout=out, stderr=subprocess.STDOUT, env=env)  # fmt: skip
    try:
        named = {p["name"]: p["containerPort"] for p in c["ports"]}
        probe = c["readinessProbe"]["httpGet"]
        ready = f"http://127.0.0.1:{named[probe['port']]}{probe['path']}"
        wait_for(lambda: http_get(ready)[0] == 200, "readiness", proc, log)
        liveness = c["livenessProbe"]["httpGet"]
        assert http_get(f"http://127.0.0.1:{named[liveness['port']]}{liveness['path']}")[0] == 200
        service_port = objects["Service"]["spec"]["ports"][0]["targetPort"]
        scrape = f"http://127.0.0.1:{named[service_port]}/metrics"
        # One message with no usable id, so the dead-letter series exists too, and one past
        # its deadline, for the error-result series.
        late = b'{"id":"late","deadline":1,"payload":{}}'
        redis.Redis.from_url(redis_url).zadd(queue, {b"not json": time.time() + 600, late: 1})
        wait_for(lambda: "llm_d_async_async_dead_letter_total{" in http_get(scrape)[1],
                 "a dead-letter series", proc, log)  # fmt: skip
        wait_for(lambda: "llm_d_async_async_error_results_total{" in http_get(scrape)[1],
                 "an error-result series", proc, log)  # fmt: skip
        wait_for(lambda: "llm_d_async_async_gate_metric_value{" in http_get(scrape)[1],
                 "the gate gauges", proc, log)  # fmt: skip
        # One answered request, for the token series (the simulator's answers carry usage).
        answered = json.dumps({"id": "ok", "deadline": int(time.time()) + 600,
                               "payload": {"prompt": "hi", "max_tokens": 2}})  # fmt: skip
        redis.Redis.from_url(redis_url).zadd(queue, {answered: time.time() + 600})
        wait_for(lambda: "llm_d_async_async_tokens_total{" in http_get(scrape)[1],
                 "the token series", proc, log)  # fmt: skip
        families = text_string_to_metric_families(http_get(scrape)[1])
        live = {sample.name for family in families for sample in family.samples}
        rules = rules_of(render(with_ap(prometheusRule={"enabled": True})))
        queried = queried_metrics(dashboard_exprs(dashboard()) + [r["expr"] for r in rules])
        # The message-latency panel is Pub/Sub-only: a Redis daemon does not export it.
        pubsub_only = {"llm_d_async_async_message_latency_time_millis_bucket"}
        assert queried - pubsub_only <= live, queried - live
        assert not pubsub_only & live
    finally:
        stop_process(proc, timeout=30)
