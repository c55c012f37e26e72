"""Many tenants on one pool: 200 queues found in a Redis set, weighted-fair merge, replicas
as separate processes. Is any tenant starved, and what does a message cost with 200
queues against 2?

Every queue is one tenant, weighted in turn by ``--weights`` (1,2,4) through the merge
policy's ``weights`` map; the daemons find the queues in a Redis set (``queue_discovery``).
All queues are loaded before the daemons start, so all stay backlogged; with ``--busy n``
only the first n are, the others stay empty (many tenants, few of them active), and the
shares are of the busy ones. ``--replicas``
daemons (``python -m async_processor run``) share one Redis; after a warm-up of
``--warmup`` results, the results of one window (below) are counted per queue against
its weighted fair share. Target: every queue ≥ 0.8 of its share.

Overhead, in the same run and at the same time: the same number of daemons on 2 queues
(equal weights), on a Redis of their own. Both sides warm up, then one window is read
for both, until either side has ``--window`` more results: daemon CPU ms per message (all
its replicas' user + system CPU), Redis round trips per message (its
``total_reads_processed``, minus the watcher's own) and its redis-server's CPU per
message. Target (the pass bar): 200 queues within 1.2× of 2 queues on daemon CPU and
round trips. The sides run at once because this machine's speed drifts between minutes:
run one after the other on a quiet machine, the 2-queue side alone read 0.94, 1.30 and
1.34 ms per message in three runs of the same code, more than the margin measured.

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

from async_processor.client.redis_sortedset import SortedSetClient
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
    redis_cpu_ms: float  # the side's redis-server's CPU per message over the window
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


@dataclass
class Side:
    """One deployment of the run: its queues on its own Redis, its daemons."""

    url: str
    tag: str
    procs: list[Process]


async def deploy(
    stack: ExitStack, url: str, sim: SimulatorProcess, weights: dict[str, float],
    replicas: int, workers: int, gather: int, busy: int, results: int,
) -> Side:  # fmt: skip
    """Load ``weights``' queues on ``url``, backlogged for ``results`` results, and start
    the daemons (stopped with ``stack``)."""
    tag = next(iter(weights)).rsplit("-", 1)[0]
    busy = busy or len(weights)
    loaded = sum(list(weights.values())[:busy])
    per_weight = results * 1.5 / loaded
    await load(url, tag, weights, int(per_weight), busy)
    merge = LOG_DIR / f"{tag}-merge.json"
    merge.parent.mkdir(parents=True, exist_ok=True)
    merge.write_text(json.dumps({"type": "weighted-fair", "parameters": {"weights": weights}}))
    procs = []
    for n in range(replicas):
        health = free_port()
        args = [*daemon_args(url, sim.url, tag, workers, merge, gather), "--health-port",
                str(health), "--metrics-port", str(free_port())]  # fmt: skip
        procs.append(python_process(stack, args, port=health, log=LOG_DIR / f"{tag}-{n}.log"))
    return Side(url, tag, procs)


@dataclass
class Reading:
    """One side's counters at one instant."""

    results: int
    cpu: float  # all its daemons' user + system seconds
    redis_cpu: float  # its redis-server's user + system seconds
    reads: int  # its Redis's read events
    own: int  # the watcher's own commands up to ``reads``
    commands: Counter[str]  # its Redis's command calls, by name (scripts' inner ones too)


class Watcher:
    """Reads one side's counters, counting its own commands (one read event each) to
    take them off the side's round trips."""

    def __init__(self, side: Side) -> None:
        self.side = side
        self.redis = Redis.from_url(side.url)
        self.own = 0

    async def results(self) -> int:
        self.own += 1
        return int(await self.redis.llen(f"{self.side.tag}:results"))

    async def read(self) -> Reading:
        self.own += 1
        stats = await self.redis.info("stats")
        own = self.own
        self.own += 2
        cpu, commands = await self.redis.info("cpu"), await self.redis.info("commandstats")
        return Reading(
            results=await self.results(),
            cpu=sum(cpu_seconds(p.pid) for p in self.side.procs),
            redis_cpu=float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"]),
            reads=int(stats["total_reads_processed"]),
            own=own,
            commands=Counter({n.removeprefix("cmdstat_"): int(v["calls"])
                              for n, v in commands.items()}),
        )  # fmt: skip

    async def window(self, start: Reading, end: Reading, seconds: float) -> Window:
        """Figures per message between two readings, and the ids pushed between them."""
        count = end.results - start.results
        raws = await self.redis.lrange(f"{self.side.tag}:results", 0, -1)
        ids = [Result.decode(raw).id for raw in reversed(raws)]
        used = end.commands - start.commands
        return Window(
            ids=ids[start.results : end.results],
            seconds=seconds,
            cpu_ms=(end.cpu - start.cpu) * 1000 / count,
            redis_cpu_ms=(end.redis_cpu - start.redis_cpu) * 1000 / count,
            round_trips=(end.reads - start.reads - (end.own - start.own)) / count,
            commands={name: calls / count for name, calls in used.most_common(6)},
        )


async def side_by_side(
    sides: list[Side], warmup: int, window: int, rounds: int
) -> tuple[list[Window], list[list[Window]]]:
    """Wait until every side has ``warmup`` results; then read all sides over ``rounds``
    windows in a row, each until the first side has ``window`` more. The sides run at
    the same time, so the machine's speed, which drifts between minutes, is the same for
    both. Returns one window per side over all rounds, and per round one per side."""
    watchers = [Watcher(side) for side in sides]
    try:
        with anyio.fail_after(900):
            while min([await w.results() for w in watchers]) < warmup:
                await anyio.sleep(0.05)
            times, readings = [time.monotonic()], [[await w.read() for w in watchers]]
            for _ in range(rounds):
                pairs = list(zip(watchers, readings[-1], strict=True))
                while not any([await w.results() - s.results >= window for w, s in pairs]):
                    await anyio.sleep(0.05)
                times.append(time.monotonic())
                readings.append([await w.read() for w in watchers])
        spans = [(0, rounds), *((n, n + 1) for n in range(rounds))]
        windows = [
            [
                await w.window(readings[a][k], readings[b][k], times[b] - times[a])
                for k, w in enumerate(watchers)
            ]
            for a, b in spans
        ]
        return windows[0], windows[1:]
    finally:
        for w in watchers:
            await w.redis.aclose()


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
    queues: int, replicas: int, workers: int, warmup: int, window: int, rounds: int,
    mix: list[float], gather: int, busy: int = 0,
) -> list[tuple[str, str]]:  # fmt: skip
    tag = f"tenants-{secrets.token_hex(3)}"
    many = {f"{tag}-t{i:03d}": mix[i % len(mix)] for i in range(queues)}
    few = {f"{tag}x-t{i}": 1.0 for i in range(2)}
    total = warmup + window * rounds
    with ExitStack() as stack:
        sim = simulator(stack, "--latency", str(LATENCY))
        urls = redis(stack).url, redis(stack).url
        with ExitStack() as daemons:
            sides = [
                await deploy(daemons, url, sim, weights, replicas, workers, gather, n, total)
                for url, weights, n in ((urls[0], many, busy), (urls[1], few, 0))
            ]
            (wide, narrow), each = await side_by_side(sides, warmup, window, rounds)
        idle = await run_idle(urls[0], sim, queues, workers, gather)
    active = dict(list(many.items())[: busy or queues])
    ratios = shares(active, wide.ids)
    worst = min(ratios, key=ratios.__getitem__)
    by_weight = "; ".join(
        f"w{w:g} {min(r for q, r in ratios.items() if many[q] == w):.2f}…"
        f"{max(r for q, r in ratios.items() if many[q] == w):.2f}"
        for w in sorted(set(active.values()))
    )
    cpu, trips = wide.cpu_ms / narrow.cpu_ms, wide.round_trips / narrow.round_trips
    redis_cpu = wide.redis_cpu_ms / narrow.redis_cpu_ms
    ideal = replicas * workers / LATENCY
    return [
        ("setup", f"{queues} queues in a Redis set, {len(active)} of them busy (weights "
                  f"{','.join(f'{w:g}' for w in mix)} "
                  f"in turn), {replicas} daemon processes × {workers} workers, gateway "
                  f"{LATENCY:g} s (ideal {ideal:.0f} msg/s), claim_gather_ms {gather}"),
        ("windows", f"both sides at once, each on its own Redis, after {warmup} results "
                    f"each: {rounds} in a row, each until one side had {window} more; "
                    f"{wide.seconds:.1f} s in all"),
        ("share range", f"{min(ratios.values()):.2f} … {max(ratios.values()):.2f} of fair"),
        ("by weight", by_weight),
        ("worst queue", verdict(f"{ratios[worst]:.2f} ({worst.rsplit('-', 1)[1]})",
                                ratios[worst] >= TARGET, f"≥ {TARGET}")),
        ("2 queues", _side(narrow)),
        (f"{queues} queues", _side(wide)),
        ("commands/msg, 2", _commands(narrow)),
        (f"commands/msg, {queues}", _commands(wide)),
        ("CPU per msg", verdict(f"× {cpu:.2f} of 2 queues", cpu <= OVERHEAD_TARGET,
                                f"≤ {OVERHEAD_TARGET}×")),
        ("round trips", verdict(f"× {trips:.2f} of 2 queues", trips <= OVERHEAD_TARGET,
                                f"≤ {OVERHEAD_TARGET}×")),
        ("each window", "; ".join(
            f"CPU × {w.cpu_ms / n.cpu_ms:.2f}, round trips × {w.round_trips / n.round_trips:.2f}"
            for w, n in each)),
        ("Redis CPU per msg", f"× {redis_cpu:.2f} of 2 queues"),
        (f"idle, {queues} queues", f"1 daemon: {idle.cores:.3f} cores, "
                                   f"{idle.round_trips:.0f} Redis round trips/s"),
        ("idle pickup", f"{min(idle.pickups) * 1000:.0f}…{max(idle.pickups) * 1000:.0f} ms "
                        f"from submit to result, less the gateway ({len(idle.pickups)} messages)"),
    ]  # fmt: skip


def _side(window: Window) -> str:
    return (
        f"{len(window.ids) / window.seconds:.0f} msg/s, {window.cpu_ms:.2f} CPU ms/msg, "
        f"{window.round_trips:.2f} Redis round trips/msg, "
        f"Redis CPU {window.redis_cpu_ms:.3f} ms/msg"
    )


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
    p.add_argument("--rounds", type=int, default=3, help="windows in a row, figures over all")
    p.add_argument("--quick", action="store_true", help="one 3,000-result window")
    p.add_argument("--gather-ms", type=int, default=GATHER_MS, help="claim_gather_ms")
    p.add_argument("--busy", type=int, default=0, help="queues with messages (0: all)")
    args = p.parse_args(argv)
    window, rounds = (3000, 1) if args.quick else (args.window, args.rounds)
    mix = [float(w) for w in args.weights.split(",")]
    rows = anyio.run(
        measure, args.queues, args.replicas, args.workers, args.warmup, window, rounds, mix,
        args.gather_ms, args.busy,
    )  # fmt: skip
    table("many tenants: weighted fair share and fetch overhead", rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
