"""Operator commands run in the daemon's pod (``kubectl exec ... async-processor status``).

The chart passes the daemon's config as arguments, not environment, so a command run
beside it found no config. In a pod PID 1 is the daemon (the image's entrypoint): the
commands read its flags from /proc/1/cmdline (here a file holding the rendered pod's
command line) and say where they looked when that fails.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import redis

from async_processor.cli import args as cli_args
from async_processor.cli.main import main
from tests.deploy.test_chart import CHART, CONFIG_DIR, container, load_values, render

EXAMPLE = CHART / "ci" / "sortedset-values.yaml"


@pytest.fixture
def pod(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, redis_url: str) -> Path:
    """The rendered pod, locally: its ConfigMap files in tmp_path, its command line as
    PID 1's, its REDIS_URL (the Secret's value) in the environment."""
    objects = render(load_values(EXAMPLE))
    for name, text in objects["ConfigMap:config"]["data"].items():
        (tmp_path / name).write_text(text)
    args = [re.sub(re.escape(CONFIG_DIR), str(tmp_path), a) for a in container(objects)["args"]]
    cmdline = tmp_path / "cmdline"
    words = ["/app/.venv/bin/python", "/app/.venv/bin/async-processor", *args]
    cmdline.write_bytes(b"\0".join(w.encode() for w in words) + b"\0")
    monkeypatch.setattr(cli_args, "DAEMON_CMDLINE", str(cmdline))
    monkeypatch.setenv("REDIS_URL", redis_url)
    return cmdline


def test_status_in_the_pod_finds_the_daemons_config(
    pod: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["status", "--json"]) == 0
    out, err = capsys.readouterr()
    queues = {q["queue"] for q in json.loads(out)["queues"]}
    assert queues == {"interactive-sortedset", "batch-sortedset"}
    assert f"using the daemon's flags from {pod}" in err


def test_check_config_in_the_pod_prints_the_daemons_config(
    pod: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["check-config"]) == 0
    config = json.loads(capsys.readouterr().out)
    assert config["transport"] == "redis-sortedset"
    assert [p["id"] for p in config["pools"]] == ["interactive", "batch"]
    assert config["runtime"]["prometheus_url"].startswith("http://prometheus-operated")


def test_flags_of_the_command_still_win(pod: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check-config", "--drain-timeout=7s"]) == 0
    assert json.loads(capsys.readouterr().out)["runtime"]["drain_timeout"] == 7.0


def test_submit_in_the_pod_writes_to_the_daemons_queue(
    pod: Path, tmp_path: Path, redis_url: str, unique: str
) -> None:
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"id": f"{unique}-1", "payload": {}}) + "\n")
    assert main(["submit", str(src)]) == 1  # two queues: --queue required
    assert main(["submit", str(src), "--queue", "batch-sortedset"]) == 0
    r = redis.Redis.from_url(redis_url)
    assert r.zscore("batch-sortedset", r.zrange("batch-sortedset", 0, -1)[0]) is not None
    r.delete("batch-sortedset")


@pytest.mark.parametrize(
    ("words", "why"),
    [
        (["/sbin/init"], "PID 1 is not async-processor"),
        (["async-processor", "sim", "--port=1"], "PID 1 is async-processor sim"),
        (["async-processor", "run", "--concurrency=4"], "PID 1 names no transport config"),
    ],
)
def test_elsewhere_the_error_says_where_it_looked(
    words: list[str], why: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    cmdline = tmp_path / "cmdline"
    cmdline.write_bytes(b"\0".join(w.encode() for w in words) + b"\0")
    monkeypatch.setattr(cli_args, "DAEMON_CMDLINE", str(cmdline))
    for command in ("status", "dead-letters", "check-config"):
        argv = [command, "list"] if command == "dead-letters" else [command]
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert (
            "no transport config: pass the daemon's --transport and --transport-config-file" in err
        )
        envs = "ASYNC_PROCESSOR_TRANSPORT_CONFIG_FILE and ASYNC_PROCESSOR_TRANSPORT_CONFIG"
        assert f"{envs}, and {cmdline} ({why})" in err
