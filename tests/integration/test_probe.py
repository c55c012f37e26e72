"""``check-config --probe`` against a real Prometheus scraping the simulator: each metric
gate, nested ones included, prints the budget it would use or why it falls back."""

from __future__ import annotations

import io
import json
import logging
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog

from async_processor.cli import main as cli
from async_processor.logs import configure_logging
from tests.fixtures.prometheus import PrometheusServer
from tests.fixtures.simulator import SimulatorProcess


@pytest.fixture(autouse=True)
def private_logs(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """cli.main points the log handler at stderr; keep that away from capsys and later tests."""
    handlers = logging.getLogger().handlers[:]
    stream = io.StringIO()
    monkeypatch.setattr(
        cli, "configure_logging", lambda level, fmt: configure_logging(level, fmt, stream=stream)
    )
    yield
    logging.getLogger().handlers[:] = handlers
    structlog.reset_defaults()


def wait_for_series(prometheus: PrometheusServer, query: str, timeout: float = 20.0) -> None:
    url = prometheus.url + "/api/v1/query?" + urllib.parse.urlencode({"query": query})
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with urllib.request.urlopen(url, timeout=5) as response:
            if json.loads(response.read())["data"]["result"]:
                return
        time.sleep(0.2)
    raise AssertionError(f"prometheus never had {query}")


def gate(gate_type: str, **params: Any) -> dict[str, Any]:
    return {"gate_type": gate_type, "gate_params": params}


def check_config_probe(
    tmp_path: Path,
    prometheus_url: str,
    queues: list[dict[str, Any]],
    pool_gate: dict[str, Any],
    redis_url: str = "redis://127.0.0.1:1/0",
) -> int:
    transport = {"url": redis_url, "queues": queues}
    pools = tmp_path / "pools.json"
    pools.write_text(json.dumps([{"id": "default", "workers": 2, **pool_gate}]))
    argv = ["check-config", "--transport", "redis-sortedset", "--transport-config",
            json.dumps(transport), "--pool-config-file", str(pools),
            "--prometheus-url", prometheus_url, "--probe"]  # fmt: skip
    return cli.main(argv, {})


@pytest.mark.slow
def test_probe_prints_each_gates_value_or_why_it_falls_back(
    tmp_path: Path,
    simulator: SimulatorProcess,
    prometheus_factory: Callable[[list[str]], PrometheusServer],
    capsys: pytest.CaptureFixture[str],
) -> None:
    simulator.configure(max_concurrent=10)
    prometheus = prometheus_factory([f"127.0.0.1:{simulator.port}"])
    wait_for_series(prometheus, "llm_d_epp_flow_control_pool_saturation")
    queues = [
        {"queue_name": "sat", "igw_base_url": "http://gw", **gate(
            "prometheus-saturation", pool="sim-pool")},
        {"queue_name": "blind", "igw_base_url": "http://gw", **gate(
            "prometheus-budget", pool="no-such-pool")},
    ]  # fmt: skip
    scrape = gate(
        "endpoint-scrape",
        url=simulator.url + "/metrics",
        metric="vllm:num_requests_running",
        max_count_per_pod=10,
    )
    query = gate("prometheus-query", query="vector(0.25)")
    pool_gate = gate("wait-on-refuse", gate=gate("composite", gates=[scrape, query]))
    assert check_config_probe(tmp_path, prometheus.url, queues, pool_gate) == 1  # a blind gate
    out = capsys.readouterr().out
    report = out[out.index("probe: queue") :].splitlines()  # after the broker and gateway
    assert report[0] == (
        "probe: queue 'sat' prometheus-saturation: budget 0.8 (read 1, closed at <= 0.2)"
    )
    assert report[1].startswith("    1 - (max by(inference_pool)(llm_d_epp_flow_control_")
    assert report[2] == (
        "probe: queue 'blind' prometheus-budget: FALLBACK budget 0: all metric sources"
        " unavailable: [0] no series; [1] no series; [2] no series"
    )
    # What is missing, asked of Prometheus: the simulator's (current) names exist, but
    # not for this pool; the legacy names do not exist at all.
    missing = [line.removeprefix("    missing: ") for line in report if "missing: " in line]
    no_pool = '{inference_pool="no-such-pool"}'
    assert missing == [
        f"llm_d_epp_flow_control_queue_size has series, none matching {no_pool}",
        "Prometheus has no series of inference_extension_flow_control_queue_size (is it"
        " scraping its source?)",
        'llm_d_epp_ready_endpoints has series, none matching {name="no-such-pool"}',
        "Prometheus has no series of inference_pool_ready_pods (is it scraping its source?)",
        'llm_d_epp_per_endpoint_queue_size has series, none matching {name="no-such-pool"}',
        "Prometheus has no series of inference_pool_per_pod_queue_size (is it scraping its"
        " source?)",
        f"vllm:num_requests_running has series, none matching {no_pool}",
    ]
    assert len([line for line in report if line.startswith("    1 - (")]) == 1 + 3
    scrape_line = next(line for line in report if "endpoint-scrape" in line)
    assert scrape_line == (
        "probe: pool 'default' > composite[0] endpoint-scrape: budget 1 (read 1, closed at <= 0)"
    )
    assert f"    GET {simulator.url}/metrics vllm:num_requests_running" in report
    assert "probe: pool 'default' > composite[1] prometheus-query: budget 0.25" in out
    json.loads(out[: out.index("probe: ")])  # the config JSON still comes first, whole


@pytest.mark.slow
def test_probe_exits_0_when_every_gate_reads_and_names_the_source(
    tmp_path: Path,
    redis_url: str,
    simulator: SimulatorProcess,
    prometheus_factory: Callable[[list[str]], PrometheusServer],
    capsys: pytest.CaptureFixture[str],
) -> None:
    simulator.configure(epp_metrics="legacy")  # an old EPP: the fallback names answer
    prometheus = prometheus_factory([f"127.0.0.1:{simulator.port}"])
    wait_for_series(prometheus, "inference_pool_ready_pods")
    queues = [{"queue_name": "q", "igw_base_url": simulator.url, **gate(
        "prometheus-budget", pool="sim-pool", max_concurrency=10)}]  # fmt: skip
    assert check_config_probe(tmp_path, prometheus.url, queues, {}, redis_url) == 0
    out = capsys.readouterr().out
    assert "probe: queue 'q' prometheus-budget: budget 0.95 (read 1, closed at <= 0.05)" in out
    assert "from source [0]" in out


@pytest.mark.slow
def test_probe_names_the_metric_a_blind_gate_lacks(
    tmp_path: Path,
    simulator: SimulatorProcess,
    prometheus_factory: Callable[[list[str]], PrometheusServer],
    capsys: pytest.CaptureFixture[str],
) -> None:
    """It said "the query returned no series": which metric, and is it absent or only
    absent with these labels? (PromQL against a real Prometheus, and a scraped page.)"""
    prometheus = prometheus_factory([f"127.0.0.1:{simulator.port}"])
    wait_for_series(prometheus, "vllm:num_requests_running")
    queues = [
        {"queue_name": "typo", "igw_base_url": simulator.url, **gate(
            "prometheus-query", query='sum(rate(vllm_num_requests{job="gate-test"}[1m]))')},
        {"queue_name": "labels", "igw_base_url": simulator.url, **gate(
            "prometheus-query", query='max(vllm:num_requests_running{job="nope"}) < bool 5')},
    ]  # fmt: skip
    pool_gate = gate("composite", gates=[
        gate("endpoint-scrape", url=simulator.url + "/metrics", metric=["vllm:nope", "x:y"]),
        gate("endpoint-scrape", url=simulator.url + "/metrics",
             metric="vllm:num_requests_running", labels={"model_name": "other"}),
    ])  # fmt: skip
    assert check_config_probe(tmp_path, prometheus.url, queues, pool_gate) == 1
    out = capsys.readouterr().out
    report = out[out.index("probe: queue") :].splitlines()
    assert report[:3] == [
        "probe: queue 'typo' prometheus-query: FALLBACK budget 0: the query returned no series",
        "    missing: Prometheus has no series of vllm_num_requests (is it scraping its source?)",
        '    sum(rate(vllm_num_requests{job="gate-test"}[1m]))',
    ]
    assert report[4] == (
        '    missing: vllm:num_requests_running has series, none matching {job="nope"}'
    )
    assert f"    missing: the page at {simulator.url}/metrics has no vllm:nope or x:y" in report
    assert (
        f"    missing: the page at {simulator.url}/metrics has vllm:num_requests_running,"
        ' none with {model_name="other"}'
    ) in report
