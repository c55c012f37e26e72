"""deploy/: the kustomize base (daemon + Redis + simulator) and the kind overlay.

Always: every kustomization's resources, generator files and patches exist and parse, and
the daemon's args and transport config load through the daemon's own config loader.
When ``kubectl`` is installed: ``kubectl kustomize deploy/overlays/kind`` renders and the
rendered objects reference each other consistently (names with generator hashes, images,
Services, ports).
"""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from async_processor.config import SortedSetConfig, load_config
from async_processor.pipeline.daemon import HARD_STOP_GRACE
from tests.fixtures.servers import require_module

helm = require_module("helm_python", "helm-python-sdk (a dev dependency) parses the YAML")
from tests.deploy.test_chart import parse_docs  # noqa: E402 - after the skip guard

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
KUSTOMIZATIONS = sorted(DEPLOY.rglob("kustomization.yaml"))
CONFIG_DIR = "/etc/async-processor/config"


def load(path: Path) -> list[dict[str, Any]]:
    return list(parse_docs(path.read_text()))


def base_objects() -> dict[tuple[str, str], dict[str, Any]]:
    kustomization = load(DEPLOY / "base" / "kustomization.yaml")[0]
    return {
        (obj["kind"], obj["metadata"]["name"]): obj
        for resource in kustomization["resources"]
        for obj in load(DEPLOY / "base" / resource)
    }


def pod_spec(obj: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = obj["spec"]["template"]["spec"]
    return spec


def test_there_is_a_base_and_a_kind_overlay() -> None:
    names = {p.parent.relative_to(DEPLOY).as_posix() for p in KUSTOMIZATIONS}
    assert {"base", "overlays/kind"} <= names


@pytest.mark.parametrize("path", KUSTOMIZATIONS, ids=lambda p: p.parent.name)
def test_every_listed_file_exists_and_parses(path: Path) -> None:
    kustomization = load(path)[0]
    assert kustomization["kind"] == "Kustomization"
    listed = [*kustomization.get("resources", [])]
    listed += [p["path"] for p in kustomization.get("patches", [])]
    for generator in kustomization.get("configMapGenerator", []):
        listed += generator.get("files", [])
    assert listed
    for entry in listed:
        target = (path.parent / entry).resolve()
        assert target.exists(), entry
        if target.is_dir():
            assert (target / "kustomization.yaml").exists(), entry
        elif target.suffix == ".json":
            json.loads(target.read_text())
        else:
            assert all("kind" in obj for obj in load(target)), entry


def test_base_holds_daemon_redis_and_simulator_with_matching_services() -> None:
    objects = base_objects()
    for name in ("async-processor", "redis", "sim"):
        deployment = objects[("Deployment", name)]
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert deployment["spec"]["selector"]["matchLabels"] == labels
    services = [o for (kind, _), o in objects.items() if kind == "Service"]
    pods = [o["spec"]["template"] for (kind, _), o in objects.items() if kind == "Deployment"]
    for service in services:
        selector = service["spec"]["selector"]
        matching = [p for p in pods if selector.items() <= p["metadata"]["labels"].items()]
        assert len(matching) == 1, service["metadata"]["name"]
        port_names = {p["name"] for c in matching[0]["spec"]["containers"] for p in c["ports"]}
        assert {p["targetPort"] for p in service["spec"]["ports"]} <= port_names


def test_simulator_runs_from_the_daemon_image_on_the_gateway_url() -> None:
    objects = base_objects()
    sim = pod_spec(objects[("Deployment", "sim")])["containers"][0]
    daemon = pod_spec(objects[("Deployment", "async-processor")])["containers"][0]
    assert sim["image"] == daemon["image"] == "async-processor"
    assert sim["args"][:1] == ["sim"]
    port = sim["args"][sim["args"].index("--port") + 1]
    assert sim["args"][sim["args"].index("--host") + 1] == "0.0.0.0"
    config = json.loads((DEPLOY / "base" / "transport-config.json").read_text())
    gateway = urlsplit(config["queues"][0]["igw_base_url"])
    sim_service = objects[("Service", "sim")]
    assert gateway.hostname == sim_service["metadata"]["name"]
    assert gateway.port == sim_service["spec"]["ports"][0]["port"] == int(port)


def test_daemon_args_and_transport_config_load(tmp_path: Path) -> None:
    """The base's args and config file go through the daemon's config loader."""
    objects = base_objects()
    daemon = pod_spec(objects[("Deployment", "async-processor")])["containers"][0]
    shutil.copy(DEPLOY / "base" / "transport-config.json", tmp_path)
    assert daemon["args"][0] == "run"
    args = [a.replace(CONFIG_DIR, str(tmp_path)) for a in daemon["args"][1:]]
    kustomization = load(DEPLOY / "base" / "kustomization.yaml")[0]
    secret = kustomization["secretGenerator"][0]
    url = next(lit.split("=", 1)[1] for lit in secret["literals"] if lit.startswith("url="))
    config = load_config(args, {"REDIS_URL": url})
    assert isinstance(config.transport_config, SortedSetConfig)
    assert config.transport_config.url == url
    redis = objects[("Service", "redis")]
    assert urlsplit(url).hostname == redis["metadata"]["name"]
    assert urlsplit(url).port == redis["spec"]["ports"][0]["port"]
    pod = pod_spec(objects[("Deployment", "async-processor")])
    grace = config.runtime.drain_timeout + HARD_STOP_GRACE + 10  # the hard stop, then exit
    assert pod["terminationGracePeriodSeconds"] == grace
    # Service links would add ASYNC_PROCESSOR_METRICS_PORT=tcp://... from the metrics Service.
    assert pod["enableServiceLinks"] is False


@pytest.fixture(scope="module")
def kind_render() -> list[dict[str, Any]]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:  # an optional tool, not a service: make test does not install it
        pytest.skip("kubectl not installed: only the structural checks ran")
    done = subprocess.run(
        [kubectl, "kustomize", str(DEPLOY / "overlays" / "kind")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return list(parse_docs(done.stdout))


def by_kind(objects: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def test_kind_overlay_renders_into_its_namespace(kind_render: list[dict[str, Any]]) -> None:
    namespace = by_kind(kind_render, "Namespace")
    assert list(namespace) == ["async-processor"]
    for obj in kind_render:
        if obj["kind"] != "Namespace":
            assert obj["metadata"]["namespace"] == "async-processor", obj["metadata"]["name"]
            assert obj["metadata"]["labels"]["app.kubernetes.io/part-of"] == "async-processor"


def test_kind_overlay_uses_the_local_image_everywhere(kind_render: list[dict[str, Any]]) -> None:
    deployments = by_kind(kind_render, "Deployment")
    for name in ("async-processor", "sim"):
        c = pod_spec(deployments[name])["containers"][0]
        assert (c["image"], c["imagePullPolicy"]) == ("async-processor:dev", "Never"), name
    daemon = pod_spec(deployments["async-processor"])["containers"][0]
    env = {e["name"]: e for e in daemon["env"]}
    assert env["ASYNC_PROCESSOR_LOG_LEVEL"]["value"] == "debug"
    assert "REDIS_URL" in env  # the patch merged into the base's env, not replaced it


def test_kind_overlay_references_the_generated_names(kind_render: list[dict[str, Any]]) -> None:
    """Generator hash suffixes are carried into the Deployment that mounts them."""
    config_maps = by_kind(kind_render, "ConfigMap")
    secrets = by_kind(kind_render, "Secret")
    daemon = pod_spec(by_kind(kind_render, "Deployment")["async-processor"])
    volume = next(v for v in daemon["volumes"] if v["name"] == "config")
    config_map = config_maps[volume["configMap"]["name"]]
    assert volume["configMap"]["name"].startswith("async-processor-config-")
    json.loads(config_map["data"]["transport-config.json"])
    env = {e["name"]: e for e in daemon["containers"][0]["env"]}
    ref = env["REDIS_URL"]["valueFrom"]["secretKeyRef"]
    url = base64.b64decode(secrets[ref["name"]]["data"][ref["key"]]).decode()
    assert url.startswith("redis://redis:")
