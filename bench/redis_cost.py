"""What a message costs Redis: commands, round trips and Redis CPU per message.

For batch sizes 1, 10 and 64, 1 and 3 daemon replicas, on one standalone redis-server and
on a 3-primary cluster: the messages are queued first (their submission not counted), then
the daemons (``python -m async_processor run``, zero-latency simulator) answer them all.
Read from every Redis node before and after, so only the daemons' work counts:

- commands per message: every command Redis ran (``INFO commandstats``), the ones inside
  the Lua scripts included, and (in brackets) the script calls among them;
- round trips per message: read events Redis processed (``total_reads_processed``): one
  per request a client waited for, a pipeline being one;
- Redis CPU per message (``used_cpu_sys`` + ``used_cpu_user``, all nodes), and the
  implied ceiling of messages per second per Redis core from the busiest node's share (in
  a cluster one queue's keys live on one node; the others only idle).

The watcher's own LLEN/INFO calls are left out. The daemons share the machine's cores
with Redis, so rates are the machine's; CPU per message is Redis's own.
``--payload-keys``: the messages are queued with upstream's payload keys (each payload in
``request-payload:<id>:<token>``; standalone only): one MGET per fetch and a DEL in the
result's script more.
Run: ``python -m bench.redis_cost [--quick] [--payload-keys]``.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import anyio
import redis

from async_processor.client.redis_sortedset import SortedSetClient
from async_processor.config.redis import RedisConnection
from bench.common import redis as standalone_redis
from bench.common import simulator, table
from bench.harness import DEADLINE, Lane, payload, start_daemon
from tests.fixtures.redis_modes import RedisClusterNodes
from tests.fixtures.simulator import SimulatorProcess

BATCHES = (1, 10, 64)
REPLICAS = (1, 3)
WORKERS = 128  # per replica: enough free workers for a full batch of 64
WATCHER = ("llen", "info", "client|setinfo")  # the bench's own (and connection set-up)
SCRIPT_CALLS = ("evalsha", "eval")


@dataclass(frozen=True)
class Target:
    """The Redis under test: its URL, mode, and every node's port."""

    url: str
    mode: str
    ports: list[int]


@dataclass(frozen=True)
class Snapshot:
    calls: dict[str, int]
    reads: int
    cpu: list[float]  # per node


@dataclass(frozen=True)
class Cost:
    commands: float  # every command Redis ran, script-internal ones included
    scripts: float  # script calls (EVALSHA / EVAL)
    round_trips: float
    cpu_us: float  # all nodes
    busiest_us: float  # the node that did the most
    seconds: float

    @property
    def ceiling(self) -> float:
        """Messages per second one Redis core could carry at this CPU cost."""
        return 1e6 / self.busiest_us if self.busiest_us else float("inf")


def snapshot(ports: list[int]) -> Snapshot:
    """Command calls, read events and CPU seconds summed over every node."""
    calls: dict[str, int] = {}
    reads, cpu = 0, []
    for port in ports:
        client = redis.Redis(host="127.0.0.1", port=port)
        try:
            info = client.info("all")
        finally:
            client.close()
        for key, value in info.items():
            if key.startswith("cmdstat_"):
                name = key.removeprefix("cmdstat_")
                calls[name] = calls.get(name, 0) + int(value["calls"])
        reads += int(info["total_reads_processed"])
        cpu.append(float(info["used_cpu_sys"]) + float(info["used_cpu_user"]))
    return Snapshot(calls, reads, cpu)


def cost(before: Snapshot, after: Snapshot, n: int, own_reads: int, seconds: float) -> Cost:
    """Per message, without the watcher's commands and reads (``own_reads``)."""
    delta = {k: v - before.calls.get(k, 0) for k, v in after.calls.items()}
    ours = {k: v for k, v in delta.items() if k not in WATCHER}
    return Cost(
        commands=sum(ours.values()) / n,
        scripts=sum(ours.get(name, 0) for name in SCRIPT_CALLS) / n,
        round_trips=max(after.reads - before.reads - own_reads, 0) / n,
        cpu_us=(sum(after.cpu) - sum(before.cpu)) * 1e6 / n,
        busiest_us=max(a - b for a, b in zip(after.cpu, before.cpu, strict=True)) * 1e6 / n,
        seconds=seconds,
    )


def start_daemons(
    stack: ExitStack, target: Target, lane: Lane, sim: SimulatorProcess, batch: int, replicas: int
) -> None:
    for _ in range(replicas):
        start_daemon(
            stack, lane, sim, WORKERS, mode=target.mode, batch_size=batch, poll_interval_ms=100
        )


async def submit(
    target: Target, queue: str, results: str, messages: int, payload_keys: bool
) -> None:
    conn = RedisConnection(url=target.url, mode=target.mode)  # type: ignore[arg-type]
    deadline = int(time.time()) + DEADLINE
    async with SortedSetClient(conn, queue, results, payload_keys=payload_keys) as client:
        for start in range(0, messages, 2000):
            batch = [
                {"id": f"m{i}", "deadline": deadline, "payload": payload()}
                for i in range(start, min(start + 2000, messages))
            ]
            await client.submit_many(batch)


def result_node(target: Target, results: str) -> redis.Redis:
    """A plain client on the node that holds ``results`` (no cluster client chatter)."""
    if target.mode != "cluster":
        return redis.Redis.from_url(target.url)
    cluster = redis.RedisCluster.from_url(target.url)
    try:
        node = cluster.get_node_from_key(results)  # type: ignore[no-untyped-call]
    finally:
        cluster.close()
    return redis.Redis(host="127.0.0.1", port=int(node.port))


def measure(
    target: Target, sim: SimulatorProcess, batch: int, replicas: int, n: int, payload_keys: bool
) -> Cost:
    queue = f"cost-{target.mode}-b{batch}-r{replicas}-{time.monotonic_ns()}"
    results = f"{{{queue}}}:results" if target.mode == "cluster" else f"{queue}-results"
    anyio.run(submit, target, queue, results, n, payload_keys)
    watcher = result_node(target, results)
    polls = 0
    before = snapshot(target.ports)
    started = time.monotonic()
    with ExitStack() as stack:
        start_daemons(stack, target, Lane(target.url, queue, results), sim, batch, replicas)
        while int(watcher.llen(results)) < n:
            polls += 1
            if time.monotonic() - started > n / 20 + 120:
                raise TimeoutError(
                    f"{queue}: not all results after {time.monotonic() - started:.0f}s"
                )
            time.sleep(0.05)
        after = snapshot(target.ports)
        seconds = time.monotonic() - started
    watcher.close()
    # Each LLEN poll and the closing INFO on each node were one read event of ours.
    return cost(before, after, n, polls + 1 + len(target.ports), seconds)


@contextmanager
def targets(stack: ExitStack) -> Iterator[list[Target]]:
    server = standalone_redis(stack)
    cluster = RedisClusterNodes(dir=Path(stack.enter_context(tempfile.TemporaryDirectory())))
    stack.callback(cluster.stop)
    cluster.start()
    yield [
        Target(server.url, "standalone", [server.port]),
        Target(cluster.url, "cluster", cluster.ports),
    ]


def run(messages: int, payload_keys: bool = False) -> list[tuple[str, str]]:
    stored = ", payloads in their own keys" if payload_keys else ""
    rows = [("setup", f"{messages} messages per row, {WORKERS} workers per replica, "
                      f"zero-latency gateway{stored}; per message:")]  # fmt: skip
    header = (
        "commands (scripts)  round trips  Redis CPU µs  busiest node  ceiling msg/s/core  run s"
    )
    rows.append(("mode / replicas / batch", header))
    with ExitStack() as stack:
        sim = simulator(stack)
        with targets(stack) as all_targets:
            for target in all_targets:
                if payload_keys and target.mode == "cluster":
                    continue  # the client writes payload keys on standalone only (yet)
                for replicas in REPLICAS:
                    for batch in BATCHES:
                        c = measure(target, sim, batch, replicas, messages, payload_keys)
                        rows.append((f"{target.mode} / {replicas} / {batch}", _row(c)))
    return rows


def _row(c: Cost) -> str:
    return (f"{c.commands:8.2f} ({c.scripts:5.2f})  {c.round_trips:11.2f}  {c.cpu_us:12.1f}  "
            f"{c.busiest_us:12.1f}  {c.ceiling:18,.0f}  {c.seconds:5.1f}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.redis_cost", description=__doc__.splitlines()[0]
    )
    p.add_argument("--messages", type=int, default=4000)
    p.add_argument("--quick", action="store_true", help="1,000 messages per row")
    p.add_argument(
        "--payload-keys", action="store_true", help="payloads in their own keys (standalone)"
    )
    args = p.parse_args(argv)
    rows = run(1000 if args.quick else args.messages, args.payload_keys)
    table("what a message costs Redis", rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
