"""The demo end to end: embedded Redis (redis-server or fakeredis) or the Pub/Sub emulator,
simulator and daemon in one process; every request gets a result over each transport and
the summary's figures agree."""

from __future__ import annotations

import re
import shutil
import sys

import pytest
import redis

from async_processor.demo import local_servers
from async_processor.demo import run as demo
from tests.fixtures.servers import RedisServer, service_missing


def run_demo(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    code = demo.main(["--latency", "0", "--timeout", "60", *args])
    return code, capsys.readouterr().out


def figure(out: str, pattern: str) -> int:
    match = re.search(pattern, out)
    assert match is not None, f"{pattern!r} not in:\n{out}"
    return int(match.group(1))


@pytest.mark.slow
def test_demo_on_a_private_redis_server_retries_the_simulated_errors(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out = run_demo(capsys, "--count", "200", "--error-rate", "0.1")
    assert code == 0
    assert "200 submitted, 200 results" in out
    assert figure(out, r"HTTP 200\s+(\d+)") == 200
    assert "p50" in out and "p99" in out
    # Every simulated 500 came back as one retry, and nothing else was retried.
    errors = figure(out, r"'500': (\d+)")
    assert errors > 0
    assert figure(out, r"retries \(metrics\)\s+(\d+)") == errors
    # The last step: a batch through the API with the real OpenAI SDK.
    assert "completed: 20/20 lines answered, output file 20 lines" in out


def test_demo_falls_back_to_fakeredis_without_redis_server(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(shutil, "which", lambda name: None)
    code, out = run_demo(capsys, "--count", "60", "--error-rate", "0")
    assert code == 0
    assert "60 submitted, 60 results" in out
    assert figure(out, r"simulator\s+(\d+) calls") == 60


def test_demo_without_redis_or_fakeredis_says_how_to_get_one(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # fakeredis is the demo extra's; without it (and without redis-server) the demo names both.
    monkeypatch.setattr(shutil, "which", lambda name: None)
    monkeypatch.setitem(sys.modules, "fakeredis", None)  # import fails as if not installed
    code = demo.main(["--count", "1"])
    assert code == 2
    err = capsys.readouterr().err
    assert "redis-server" in err and "async-processor[demo]" in err


def demo_keys(redis_url: str) -> list[bytes | str]:
    client = redis.Redis.from_url(redis_url)
    try:
        # Bare names and hash-tagged bookkeeping keys ({demo-…-results}:pushed) alike.
        return [*client.keys("demo-*"), *client.keys("{demo-*")]
    finally:
        client.close()


def test_demo_on_a_given_redis_leaves_no_queues_behind(
    capsys: pytest.CaptureFixture[str], redis_url: str
) -> None:
    code, out = run_demo(capsys, "--count", "80", "--error-rate", "0", "--redis-url", redis_url)
    assert code == 0
    assert "80 submitted, 80 results" in out
    assert demo_keys(redis_url) == []


def test_demo_reports_failure_when_results_do_not_arrive(
    capsys: pytest.CaptureFixture[str], private_redis: RedisServer
) -> None:
    # A gateway nobody listens on: requests are retried until the demo gives up; the
    # drain hands them back, and the tidy-up still removes the run's queues.
    code, out = run_demo(
        capsys, "--count", "5", "--timeout", "2", "--gateway-url", "http://127.0.0.1:9",
        "--redis-url", private_redis.url,
    )  # fmt: skip
    assert code == 1
    assert "5 requests got no result in time" in out
    assert demo_keys(private_redis.url) == []


def test_demo_over_redis_pubsub_retries_through_the_retry_set_and_tidies_up(
    capsys: pytest.CaptureFixture[str], redis_url: str
) -> None:
    code, out = run_demo(
        capsys, "--transport", "redis-pubsub", "--count", "120", "--error-rate", "0.1",
        "--redis-url", redis_url,
    )  # fmt: skip
    assert code == 0
    assert "over 2 redis-pubsub queues" in out
    assert "120 submitted, 120 results" in out
    assert figure(out, r"HTTP 200\s+(\d+)") == 120
    assert figure(out, r"retries \(metrics\)\s+(\d+)") == figure(out, r"'500': (\d+)")
    assert demo_keys(redis_url) == []


def emulator_installed() -> bool:
    return local_servers.find_emulator() is not None and shutil.which("java") is not None


@pytest.mark.pubsub
@pytest.mark.gcp
def test_demo_over_gcp_pubsub_runs_on_the_emulator(capsys: pytest.CaptureFixture[str]) -> None:
    if not emulator_installed():
        service_missing("the Pub/Sub emulator (or java) is missing")
    code, out = run_demo(capsys, "--transport", "gcp-pubsub", "--count", "100", "--error-rate", "0")
    assert code == 0
    assert "over 2 gcp-pubsub queues" in out
    assert "100 submitted, 100 results" in out
    assert figure(out, r"HTTP 200\s+(\d+)") == 100
    assert figure(out, r"simulator\s+(\d+) calls") == 100


def test_demo_without_the_emulator_says_how_to_install_it(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(local_servers, "find_emulator", lambda: None)
    code = demo.main(["--transport", "gcp-pubsub", "--count", "1"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1
    assert "apt-get install google-cloud-cli-pubsub-emulator" in err
