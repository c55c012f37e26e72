"""Demo: the whole pipeline on one machine, with a live progress bar and a summary table.

Stage: outside the daemon (``async-processor demo``, ``make demo``). Input: options (the
transport, how many requests, simulated latency and error rate; optionally a real Redis
and gateway). Output: requests submitted over two queues in the transport's wire format
(``demo.feeds``), processed by an in-process ``Processor`` against the simulator, progress
on stdout, then throughput, end-to-end latency percentiles, results by status / error code
and retries. Exit 0 when every request got its result, 1 when some did not, 2 when the
transport's local server is missing. The Redis transports use ``--redis-url`` or a private
``redis-server`` (or, when none is installed, a fakeredis TCP server with Lua from the
``demo`` extra) on a free port; gcp-pubsub runs the Pub/Sub emulator on a free port.
"""

from __future__ import annotations

import argparse
import json
import secrets
import statistics
import sys
import time
from collections import Counter
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

import anyio
from prometheus_client import CollectorRegistry

from async_processor.cli.args import duration, parse, subcommand_parser
from async_processor.config import AppConfig, RuntimeConfig
from async_processor.demo.batch import run_batch_step
from async_processor.demo.feeds import QUEUES, TRANSPORTS, Feed, open_feed
from async_processor.demo.local_servers import ServerMissing, embedded_redis, pubsub_emulator
from async_processor.logs import configure_logging
from async_processor.messages import Request, Result
from async_processor.metrics import PREFIX, Metrics
from async_processor.pipeline.processor import Processor
from async_processor.sim.app import Simulator
from async_processor.sim.config import SimConfig

SUBMIT_CHUNK = 250
DEADLINE_SECONDS = 300
PROJECT = "demo-project"  # any name does on the emulator


@dataclass(frozen=True)
class Options:
    transport: str
    count: int
    redis_url: str
    gateway_url: str
    latency: float
    error_rate: float
    workers: int
    timeout: float
    batch_lines: int


@dataclass
class Progress:
    """What the demo has seen so far; ``latencies`` are submit-to-result seconds."""

    total: int
    submitted: int = 0
    started: float = field(default_factory=time.monotonic)
    submit_times: dict[str, float] = field(default_factory=dict)
    latencies: list[float] = field(default_factory=list)
    outcomes: Counter[str] = field(default_factory=Counter)
    finished: float = 0.0

    @property
    def done(self) -> int:
        return len(self.latencies)

    def record(self, result: Result) -> None:
        sent = self.submit_times.pop(result.id, None)
        if sent is None:
            return  # not ours (a shared result list) or a duplicate
        self.latencies.append(time.monotonic() - sent)
        self.outcomes[_outcome(result)] += 1
        self.finished = time.monotonic()


def _outcome(result: Result) -> str:
    if result.error_code:
        return result.error_code
    return f"HTTP {result.status_code}"


# -- the run --------------------------------------------------------------------------


def _runtime(opts: Options) -> RuntimeConfig:
    return RuntimeConfig.model_validate(
        {
            "concurrency": opts.workers,
            "health_port": 0,
            "metrics_port": 0,
            "bind_address": "127.0.0.1",
            "drain_timeout": "10s",
        }
    )


async def run_demo(opts: Options, redis_url: str) -> tuple[Progress, dict[str, Any]]:
    """Start simulator and daemon, push the requests through; (progress, figures)."""
    run_id = secrets.token_hex(4)
    sim = Simulator(SimConfig(latency=opts.latency, error_rate=opts.error_rate))
    metrics = Metrics(CollectorRegistry())
    async with anyio.create_task_group() as services:
        gateway = opts.gateway_url
        if not gateway:
            gateway = f"http://127.0.0.1:{await services.start(sim.serve, '127.0.0.1', 0)}"
        async with open_feed(opts.transport, run_id, redis_url=redis_url, project=PROJECT) as feed:
            config = AppConfig(
                transport=opts.transport,
                transport_config=feed.transport_config(gateway),
                runtime=_runtime(opts),
            )
            processor = Processor(config, metrics=metrics)
            async with anyio.create_task_group() as daemon:
                await daemon.start(processor.run)
                progress = await _drive(opts, feed)
                processor.request_stop()
            await feed.tidy()  # after the drain, which may hand messages back
        services.cancel_scope.cancel()
    figures = {
        "retries": _counter_total(metrics, "request_retries_total"),
        "shed": _counter_total(metrics, "shedded_requests_total"),
        "simulator": None if opts.gateway_url else sim.stats,
    }
    return progress, figures


async def _drive(opts: Options, feed: Feed) -> Progress:
    """Submit, collect and show progress side by side; stop when all are in or at timeout."""
    progress = Progress(total=opts.count)
    with anyio.move_on_after(opts.timeout):
        async with anyio.create_task_group() as tg:
            tg.start_soon(_submit, feed, progress)
            tg.start_soon(_show, progress)
            await _collect(feed, progress)
            tg.cancel_scope.cancel()
    _show_line(progress, final=True)
    return progress


async def _submit(feed: Feed, progress: Progress) -> None:
    deadline = int(time.time()) + DEADLINE_SECONDS
    prefix = secrets.token_hex(4)
    for start in range(0, progress.total, SUBMIT_CHUNK):
        numbers = range(start, min(start + SUBMIT_CHUNK, progress.total))
        batch = [_request(f"{prefix}-{i}", deadline, i) for i in numbers]
        now = time.monotonic()
        for request in batch:
            progress.submit_times[request.id] = now
        await feed.submit(batch, (start // SUBMIT_CHUNK) % len(QUEUES))
        progress.submitted += len(batch)


def _request(request_id: str, deadline: int, i: int) -> Request:
    payload = json.dumps({"model": "demo-model", "prompt": f"Request number {i}", "max_tokens": 16})
    return Request(id=request_id, deadline=deadline, payload=payload.encode())


async def _collect(feed: Feed, progress: Progress) -> None:
    while progress.done < progress.total:
        for result in await feed.results(progress.total - progress.done, 0.5):
            progress.record(result)


async def _show(progress: Progress) -> None:
    interval = 0.1 if sys.stdout.isatty() else 2.0
    while True:
        await anyio.sleep(interval)
        _show_line(progress)


def _show_line(progress: Progress, *, final: bool = False) -> None:
    done, total = progress.done, progress.total
    elapsed = time.monotonic() - progress.started
    width = 30
    filled = width * done // max(total, 1)
    line = (f"[{'#' * filled}{'.' * (width - filled)}] {done}/{total} done, "
            f"{progress.submitted} submitted, {done / max(elapsed, 1e-9):,.0f}/s")  # fmt: skip
    if sys.stdout.isatty():
        print(f"\r{line}", end="\n" if final else "", flush=True)
    else:
        print(line, flush=True)


def _counter_total(metrics: Metrics, sample: str) -> float:
    name = PREFIX + sample
    return sum(s.value for m in metrics.registry.collect() for s in m.samples if s.name == name)


# -- summary --------------------------------------------------------------------------


def summary_rows(progress: Progress, figures: dict[str, Any]) -> list[tuple[str, str]]:
    elapsed = (progress.finished or time.monotonic()) - progress.started
    rows = [
        ("requests", f"{progress.total} submitted, {progress.done} results"),
        ("wall time", f"{elapsed:.2f} s"),
        ("throughput", f"{progress.done / max(elapsed, 1e-9):,.0f} results/s"),
    ]
    if len(progress.latencies) >= 2:
        cuts = statistics.quantiles(progress.latencies, n=100, method="inclusive")
        rows.append(
            (
                "end-to-end latency",
                f"p50 {cuts[49]:.3f} s, p95 {cuts[94]:.3f} s, p99 {cuts[98]:.3f} s",
            )
        )
    for outcome, n in sorted(progress.outcomes.items()):
        rows.append((f"  {outcome}", str(n)))
    rows.append(
        (
            "retries (metrics)",
            f"{figures['retries']:.0f}, of which 429 sheds: {figures['shed']:.0f}",
        )
    )
    sim = figures["simulator"]
    if sim is not None:
        rows.append(("simulator", f"{sim['total']} calls, by status {sim['by_status']}"))
    return rows


def print_summary(rows: list[tuple[str, str]]) -> None:
    width = max(len(name) for name, _ in rows)
    print("\nsummary")
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")


# -- command line ---------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = subcommand_parser("async-processor demo", __doc__.splitlines()[0])
    p.add_argument("--transport", choices=TRANSPORTS, default=TRANSPORTS[0], help="transport")
    p.add_argument("--count", type=int, default=3000, metavar="N", help="requests to submit")
    p.add_argument(
        "--redis-url",
        default="",
        metavar="URL",
        help="a real Redis for the Redis transports (default: a private one)",
    )
    p.add_argument(
        "--gateway-url", default="", metavar="URL", help="a real gateway (default: the simulator)"
    )
    p.add_argument(
        "--latency",
        type=duration,
        default="50ms",
        metavar="DURATION",
        help="simulated latency per request",
    )
    p.add_argument(
        "--error-rate", type=float, default=0.02, metavar="FRACTION", help="share of simulated 500s"
    )
    p.add_argument(
        "--batch-lines",
        type=int,
        default=20,
        metavar="N",
        help="lines of the last step's OpenAI batch (0: skip it)",
    )
    p.add_argument("--workers", type=int, default=64, metavar="N", help="dispatch workers")
    p.add_argument(
        "--timeout",
        type=duration,
        default="2m",
        metavar="DURATION",
        help="give up waiting for results after",
    )
    return p  # fmt: skip


def main(argv: list[str]) -> int:
    opts = Options(**vars(parse(_parser(), argv)))
    configure_logging("warning")
    with ExitStack() as stack:
        try:
            redis_url = _broker(opts, stack)
        except ServerMissing as exc:
            print(f"demo: {exc}", file=sys.stderr)
            return 2
        where = "the simulator" if not opts.gateway_url else opts.gateway_url
        print(
            f"demo: {opts.count} requests over {len(QUEUES)} {opts.transport} queues -> {where}",
            flush=True,
        )
        progress, figures = anyio.run(run_demo, opts, redis_url)
        print_summary(summary_rows(progress, figures))
        batch_ok = _batch_step(opts, redis_url)
    if progress.done < progress.total:
        print(f"demo: {progress.total - progress.done} requests got no result in time")
        return 1
    return 0 if batch_ok else 1


def _batch_step(opts: Options, redis_url: str) -> bool:
    """The last step: a small batch with the OpenAI SDK through ``async-processor api``,
    on the demo's private Redis only (an API on a shared one would drive and sweep that
    Redis's other batches and files). False when it did not complete."""
    if not opts.batch_lines or not redis_url or opts.redis_url:
        return True
    print(f"\nbatch: {opts.batch_lines} lines, OpenAI SDK -> async-processor api -> daemon")
    done = anyio.run(run_batch_step, redis_url, opts.gateway_url, opts.batch_lines)
    print(
        f"  {done.status}: {done.completed}/{done.total} lines answered, output file "
        f"{done.output_lines} lines, {done.seconds:.1f} s; first answer {done.first_answer!r}"
    )
    return done.status == "completed" and done.output_lines == opts.batch_lines


def _broker(opts: Options, stack: ExitStack) -> str:
    """The Redis URL to use ("" for gcp-pubsub, whose emulator runs until ``stack`` closes)."""
    if opts.transport == "gcp-pubsub":
        stack.enter_context(pubsub_emulator(PROJECT))
        return ""
    return opts.redis_url or stack.enter_context(embedded_redis())
