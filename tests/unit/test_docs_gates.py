"""Every gate config shown in docs/gates.md builds (the EPP recipes included)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from async_processor.gates.base import GateContext, GateOwner, build_gate
from async_processor.gates.epp import POOL_SATURATION, READY_ENDPOINTS

DOC = Path(__file__).parents[2] / "docs" / "gates.md"
EXAMPLES = [
    json.loads(block)
    for block in re.findall(r"```json\n(.*?)```", DOC.read_text(), flags=re.S)
    if '"gate_type"' in block and "<type>" not in block  # not the schematic one
]


def test_the_page_has_the_epp_recipes() -> None:
    scraped = [e["gate_params"] for e in EXAMPLES if e["gate_type"] == "endpoint-scrape"]
    names = [p.get("pods_metric") or p["metric"] for p in scraped]
    assert list(READY_ENDPOINTS.names) in names
    assert list(POOL_SATURATION.names) in names


@pytest.mark.anyio
@pytest.mark.parametrize("example", EXAMPLES, ids=lambda e: str(e["gate_type"]))
async def test_every_documented_gate_config_builds(example: dict[str, Any]) -> None:
    ctx = GateContext(owner=GateOwner(pool="p"), prometheus_url="http://prometheus:9090")
    try:
        build_gate(example["gate_type"], example.get("gate_params"), ctx)
    finally:
        for close in ctx.closers:
            await close()
