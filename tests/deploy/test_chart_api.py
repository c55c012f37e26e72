"""The chart's optional ``async-processor api`` (ap.api): Deployment, Service and PVC, keys
from a Secret, the values in the schema, the NOTES' Python snippet. The rendered args and
ConfigMap go through the API command's own parser and queue lookup."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path
from typing import Any

import pytest

from async_processor.api import app as api_app
from async_processor.cli.args import parse
from async_processor.config import redis_connection_file
from tests.deploy.test_chart import (
    CHART,
    CONFIG_DIR,
    NAMESPACE,
    env_of,
    helm,
    load_values,
    render,
    with_ap,
)

EXAMPLE = CHART / "ci" / "api-values.yaml"


def api_container(objects: dict[str, dict[str, Any]]) -> dict[str, Any]:
    pod = objects["Deployment:api"]["spec"]["template"]["spec"]
    c: dict[str, Any] = pod["containers"][0]
    return c


def test_the_api_runs_with_args_and_files_its_command_accepts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    values = load_values(EXAMPLE)
    objects = render(values)
    c = api_container(objects)
    assert c["args"][0] == "api"
    for name, text in objects["ConfigMap:config"]["data"].items():
        (tmp_path / name).write_text(text)
    local = [a.replace(CONFIG_DIR, str(tmp_path)) for a in c["args"][1:]]
    args = parse(api_app._parser(), local)
    assert args.api_keys_file == "/etc/async-processor/api-keys/keys.json"
    assert args.storage_dir == "/var/lib/async-processor-api"
    assert args.max_open_batches == 20 and args.output_order == "input"
    assert api_app._queue(args) == "batch-sortedset"
    assert api_app._gateway(args, "batch-sortedset") == values["ap"]["igwBaseURL"]
    # The Redis URL comes from the chart's Secret through REDIS_URL, as for the daemon.
    assert env_of(c)["REDIS_URL"]["secretKeyRef"] == {"name": "redis-creds", "key": "url"}
    conn = redis_connection_file(args.transport_config_file, "redis://redis:6379")
    assert conn.url == "redis://redis:6379"
    pod = objects["Deployment:api"]["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["api-keys"]["secret"]["secretName"] == "batch-api-keys"
    claim = volumes["storage"]["persistentVolumeClaim"]["claimName"]
    pvc = objects["PersistentVolumeClaim"]
    assert pvc["metadata"]["name"] == claim
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    assert pvc["spec"]["resources"]["requests"]["storage"] == "50Gi"
    assert objects["Deployment:api"]["spec"]["replicas"] == 2
    assert "strategy" not in objects["Deployment:api"]["spec"]  # RWX: rolling is fine
    service = objects["Service:api"]["spec"]
    assert service["ports"][0]["port"] == 8000 and service["ports"][0]["targetPort"] == "api"
    labels = objects["Deployment:api"]["spec"]["template"]["metadata"]["labels"]
    assert all(labels[k] == v for k, v in service["selector"].items())
    # The daemon's own Deployment does not select the API's pods (nor they its Service).
    daemon = objects["Deployment"]["spec"]["selector"]["matchLabels"]
    assert not all(labels.get(k) == v for k, v in daemon.items())


def test_a_chart_made_rwo_claim_recreates_and_no_auth_mounts_no_keys() -> None:
    api = {"enabled": True, "noAuth": True}
    objects = render(with_ap(transport="redis-sortedset", api=api))
    deployment = objects["Deployment:api"]["spec"]
    assert deployment["strategy"] == {"type": "Recreate"}
    c = api_container(objects)
    assert "--no-auth" in c["args"] and not any("keys" in a for a in c["args"])
    assert "api-keys" not in {v["name"] for v in deployment["template"]["spec"]["volumes"]}
    existing = render(with_ap(transport="redis-sortedset",
                              api={**api, "storage": {"existingClaim": "mine"}}))  # fmt: skip
    assert "PersistentVolumeClaim" not in existing
    pod = existing["Deployment:api"]["spec"]["template"]["spec"]
    assert {v["name"]: v for v in pod["volumes"]}["storage"]["persistentVolumeClaim"] == {
        "claimName": "mine"
    }
    assert "Deployment:api" not in render(with_ap(transport="redis-sortedset"))  # off by default


@pytest.mark.parametrize(
    ("ap", "message"),
    [
        ({"transport": "redis-sortedset", "api": {"enabled": True}}, "keysSecret.name"),
        ({"transport": "redis-pubsub", "api": {"enabled": True, "noAuth": True}},
         "needs ap.transport=redis-sortedset"),
    ],
)  # fmt: skip
def test_an_api_that_could_not_run_fails_the_render(ap: dict[str, Any], message: str) -> None:
    with pytest.raises(helm.HelmRenderError, match=re.escape(message)):
        render(with_ap(**ap))


@pytest.mark.parametrize(
    ("api", "where"),
    [
        ({"port": 0}, "/ap/api/port"),
        ({"storage": {"accessModes": ["RWX"]}}, "/ap/api/storage/accessModes/0"),
        ({"extraArgs": ["rm -rf /"]}, "/ap/api/extraArgs/0"),
        ({"keysSecret": {"name": "k", "key": ""}}, "/ap/api/keysSecret/key"),
        ({"noauth": True}, "noauth"),
    ],
)
def test_schema_rejects_bad_api_values(api: dict[str, Any], where: str) -> None:
    with helm.Chart.load(str(CHART)) as chart, pytest.raises(helm.HelmValuesError, match=where):
        chart.validate_schema(with_ap(api=api))


def test_notes_carry_a_python_snippet_that_compiles() -> None:
    with helm.Chart.load(str(CHART)) as chart:
        manifests = chart.render(load_values(EXAMPLE), name="demo", namespace=NAMESPACE,
                                 is_install=True)  # fmt: skip
    notes = manifests["async-processor/templates/NOTES.txt"]
    assert f"kubectl -n {NAMESPACE} port-forward svc/demo-async-processor-api 8000" in notes
    snippet = notes.split("python - <<'EOF'\n", 1)[1].split("\n  EOF", 1)[0]
    source = textwrap.dedent(snippet)
    assert 'base_url="http://localhost:8000/v1"' in source and "batch-api-keys" in source
    compile(source, "NOTES.txt", "exec")
