"""``async-processor check-config`` on each transport's example config in config/.

It must build the transport without connecting to any broker, and print the effective
config as JSON alone on stdout (logs, such as redis-pubsub's deprecation warning, go to
stderr), as a user runs it in a shell or a pipeline.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures.servers import env_without

CONFIG_DIR = Path(__file__).resolve().parents[2] / "config"

EXAMPLES = [
    pytest.param("redis-sortedset", "sortedset.json", [], id="sortedset"),
    pytest.param("redis-pubsub", "redis-pubsub.json", [], id="redis-pubsub"),
    # The example's queue gate is prometheus-saturation, which needs a Prometheus URL.
    pytest.param(
        "gcp-pubsub",
        "gcp-pubsub.json",
        ["--prometheus-url", "http://prometheus:9090"],
        id="gcp-pubsub",
    ),
]


def check_config(*args: str) -> subprocess.CompletedProcess[str]:
    """``async-processor check-config`` as a user runs it, with no broker reachable."""
    env = env_without("PUBSUB_EMULATOR_HOST", "GOOGLE_APPLICATION_CREDENTIALS", "REDIS_URL")
    command = [sys.executable, "-m", "async_processor", "check-config", *args]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=60, check=False)


@pytest.mark.parametrize(("transport", "example", "extra"), EXAMPLES)
def test_check_config_builds_each_example_transport_offline(
    transport: str, example: str, extra: list[str]
) -> None:
    path = CONFIG_DIR / example
    done = check_config("--transport", transport, "--transport-config-file", str(path), *extra)
    assert done.returncode == 0, done.stderr
    printed = json.loads(done.stdout)  # stdout is the JSON alone: logs go to stderr
    if transport == "redis-pubsub":
        assert "redis_pubsub_deprecated" in done.stderr
    assert printed["transport"] == transport
    shown = printed["transport_config"]
    for key, value in json.loads(path.read_text()).items():
        if isinstance(value, list):
            assert len(shown[key]) == len(value)
        else:
            assert shown[key] == value


def test_check_config_names_the_missing_prometheus_url_for_the_gcp_example() -> None:
    path = str(CONFIG_DIR / "gcp-pubsub.json")
    done = check_config("--transport", "gcp-pubsub", "--transport-config-file", path)
    assert done.returncode == 2
    assert "--prometheus-url" in done.stderr


@pytest.mark.parametrize(
    ("example", "transport"),
    [("sortedset.json", "redis-sortedset"), ("gcp-pubsub.json", "gcp-pubsub")],
)
def test_a_config_for_another_transport_without_transport_names_it(
    example: str, transport: str
) -> None:
    """The default transport is redis-pubsub; a forgotten --transport is named as such."""
    done = check_config("--transport-config-file", str(CONFIG_DIR / example))
    assert done.returncode == 2
    assert f"this looks like a {transport} config; pass --transport {transport}" in done.stderr
    assert "Extra inputs" not in done.stderr


def test_a_broken_config_with_an_explicit_transport_gets_no_guess() -> None:
    done = check_config(
        "--transport", "redis-pubsub", "--transport-config-file", str(CONFIG_DIR / "sortedset.json")
    )
    assert done.returncode == 2
    assert "this looks like" not in done.stderr and "Extra inputs" in done.stderr


def test_equal_health_and_metrics_ports_fail_the_check() -> None:
    path = str(CONFIG_DIR / "sortedset.json")
    base = ("--transport", "redis-sortedset", "--transport-config-file", path)
    done = check_config(*base, "--health-port", "9090")
    assert done.returncode == 2
    assert "--health-port and --metrics-port are both 9090" in done.stderr
    assert check_config(*base, "--health-port", "0", "--metrics-port", "0").returncode == 0
