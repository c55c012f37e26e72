"""The chart's hot reload: ``ap.transportConfigWatchInterval`` passes the flag, and with it
a change of the transport config's queues alone no longer rolls the pods (the kubelet
updates the mounted ConfigMap in place and the daemon applies it); any other config
change still does. Rendered with helm-python-sdk, as tests/deploy/test_chart.py."""

from __future__ import annotations

from typing import Any

import pytest

from tests.deploy.test_chart import CHART, MINIMAL, container, helm, render, with_ap

QUEUES = {"queues": [{"queue_name": "q"}, {"queue_name": "other"}]}


def checksum(values: dict[str, Any]) -> str:
    pod = render(values)["Deployment"]["spec"]["template"]
    return str(pod["metadata"]["annotations"]["checksum/config"])


def test_the_flag_follows_the_value() -> None:
    args = container(render(with_ap(transportConfigWatchInterval="30s")))["args"]
    assert "--transport-config-watch-interval=30s" in args
    assert not any("watch" in a for a in container(render(MINIMAL))["args"])


@pytest.mark.parametrize("every", ["30s", "1m", "0.5s"])
def test_with_the_watch_only_a_change_outside_the_queues_rolls_the_pods(every: str) -> None:
    def watched(**ap: Any) -> dict[str, Any]:
        return with_ap(transportConfigWatchInterval=every, **ap)

    base = checksum(watched())
    assert checksum(watched(transportConfig=QUEUES)) == base  # reloaded in place
    assert checksum(watched(transportConfig={**QUEUES, "batch_size": 50})) != base
    assert checksum(watched(workerPools=[{"id": "default", "workers": 3}])) != base
    assert checksum(watched(requestMergePolicyConfig={"type": "weighted-fair"})) != base


@pytest.mark.parametrize("every", ["", "0", "0s", "0.0m", "0m0s", "0h0.0m0s"])
def test_without_the_watch_a_queue_change_rolls_the_pods(every: str) -> None:
    values = with_ap(transportConfigWatchInterval=every)
    changed = with_ap(transportConfigWatchInterval=every, transportConfig=QUEUES)
    assert checksum(changed) != checksum(values)


def test_the_schema_refuses_a_bad_interval() -> None:
    with helm.Chart.load(str(CHART)) as chart:
        chart.validate_schema(with_ap(transportConfigWatchInterval="1m30s"))
        with pytest.raises(helm.HelmValuesError, match="transportConfigWatchInterval"):
            chart.validate_schema(with_ap(transportConfigWatchInterval="every minute"))
        with pytest.raises(helm.HelmValuesError, match="transportConfigWatchInterval"):
            chart.validate_schema(with_ap(transportConfigWatchInterval="-5s"))
