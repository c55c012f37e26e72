"""Chaos: the faults of issue 30 together, 3 daemon replicas, every id answered once.

Not part of ``make bench`` (it runs 10 minutes): ``python -m bench.chaos [--quick]``.

A Sentinel group (primary + replica + 3 sentinels, from the test fixtures), the simulator
at ``--latency``, and 3 daemons on one queue and one result list, ``lease_seconds: 3``
and ``wait_replicas: 1``. Replicas 1 and 2 find the primary through the sentinels;
replica 3 reaches it through a proxy whose path can be blackholed (``bench.blackhole``,
a service in front of the primary) and runs with its wall clock ``--skew`` seconds ahead
(``bench.skew``). A producer submits ``--rate`` requests a second for the run's length
(retrying a submission the broker refused, with its first attempt's time kept); meanwhile,
each on its own period, so they overlap:

- the primary is killed (SIGKILL), the replica promoted, the killed node brought back as
  its replica (``SentinelGroup.fail_over``);
- a daemon is frozen (SIGSTOP) for ``FREEZE`` s and let go (SIGCONT), each in turn;
- the primary refuses writes (``maxmemory 1``: ``OOM command not allowed``) for ``OOM`` s;
- replica 3's path to Redis is blackholed for ``BLACKHOLE`` s.

Results are read as they come (``LRANGE`` of the list's new head, not popped: a pop the
killed primary had not passed on would come back with the promotion, the reader's loss,
not a second answer). After the producer stops and every id has an answer, the daemons
are stopped (SIGTERM: in-flight work ends) and the final list counted. Printed: results/s,
submit-to-result p50/p99/max, the faults made, lost and duplicated ids. Exit 1 if any id
was lost or answered twice.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import tempfile
import time
from collections.abc import Awaitable, Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import redis

from async_processor.client.redis_sortedset import SortedSetClient
from async_processor.config.redis import RedisConnection
from async_processor.errors import TransportError
from bench.blackhole import Blackhole
from bench.common import python_process, simulator, table
from bench.harness import LOG_DIR, Process
from tests.fixtures.redis_modes import MASTER_NAME, SentinelGroup
from tests.fixtures.servers import free_port

QUEUE, RESULTS = "chaos", "chaos:results"
LEASE = 3
FREEZE, OOM, BLACKHOLE = 8.0, 6.0, 8.0  # seconds each fault lasts
# (first after, then every) seconds: periods apart, so the faults meet in every combination.
SCHEDULE = {"kill": (30.0, 45.0), "freeze": (10.0, 40.0), "oom": (20.0, 50.0),
            "blackhole": (40.0, 55.0)}  # fmt: skip
TAIL = 180.0  # seconds after the producer stops for the last answers
SLACK = 500  # results read again at each look (a failover's lost and new entries)


@dataclass
class Ledger:
    """Submit times and first sightings by id; the faults made."""

    submitted: dict[str, float] = field(default_factory=dict)
    answered: dict[str, float] = field(default_factory=dict)
    faults: dict[str, int] = field(default_factory=dict)
    producing: bool = True

    def done(self) -> bool:
        return not self.producing and len(self.answered) >= len(self.submitted)


def daemon(stack: ExitStack, n: int, config: dict[str, Any], workers: int, skew: float) -> Process:
    health = free_port()
    program = ["-m", "bench.skew", str(skew)] if skew else ["-m", "async_processor"]
    args = [*program, "run", "--transport", "redis-sortedset",
            "--transport-config", json.dumps(config), "--concurrency", str(workers),
            "--health-port", str(health), "--metrics-port", str(free_port()),
            "--bind-address", "127.0.0.1", "--log-level", "warning", "--log-format", "json",
            "--metrics-backlog-poll-interval", "0"]  # fmt: skip
    return python_process(stack, args, port=health, log=LOG_DIR / f"chaos-{n}.log")


def config(gateway: str, **connection: Any) -> dict[str, Any]:
    return {
        "result_queue_name": RESULTS,
        "retry_queue_name": f"{QUEUE}:retry",
        "poll_interval_ms": 100,
        "lease_seconds": LEASE,
        "wait_replicas": 1,
        "wait_timeout_ms": 500,
        "queues": [{"queue_name": QUEUE, "igw_base_url": gateway}],
        **connection,
    }


async def produce(conn: RedisConnection, ledger: Ledger, rate: int, seconds: float) -> None:
    """``rate`` requests a second, a tenth of a second's worth at a time."""
    deadline = int(time.time() + seconds + 3600)
    step, sent = 0.1, 0
    started = time.monotonic()
    async with SortedSetClient(conn, QUEUE, RESULTS) as client:
        while (now := time.monotonic()) < started + seconds:
            due = int((now - started) * rate) - sent
            ids = [f"c{sent + i}" for i in range(due)]
            batch = [{"id": i, "deadline": deadline, "payload": {"n": i}} for i in ids]
            ledger.submitted.update(dict.fromkeys(ids, now))
            while batch:
                try:
                    await client.submit_many(batch)
                    break
                except TransportError:  # away (failover, blackhole, OOM): the same again
                    await anyio.sleep(0.2)
            sent += due
            await anyio.sleep(step)
    ledger.producing = False


async def collect(group: SentinelGroup, ledger: Ledger, give_up: float) -> None:
    """Note each id's first answer: the list's new head since the last look."""
    seen = 0
    while not ledger.done() and time.monotonic() < give_up:
        await anyio.sleep(0.25)
        try:
            seen, raws = await anyio.to_thread.run_sync(_new_head, group, seen)
        except (redis.RedisError, OSError):
            continue  # a failover under way (no primary named yet): look again
        now = time.monotonic()
        for raw in raws:
            ledger.answered.setdefault(json.loads(raw)["id"], now)


def primary(group: SentinelGroup) -> redis.Redis:
    """A client of the primary the sentinels name now (OSError while they name none)."""
    port = group.master_port()
    if port is None:
        raise OSError("no primary named")
    return redis.Redis(host="127.0.0.1", port=port, socket_timeout=5)


def _new_head(group: SentinelGroup, seen: int) -> tuple[int, list[bytes]]:
    """The list's length now, and its head down to ``SLACK`` entries past what was there
    when it was ``seen`` long: with a failover the list can lose its newest entries
    (their messages run again) and gain others before the next look."""
    client = primary(group)
    try:
        length = int(client.llen(RESULTS))
        head = client.lrange(RESULTS, 0, max(0, length - seen) + SLACK)
        return length, [raw for raw in head if isinstance(raw, bytes)]
    finally:
        client.close()


def final_count(group: SentinelGroup) -> dict[str, int]:
    client = primary(group)
    try:
        counts: dict[str, int] = {}
        for raw in client.lrange(RESULTS, 0, -1):
            key = json.loads(raw)["id"]
            counts[key] = counts.get(key, 0) + 1
        return counts
    finally:
        client.close()


async def every(name: str, ledger: Ledger, fault: Callable[[int], Awaitable[object]]) -> None:
    """Make fault ``name`` on its schedule while the producer runs."""
    first, period = SCHEDULE[name]
    await anyio.sleep(first)
    n = 0
    while ledger.producing:
        ledger.faults[name] = n + 1  # counted when made (the run may end while it lasts)
        await fault(n)
        n += 1
        await anyio.sleep(period)


async def freeze(procs: list[Process], n: int) -> None:
    proc = procs[n % len(procs)]
    proc.send_signal(signal.SIGSTOP)
    try:
        await anyio.sleep(FREEZE)
    finally:
        proc.send_signal(signal.SIGCONT)


async def refuse_writes(group: SentinelGroup) -> None:
    client = primary(group)
    try:
        client.config_set("maxmemory", 1)
        await anyio.sleep(OOM)
        client.config_set("maxmemory", 0)
    except (redis.RedisError, OSError):
        pass  # killed meanwhile: it comes back without the limit
    finally:
        client.close()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


async def run(opts: argparse.Namespace) -> tuple[Ledger, dict[str, int], float]:
    ledger = Ledger()
    with ExitStack() as stack:
        group = SentinelGroup(dir=Path(stack.enter_context(tempfile.TemporaryDirectory())))
        stack.callback(group.stop)
        group.start()
        sim = simulator(stack, "--latency", str(opts.latency))
        url = f"redis://{group.sentinels[0]}/0"
        sentinel = {"url": url, "mode": "sentinel", "addrs": group.sentinels[1:]}
        sentinel["master_name"] = MASTER_NAME
        async with anyio.create_task_group() as tg:
            proxy = Blackhole(group.master_port)
            proxy_port = await tg.start(proxy.serve)
            procs = [daemon(stack, n, config(sim.url, **sentinel), opts.workers, 0.0)
                     for n in range(opts.replicas - 1)]  # fmt: skip
            proxied = config(sim.url, url=f"redis://127.0.0.1:{proxy_port}/0")
            procs.append(daemon(stack, opts.replicas - 1, proxied, opts.workers, opts.skew))
            conn = RedisConnection(url, "sentinel", tuple(group.sentinels[1:]), MASTER_NAME)
            started = time.monotonic()
            async with anyio.create_task_group() as chaos:
                chaos.start_soon(produce, conn, ledger, opts.rate, opts.seconds)
                chaos.start_soon(
                    every, "kill", ledger, lambda n: anyio.to_thread.run_sync(group.fail_over)
                )
                chaos.start_soon(every, "freeze", ledger, lambda n: freeze(procs, n))
                chaos.start_soon(every, "oom", ledger, lambda n: refuse_writes(group))
                chaos.start_soon(every, "blackhole", ledger, lambda n: proxy.cut(BLACKHOLE))
                await collect(group, ledger, started + opts.seconds + TAIL)
                chaos.cancel_scope.cancel()  # a frozen daemon is let go, the path opened
            elapsed = max(ledger.answered.values(), default=started) - started
            for proc in procs:  # in-flight work ends: a late second answer would be counted
                proc.send_signal(signal.SIGTERM)
                await anyio.to_thread.run_sync(proc.wait, 60)
            tg.cancel_scope.cancel()
        counts = await anyio.to_thread.run_sync(final_count, group)
    return ledger, counts, elapsed


def report(opts: argparse.Namespace, ledger: Ledger, counts: dict[str, int], elapsed: float,
           load: tuple[str, str]) -> bool:  # fmt: skip
    waits = [ledger.answered[i] - t for i, t in ledger.submitted.items() if i in ledger.answered]
    lost = [i for i in ledger.submitted if i not in counts]
    twice = [i for i, n in counts.items() if n > 1]
    faults = ", ".join(f"{name} ×{n}" for name, n in sorted(ledger.faults.items()))
    table("chaos", [
        ("setup", f"{opts.replicas} daemons × {opts.workers} workers, gateway {opts.latency:g} s, "
                  f"{opts.rate}/s for {opts.seconds:.0f} s, replica {opts.replicas} "
                  f"{opts.skew:g} s ahead"),
        ("load average", f"{load[0]} before, {load[1]} after"),
        ("faults", faults or "none"),
        ("submitted", f"{len(ledger.submitted):,}"),
        ("results/s", f"{len(counts) / max(elapsed, 1e-9):,.1f} (offered {opts.rate}/s)"),
        ("submit→result", f"p50 {percentile(waits, 0.5):.2f} s, "
                          f"p99 {percentile(waits, 0.99):.2f} s, "
                          f"max {max(waits, default=float('nan')):.2f} s"),
        ("lost", f"{len(lost)} {lost[:5]}"),
        ("answered twice", f"{len(twice)} {twice[:5]}"),
        ("logs", str(LOG_DIR / "chaos-*.log")),
    ])  # fmt: skip
    return not lost and not twice


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.chaos", description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--quick", action="store_true", help="2 minutes")
    p.add_argument("--rate", type=int, default=60, help="requests submitted per second")
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--workers", type=int, default=16, help="per daemon")
    p.add_argument("--latency", type=float, default=0.2, help="gateway seconds per request")
    p.add_argument("--skew", type=float, default=20.0, help="the last replica's clock, ahead")
    opts = p.parse_args(argv)
    opts.seconds = 60 * (2.0 if opts.quick else opts.minutes)
    before = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    ledger, counts, elapsed = anyio.run(run, opts)
    after = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return 0 if report(opts, ledger, counts, elapsed, (before, after)) else 1


if __name__ == "__main__":
    raise SystemExit(main())
