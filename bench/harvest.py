"""``python -m bench.harvest [--quick]`` (``make bench-harvest``): how much idle pool capacity
each daemon strategy fills, and how much it slows interactive traffic, against an oracle.

Run A replays an interactive trace alone against the simulator's load-dependent pool;
runs B… replay the same trace while the daemon drains a deep backlog (real Redis) under
one strategy each. The oracle (the same pool model on virtual time, exact knowledge)
draws the frontier. Output: the definitions, a Markdown table, a JSON file and a PNG per
run; the last stdout line is the summary (``harvest: best=…``). Figures only.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from contextlib import ExitStack
from dataclasses import dataclass, replace
from pathlib import Path

import anyio

from async_processor.gates import epp
from bench import harvest_plot
from bench.common import redis
from bench.harness import LOG_DIR
from bench.harvest_model import (
    Point,
    Scenario,
    cycle_ratios,
    frontier_harvest,
    oracle_points,
    percentile,
)
from bench.harvest_runs import SIM_URL, RunResult, Strategy, as_json, dumps, run_alone, run_strategy

TTFT_LIMIT = E2E_LIMIT = 1.3
SHED_LIMIT = 0.01  # the goal: fewer than 1 % of batch requests answered 429
POOL = "sim-pool"
SATURATION = epp.POOL_SATURATION.current  # what the simulator exports by default
RECOMMENDED = "pool-headroom H=16"
QUICK = ("fixed-64", "prometheus-saturation", RECOMMENDED)
# The default run: the stock strategies and the recommendation, 3 cycles each,
# within 15 min; every other row (the steps towards the recommendation) runs with --only.
FULL = ("fixed-16", "fixed-64", "prometheus-saturation", "scrape-saturation",
        "adaptive-concurrency", RECOMMENDED)  # fmt: skip

DEFINITIONS = """\
definitions:
  capacity C     = pods x max-num-seqs running slots
  idle           = integral of (C - interactive running) dt over run A
  harvested      = slot-seconds of batch requests that completed during run B
                   (work lost to preemption does not count, nor the part of a request
                   that ran before the trace started, during the daemon's warm-up)
  harvest ratio  = harvested / idle
  trace          = cycles x the load profile (20 % -> 85 % -> burst 100 % -> 20 %), each
                   cycle its own seed; every run and the oracle replay the same trace
  TTFT/e2e ratio = interactive p99 TTFT (the model's) / e2e latency (measured) in B / in A,
                   the p99 over all cycles' requests together; "per cycle" is the range of
                   each cycle's own TTFT ratio (one burst each: the spread, not the figure)
  oracle         = the same pool model on virtual time, admitting batch work whenever more
                   than H slots are free (exact, instant; no daemon)
  oracle ratio   = harvest / the oracle's harvest at the same TTFT ratio (upper envelope
                   of its points, linear between them; below the lowest TTFT ratio the best
                   harvest at a ratio <= 1.0, above the highest the best harvest of all)
  shed share     = batch 429s / (batch completed + batch 429s)
  best           = the highest oracle ratio among rows within the goal's limits: TTFT and
                   e2e p99 <= 1.3x and shed share < 0.01 (else best=none); spaces in its
                   name become _ in the summary line"""


def strategies(s: Scenario) -> list[Strategy]:
    """Runs B…: the stock strategies with the reference's defaults (a gate's budget only
    sizing fetches, a 5 s metric cache), then one change at a time towards the
    recommendation, each the "after" of the row before it."""
    sim_metrics = SIM_URL + "/metrics"
    fetch_scope, fast_cache = ("--budget-scope", "fetch"), ("--prometheus-cache-ttl", "500ms")
    saturation = {
        "gate_type": "endpoint-scrape",
        "gate_params": {"url": sim_metrics, "metric": SATURATION},
    }
    running = {
        "gate_type": "endpoint-scrape",
        "gate_params": {
            "url": sim_metrics,
            "metric": "vllm:num_requests_running",
            "labels": {"pod": "sim-0"},
            "max_count_per_pod": s.max_num_seqs,
        },
    }
    prometheus = {"gate_type": "prometheus-saturation", "gate_params": {"pool": POOL}}
    shed_pause = ("--shed-pause", "1s")

    def pool_headroom(h: int, interval: str = "100ms") -> Strategy:
        gate = {
            "url": sim_metrics,
            "max_num_seqs": s.max_num_seqs,
            "headroom": h,
            "interval": interval,
        }
        suffix = "" if interval == "100ms" else f" {interval}"
        return Strategy(
            f"pool-headroom H={h}{suffix}",
            s.capacity - h,
            pool_gate={"gate_type": "pool-headroom", "gate_params": gate},
            note=f"after: a pool gate admitting while more than {h} slots are free "
            f"(read every {interval}, its own requests counted exactly), "
            f"C - H = {s.capacity - h} workers",
        )

    return [
        Strategy("fixed-16", 16, note="16 workers, no gate"),
        Strategy("fixed-64", 64, note="64 workers (the default), no gate"),
        Strategy("prometheus-saturation", 64, prometheus, flags=fetch_scope, prometheus=True,
                 note="the reference: threshold 0.8, budget sizes fetches, 5 s cache; "
                      "Prometheus scrapes every 1 s"),
        Strategy("scrape-saturation", 64, saturation, flags=fetch_scope,
                 note="the pool saturation gauge from /metrics, budget sizes fetches, 5 s cache"),
        Strategy("scrape-running", 64, running, flags=fetch_scope,
                 note="one pod's running count / max-num-seqs, budget sizes fetches, 5 s cache"),
        Strategy("adaptive-concurrency", 64, pool_gate={"gate_type": "adaptive-concurrency"},
                 note="the adaptive gate's defaults, as the pool's gate"),
        Strategy("fixed-64 shed-pause", 64, flags=shed_pause,
                 note="after: the pool waits out Retry-After after a 429 (--shed-pause 1s)"),
        Strategy("prometheus-saturation in-flight", 64, prometheus, prometheus=True,
                 note="after: the budget caps what is in flight (--budget-scope in-flight)"),
        Strategy("scrape-saturation in-flight", 64, saturation,
                 note="after: --budget-scope in-flight (vs scrape-saturation)"),
        Strategy("scrape-saturation in-flight 0.5s", 64, saturation, flags=fast_cache,
                 note="after: a 500 ms cache (--prometheus-cache-ttl) instead of 5 s"),
        Strategy("scrape-saturation in-flight 0.5s 192w pause", 192, saturation,
                 flags=fast_cache + shed_pause,
                 note="after: 192 workers, so the in-flight cap (budget x workers) can reach the "
                      "pool's 128 slots, and --shed-pause 1s"),
        Strategy("adaptive-concurrency latency", 192,
                 pool_gate={"gate_type": "adaptive-concurrency", "gate_params": {
                     "initial_limit": 64, "max_limit": 192, "latency_target": "2600ms"}},
                 note="after: the adaptive gate also backs off when a batch request takes "
                      "longer than 2.6 s (2.06 s on an idle pod, 3.1 s on a full one)"),
        *(pool_headroom(h) for h in (0, 8, 16, 32, 48, 56)),
        pool_headroom(16, "50ms"),
        pool_headroom(56, "500ms"),
    ]  # fmt: skip


@dataclass
class Row:
    point: Point
    oracle_ratio: float
    completed: int
    shed: int
    preempted: int
    retries: float
    cpu: float

    @property
    def shed_share(self) -> float:
        return self.shed / max(1, self.completed + self.shed)

    def within_limits(self) -> bool:
        """The goal's three limits: a setup that keeps latency only by having most of its
        requests refused (H = 0 shed 75 %) does not qualify as best."""
        p = self.point
        return (p.ttft_ratio <= TTFT_LIMIT and p.e2e_ratio <= E2E_LIMIT
                and self.shed_share < SHED_LIMIT)  # fmt: skip


def ratio(values: list[float], reference: list[float]) -> float:
    return percentile(values, 99) / percentile(reference, 99)


def row(s: Scenario, a: RunResult, b: RunResult, frontier: list[Point]) -> Row:
    idle = s.capacity * s.duration - a.counters["slot_seconds"]["interactive"]
    c = b.counters
    harvested = c["completed_slot_seconds"]["batch"] - c["carried_in"]["batch"]
    cycles = cycle_ratios(s, (b.arrivals, b.ttft), (a.arrivals, a.ttft))
    point = Point(b.name, harvested / idle,
                  ratio(b.ttft, a.ttft), ratio(b.e2e, a.e2e), cycles)  # fmt: skip
    best = frontier_harvest(frontier, point.ttft_ratio)
    return Row(point, point.harvest_ratio / best if best > 0 else math.nan,
               c["completed"]["batch"], c["shed"]["batch"], c["preempted"]["batch"],
               b.retries, b.daemon_cpu)  # fmt: skip


def markdown(rows: list[Row], frontier: list[Point], duration: float) -> str:
    lines = [
        "| strategy | harvest | oracle ratio | TTFT p99 × | per cycle | e2e p99 × | batch done "
        "| 429s | shed share | preempted | retries | daemon CPU |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        p = r.point
        lines.append(
            f"| {p.name} | {p.harvest_ratio:.2f} | {r.oracle_ratio:.2f} | {p.ttft_ratio:.2f} "
            f"| {spread(p)} | {p.e2e_ratio:.2f} | {r.completed} | {r.shed} | {r.shed_share:.3f} "
            f"| {r.preempted} | {r.retries:.0f} | {100 * r.cpu / duration:.0f} % |"
        )
    for p in frontier:
        lines.append(f"| {p.name} | {p.harvest_ratio:.2f} | 1.00 | {p.ttft_ratio:.2f} "
                     f"| {spread(p)} | {p.e2e_ratio:.2f} | | | | | | |")  # fmt: skip
    return "\n".join(lines)


def spread(p: Point) -> str:
    return f"{min(p.cycle_ttft):.2f}–{max(p.cycle_ttft):.2f}" if p.cycle_ttft else ""


def summary(rows: list[Row]) -> str:
    fit = [r for r in rows if r.within_limits() and not math.isnan(r.oracle_ratio)]
    if not fit:
        n = math.nan
        return (f"harvest: best=none harvest_ratio={n:.2f} oracle_ratio={n:.2f} "
                f"ttft_p99_ratio={n:.2f} e2e_p99_ratio={n:.2f} shed_share={n:.3f}")  # fmt: skip
    b = max(fit, key=lambda r: r.oracle_ratio)
    p = b.point
    name = p.name.replace(" ", "_")  # one token, so the line splits on spaces
    return (f"harvest: best={name} harvest_ratio={p.harvest_ratio:.2f} "
            f"oracle_ratio={b.oracle_ratio:.2f} ttft_p99_ratio={p.ttft_ratio:.2f} "
            f"e2e_p99_ratio={p.e2e_ratio:.2f} shed_share={b.shed_share:.3f}")  # fmt: skip


async def run_all(s: Scenario, chosen: list[Strategy]) -> tuple[RunResult, list[RunResult]]:
    with ExitStack() as stack:
        redis_url = redis(stack).url
        print(f"run A: interactive alone ({s.duration:g} s)", flush=True)
        alone = await run_alone(s)
        results = []
        for strategy in chosen:
            print(f"run B: {strategy.name}: {strategy.note}", flush=True)
            results.append(await run_strategy(s, strategy, redis_url))
    return alone, results


def report(s: Scenario, out: Path, alone: RunResult, results: list[RunResult],
           frontiers: tuple[list[Point], list[Point]]) -> list[Row]:  # fmt: skip
    frontier = frontiers[1] if s.preemption else frontiers[0]
    rows = [row(s, alone, b, frontier) for b in results]
    print(f"\n{DEFINITIONS}\n")
    print(markdown(rows, [*frontiers[0], *frontiers[1]], s.duration))
    (out / "harvest.md").write_text(markdown(rows, [*frontiers[0], *frontiers[1]], s.duration))
    data = {"scenario": vars(s), "rows": [{**vars(r.point), "oracle_ratio": r.oracle_ratio,
            "completed": r.completed, "shed": r.shed, "shed_share": r.shed_share,
            "preempted": r.preempted, "retries": r.retries, "daemon_cpu_seconds": r.cpu}
            for r in rows], "oracle": [vars(p) for p in [*frontiers[0], *frontiers[1]]],
            "runs": [as_json(x) for x in [alone, *results]]}  # fmt: skip
    (out / "harvest.json").write_text(dumps([data]))
    print(f"\nJSON: {out / 'harvest.json'}")
    _pngs(s, out, alone, results, rows, frontiers)
    return rows


def _pngs(s: Scenario, out: Path, alone: RunResult, results: list[RunResult], rows: list[Row],
          frontiers: tuple[list[Point], list[Point]]) -> None:  # fmt: skip
    if not harvest_plot.available():
        print("PNGs: skipped (pip install -e '.[bench]' for matplotlib)")
        return
    labelled = {"oracle": frontiers[0], "oracle + preemption": frontiers[1]}
    points = [r.point for r in rows]
    for result in [alone, *results]:
        path = out / f"harvest-{result.name.split(':')[0].replace(' ', '-')}.png"
        harvest_plot.draw(path, result, s.capacity, points, labelled, result.name)
        print(f"PNG: {path}")


def parse(argv: list[str]) -> tuple[Scenario, list[Strategy], Path]:
    p = argparse.ArgumentParser(prog="python -m bench.harvest", description=__doc__.splitlines()[0])
    p.add_argument(
        "--quick", action="store_true", help=f"short runs of {', '.join(QUICK)} (≤ 3 min in all)"
    )
    p.add_argument("--all", action="store_true", help="every strategy (about 40 min)")
    p.add_argument("--duration", type=float, help="seconds per cycle (default 40, quick 20)")
    p.add_argument("--cycles", type=int, help="load profiles per run, back to back "
                   "(default 3, quick 1)")  # fmt: skip
    p.add_argument("--time-factor-under-load", type=float, default=1.5)
    p.add_argument("--no-preemption", action="store_true")
    p.add_argument("--only", default="", help="comma-separated strategy names")
    p.add_argument("--out", type=Path, help=f"output directory (default {LOG_DIR}/harvest-F<f>)")
    args = p.parse_args(argv)
    cycles = args.cycles or (1 if args.quick else 3)
    duration = (args.duration or (20.0 if args.quick else 40.0)) * cycles
    s = replace(Scenario(), duration=duration, cycles=cycles,
                time_factor=args.time_factor_under_load,
                preemption=not args.no_preemption)  # fmt: skip
    chosen = strategies(s)
    names = args.only.split(",") if args.only else list(QUICK if args.quick else FULL)
    names = [x.name for x in chosen] if args.all else names
    unknown = set(names) - {x.name for x in chosen}
    if unknown:
        p.error(f"unknown strategies {sorted(unknown)}; known: {[x.name for x in chosen]}")
    chosen = [x for x in chosen if x.name in names]
    out = args.out or LOG_DIR / f"harvest-F{s.time_factor:g}"
    return s, chosen, out


def main(argv: list[str] | None = None) -> int:
    s, chosen, out = parse(sys.argv[1:] if argv is None else argv)
    out.mkdir(parents=True, exist_ok=True)
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"{os.cpu_count()} CPUs, load average {load}; scenario: {json.dumps(vars(s))}")
    started = time.monotonic()
    frontiers = oracle_points(s)
    print(f"oracle frontier: {time.monotonic() - started:.0f} s", flush=True)
    alone, results = anyio.run(run_all, s, chosen)
    rows = report(s, out, alone, results, frontiers)
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"\nall runs: {time.monotonic() - started:.0f} s; load average now {load}")
    print(summary(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
