"""Chart values for installing safely: the Redis URL without `redis.enabled`, image
digests, the `helm test` hook and the NetworkPolicy (what they render; whether a cluster
takes them is test_chart_kubernetes.py, the hook's script run in the image test_image.py).
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.deploy.test_chart import CHART, container, env_of, helm, load_values, render, with_ap

DIGEST = "sha256:" + "ab" * 32


def without_redis_enabled(**redis: Any) -> dict[str, Any]:
    """The minimal values with ``ap.redis`` replaced as a whole."""
    return with_ap(redis=redis)


@pytest.mark.parametrize(
    "redis",
    [
        {"enabled": True, "secretName": "redis-creds"},  # the Go chart's values, unchanged
        {"secretName": "redis-creds"},  # naming the Secret is enough
        {"enabled": False, "secretName": "redis-creds"},
    ],
)
def test_a_named_redis_secret_hands_over_redis_url(redis: dict[str, Any]) -> None:
    objects = render(without_redis_enabled(**redis))
    ref = env_of(container(objects))["REDIS_URL"]["secretKeyRef"]
    assert ref == {"name": "redis-creds", "key": "url"}
    assert "Secret" not in objects


def test_a_redis_url_alone_makes_the_secret() -> None:
    objects = render(without_redis_enabled(url="redis://redis.example:6379/0"))
    assert objects["Secret"]["stringData"] == {"url": "redis://redis.example:6379/0"}
    ref = env_of(container(objects))["REDIS_URL"]["secretKeyRef"]
    assert ref["name"] == objects["Secret"]["metadata"]["name"]


def test_no_redis_url_in_the_environment_when_the_config_names_it() -> None:
    values = with_ap(transportConfig={"url": "redis://redis:6379", "queues": [{"queue_name": "q"}]})
    values["ap"]["redis"] = {}
    assert "REDIS_URL" not in env_of(container(render(values)))


def test_redis_values_say_the_chart_installs_no_redis() -> None:
    text = (CHART / "values.yaml").read_text()
    block = text[text.index("  redis:\n") - 400 : text.index("  redis:\n") + 200]
    assert "never installs" in block and "enabled" in block
    with pytest.raises(helm.HelmRenderError, match="installs no Redis"):
        render(without_redis_enabled(enabled=True))


def test_an_image_digest_pins_the_pod_and_the_test_hook() -> None:
    objects = render(with_ap(image={"repository": "registry.example.com/ap", "digest": DIGEST}))
    assert container(objects)["image"] == f"registry.example.com/ap@{DIGEST}"
    assert objects["Pod"]["spec"]["containers"][0]["image"] == f"registry.example.com/ap@{DIGEST}"
    tagged = render(with_ap(image={"repository": "registry.example.com/ap", "tag": "1.2"}))
    assert container(tagged)["image"] == "registry.example.com/ap:1.2"
    with helm.Chart.load(str(CHART)) as chart, pytest.raises(helm.HelmValuesError):
        chart.validate_schema(with_ap(image={"repository": "r", "digest": "latest"}))


def test_the_test_hook_asks_the_service_for_readyz_and_metrics_with_the_token() -> None:
    objects = render(load_values(CHART / "ci" / "keda-values.yaml"))
    pod = objects["Pod"]
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    hook = pod["spec"]["containers"][0]
    service = objects["Service"]
    host = f"http://{service['metadata']['name']}.batch.svc"
    ports = {p["name"]: p["port"] for p in service["spec"]["ports"]}
    assert hook["args"] == [
        f"{host}:{ports['health']}/readyz",
        f"{host}:{ports['metrics']}/metrics",
        "/etc/async-processor/metrics-token/token",
    ]
    assert hook["securityContext"] == container(objects)["securityContext"]
    mount = {"name": "metrics-token", "mountPath": "/etc/async-processor/metrics-token",
             "readOnly": True}  # fmt: skip
    assert hook["volumeMounts"] == [mount]
    assert "Pod" not in render(with_ap(tests={"enabled": False}))
    assert "Pod" not in render(with_ap(metrics={"service": {"enabled": False}}))


def test_network_policy_opens_the_pods_ports_and_the_listed_egress() -> None:
    assert "NetworkPolicy" not in render(with_ap())
    objects = render(load_values(CHART / "ci" / "locked-down-values.yaml"))
    spec = objects["NetworkPolicy"]["spec"]
    names = {p["name"] for p in container(objects)["ports"]}
    (ingress,) = spec["ingress"]
    assert {p["port"] for p in ingress["ports"]} == names == {"health", "metrics"}
    monitoring, hook = ingress["from"]
    assert monitoring["namespaceSelector"]["matchLabels"]
    assert (
        hook["podSelector"]["matchLabels"].items() <= objects["Pod"]["metadata"]["labels"].items()
    )
    dns, tcp = spec["egress"]
    assert {(p["port"], p["protocol"]) for p in dns["ports"]} == {(53, "UDP"), (53, "TCP")}
    assert [p["port"] for p in tcp["ports"]] == [6379, 80] and len(tcp["to"]) == 2
    # It selects the daemon's pods and the exporter's, nothing else of the release.
    selector = spec["podSelector"]
    pod_labels = objects["Deployment"]["spec"]["template"]["metadata"]["labels"]
    assert selector["matchLabels"].items() <= pod_labels.items()
    (names_in,) = selector["matchExpressions"]
    assert pod_labels["app.kubernetes.io/name"] in names_in["values"]
    exporter = render(with_ap(exporter={"enabled": True}, networkPolicy={"enabled": True}))
    exporter_pod = exporter["Deployment:exporter"]["spec"]["template"]["metadata"]["labels"]
    assert exporter_pod["app.kubernetes.io/name"] in names_in["values"]
