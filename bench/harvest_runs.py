"""Harvest bench, the live side: one run = a fresh pool simulator, the interactive trace
replayed against it, and (runs B…) the daemon draining a deep backlog under one strategy.

Input: the scenario, a strategy (daemon flags and queue gate), the shared Redis.
Output: a ``RunResult``: per-request interactive TTFT (the model's, from the response
header) and end-to-end latency (measured here), the pool's per-class counters over the
trace, a time series sampled every ``SAMPLE_EVERY`` seconds, and the daemon's CPU,
retries and 429s.
"""

from __future__ import annotations

import json
import math
import shutil
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import anyio
from prometheus_client.parser import text_string_to_metric_families

from async_processor.sim.serving import TIMING_HEADER
from bench.common import cpu_seconds, simulator
from bench.harness import LOG_DIR, Lane, bulk_load, start_daemon
from bench.harvest_model import CHARS_PER_TOKEN, Scenario, interactive_trace
from tests.fixtures.prometheus import start_prometheus
from tests.fixtures.servers import free_port, stop_process
from tests.fixtures.simulator import SimulatorProcess

SAMPLE_EVERY = 0.5
WARM_UP = 3.0  # seconds the daemon fills the pool before the trace starts


def warm_up(s: Scenario) -> float:
    return min(WARM_UP, s.duration / 4)  # tiny smoke runs wait less


SIM_URL = "{sim}"  # in a strategy's gate params: the run's own simulator URL
BATCH_OBJECTIVE = "batch"  # the simulator treats this objective as sheddable batch work


@dataclass(frozen=True)
class Strategy:
    """How the daemon runs in one B run: its workers, queue gate and extra flags."""

    name: str
    workers: int
    gate: dict[str, Any] = field(default_factory=dict)  # queue gate: gate_type / gate_params
    pool_gate: dict[str, Any] = field(default_factory=dict)  # the pool's gate (hears outcomes)
    flags: tuple[str, ...] = ()
    prometheus: bool = False  # needs a real Prometheus scraping the simulator
    note: str = ""


@dataclass
class Sample:
    t: float
    interactive: int
    batch: int
    waiting: int


@dataclass
class RunResult:
    name: str
    duration: float
    ttft: list[float] = field(default_factory=list)
    e2e: list[float] = field(default_factory=list)
    arrivals: list[float] = field(default_factory=list)  # each interactive request's start
    interactive_errors: int = 0
    counters: dict[str, Any] = field(default_factory=dict)  # pool counters over the trace
    series: list[Sample] = field(default_factory=list)
    daemon_cpu: float = 0.0
    retries: float = 0.0


def counter_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """The counters over the trace, and ``carried_in``: the slot-seconds the jobs running at
    its start had already spent (the daemon's warm-up), which their completion will count."""
    keys = ("slot_seconds", "completed_slot_seconds", "completed", "shed", "preempted")
    delta = {k: {c: after[k][c] - before[k][c] for c in after[k]} for k in keys}
    return {**delta, "carried_in": before["running_age"]}


async def _pool(session: aiohttp.ClientSession, sim: SimulatorProcess) -> dict[str, Any]:
    async with session.get(sim.url + "/admin/pool") as r:
        snapshot: dict[str, Any] = await r.json()
        return snapshot


async def replay(
    session: aiohttp.ClientSession,
    sim: SimulatorProcess,
    s: Scenario,
    result: RunResult,
    t0: float,
) -> None:
    """The interactive trace from ``t0``, open loop: each request leaves at its time,
    whatever the rest do; returns when the last one has its answer."""
    prompt = "x" * (s.interactive_prompt_tokens * CHARS_PER_TOKEN)
    url = sim.url + "/v1/completions"

    async def one(at: float, tokens: int) -> None:
        started = time.monotonic()
        body = {"model": "sim", "prompt": prompt, "max_tokens": tokens}
        try:
            async with session.post(url, json=body) as r:
                await r.read()
                if r.status != 200:
                    result.interactive_errors += 1
                    return
                ttft = float(r.headers[TIMING_HEADER])
        except aiohttp.ClientError:
            result.interactive_errors += 1
            return
        result.ttft.append(ttft)
        result.e2e.append(time.monotonic() - started)
        result.arrivals.append(at)

    async with anyio.create_task_group() as tg:
        for arrival in interactive_trace(s):
            await anyio.sleep(max(0.0, t0 + arrival.at - time.monotonic()))
            tg.start_soon(one, arrival.at, arrival.output_tokens)


async def sample(session: aiohttp.ClientSession, sim: SimulatorProcess, out: list[Sample]) -> None:
    t0 = time.monotonic()
    while True:
        p = await _pool(session, sim)
        running = p["running"]
        out.append(Sample(time.monotonic() - t0, running["interactive"], running["batch"],
                          p["waiting"]))  # fmt: skip
        await anyio.sleep(SAMPLE_EVERY)


async def daemon_retries(session: aiohttp.ClientSession, port: int) -> float:
    """The daemon's retries so far; NaN (and a warning) when it no longer answers."""
    try:
        async with session.get(f"http://127.0.0.1:{port}/metrics") as r:
            text = await r.text()
    except aiohttp.ClientError as exc:
        print(f"  warning: the daemon's /metrics did not answer ({exc}); see {LOG_DIR}")
        return math.nan
    return sum(
        s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name.endswith("request_retries_total")
    )


async def measure(
    s: Scenario, sim: SimulatorProcess, name: str, daemon: Callable[[], tuple[int, int]] | None
) -> RunResult:
    """Run the trace against ``sim``; ``daemon`` starts the consumer (PID, metrics port)."""
    result = RunResult(name, s.duration)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        pid, metrics_port = daemon() if daemon else (0, 0)
        if daemon:
            await anyio.sleep(warm_up(s))
        before, cpu0 = await _pool(session, sim), cpu_seconds(pid) if pid else 0.0
        t0 = time.monotonic()
        async with anyio.create_task_group() as tg:
            tg.start_soon(sample, session, sim, result.series)
            async with anyio.create_task_group() as trace:
                trace.start_soon(replay, session, sim, s, result, t0)
                # The counters cover the trace's span, as the oracle's do; its last requests
                # may finish later (their latencies count), the daemon's work then does not.
                await anyio.sleep(max(0.0, t0 + s.duration - time.monotonic()))
                after = await _pool(session, sim)
            tg.cancel_scope.cancel()
        result.counters = counter_delta(before, after)
        if pid:
            result.retries = await daemon_retries(session, metrics_port)
            result.daemon_cpu = cpu_seconds(pid) - cpu0 if Path(f"/proc/{pid}").exists() else 0
    return result


def backlog_size(s: Scenario) -> int:
    """More batch messages than the whole pool could ever answer in a run."""
    c = s.pool()
    prefill, decode = c.work(s.batch_prompt_tokens, s.batch_output_tokens)
    return math.ceil(s.capacity / (prefill + decode) * (s.duration + WARM_UP + 5) * 1.2)


def batch_request(s: Scenario) -> dict[str, Any]:
    prompt = "y" * (s.batch_prompt_tokens * CHARS_PER_TOKEN)
    return {"model": "sim", "prompt": prompt, "max_tokens": s.batch_output_tokens}


async def run_alone(s: Scenario) -> RunResult:
    with ExitStack() as stack:
        sim = simulator(stack, *s.sim_args())
        return await measure(s, sim, "A: interactive alone", None)


async def run_strategy(s: Scenario, strategy: Strategy, redis_url: str) -> RunResult:
    """One B run: a fresh simulator (and Prometheus), a fresh backlog, the daemon on it."""
    with ExitStack() as stack:
        sim = simulator(stack, *s.sim_args())
        lane = Lane.fresh(redis_url, strategy.name.replace(" ", "-"))
        await bulk_load(lane, backlog_size(s), batch_request(s))
        flags = list(strategy.flags)
        if strategy.pool_gate:
            flags += ["--pool-config-file", _pools_file(stack, strategy, sim.url)]
        if strategy.prometheus:
            flags += ["--prometheus-url", _prometheus(stack, sim).url]
        metrics_port = free_port()

        def daemon() -> tuple[int, int]:
            queue = {"inference_objective": BATCH_OBJECTIVE, **at(strategy.gate, sim.url)}
            proc = start_daemon(stack, lane, sim, strategy.workers, queue=queue,
                                flags=flags, metrics_port=metrics_port)  # fmt: skip
            return proc.pid, metrics_port

        return await measure(s, sim, strategy.name, daemon)


def at(gate: dict[str, Any], sim_url: str) -> dict[str, Any]:
    """A strategy's gate config with ``SIM_URL`` pointing at the run's simulator."""
    config: dict[str, Any] = json.loads(json.dumps(gate).replace(SIM_URL, sim_url))
    return config


def _pools_file(stack: ExitStack, strategy: Strategy, sim_url: str) -> str:
    pools = [{"id": "default", "workers": strategy.workers, **at(strategy.pool_gate, sim_url)}]
    path = Path(stack.enter_context(tempfile.TemporaryDirectory())) / "pools.json"
    path.write_text(json.dumps(pools))
    return str(path)


def _prometheus(stack: ExitStack, sim: SimulatorProcess) -> Any:
    binary = shutil.which("prometheus")
    if binary is None:
        raise RuntimeError("prometheus is not installed (Debian package 'prometheus')")
    run_dir = Path(stack.enter_context(tempfile.TemporaryDirectory())) / "prometheus"
    server = start_prometheus(binary, run_dir, [f"127.0.0.1:{sim.port}"])
    stack.callback(stop_process, server.proc)
    return server


def as_json(result: RunResult) -> dict[str, Any]:
    return {
        "name": result.name,
        "counters": result.counters,
        "interactive_requests": len(result.ttft),
        "interactive_errors": result.interactive_errors,
        "daemon_cpu_seconds": result.daemon_cpu,
        "retries": result.retries,
        "series": [vars(x) for x in result.series],
    }


def dumps(results: list[dict[str, Any]]) -> str:
    return json.dumps(results, indent=1, default=float)
