"""``python -m bench.harvest`` runs end to end on tiny runs: the oracle, run A, the
reference's prometheus-saturation (the daemon, a real Redis and a real Prometheus) and the
recommended pool-headroom pool gate, then the table, the JSON, the PNGs and the summary
line. Figures are not asserted (only that the pool gate let batch work through)."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench.harvest import RECOMMENDED
from bench.harvest_model import HEADROOMS
from tests.fixtures.servers import require_binary

SUMMARY = re.compile(
    r"harvest: best=\S+ harvest_ratio=\S+ oracle_ratio=\S+ ttft_p99_ratio=\S+ "
    r"e2e_p99_ratio=\S+ shed_share=\S+"
)


@pytest.mark.timeout(180)
@pytest.mark.redis
@pytest.mark.prometheus
def test_the_harvest_bench_runs_end_to_end(tmp_path: Path) -> None:
    require_binary("redis-server")
    require_binary("prometheus")
    only = f"prometheus-saturation,{RECOMMENDED}"  # a queue gate and a pool gate
    args = ["--duration", "3", "--cycles", "2", "--only", only, "--out", str(tmp_path)]
    done = subprocess.run(
        [sys.executable, "-m", "bench.harvest", *args],
        capture_output=True,
        text=True,
        timeout=170,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert SUMMARY.fullmatch(lines[-1]), lines[-1]
    assert "harvested      = slot-seconds of batch requests" in done.stdout
    assert "| prometheus-saturation |" in done.stdout
    data = json.loads((tmp_path / "harvest.json").read_text())[0]
    assert [r["name"] for r in data["rows"]] == ["prometheus-saturation", RECOMMENDED]
    assert data["rows"][1]["completed"] > 0  # the pool gate read the run's simulator
    assert len(data["oracle"]) == 2 * len(HEADROOMS)  # with and without preemption
    assert all(run["interactive_requests"] > 0 for run in data["runs"])
    if importlib.util.find_spec("matplotlib") is not None:
        assert {p.name for p in tmp_path.glob("*.png")} == {
            "harvest-A.png", "harvest-prometheus-saturation.png",
            f"harvest-{RECOMMENDED.replace(' ', '-')}.png",
        }  # fmt: skip
