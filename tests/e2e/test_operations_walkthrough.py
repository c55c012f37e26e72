"""docs/operations.md, "The first hour": install, first message, status, an alert's metric
rising, a dead letter's replay refused and purged, each command run as written (hosts,
ports and the venv's path substituted) against a private Redis and the simulator."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import pytest

from tests.e2e.test_readme import BIN, ROOT, bash, wait_ready
from tests.fixtures.servers import RedisServer, free_port
from tests.fixtures.simulator import SimulatorProcess


def walkthrough() -> list[str]:
    text = (ROOT / "docs" / "operations.md").read_text()
    section = text[text.index("## The first hour") : text.index("## 1. The image")]
    return re.findall(r"^```sh\n(.*?)^```", section, re.M | re.S)


@pytest.mark.slow
def test_the_first_hour_runs_as_written(
    private_redis: RedisServer, simulator: SimulatorProcess, tmp_path: Path
) -> None:
    health, metrics = free_port(), free_port()

    def local(script: str) -> str:
        script = (
            script.replace("redis://127.0.0.1:6379/0", private_redis.url)
            .replace("http://127.0.0.1:8000", simulator.url)
            .replace("redis-cli ", f"redis-cli -p {private_redis.port} ")
            .replace("--metrics-port 9090", f"--metrics-port {metrics}")
            .replace("--health-port 8081", f"--health-port {health}")
            .replace("localhost:9090", f"localhost:{metrics}")
            .replace(" &\n", " > daemon.log 2>&1 &\n")  # the daemon's output kept
        )
        script = re.sub(r"(^|\| )async-processor ", rf"\g<1>{BIN}/async-processor ", script,
                        flags=re.M)  # fmt: skip
        assert "6379" not in script  # never the machine's own Redis
        return script

    install, first, status, alert, dead = walkthrough()
    env = {**os.environ, "ASYNC_PROCESSOR_LOG_FORMAT": "json"}
    done = bash(local(install) + "echo $! > daemon.pid\n", tmp_path, env)
    assert done.returncode == 0, done.stdout + done.stderr
    pid = int((tmp_path / "daemon.pid").read_text())
    try:
        wait_ready(health, tmp_path / "daemon.log")

        done = bash(local(first), tmp_path, env)
        assert done.returncode == 0, done.stderr
        [result] = [json.loads(line) for line in done.stdout.splitlines()]
        assert (result["id"], result["status_code"]) == ("first", 200)

        done = bash(local(status), tmp_path, env)
        assert done.returncode == 0, done.stderr
        assert re.search(r"^requests\s+default\s+0\s+0", done.stdout, re.M), done.stdout

        done = bash(local(alert), tmp_path, env)
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip().endswith(" 1.0"), done.stdout  # from 0 to 1: an increase

        done = bash(local(dead), tmp_path, env)
        assert done.returncode == 0, done.stderr
        lines = done.stdout.splitlines()
        assert "missing_id" in lines[1]  # list: the entry, its reason
        assert "undecodable 1" in done.stdout and "not replayed: see why above" in done.stdout
        assert "cannot be replayed: the message does not decode" in done.stderr
        assert lines[-1] == "purged 1"
    finally:
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 30
        while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
