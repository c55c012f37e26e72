"""(e) gcp-pubsub at cloud latency: the daemon beside a bare baseline on the emulator.

In each cell the daemon (``--transport gcp-pubsub``, default ``batch_size``) and
``bench.pubsub_baseline`` (~80 lines: pull up to the free slots, POST, publish results in
batches, ack after the publish) drain their own copies of the same messages at the same
time, against the same emulator and simulator. Both are measured over one common window
(from when both passed 10 % of their results to when the first passed 90 %), so work
from outside on this shared machine weighs on both alike. Cells: emulator round trip 0
or 40 ms (a ``bench.delay_proxy`` in front of the emulator holds each chunk 20 ms each
way) × gateway latency 0 s (256 workers) or 1 s (512 workers: Little's law allows 512
msg/s). Printed per consumer: msg/s and CPU ms per message over that window, and whether
every id got exactly one result; each target with pass or FALL-SHORT: daemon ≥ 0.9 × the
baseline's throughput in every cell, CPU per message ≤ 1.2 × the baseline's, ≥ 0.95 of
Little's law at 1 s / 512 workers / 40 ms. What Little's law is made of is printed too:
the gateway latency each consumer saw (the daemon's from its /metrics, the baseline's
from its own count) and the share of workers busy (rate × that latency ÷ workers), with
the CPU the emulator, the delay proxy and the simulator used meanwhile (in cores) and the
machine's load. Run alone: ``python -m bench.pubsub [--quick] [--cell 40/1 ...]``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import secrets
import time
from contextlib import ExitStack, suppress
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import anyio
from prometheus_client.parser import text_string_to_metric_families

from async_processor.demo import local_servers
from bench.common import (
    cpu_seconds,
    peak_rss_bytes,
    python_process,
    rss_bytes,
    simulator,
    table,
    verdict,
)
from bench.harness import DEADLINE, LOG_DIR, Process, Run, payload
from bench.overhead import describe
from tests.fixtures.pubsub import PubSubAdmin
from tests.fixtures.servers import free_port, stop_process, wait_for_port
from tests.fixtures.simulator import SimulatorProcess

PROJECT = "bench-project"
HOLD = 0.020  # seconds the proxy holds each chunk, each way: a 40 ms round trip
PUBLISH_CHUNK = 1000
THROUGHPUT_TARGET, LITTLE_TARGET, CPU_TARGET = 0.9, 0.95, 1.2


@dataclass
class Lane:
    """One consumer's request subscription and result topic on the emulator."""

    sub: str
    results: str
    results_sub: str

    @classmethod
    async def fresh(cls, admin: PubSubAdmin, label: str) -> Lane:
        tag = f"{label}-{secrets.token_hex(3)}"
        lane = cls(f"{tag}-req-sub", f"{tag}-res", f"{tag}-res-sub")
        # A long ack deadline: a slow run must not count redeliveries as work.
        await admin.create_subscription(lane.sub, f"{tag}-req", ack_deadline=120)
        await admin.create_subscription(lane.results_sub, lane.results, ack_deadline=120)
        return lane


async def publish(admin: PubSubAdmin, lane: Lane, count: int) -> None:
    deadline = int(time.time()) + DEADLINE
    topic = lane.sub.removesuffix("-sub")
    for start in range(0, count, PUBLISH_CHUNK):
        bodies = [
            json.dumps({"id": f"m{i}", "deadline": deadline, "payload": payload()}).encode()
            for i in range(start, min(start + PUBLISH_CHUNK, count))
        ]
        await admin.publish(topic, bodies)


def start_daemon(
    stack: ExitStack, lane: Lane, sim: SimulatorProcess, workers: int, host: str, metrics: int
) -> Process:
    config = {"project_id": PROJECT, "result_topic_id": lane.results,
              "topics": [{"subscriber_id": lane.sub, "igw_base_url": sim.url}]}  # fmt: skip
    health = free_port()
    args = ["-m", "async_processor", "run", "--transport", "gcp-pubsub",
            "--transport-config", json.dumps(config), "--concurrency", str(workers),
            "--health-port", str(health), "--metrics-port", str(metrics),
            "--bind-address", "127.0.0.1", "--log-level", "warning",
            "--metrics-backlog-poll-interval", "0"]  # fmt: skip
    env = {"PUBSUB_EMULATOR_HOST": host}
    return python_process(stack, args, port=health, log=LOG_DIR / f"{lane.sub}.log", env=env)


def start_baseline(
    stack: ExitStack, lane: Lane, sim: SimulatorProcess, workers: int, host: str, count: int
) -> Process:
    args = ["-m", "bench.pubsub_baseline",
            "--subscription", f"projects/{PROJECT}/subscriptions/{lane.sub}",
            "--topic", f"projects/{PROJECT}/topics/{lane.results}", "--gateway-url", sim.url,
            "--workers", str(workers), "--count", str(count),
            "--stats", str(LOG_DIR / f"{lane.sub}.json")]  # fmt: skip
    env = {"PUBSUB_EMULATOR_HOST": host}
    return python_process(stack, args, log=LOG_DIR / f"{lane.sub}.log", env=env)


@dataclass
class Trace:
    """One consumer's progress: (seconds, results, CPU seconds) samples, ids seen."""

    proc: Process
    count: int
    samples: list[tuple[float, int, float]] = field(default_factory=list)
    ids: set[str] = field(default_factory=set)
    duplicates: int = 0  # a second result for an id: a broken guarantee
    peak_rss: int = 0
    rss: int = 0

    def sample(self) -> None:
        cpu = self.samples[-1][2] if self.samples else 0.0
        with suppress(OSError):  # the baseline exits once done
            cpu = cpu_seconds(self.proc.pid)
            self.peak_rss, self.rss = peak_rss_bytes(self.proc.pid), rss_bytes(self.proc.pid)
        self.samples.append((time.monotonic(), len(self.ids), cpu))

    def reached(self, results: int) -> float:
        return next(t for t, n, _ in self.samples if n >= results)

    def at(self, when: float) -> tuple[float, float]:
        """Results and CPU seconds at ``when``, interpolated between samples."""
        for (t0, n0, c0), (t1, n1, c1) in itertools.pairwise(self.samples):
            if t0 <= when <= t1:
                f = (when - t0) / (t1 - t0) if t1 > t0 else 1.0
                return n0 + f * (n1 - n0), c0 + f * (c1 - c0)
        return float(self.samples[-1][1]), self.samples[-1][2]


async def follow(admin: PubSubAdmin, lane: Lane, trace: Trace) -> None:
    """Read a consumer's results until every id has one."""
    trace.sample()
    with anyio.fail_after(trace.count / 50 + 120):
        while len(trace.ids) < trace.count:
            if trace.proc.poll() is not None and trace.proc.returncode:
                raise RuntimeError(f"consumer exited with {trace.proc.returncode}; see {LOG_DIR}")
            for message in await admin.pull(lane.results_sub, 1000, timeout=2.0):
                result_id = json.loads(message.message.data)["id"]
                trace.duplicates += result_id in trace.ids
                trace.ids.add(result_id)
            trace.sample()


def steady(traces: list[Trace]) -> list[Run]:
    """Each consumer's rate and CPU per message over one common window: from when both
    passed 10 % of their results to when the first passed 90 %, so both are measured
    under the same load from outside (this machine is shared)."""
    start = max(t.reached(max(1, t.count // 10)) for t in traces)
    end = min(t.reached(max(1, t.count * 9 // 10)) for t in traces)
    if len(traces) > 1 and end - start < 1.0:  # barely overlapping: each its own window
        return [steady([t])[0] for t in traces]
    end = max(end, start + 1e-3)
    runs = []
    for trace in traces:
        (n0, c0), (n1, c1) = trace.at(start), trace.at(end)
        done = max(n1 - n0, 1.0)
        wall = trace.samples[-1][0] - trace.samples[0][0]
        rate, cpu_ms = done / (end - start), (c1 - c0) * 1000 / done
        runs.append(Run(trace.count, rate, cpu_ms, wall, trace.peak_rss, trace.rss))
    return runs


@dataclass
class Beside:
    """Around one race: the gateway latency each consumer saw (s per POST: daemon,
    baseline) and the CPU, in cores, of the processes both use."""

    latency: tuple[float, float]
    cores: dict[str, float]


def group_pids(group: int) -> list[int]:
    """The processes of one process group (the emulator's launcher and its java)."""
    pids = []
    for entry in Path("/proc").iterdir():
        with suppress(ValueError, OSError):
            if os.getpgid(int(entry.name)) == group:
                pids.append(int(entry.name))
    return pids


def cpu_of(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        with suppress(OSError):
            total += cpu_seconds(pid)
    return total


async def daemon_latency(port: int) -> float:
    """Mean seconds per gateway attempt, from the daemon's /metrics."""
    url = f"http://127.0.0.1:{port}/metrics"
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        text = await response.text()
    totals = {"sum": 0.0, "count": 0.0}
    for family in text_string_to_metric_families(text):
        if family.name.endswith("inference_latency_time_millis"):
            for sample in family.samples:
                kind = sample.name.rsplit("_", 1)[1]
                if kind in totals:
                    totals[kind] += sample.value
    return totals["sum"] / max(totals["count"], 1.0) / 1000


async def baseline_latency(proc: Process, stats: Path) -> float:
    """Mean seconds per POST, written by the baseline when it exits; NaN if it did not."""
    with anyio.move_on_after(30):
        while proc.poll() is None:
            await anyio.sleep(0.1)
    try:
        return float(json.loads(stats.read_text())["post_seconds"])
    except (OSError, ValueError, KeyError):
        return math.nan


async def race(
    admin: PubSubAdmin,
    sim: SimulatorProcess,
    host: str,
    workers: int,
    count: int,
    shared: dict[str, list[int]],
) -> tuple[list[Run], list[Trace], Beside]:
    """The daemon and the baseline draining their own copies of the same messages at once."""
    lanes = [await Lane.fresh(admin, name) for name in ("daemon", "baseline")]
    for lane in lanes:
        await publish(admin, lane, count)
    shared = {**shared, "simulator": [sim.proc.pid]}
    metrics = free_port()
    with ExitStack() as stack:
        daemon = start_daemon(stack, lanes[0], sim, workers, host, metrics)  # once it serves
        baseline = start_baseline(stack, lanes[1], sim, workers, host, count)
        traces = [Trace(daemon, count), Trace(baseline, count)]
        cpu0, started = {k: cpu_of(v) for k, v in shared.items()}, time.monotonic()
        async with anyio.create_task_group() as tg:
            for lane, trace in zip(lanes, traces, strict=True):
                tg.start_soon(follow, admin, lane, trace)
        elapsed = time.monotonic() - started
        cores = {k: (cpu_of(v) - cpu0[k]) / elapsed for k, v in shared.items()}
        seen = (
            await daemon_latency(metrics),
            await baseline_latency(baseline, LOG_DIR / f"{lanes[1].sub}.json"),
        )
    return steady(traces), traces, Beside(seen, cores)


async def cell(
    admin: PubSubAdmin,
    sim: SimulatorProcess,
    host: str,
    rtt_ms: int,
    latency: float,
    args: Args,
    shared: dict[str, list[int]],
) -> list[tuple[str, str]]:
    workers = args.slow_workers if latency else args.workers
    count = args.slow_messages if latency else args.messages
    (daemon, base), (trace_d, trace_b), beside = await race(
        admin, sim, host, workers, count, shared
    )
    speed, cpu = daemon.rate / base.rate, daemon.cpu_ms / base.cpu_ms
    name = f"RTT {rtt_ms} ms, gateway {latency:g} s, {workers} workers"
    dups = f"duplicates: daemon {trace_d.duplicates}, baseline {trace_b.duplicates}"
    rows = [
        (name, ""),
        ("  daemon", describe(daemon)),
        ("  baseline", describe(base)),
        ("  throughput ÷ baseline", verdict(f"× {speed:.2f}", speed >= THROUGHPUT_TARGET, "≥ 0.9")),
        ("  CPU/msg ÷ baseline", verdict(f"× {cpu:.2f}", cpu <= CPU_TARGET, "≤ 1.2")),
    ]
    if latency:
        little, base_little = daemon.rate * latency / workers, base.rate * latency / workers
        text = f"{little:.3f} (baseline {base_little:.3f})"
        if rtt_ms:
            text = verdict(text, little >= LITTLE_TARGET, "≥ 0.95")
        seen_d, seen_b = beside.latency
        rows += [
            ("  Little's law", text),
            ("    = workers busy", f"{daemon.rate * seen_d / workers:.2f} "
                                   f"(baseline {base.rate * seen_b / workers:.2f})"),
            ("    × gateway latency", f"{latency:g} s ÷ {seen_d:.3f} s seen by the daemon "
                                      f"({latency:g} s ÷ {seen_b:.3f} s by the baseline)"),
        ]  # fmt: skip
    beside_cpu = ", ".join(f"{k} {v:.2f}" for k, v in beside.cores.items())
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return [
        *rows,
        ("  exactly one result", f"{count} ids each; {dups}"),
        ("  beside them (cores)", f"{beside_cpu}; load average {load}"),
    ]


@dataclass
class Args:
    messages: int
    workers: int
    slow_messages: int
    slow_workers: int
    cells: list[tuple[int, float]]  # (RTT ms, gateway s) to run; empty = all four


async def warm_up(admin: PubSubAdmin, count: int) -> None:
    """Publish and pull ``count`` messages first: a cold emulator (JIT) answers pulls
    several times slower, and the first cell would pay for it."""
    lane = await Lane.fresh(admin, "warm-up")
    await publish(admin, lane, count)
    await admin.pull_until(lane.sub, count, timeout=120.0)


async def measure(args: Args) -> list[tuple[str, str]]:
    rows = [("setup", f"{args.messages:,} msgs at a 0 s gateway, {args.slow_messages:,} at 1 s")]
    with ExitStack() as stack:
        emulator = local_servers.start_emulator(PROJECT)
        stack.callback(emulator.stop)
        os.environ["PUBSUB_EMULATOR_HOST"] = emulator.host  # the bench's own admin client
        proxy_port = free_port()
        proxy = python_process(stack, ["-m", "bench.delay_proxy", "--listen-port",
                                       str(proxy_port), "--target", emulator.host,
                                       "--delay", str(HOLD)])  # fmt: skip
        wait_for_port(proxy_port, timeout=30, proc=proxy)
        hosts = {0: emulator.host, round(HOLD * 2000): f"127.0.0.1:{proxy_port}"}
        shared = {"emulator": group_pids(emulator.proc.pid), "delay proxy": [proxy.pid]}
        sims = {0.0: simulator(stack), 1.0: simulator(stack, "--latency", "1")}
        admin = PubSubAdmin(PROJECT)
        try:
            await warm_up(admin, args.messages)
            for latency, sim in sims.items():
                for rtt_ms, host in hosts.items():
                    if not args.cells or (rtt_ms, latency) in args.cells:
                        rows += await cell(admin, sim, host, rtt_ms, latency, args, shared)
        finally:
            await admin.aclose()
        stop_process(proxy)
    return rows


def parse_cell(text: str) -> tuple[int, float]:
    """``40/1`` -> (40, 1.0): one cell of the four."""
    rtt, _, latency = text.partition("/")
    return int(rtt), float(latency)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.pubsub")
    p.add_argument("--messages", type=int, default=10000, help="per run at a 0 s gateway")
    p.add_argument("--workers", type=int, default=256, help="at a 0 s gateway")
    p.add_argument("--slow-messages", type=int, default=8000, help="per run at a 1 s gateway")
    p.add_argument("--slow-workers", type=int, default=512, help="at a 1 s gateway")
    p.add_argument("--quick", action="store_true", help="3,000 messages per run")
    p.add_argument(
        "--cell",
        action="append",
        default=[],
        type=parse_cell,
        dest="cells",
        help="RTT_MS/GATEWAY_S, e.g. 40/1 (repeatable; default: all four)",
    )
    a = p.parse_args(argv)
    quick = 3000 if a.quick else 0
    args = Args(quick or a.messages, a.workers, quick or a.slow_messages, a.slow_workers, a.cells)
    title = "(e) gcp-pubsub vs a bare baseline at cloud latency"
    try:
        table(title, anyio.run(measure, args))
    except local_servers.EmulatorMissing as exc:
        table(title, [("skipped", str(exc))])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
