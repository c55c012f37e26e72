"""Bench harness: a private Redis and simulator, a consumer process, and its steady state.

Input: which consumer to run (the daemon via ``python -m async_processor run``, or
``bench.baseline``), how many workers, how many messages. Output: a ``Run`` with the
steady-state rate, the consumer's CPU ms per message over that window, and its RSS.

The steady window starts at 10 % of the results (start-up does not count) and spans a
whole number of worker rounds, ending by 90 % (the tail does not count). Whole rounds,
because with a fixed gateway latency the results come in waves, one per round of the
workers (they all start within a few claims of each other and stay in step): between 10 %
and 90 % of 20,000 results at 1,024 workers the window ran from near the end of one wave
to the middle of another, 16,000 results in about 16 rounds' time, which reads as at most
16,000 / 16,384 = 0.977 of Little's law however well the consumer kept its workers busy
(the tighter the waves, the nearer that bound). Marks at the same place of a wave count
whole rounds, and their results, for the daemon and the baseline alike. ``rate_10_90``
keeps the old window's figure beside it.

That window still counts results, which come in waves: over ~15 rounds it reads 1.000 or
0.938 for a true 0.977, by phase, unless every round holds exactly ``workers`` results.
``occupancy`` is free of that: the simulator integrates its requests in flight over time
(``sim_capacity.Occupancy``), the harness reads the integral during the run, and the
steady window is a span of time: from when the gateway first holds all the workers'
requests (its exact peak; the first arrival if it never does), plus ``SETTLE``, to when
the last request has reached it, less ``SETTLE``.
The time-averaged number in flight over it, ÷ workers, is by Little's law at the gateway
(every request spends its fixed latency there) throughput ÷ (workers ÷ latency), without
the steps. When a loaded simulator keeps requests longer than its latency (the mean,
``gateway_seconds``, is printed beside), it is throughput × that time ÷ workers instead.
"""

from __future__ import annotations

import json
import secrets
import subprocess
import tempfile
import time
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
from redis.asyncio import Redis

from async_processor.client.redis_sortedset import SortedSetClient
from async_processor.messages import Envelope, Request, Routing
from bench.common import cpu_seconds, peak_rss_bytes, python_process, rss_bytes
from tests.fixtures.servers import free_port
from tests.fixtures.simulator import SimulatorProcess

LOG_DIR = Path(tempfile.gettempdir()) / "async-processor-bench"  # consumer logs
DEADLINE = 4 * 3600  # seconds from now: no bench message may expire
BULK_CHUNK = 2000
SETTLE = 1.0  # seconds cut from each end of the occupancy window (one round at 1 s)
SAMPLE_EVERY = 0.05  # seconds between readings of the simulator's in-flight integral
Process = subprocess.Popen[bytes]


@dataclass
class Lane:
    """One consumer's queue and result list on the shared Redis."""

    redis_url: str
    queue: str
    results: str

    @classmethod
    def fresh(cls, redis_url: str, label: str) -> Lane:
        tag = f"{label}-{secrets.token_hex(3)}"
        return cls(redis_url, f"bench-{tag}", f"bench-{tag}-results")


@dataclass
class Run:
    messages: int
    rate: float  # steady-state results per second (whole worker rounds, above)
    cpu_ms: float  # consumer CPU per message over the steady-state window
    seconds: float  # first submission seen to last result
    peak_rss: int
    rss: int
    rate_10_90: float = 0.0  # the same between 10 % and 90 % of the results (before)
    occupancy: float | None = None  # time-averaged in flight at the gateway ÷ workers (above)
    gateway_seconds: float | None = None  # mean time a request spent in the gateway

    @property
    def core_share(self) -> float:
        """The consumer's CPU use over the window, in cores: near 1.0 means CPU-bound."""
        return self.cpu_ms * self.rate / 1000


def payload(prompt_bytes: int = 64) -> dict[str, Any]:
    return {"model": "bench", "prompt": "x" * prompt_bytes, "max_tokens": 16}


async def submit(lane: Lane, count: int, prompt_bytes: int = 64) -> None:
    """Enqueue through the client library, as a producer would."""
    deadline = int(time.time()) + DEADLINE
    body = payload(prompt_bytes)
    async with SortedSetClient(lane.redis_url, lane.queue, lane.results) as client:
        for start in range(0, count, BULK_CHUNK):
            n = min(BULK_CHUNK, count - start)
            batch = [
                {"id": f"m{start + i}", "deadline": deadline, "payload": body} for i in range(n)
            ]
            await client.submit_many(batch)


async def bulk_load(lane: Lane, count: int, request: dict[str, Any] | None = None) -> None:
    """A deep backlog fast: envelopes ZADDed many per command (no active-token keys)."""
    deadline = int(time.time()) + DEADLINE
    body = json.dumps(request or payload()).encode()
    routing = Routing(request_queue_name=lane.queue, result_queue_name=lane.results)
    redis = Redis.from_url(lane.redis_url)
    try:
        for start in range(0, count, BULK_CHUNK):
            members = {
                Envelope(Request(f"b{i}", deadline, body), routing, "redis").encode(): deadline
                for i in range(start, min(start + BULK_CHUNK, count))
            }
            await redis.zadd(lane.queue, members)
    finally:
        await redis.aclose()


def start_daemon(
    stack: ExitStack,
    lane: Lane,
    sim: SimulatorProcess,
    workers: int,
    *,
    queue: dict[str, Any] | None = None,
    flags: Sequence[str] = (),
    metrics_port: int = 0,
    **transport: Any,
) -> Process:
    """The daemon as a process (``python -m async_processor run``); ``queue`` adds fields to
    its queue entry (gate, objective), ``flags`` to its command line."""
    config = {
        "url": lane.redis_url,
        "result_queue_name": lane.results,
        "retry_queue_name": lane.queue + "-retry",
        "queues": [{"queue_name": lane.queue, "igw_base_url": sim.url, **(queue or {})}],
        **transport,
    }
    health = free_port()
    args = ["-m", "async_processor", "run", "--transport", "redis-sortedset",
            "--transport-config", json.dumps(config), "--concurrency", str(workers),
            "--health-port", str(health), "--metrics-port", str(metrics_port or free_port()),
            "--bind-address", "127.0.0.1", "--log-level", "warning",
            "--metrics-backlog-poll-interval", "0", *flags]  # fmt: skip
    return python_process(stack, args, port=health, log=LOG_DIR / f"{lane.queue}.log")


def start_baseline(
    stack: ExitStack, lane: Lane, sim: SimulatorProcess, workers: int, count: int
) -> Process:
    args = ["-m", "bench.baseline", "--redis-url", lane.redis_url, "--queue", lane.queue,
            "--result-list", lane.results, "--gateway-url", sim.url,
            "--workers", str(workers), "--count", str(count)]  # fmt: skip
    return python_process(stack, args, log=LOG_DIR / f"{lane.queue}.log")


def window(count: int, rounds: int) -> tuple[int, int]:
    """The steady window's first and last result counts: from 10 % of ``count``, the most
    whole rounds of ``rounds`` results that end by 90 % (10 %..90 % if not even one fits)."""
    low, end = max(1, count // 10), max(1, count * 9 // 10)
    whole = (end - low) // max(1, rounds)
    return (low, low + whole * rounds) if whole else (low, end)


async def watch(lane: Lane, proc: Process, count: int, timeout: float, rounds: int = 1) -> Run:
    """Poll the result list until ``count`` results; time and CPU the steady window
    (``window``: whole rounds of ``rounds`` results, the consumer's workers)."""
    pid = proc.pid
    redis = Redis.from_url(lane.redis_url)
    low, high = window(count, rounds)
    marks: dict[int, tuple[float, float]] = {}
    thresholds = sorted({low, high, max(1, count * 9 // 10)})
    started = time.monotonic()
    try:
        with anyio.fail_after(timeout):
            while (done := int(await redis.llen(lane.results))) < count:
                if proc.poll() is not None:
                    raise RuntimeError(f"consumer exited with {proc.returncode}; see {LOG_DIR}")
                now = time.monotonic(), cpu_seconds(pid)
                for mark in thresholds:
                    if done >= mark and mark not in marks:
                        marks[mark] = now
                await anyio.sleep(0.02)
        end = time.monotonic(), cpu_seconds(pid)
    finally:
        await redis.aclose()
    (t0, c0), (t1, c1) = marks.get(low, (started, 0.0)), marks.get(high, end)
    t90 = marks.get(max(1, count * 9 // 10), end)[0]
    span = max(high - low, 1)
    return Run(
        messages=count,
        rate=span / max(t1 - t0, 1e-9),
        cpu_ms=(c1 - c0) * 1000 / span,
        seconds=end[0] - started,
        peak_rss=peak_rss_bytes(pid),
        rss=rss_bytes(pid),
        rate_10_90=(max(1, count * 9 // 10) - low) / max(t90 - t0, 1e-9),
    )


@dataclass(frozen=True)
class Reading:
    """One reading of the simulator's ``/admin/stats``: its clock, the in-flight integral
    up to then (request-seconds), the most requests in flight at once so far (exact, not
    only at readings) and the requests arrived."""

    clock: float
    integral: float
    peak: int
    arrived: int


def steady_occupancy(readings: Sequence[Reading], workers: int, arrivals: int) -> float | None:
    """Time-averaged requests in flight ÷ ``workers`` between the first reading ``SETTLE``
    after the gateway first held all the workers' requests (after the first arrival if it
    never did: the slow start then counts) and the last one ``SETTLE`` before all
    ``arrivals`` had reached it; None if too short."""
    first = next((r.clock for r in readings if r.arrived), None)
    if first is None:
        return None
    filled = next((r.clock for r in readings if r.peak >= workers), first)
    drained = next((r.clock for r in readings if r.arrived >= arrivals), readings[-1].clock)
    span = [r for r in readings if filled + SETTLE <= r.clock <= drained - SETTLE]
    if len(span) < 2:
        return None
    return (span[-1].integral - span[0].integral) / (span[-1].clock - span[0].clock) / workers


async def read_gateway(sim: SimulatorProcess, readings: list[Reading]) -> None:
    """Append a reading every ``SAMPLE_EVERY`` until cancelled (urllib: in a thread)."""
    while True:
        s = await anyio.to_thread.run_sync(sim.stats)
        reading = s["clock"], s["in_flight_seconds"], s["in_flight_peak"], s["total"]
        readings.append(Reading(*reading))
        await anyio.sleep(SAMPLE_EVERY)


async def drain(
    redis_url: str,
    sim: SimulatorProcess,
    label: str,
    workers: int,
    messages: int,
    *,
    baseline: bool = False,
    prompt_bytes: int = 64,
    flags: Sequence[str] = (),
) -> tuple[Run, dict[str, Any]]:
    """Queue ``messages`` on a fresh lane, let the daemon (or the baseline) answer them all.

    ``flags`` go to the daemon's command line. Returns the run and the simulator's stats for
    it (calls, statuses, peak concurrency).
    The consumer is stopped before returning, so runs in a row do not overlap.
    """
    lane = Lane.fresh(redis_url, label)
    await submit(lane, messages, prompt_bytes)
    sim.reset()
    readings: list[Reading] = []
    with ExitStack() as stack:
        if baseline:
            proc = start_baseline(stack, lane, sim, workers, messages)
        else:
            proc = start_daemon(stack, lane, sim, workers, flags=flags)
        async with anyio.create_task_group() as tg:
            tg.start_soon(read_gateway, sim, readings)
            run = await watch(lane, proc, messages, timeout=messages / 50 + 60, rounds=workers)
            tg.cancel_scope.cancel()
    seen = sim.stats()
    run.occupancy = steady_occupancy(readings, workers, messages)
    run.gateway_seconds = seen["in_flight_seconds"] / max(seen["total"], 1)
    return run, seen
