"""(f) The daemon's own cost, without its HTTP client: CPU per message, a freed worker's wait.

The daemon in-process (``Processor``, uvloop) on a private redis-server, its HTTP client
replaced by a stub that answers after a fixed delay with what the simulator sends. What is
measured is our code, redis-py and the event loop: no HTTP library, no simulator process
sharing the CPU. The HTTP client's own cost comes on top (``bench.http_clients``).

1. Zero-latency stub, 256 workers: CPU µs per message over the steady 10–90 % window.
2. 1 s stub, 1,024 workers: Little's-law efficiency, the time from a worker's answer to
   its next request (mean, p90, p99), the event loop's lag (a 10 ms sleep's overshoot),
   and the fetches (messages per fetch, time per fetch call).

Run: ``python -m bench.pipeline [--quick]``. Figures only, never asserted.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Mapping
from contextlib import ExitStack
from dataclasses import dataclass, field

import anyio
from redis.asyncio import Redis

from async_processor.config import AppConfig, SortedSetConfig
from async_processor.httpclients.base import Answer
from async_processor.logs import configure_logging
from async_processor.pipeline import processor as processor_module
from async_processor.pipeline.processor import Processor
from async_processor.transports.redis_sortedset.transport import SortedSetTransport
from bench.common import redis, table
from bench.harness import Lane, submit
from tests.fixtures.inprocess import runtime_config

# The simulator's answer to a bench request (its usage block is parsed for token counts).
ANSWER = (
    b'{"id":"cmpl-1","object":"text_completion","created":1,"model":"bench","choices":'
    b'[{"index":0,"text":"ok ok ok ok","finish_reason":"length"}],'
    b'"usage":{"prompt_tokens":64,"completion_tokens":16,"total_tokens":80}}'
)


@dataclass
class Probe:
    """What the stub and the wrapped fetch saw."""

    latency: float
    last_answer: dict[int, float] = field(default_factory=dict)  # worker task -> time
    waits: list[float] = field(default_factory=list)  # answer -> the worker's next request
    fetches: list[tuple[int, float]] = field(default_factory=list)  # (messages, seconds)
    lags: list[float] = field(default_factory=list)


class StubClient:
    """The ``HttpClient`` seam answering ``ANSWER`` after ``probe.latency`` seconds."""

    def __init__(self, probe: Probe) -> None:
        self._probe = probe

    async def post(
        self,
        url: str,
        body: bytes | memoryview,
        headers: Mapping[str, str],
        *,
        timeout: float,
        limit: int,
    ) -> Answer:
        probe, task = self._probe, anyio.get_current_task().id
        if task in probe.last_answer:
            probe.waits.append(time.monotonic() - probe.last_answer[task])
        if probe.latency:
            await anyio.sleep(probe.latency)
        else:
            await anyio.lowlevel.checkpoint()
        probe.last_answer[task] = time.monotonic()
        return Answer(200, ANSWER)

    async def aclose(self) -> None:
        pass


def install(probe: Probe) -> None:
    """The stub as the daemon's client, and every fetch timed."""
    processor_module.build_http_client = lambda name, tls, n: StubClient(probe)  # type: ignore[assignment,misc]
    fetch = SortedSetTransport.fetch

    async def timed(self: SortedSetTransport, queue: object, limit: int, wait: float) -> object:
        started = time.monotonic()
        deliveries = await fetch(self, queue, limit, wait)  # type: ignore[arg-type]
        probe.fetches.append((len(deliveries), time.monotonic() - started))
        return deliveries

    SortedSetTransport.fetch = timed  # type: ignore[assignment,method-assign]


async def run(url: str, probe: Probe, workers: int, messages: int) -> tuple[float, float]:
    """(CPU µs per message, msg/s) over the 10–90 % window of ``messages``."""
    lane = Lane.fresh(url, "pipeline")
    await submit(lane, messages)
    transport = SortedSetConfig.model_validate(
        {"url": url, "result_queue_name": lane.results, "retry_queue_name": lane.queue + "-r",
         "queues": [{"queue_name": lane.queue, "igw_base_url": "http://127.0.0.1:9"}]}
    )  # fmt: skip
    config = AppConfig(
        transport="redis-sortedset",
        transport_config=transport,
        runtime=runtime_config(concurrency=workers),
    )
    daemon, client = Processor(config), Redis.from_url(url)
    low, high, marks = messages // 10, messages * 9 // 10, {}
    async with anyio.create_task_group() as tg:
        await tg.start(daemon.run)
        tg.start_soon(_lag, probe)
        while (done := await client.llen(lane.results)) < messages:
            for name, at in (("low", low), ("high", high)):
                if done >= at and name not in marks:
                    marks[name] = (time.monotonic(), time.process_time())
            await anyio.sleep(0.01)
        tg.cancel_scope.cancel()
    await client.aclose()
    (t0, c0), (t1, c1) = marks["low"], marks["high"]
    return (c1 - c0) * 1e6 / (high - low), (high - low) / (t1 - t0)


async def _lag(probe: Probe) -> None:
    while True:
        started = time.monotonic()
        await anyio.sleep(0.01)
        probe.lags.append(time.monotonic() - started - 0.01)


def spread(values: list[float]) -> str:
    v = sorted(values)
    n = len(v)
    return (f"mean {sum(v) / n * 1000:.1f} ms, p90 {v[n * 9 // 10] * 1000:.1f}, "
            f"p99 {v[n * 99 // 100] * 1000:.1f}")  # fmt: skip


async def measure(messages: int, rounds: int) -> list[tuple[str, str]]:
    rows = []
    with ExitStack() as stack:
        url = redis(stack).url
        cpu = []
        for _ in range(rounds):
            install(probe := Probe(0.0))
            cpu.append(await run(url, probe, 256, messages))
        rows.append(("zero latency, 256 workers", ", ".join(
            f"{us:.0f} µs CPU/msg ({rate:,.0f} msg/s)" for us, rate in cpu)))  # fmt: skip
        install(probe := Probe(1.0))
        us, rate = await run(url, probe, 1024, messages)
        sizes = [n for n, _ in probe.fetches]
        rows += [
            ("1 s latency, 1,024 workers", f"efficiency {rate / 1024:.3f}, {us:.0f} µs CPU/msg"),
            ("  answer -> next request", spread(probe.waits)),
            ("  event-loop lag", spread(probe.lags)),
            ("  fetches", f"{len(sizes)}, {sum(sizes) / len(sizes):.1f} messages each, "
                          f"{sum(s for _, s in probe.fetches) / len(sizes) * 1000:.1f} ms a call"),
        ]  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.pipeline")
    p.add_argument("--messages", type=int, default=20000)
    p.add_argument("--rounds", type=int, default=3, help="zero-latency rounds")
    p.add_argument("--quick", action="store_true", help="5,000 messages, one round")
    args = p.parse_args(argv)
    messages, rounds = (5000, 1) if args.quick else (args.messages, args.rounds)
    configure_logging("warning", "json")
    rows = anyio.run(measure, messages, rounds, backend_options={"use_uvloop": True})
    table("(f) the daemon's own cost, HTTP client stubbed", rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
