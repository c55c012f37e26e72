"""The README's commands and client snippet, run as written against a real Redis, the
simulator and a daemon process (only hosts, ports and the venv's path are substituted).

The README's ZADD showed no request JSON (its ``deadline`` field is required) and its
client snippet lacked its imports: neither could be run as shown.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.fixtures.servers import RedisServer, free_port
from tests.fixtures.simulator import SimulatorProcess

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", (ROOT / "README.md").read_text(), re.M | re.S)


def localised(text: str, redis: RedisServer, gateway: str) -> str:
    return (
        text.replace("redis://redis:6379/0", redis.url)
        .replace("redis://localhost:6379/0", redis.url)
        .replace("http://llm-d-router:8000", gateway)
        .replace(".venv/bin/", f"{BIN}/")
        .replace("redis-cli ", f"redis-cli -p {redis.port} ")
    )


def bash(script: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip


def wait_ready(port: int, log: Path, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=1):
                return
        except OSError:
            time.sleep(0.2)
    raise AssertionError(f"the README's daemon never got ready:\n{log.read_text()[-3000:]}")


@pytest.mark.slow
def test_readme_commands_and_snippet_run_as_written(
    private_redis: RedisServer, simulator: SimulatorProcess, tmp_path: Path
) -> None:
    if not any(Path(p, "redis-cli").exists() for p in os.environ["PATH"].split(os.pathsep)):
        pytest.fail("redis-cli is needed (it comes with redis-server)")
    run_it, submit, zadd = blocks("sh")[1:4]
    health = free_port()
    env = {
        **os.environ,
        "ASYNC_PROCESSOR_HEALTH_PORT": str(health),
        "ASYNC_PROCESSOR_METRICS_PORT": str(free_port()),
        "ASYNC_PROCESSOR_LOG_FORMAT": "json",
    }
    # The "run it" block: its last command is the daemon, started in the background here.
    script = localised(run_it, private_redis, simulator.url).rstrip()
    script += " > daemon.log 2>&1 &\necho $! > daemon.pid\n"
    done = bash(script, tmp_path, env)
    assert done.returncode == 0, done.stdout + done.stderr  # check-config --probe passed too
    assert "probe: broker redis-sortedset at 127.0.0.1" in done.stdout
    pid = int((tmp_path / "daemon.pid").read_text())
    try:
        wait_ready(health, tmp_path / "daemon.log")
        done = bash(localised(submit, private_redis, simulator.url), tmp_path, env)
        assert done.returncode == 0, done.stderr
        [result] = [json.loads(line) for line in done.stdout.splitlines()]
        assert (result["id"], result["status_code"]) == ("r2", 200)

        done = bash(localised(zadd, private_redis, simulator.url), tmp_path, env)
        assert done.returncode == 0, done.stderr
        assert done.stdout.splitlines()[0] == "1"  # ZADD added one member
        popped = json.loads(done.stdout.splitlines()[-1])  # BRPOP: the list, then the result
        assert (popped["id"], popped["status_code"]) == ("r3", 200)

        [snippet] = blocks("python")
        done = subprocess.run([sys.executable, "-c", localised(snippet, private_redis, "")],
                              capture_output=True, text=True, timeout=90, env=env)  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith("r1 200 ")
    finally:
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 30
        while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
            time.sleep(0.1)  # drains and exits (bash's child: reaped by init)
