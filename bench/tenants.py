"""Many tenants on one pool: 200 queues found in a Redis set, weighted-fair merge, replicas
as separate processes. Is any tenant starved, and what does a message cost with 200
queues against 2?

Every queue is one tenant, weighted in turn by ``--weights`` (1,2,4) through the merge
policy's ``weights`` map; the daemons find the queues in a Redis set (``queue_discovery``).
All queues are loaded before the daemons start, so all stay backlogged; with ``--busy n``
only the first n are, the others stay empty (many tenants, few of them active), and the
shares are of the busy ones. ``--replicas``
daemons (``python -m async_processor run``) share one Redis; after a warm-up of
``--warmup`` results, the next ``--window`` results, across every replica, are counted
per queue against its weighted fair share. Target: every queue ≥ 0.8 of its share.

Overhead, in the same run: the same daemons on 2 queues (equal weights), the same
window: daemon CPU ms per message (all replicas' user + system CPU over the window) and
Redis round trips per message (``total_reads_processed`` over the window, minus the
watcher's own). Target (the pass bar): 200 queues within 1.2× of 2 queues on both.

Idle queues, last: one daemon on ``--queues`` empty queues for ``IDLE_SECONDS``: its CPU
(cores) and Redis round trips a second; then single messages put on idle queues one by
one, each timed from submission to its result (minus the gateway's ``LATENCY``): the
pickup latency of an idle queue.
Run alone: ``python -m bench.tenants [--quick]``.
"""

from __future__ import annotations

import argparse
import json
import secrets
import time
from collections import Counter
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import anyio
from redis.asyncio import Redis

from async_processor.client import SortedSetClient
from async_processor.messages import Result
from bench.common import cpu_seconds, python_process, redis, simulator, table, verdict
from bench.harness import LOG_DIR, Process
from tests.fixtures.servers import free_port
from tests.fixtures.simulator import SimulatorProcess

TARGET = 0.8
OVERHEAD_TARGET = 1.2
LATENCY = 0.2  # gateway seconds: workers ÷ latency stays within the machine's CPU
IDLE_SECONDS = 10.0
PICKUPS = 10  # single messages timed on idle queues


@dataclass
class Window:
    ids: list[str]  # result ids in the window, in the order they were pushed
    seconds: float
    cpu_ms: float  # all daemons' CPU per message over the window
    round_trips: float  # Redis read events per message over the window
    commands: dict[str, float]  # Redis commands per message over the window, by name


GATHER_MS = 10  # claim_gather_ms, the transport's default


def daemon_args(
    url: str, gateway: str, tag: str, workers: int, merge: Path, gather: int = GATHER_MS
) -> list[str]:
    transport = {
        "url": url, "result_queue_name": f"{tag}:results", "poll_interval_ms": 100,
        "claim_gather_ms": gather,
        "queue_discovery": {"set_key": f"{tag}:tenants", "refresh_seconds": 5,
                            "template": {"igw_base_url": gateway}},
    }  # fmt: skip
    return ["-m", "async_processor", "run", "--transport", "redis-sortedset",
            "--transport-config", json.dumps(transport), "--concurrency", str(workers),
            "--request-merge-policy-config-file", str(merge),
            "--bind-address", "127.0.0.1", "--log-level", "warning",
            "--metrics-backlog-poll-interval", "0"]  # fmt: skip


async def load(url: str, tag: str, weights: dict[str, float], per_weight: int, busy: int) -> None:
    """Messages on the first ``busy`` queues; every queue listed in the set."""
    deadline = int(time.time()) + 3600
    async with SortedSetClient(url, result_queue=f"{tag}:results") as client:
        for name, weight in list(weights.items())[:busy]:
            requests = [{"id": f"{name}/{n}", "deadline": deadline, "payload": {}}
                        for n in range(int(per_weight * weight) + 5)]  # fmt: skip
            await client.submit_many(requests, queue=name)
    r = Redis.from_url(url)
    try:
        await r.sadd(f"{tag}:tenants", *weights)
    finally:
        await r.aclose()


async def watch(url: str, tag: str, procs: list[Process], warmup: int, window: int) -> Window:
    """Wait for ``warmup`` results, then time, CPU and count reads until ``window`` more."""
    r = Redis.from_url(url)
    own = 0  # our read events: one per command

    async def done() -> int:
        nonlocal own
        own += 1
        return int(await r.llen(f"{tag}:results"))

    async def reads() -> int:
        nonlocal own
        own += 1
        return int((await r.info("stats"))["total_reads_processed"])

    async def commands() -> Counter[str]:
        # Commands called inside scripts count too: a claim's ZPOPMIN shows beside EVALSHA.
        stats = await r.info("commandstats")
        return Counter(
            {name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in stats.items()}
        )

    try:
        with anyio.fail_after(900):
            while await done() < warmup:
                await anyio.sleep(0.05)
            own = 0
            before = await commands()
            start = time.monotonic(), sum(cpu_seconds(p.pid) for p in procs), await reads()
            while await done() < warmup + window:
                await anyio.sleep(0.05)
            end = time.monotonic(), sum(cpu_seconds(p.pid) for p in procs), await reads()
            used = await commands() - before
        pushed = [
            Result.decode(raw).id for raw in reversed(await r.lrange(f"{tag}:results", 0, -1))
        ]
    finally:
        await r.aclose()
    return Window(
        ids=pushed[warmup : warmup + window],
        seconds=end[0] - start[0],
        cpu_ms=(end[1] - start[1]) * 1000 / window,
        round_trips=(end[2] - start[2] - own) / window,
        commands={name: calls / window for name, calls in used.most_common(6)},
    )


async def run_tenants(
    url: str, sim: SimulatorProcess, weights: dict[str, float], replicas: int, workers: int,
    warmup: int, window: int, gather: int, busy: int = 0,
) -> Window:  # fmt: skip
    tag = next(iter(weights)).rsplit("-", 1)[0]
    busy = busy or len(weights)
    loaded = sum(list(weights.values())[:busy])
    per_weight = (warmup + window) * 1.5 / loaded  # backlogged all along
    await load(url, tag, weights, int(per_weight), busy)
    with ExitStack() as stack:
        merge = LOG_DIR / f"{tag}-merge.json"
        merge.parent.mkdir(parents=True, exist_ok=True)
        merge.write_text(json.dumps({"type": "weighted-fair", "parameters": {"weights": weights}}))
        procs = []
        for n in range(replicas):
            health = free_port()
            args = [*daemon_args(url, sim.url, tag, workers, merge, gather), "--health-port",
                    str(health), "--metrics-port", str(free_port())]  # fmt: skip
            procs.append(python_process(stack, args, port=health, log=LOG_DIR / f"{tag}-{n}.log"))
        return await watch(url, tag, procs, warmup, window)


@dataclass
class Idle:
    cores: float  # the daemon's CPU over the idle window
    round_trips: float  # Redis read events a second, minus the watcher's own
    pickups: list[float]  # seconds from submission to result, minus the gateway's latency


async def run_idle(url: str, sim: SimulatorProcess, queues: int, workers: int, gather: int) -> Idle:
    tag = f"idle-{secrets.token_hex(3)}"
    names = [f"{tag}-t{i:03d}" for i in range(queues)]
    r = Redis.from_url(url)
    with ExitStack() as stack:
        await r.sadd(f"{tag}:tenants", *names)
        merge = LOG_DIR / f"{tag}-merge.json"
        merge.write_text(json.dumps({"type": "weighted-fair", "parameters": {}}))
        health = free_port()
        args = [*daemon_args(url, sim.url, tag, workers, merge, gather), "--health-port",
                str(health), "--metrics-port", str(free_port())]  # fmt: skip
        proc = python_process(stack, args, port=health, log=LOG_DIR / f"{tag}.log")
        await anyio.sleep(3.0)  # discovery's first refresh, pollers started
        reads = int((await r.info("stats"))["total_reads_processed"])
        cpu, start = cpu_seconds(proc.pid), time.monotonic()
        await anyio.sleep(IDLE_SECONDS)
        seconds = time.monotonic() - start
        cores = (cpu_seconds(proc.pid) - cpu) / seconds
        round_trips = (int((await r.info("stats"))["total_reads_processed"]) - reads - 1) / seconds
        pickups = await _pickups(url, tag, names)
        await r.aclose()
    return Idle(cores, round_trips, pickups)


async def _pickups(url: str, tag: str, names: list[str]) -> list[float]:
    """Seconds from submission to result of single messages on idle queues, one at a time."""
    out = []
    async with SortedSetClient(url, result_queue=f"{tag}:results") as client:
        for n in range(PICKUPS):
            await anyio.sleep(0.37)  # off the probe's ticks
            started = time.monotonic()
            request = {"id": f"p{n}", "deadline": int(time.time()) + 60, "payload": {}}
            await client.submit(request, queue=names[(n * 37) % len(names)])
            await client.drain_results(1, 10)
            out.append(time.monotonic() - started - LATENCY)
    return out


def shares(weights: dict[str, float], ids: list[str]) -> dict[str, float]:
    got = Counter(i.split("/")[0] for i in ids)
    total = sum(weights.values())
    return {q: got[q] / (len(ids) * w / total) for q, w in weights.items()}


async def measure(
    queues: int, replicas: int, workers: int, warmup: int, window: int, mix: list[float],
    gather: int, busy: int = 0,
) -> list[tuple[str, str]]:  # fmt: skip
    tag = f"tenants-{secrets.token_hex(3)}"
    many = {f"{tag}-t{i:03d}": mix[i % len(mix)] for i in range(queues)}
    few = {f"{tag}x-t{i}": 1.0 for i in range(2)}
    with ExitStack() as stack:
        url, sim = redis(stack).url, simulator(stack, "--latency", str(LATENCY))
        wide = await run_tenants(url, sim, many, replicas, workers, warmup, window, gather, busy)
        narrow = await run_tenants(url, sim, few, replicas, workers, warmup, window, gather)
        idle = await run_idle(url, sim, queues, workers, gather)
    active = dict(list(many.items())[: busy or queues])
    ratios = shares(active, wide.ids)
    worst = min(ratios, key=ratios.__getitem__)
    by_weight = "; ".join(
        f"w{w:g} {min(r for q, r in ratios.items() if many[q] == w):.2f}…"
        f"{max(r for q, r in ratios.items() if many[q] == w):.2f}"
        for w in sorted(set(active.values()))
    )
    cpu, trips = wide.cpu_ms / narrow.cpu_ms, wide.round_trips / narrow.round_trips
    ideal = replicas * workers / LATENCY
    return [
        ("setup", f"{queues} queues in a Redis set, {len(active)} of them busy (weights "
                  f"{','.join(f'{w:g}' for w in mix)} "
                  f"in turn), {replicas} daemon processes × {workers} workers, gateway "
                  f"{LATENCY:g} s (ideal {ideal:.0f} msg/s), claim_gather_ms {gather}"),
        ("window", f"results {warmup}…{warmup + window} in {wide.seconds:.1f} s "
                   f"({window / wide.seconds:.0f} msg/s)"),
        ("share range", f"{min(ratios.values()):.2f} … {max(ratios.values()):.2f} of fair"),
        ("by weight", by_weight),
        ("worst queue", verdict(f"{ratios[worst]:.2f} ({worst.rsplit('-', 1)[1]})",
                                ratios[worst] >= TARGET, f"≥ {TARGET}")),
        ("2 queues", f"{window / narrow.seconds:.0f} msg/s, {narrow.cpu_ms:.2f} CPU ms/msg, "
                     f"{narrow.round_trips:.2f} Redis round trips/msg"),
        (f"{queues} queues", f"{wide.cpu_ms:.2f} CPU ms/msg, "
                             f"{wide.round_trips:.2f} Redis round trips/msg"),
        ("commands/msg, 2", _commands(narrow)),
        (f"commands/msg, {queues}", _commands(wide)),
        ("CPU per msg", verdict(f"× {cpu:.2f} of 2 queues", cpu <= OVERHEAD_TARGET,
                                f"≤ {OVERHEAD_TARGET}×")),
        ("round trips", verdict(f"× {trips:.2f} of 2 queues", trips <= OVERHEAD_TARGET,
                                f"≤ {OVERHEAD_TARGET}×")),
        (f"idle, {queues} queues", f"1 daemon: {idle.cores:.3f} cores, "
                                   f"{idle.round_trips:.0f} Redis round trips/s"),
        ("idle pickup", f"{min(idle.pickups) * 1000:.0f}…{max(idle.pickups) * 1000:.0f} ms "
                        f"from submit to result, less the gateway ({len(idle.pickups)} messages)"),
    ]  # fmt: skip


def _commands(window: Window) -> str:
    return ", ".join(f"{name} {calls:.2f}" for name, calls in window.commands.items())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.tenants")
    p.add_argument("--queues", type=int, default=200)
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--workers", type=int, default=16)
    p.add_argument("--warmup", type=int, default=1000)
    p.add_argument("--window", type=int, default=9000)
    p.add_argument("--weights", default="1,2,4", help="weights given to the queues in turn")
    p.add_argument("--quick", action="store_true", help="a 3,000-result window")
    p.add_argument("--gather-ms", type=int, default=GATHER_MS, help="claim_gather_ms")
    p.add_argument("--busy", type=int, default=0, help="queues with messages (0: all)")
    args = p.parse_args(argv)
    window = 3000 if args.quick else args.window
    mix = [float(w) for w in args.weights.split(",")]
    rows = anyio.run(
        measure, args.queues, args.replicas, args.workers, args.warmup, window, mix,
        args.gather_ms, args.busy,
    )  # fmt: skip
    table("many tenants: weighted fair share and fetch overhead", rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
