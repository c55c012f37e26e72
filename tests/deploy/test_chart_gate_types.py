"""The chart's schema refuses a gate type the daemon would refuse, at ``helm install``.

It took any string, so a misspelled ``gate_type`` rendered and the pods crash-looped.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from async_processor.gates import GATES
from tests.deploy.test_chart import CHART, helm, with_ap


def gate_type_enums(node: Any) -> list[list[str]]:
    """Every ``gate_type`` property's enum in the schema."""
    found = []
    if isinstance(node, dict):
        gate_type = node.get("properties", {}).get("gate_type")
        if gate_type is not None:
            found.append(gate_type.get("enum"))
        for value in node.values():
            found += gate_type_enums(value)
    elif isinstance(node, list):
        for value in node:
            found += gate_type_enums(value)
    return found


def test_every_gate_type_in_the_schema_is_exactly_the_daemons() -> None:
    enums = gate_type_enums(json.loads((CHART / "values.schema.json").read_text()))
    assert len(enums) == 3  # queues, the discovery template, worker pools
    for enum in enums:
        assert enum == ["", *GATES.known()]


@pytest.mark.parametrize(
    "ap",
    [
        {"transportConfig": {"queues": [{"queue_name": "q", "gate_type": "prometheus-saturaton"}]}},
        {"workerPools": [{"id": "p", "workers": 1, "gate_type": "redis_quota"}]},
    ],
    ids=["queue", "pool"],
)
def test_schema_rejects_a_misspelled_gate_type(ap: dict[str, Any]) -> None:
    with (
        helm.Chart.load(str(CHART)) as chart,
        pytest.raises(helm.HelmValuesError, match="gate_type"),
    ):
        chart.validate_schema(with_ap(**ap))


def test_schema_accepts_a_known_gate_type() -> None:
    queues = [{"queue_name": "q", "gate_type": "prometheus-saturation"}]
    with helm.Chart.load(str(CHART)) as chart:
        chart.validate_schema(with_ap(transportConfig={"queues": queues}))
