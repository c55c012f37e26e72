"""The rendered chart as an API server would take it.

Every object rendered from every ``charts/*/ci/*-values.yaml`` and from the defaults with
the required values is validated strictly (unknown fields are errors) against the
Kubernetes OpenAPI schemas of the oldest and the newest Kubernetes the chart claims
(``kubeVersion``), with kubernetes-validate (the schemas ship in its wheel: no network, no
cluster). The custom resources (PodMonitor, ServiceMonitor, PrometheusRule, ScaledObject)
are checked against the structural schemas in crd_schemas.py. Also: the chart's package.
"""

from __future__ import annotations

import re
import tarfile
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from tests.deploy import crd_schemas
from tests.deploy.test_chart import MINIMAL, NAMESPACE, helm, load_values, parse_docs, with_ap
from tests.fixtures.servers import require_module

kv = require_module("kubernetes_validate", "kubernetes-validate is a dev dependency")

ROOT = Path(__file__).resolve().parents[2]
CHARTS = sorted(p.parent for p in (ROOT / "charts").glob("*/Chart.yaml"))
CASES = [
    (chart, example) for chart in CHARTS for example in sorted((chart / "ci").glob("*-values.yaml"))
]
CUSTOM_KINDS = {"PodMonitor", "ServiceMonitor", "PrometheusRule", "ScaledObject"}


def kube_versions(chart: Path) -> list[str]:
    """The oldest version ``kubeVersion`` admits and the newest one with schemas to check."""
    claim = helm.values_from_yaml((chart / "Chart.yaml").read_text())["kubeVersion"]
    match = re.fullmatch(r">=\s*(\d+)\.(\d+)(?:\.\d+)?(?:-0)?", claim)
    assert match, f"{chart.name}: kubeVersion {claim!r} is not an open >= range"
    oldest = f"{match[1]}.{match[2]}.0"
    shipped = kv.utils.all_versions()
    assert oldest in shipped, f"kubernetes-validate has no schemas for {oldest}"
    return [oldest, kv.utils.latest_version()]


def render_all(chart: Path, values: dict[str, Any]) -> list[dict[str, Any]]:
    """Every object, test hooks included."""
    with helm.Chart.load(str(chart)) as c:
        manifests = c.render(values, name="demo", namespace=NAMESPACE, is_install=True)
    texts = [text for path, text in manifests.items() if not path.endswith("NOTES.txt")]
    return [obj for text in texts for obj in parse_docs(text)]


def validate(obj: dict[str, Any], version: str) -> None:
    try:
        kv.validate(obj, version, strict=True)
    except kv.utils.SchemaNotFoundError:
        schema = crd_schemas.schema_of(obj["apiVersion"], obj["kind"])
        assert schema is not None, f"no schema for {obj['apiVersion']} {obj['kind']}"
        jsonschema.validate(obj, schema)


def check(chart: Path, values: dict[str, Any]) -> set[str]:
    kinds = set()
    objects = render_all(chart, values)
    for version in kube_versions(chart):
        for obj in objects:
            where = f"{obj['kind']}/{obj['metadata']['name']} on Kubernetes {version}"
            try:
                validate(obj, version)
            except (kv.utils.ValidationError, jsonschema.ValidationError) as exc:
                path = "/".join(map(str, exc.absolute_path))
                pytest.fail(f"{where}: {path}: {exc.message}")
            kinds.add(obj["kind"])
    return kinds


@pytest.mark.parametrize(("chart", "example"), CASES, ids=lambda p: p.name)
def test_every_example_validates_strictly_on_the_oldest_and_newest_kubernetes(
    chart: Path, example: Path
) -> None:
    assert "Deployment" in check(chart, load_values(example))


def test_the_defaults_with_the_required_values_validate() -> None:
    chart = ROOT / "charts" / "async-processor"
    kinds = check(chart, MINIMAL)
    assert {"Deployment", "ConfigMap", "Service", "ServiceAccount", "Pod"} <= kinds


def test_every_custom_kind_is_rendered_by_some_example_and_checked() -> None:
    kinds = {o["kind"] for chart, example in CASES for o in render_all(chart, load_values(example))}
    assert kinds >= CUSTOM_KINDS
    assert {"NetworkPolicy", "PodDisruptionBudget"} <= kinds


def test_the_check_rejects_what_a_cluster_would() -> None:
    """An unknown field, a wrong type, a deprecated monitor field, a numeric KEDA value."""
    chart = ROOT / "charts" / "async-processor"
    objects = {o["kind"]: o for o in render_all(chart, with_ap(podMonitor={"enabled": True}))}
    newest = kube_versions(chart)[-1]
    deployment = objects["Deployment"]
    deployment["spec"]["template"]["spec"]["containers"][0]["readOnlyRootFS"] = True
    with pytest.raises(kv.utils.ValidationError):
        validate(deployment, newest)
    service = objects["Service"]
    service["spec"]["ports"][0]["port"] = "9090"
    with pytest.raises(kv.utils.ValidationError):
        validate(service, newest)
    monitor = objects["PodMonitor"]
    monitor["spec"]["podMetricsEndpoints"][0]["bearerTokenSecret"] = {"name": "t", "key": "k"}
    with pytest.raises(jsonschema.ValidationError):
        validate(monitor, newest)
    keda = with_ap(keda={"enabled": True, "serverAddress": "http://prometheus:9090"})
    scaled = next(o for o in render_all(chart, keda) if o["kind"] == "ScaledObject")
    validate(scaled, newest)
    scaled["spec"]["triggers"][0]["metadata"]["threshold"] = 200
    with pytest.raises(jsonschema.ValidationError):
        validate(scaled, newest)


def test_chart_package_holds_the_schema_and_renders(tmp_path: Path) -> None:
    """What `make chart` makes (and `helm push` uploads, docs/operations.md)."""
    chart = ROOT / "charts" / "async-processor"
    archive = Path(helm.package(str(chart), destination=str(tmp_path)))
    meta = helm.values_from_yaml((chart / "Chart.yaml").read_text())
    assert archive.name == f"{meta['name']}-{meta['version']}.tgz"
    with tarfile.open(archive) as tar:
        names = set(tar.getnames())
    prefix = meta["name"] + "/"
    for required in ("Chart.yaml", "values.yaml", "values.schema.json", "templates/tests"):
        assert any(n.startswith(prefix + required) for n in names), required
    assert prefix + "ci/sortedset-values.yaml" not in names  # .helmignore: CI values stay out
    with helm.Chart.load_archive(archive.read_bytes()) as packaged:
        rendered = packaged.render(MINIMAL, name="demo", namespace=NAMESPACE, is_install=True)
        with pytest.raises(helm.HelmError):  # the schema travels with the package
            packaged.validate_schema(with_ap(concurrency="many"))
    assert any("kind: Deployment" in text for text in rendered.values())
