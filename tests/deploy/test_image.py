"""The container image, built with podman (``make image``) and run the way the chart runs it.

The flags come from the rendered Deployment: read-only root filesystem, its UID/GID, every
capability dropped, no privilege escalation, /tmp as the only writable place, the config
files mounted read-only where the chart mounts them, REDIS_URL from the environment. The
daemon inside talks to a real redis-server and the simulator on the host (host network,
loopback only). ``make image-test`` runs this file; ``.ci/run`` builds the image first, so
the build here is a cache hit.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from async_processor.messages import Result
from tests.deploy.test_chart import CONFIG_DIR, container, http_get, render, with_ap
from tests.deploy.test_dockerfile import requirement_name
from tests.fixtures.servers import free_port, require_binary
from tests.fixtures.simulator import SimulatorProcess

ROOT = Path(__file__).resolve().parents[2]
IMAGE = "localhost/async-processor:dev"
CONF = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
PODMAN_ENV = {**os.environ, "CONTAINERS_CONF": str(CONF / "async-processor-image/containers.conf")}
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("image")]


def podman(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["podman", *args], env=PODMAN_ENV, capture_output=True, text=True,
                          timeout=timeout, check=False)  # fmt: skip


@pytest.fixture(scope="module")
def image() -> str:
    """Built (or found up to date in podman's layer cache) from this checkout."""
    require_binary("podman")
    env = {**os.environ, "IMAGE": IMAGE, "PYTHON": sys.executable}
    done = subprocess.run(["bash", str(ROOT / "scripts" / "image.sh")], env=env,
                          capture_output=True, text=True, timeout=900)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return IMAGE


def chart_flags(objects: dict[str, dict[str, Any]]) -> list[str]:
    """podman flags for what the rendered pod spec asks of the container runtime."""
    pod = objects["Deployment"]["spec"]["template"]["spec"]
    c = container(objects)
    sc, psc = c["securityContext"], pod["securityContext"]
    flags = ["--user", f"{psc['runAsUser']}:{psc['runAsGroup']}"]
    assert sc["readOnlyRootFilesystem"] is True
    flags.append("--read-only")
    assert sc["capabilities"]["drop"] == ["ALL"] and not sc["capabilities"].get("add")
    flags += ["--cap-drop", "ALL"]
    assert sc["allowPrivilegeEscalation"] is False
    flags += ["--security-opt", "no-new-privileges"]
    tmp = next(m for m in c["volumeMounts"] if m["name"] == "tmp")
    return [*flags, "--read-only-tmpfs=false", "--tmpfs", tmp["mountPath"]]


def config_mount(objects: dict[str, dict[str, Any]], where: Path) -> list[str]:
    where.mkdir(mode=0o755)
    for name, text in objects["ConfigMap:config"]["data"].items():
        (where / name).write_text(text)
        (where / name).chmod(0o644)
    return ["--volume", f"{where}:{CONFIG_DIR}:ro"]


def sortedset_values(unique: str, gateway: str, **ap: Any) -> dict[str, Any]:
    return with_ap(
        igwBaseURL=gateway,
        transportConfig={
            "result_queue_name": f"{unique}:results",
            "retry_queue_name": f"{unique}:retry",
            "poll_interval_ms": 50,
            "queues": [{"queue_name": f"{unique}:requests"}],
        },
        bindAddress="127.0.0.1",
        **ap,
    )


def test_version_labels_and_size(image: str) -> None:
    objects = render(sortedset_values("v", "http://127.0.0.1:1"))
    ran = podman("run", "--rm", *chart_flags(objects), image, "--version")
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.split() == ["async-processor", PROJECT["version"]]
    labels = json.loads(podman("image", "inspect", image, "--format", "{{json .Labels}}").stdout)
    oci = {k.removeprefix("org.opencontainers.image."): v for k, v in labels.items()}
    assert oci["version"] == PROJECT["version"]
    assert re.fullmatch(r"[0-9a-f]{40}(-dirty)?", oci["revision"]), oci["revision"]
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", oci["created"]), oci["created"]
    assert oci["licenses"] == PROJECT["license"]["text"]
    assert oci["source"].startswith("https://")
    size = int(podman("image", "inspect", image, "--format", "{{.Size}}").stdout)
    layers = int(podman("image", "inspect", image, "--format", "{{len .RootFS.Layers}}").stdout)
    print(f"{image}: {size / 1e6:.0f} MB, {layers} layers")
    assert size < 500e6 and layers <= 5


def test_runtime_holds_the_lock_and_no_dev_bench_or_demo_package(image: str) -> None:
    listing = podman("run", "--rm", "--entrypoint", "python", image, "-c",
                     "import importlib.metadata as m, json; print(json.dumps("
                     "{d.metadata['Name'].lower().replace('_', '-'): d.version"
                     " for d in m.distributions()}))")  # fmt: skip
    assert listing.returncode == 0, listing.stderr
    installed = json.loads(listing.stdout)
    lock = re.findall(r"^([\w.-]+)==(\S+)", (ROOT / "requirements-image.txt").read_text(), re.M)
    for name, version in lock:
        if name != "async-timeout":  # only below Python 3.11.3 (bookworm's 3.11.2 has it)
            assert installed.get(name) == version, name
    extras = PROJECT["optional-dependencies"]
    dev_only = {requirement_name(d) for e in ("dev", "bench", "demo", "pyreqwest")
                for d in extras[e]}  # fmt: skip
    dev_only -= {requirement_name(d) for d in PROJECT["dependencies"]} | {PROJECT["name"]}
    assert dev_only and not dev_only & installed.keys(), dev_only & installed.keys()
    assert not {"pip", "setuptools", "wheel"} & installed.keys()  # build tools stay behind
    assert installed[PROJECT["name"]] == PROJECT["version"]


def test_check_config_reads_the_charts_files(
    image: str, tmp_path: Path, redis_url: str, simulator: SimulatorProcess, unique: str
) -> None:
    objects = render(sortedset_values(unique, simulator.url))
    args = container(objects)["args"]
    assert args[0] == "run"
    flags = [*chart_flags(objects), *config_mount(objects, tmp_path / "config")]
    ran = podman("run", "--rm", "--network", "host", "--env", f"REDIS_URL={redis_url}", *flags,
                 image, "check-config", *args[1:])  # fmt: skip
    assert ran.returncode == 0, ran.stdout + ran.stderr
    bad = podman("run", "--rm", *flags, image, "check-config", *args[1:], "--concurrency=0")
    assert bad.returncode != 0, bad.stdout


@pytest.fixture
def running(
    image: str, tmp_path: Path, redis_url: str, simulator: SimulatorProcess, unique: str
) -> Iterator[tuple[str, dict[str, dict[str, Any]]]]:
    ports = {"health": free_port(), "metrics": free_port()}
    values = sortedset_values(unique, simulator.url, health={"port": ports["health"]},
                              metrics={"port": ports["metrics"]}, drainTimeout="10s")  # fmt: skip
    objects = render(values)
    name = f"ap-{unique.replace(':', '-')}"[:60]
    started = podman("run", "--detach", "--name", name, "--network", "host",
                     "--env", f"REDIS_URL={redis_url}", *chart_flags(objects),
                     *config_mount(objects, tmp_path / "config"), image,
                     *container(objects)["args"])  # fmt: skip
    assert started.returncode == 0, started.stderr
    try:
        yield name, objects
    finally:
        podman("rm", "--force", "--time", "0", name)


def wait(check: Any, what: str, name: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.1)
    raise AssertionError(f"{what} not seen in {timeout} s:\n{podman('logs', name).stderr[-3000:]}")


def submit(r: redis.Redis, queue: str, ids: list[str]) -> None:
    deadline = int(time.time()) + 600
    r.zadd(queue, {json.dumps({"id": i, "deadline": deadline,
                               "payload": {"prompt": "hi", "max_tokens": 2}}): deadline
                   for i in ids})  # fmt: skip


def helm_test(objects: dict[str, dict[str, Any]], image: str) -> None:
    """The chart's `helm test` Pod, its Service host name swapped for the loopback."""
    pod = objects["Pod"]
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    hook = pod["spec"]["containers"][0]
    args = [re.sub(r"^http://[^:/]+", "http://127.0.0.1", a) for a in hook["args"]]
    assert args[-1] == ""  # no bearer token on /metrics here
    command = ["--entrypoint", hook["command"][0], image, *hook["command"][1:], *args]
    ran = podman("run", "--rm", "--network", "host", *chart_flags(objects), *command)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert ran.stdout.count(" 200") == 2, ran.stdout


def test_serves_round_trips_and_drains_on_sigterm(
    image: str,
    running: tuple[str, dict[str, dict[str, Any]]],
    redis_url: str,
    simulator: SimulatorProcess,
    unique: str,
) -> None:
    name, objects = running
    c = container(objects)
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    probe = c["readinessProbe"]["httpGet"]
    wait(lambda: http_get(f"http://127.0.0.1:{ports[probe['port']]}{probe['path']}")[0] == 200,
         "/readyz 200", name)  # fmt: skip
    assert "llm_d_async_" in http_get(f"http://127.0.0.1:{ports['metrics']}/metrics")[1]
    helm_test(objects, image)
    r = redis.Redis.from_url(redis_url)
    results, queue = f"{unique}:results", f"{unique}:requests"
    submit(r, queue, [f"a{i}" for i in range(100)])
    wait(lambda: r.llen(results) >= 100, "100 results", name)
    done = [Result.decode(x) for x in r.rpop(results, 200) or []]
    assert sorted(x.id for x in done) == sorted(f"a{i}" for i in range(100))
    assert {x.status_code for x in done} == {200}, [x for x in done if x.status_code != 200][:3]

    # In flight at SIGTERM (20 of 64 workers): each answer takes 2 s; the drain (10 s)
    # finishes every one and the process exits 0.
    simulator.configure(latency=2.0)
    submit(r, queue, [f"b{i}" for i in range(20)])
    wait(lambda: simulator.stats()["running"] == 20, "20 requests in flight", name)
    grace = objects["Deployment"]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    started = time.monotonic()
    assert podman("kill", "--signal", "TERM", name).returncode == 0
    exited = podman("wait", name, timeout=grace + 5)
    assert time.monotonic() - started < grace
    assert exited.stdout.strip() == "0", podman("logs", name).stderr[-3000:]
    drained = [Result.decode(x) for x in r.rpop(results, 200) or []]
    assert sorted(x.id for x in drained) == sorted(f"b{i}" for i in range(20))
    assert {x.status_code for x in drained} == {200}, [x for x in drained][:3]
    assert r.zcard(queue) == 0
