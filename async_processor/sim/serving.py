"""The pool model (sim/pool.py) served over HTTP by the simulator, on the wall clock.

Stage: outside the daemon (simulator). Input: completion requests, classified as
interactive or batch from their headers; the ``--pods``/``--max-num-seqs``/... flags.
Output: each request's job run through the ``Pool`` (or shed), per-pod ``vllm:*`` gauges,
per-class counters (``sim_*``) and a JSON snapshot (``/admin/pool``) for benchmarks.

One driver task advances the pool to the wall clock at each event (first token or
completion) and wakes the handlers whose jobs finished; a new request wakes it too, since
it changes every running job's speed on its pod.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import anyio
from aiohttp import web
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from async_processor.cli.args import duration
from async_processor.headers import (
    DEFAULT_OBJECTIVE_HEADER,
    DEFAULT_PRIORITY_HEADER,
    OBJECTIVE_HEADER,
)
from async_processor.sim.pool import BATCH, CLASSES, INTERACTIVE, Job, Pool, PoolConfig

OBJECTIVE_HEADERS = (OBJECTIVE_HEADER, DEFAULT_OBJECTIVE_HEADER)
BATCH_OBJECTIVES = frozenset({"batch", "sheddable"})
TIMING_HEADER = "x-sim-ttft-seconds"  # the model's TTFT, for benchmarks (no streaming here)


def request_class(headers: Mapping[str, str]) -> str:
    """Batch (sheddable) when the priority is negative or the objective names batch work."""
    priority = headers.get(DEFAULT_PRIORITY_HEADER, "").strip()
    try:
        if priority and int(priority) < 0:
            return BATCH
    except ValueError:
        pass
    objectives = {headers.get(h, "").strip().lower() for h in OBJECTIVE_HEADERS}
    return BATCH if objectives & BATCH_OBJECTIVES else INTERACTIVE


@dataclass
class Load:
    """What the EPP/vLLM gauges report: per-pod (running, waiting) and pool saturation."""

    per_pod: list[tuple[str, int, int]]
    saturation: float

    @property
    def running(self) -> int:
        return sum(r for _, r, _ in self.per_pod)

    @property
    def waiting(self) -> int:
        return sum(w for _, _, w in self.per_pod)


class PoolRuntime:
    """The pool on a clock: ``drive`` runs until cancelled, ``run`` serves one request."""

    def __init__(self, config: PoolConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.pool = Pool(config, clock())
        self._done: dict[Job, anyio.Event] = {}
        self._wake = anyio.Event()

    def _advance(self) -> None:
        for job in self.pool.advance(self._clock()):
            event = self._done.pop(job, None)
            if event is not None:
                event.set()

    async def drive(self) -> None:
        while True:
            self._wake = anyio.Event()
            self._advance()
            at = self.pool.next_event()
            delay = math.inf if at is None else max(0.0, at - self._clock())
            with anyio.move_on_after(delay):
                await self._wake.wait()

    async def run(self, cls: str, prompt_tokens: int, output_tokens: int) -> Job | None:
        """The job once finished, or None when the router shed it."""
        self._advance()
        job = Job(cls, *self.pool.config.work(prompt_tokens, output_tokens), self.pool.now)
        if not self.pool.submit(job):
            return None
        done = self._done[job] = anyio.Event()
        self._wake.set()
        try:
            await done.wait()
        except BaseException:  # the client went away: free its slot at once
            self._done.pop(job, None)
            self._advance()
            if job.finished is None:
                self.pool.cancel(job)
                self._wake.set()
            raise
        return job

    def load(self) -> Load:
        self._advance()
        pods = [(p.name, len(p.running), p.num_waiting) for p in self.pool.pods]
        return Load(pods, self.pool.saturation())

    def snapshot(self) -> dict[str, Any]:
        """Gauges and counters as JSON (``/admin/pool``): what a benchmark samples."""
        self._advance()
        pool, c = self.pool, self.pool.counters
        return {
            "now": pool.now,
            "capacity": pool.config.capacity,
            "running": {cls: pool.running(cls) for cls in CLASSES},
            "waiting": pool.waiting(),
            "saturation": pool.saturation(),
            "slot_seconds": {cls: c.slot_seconds[cls] for cls in CLASSES},
            "completed_slot_seconds": {cls: c.completed_slot_seconds[cls] for cls in CLASSES},
            "running_age": {cls: pool.running_age(cls) for cls in CLASSES},
            "completed": {cls: c.completed[cls] for cls in CLASSES},
            "shed": {cls: c.shed[cls] for cls in CLASSES},
            "preempted": {cls: c.preempted[cls] for cls in CLASSES},
        }

    def add_routes(self, app: web.Application) -> None:
        async def pool_state(_: web.Request) -> web.Response:
            return web.json_response(self.snapshot())

        app.router.add_get("/admin/pool", pool_state)


class PoolCollector(Collector):
    """KV-cache use per pod and the per-class counters (the vLLM gauges are the simulator's)."""

    def __init__(self, runtime: PoolRuntime, labels: Callable[[], dict[str, str]]) -> None:
        self._runtime = runtime
        self._labels = labels

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        self._runtime.load()  # brings the counters up to now
        pool, c, base = self._runtime.pool, self._runtime.pool.counters, self._labels()
        kv = GaugeMetricFamily(
            "vllm:kv_cache_usage_perc", "KV-cache use, 0..1.", labels=[*base, "pod"]
        )
        for pod in pool.pods:
            kv.add_metric([*base.values(), pod.name], pod.kv_usage)
        yield kv
        running = GaugeMetricFamily("sim_requests_running", "Running by class.", labels=["class"])
        for cls in CLASSES:
            running.add_metric([cls], pool.running(cls))
        yield running
        for name, doc, values in (
            ("sim_slot_seconds", "Slot-seconds spent running, by class.", c.slot_seconds),
            ("sim_completed_slot_seconds", "Slot-seconds of completed runs (not preempted work).",
             c.completed_slot_seconds),
            ("sim_requests_completed", "Requests completed.", c.completed),
            ("sim_requests_shed", "Requests the router shed (429).", c.shed),
            ("sim_requests_preempted", "Running requests preempted.", c.preempted),
        ):  # fmt: skip
            family = CounterMetricFamily(name, doc, labels=["class"])
            for cls in CLASSES:
                family.add_metric([cls], values[cls])
            yield family


# -- command line ---------------------------------------------------------------------

# flag -> (type, metavar, help); durations take Go syntax or plain seconds.
FLAGS: dict[str, tuple[Any, str, str]] = {
    "pods": (int, "N", "pods in the pool"),
    "max-num-seqs": (int, "N", "running requests per pod (turns the pool model on)"),
    "prefill-overhead": (duration, "DURATION", "fixed prefill time per request"),
    "prefill-time-per-token": (duration, "DURATION", "prefill time per prompt token"),
    "inter-token-latency": (duration, "DURATION", "decode time per output token"),
    "time-factor-under-load": (float, "FACTOR", "slow-down of a pod running --max-num-seqs (>= 1)"),
    "scheduling-policy": (str, "{fcfs,priority}", "priority: interactive requests jump batch ones"),
    "shed-queue-depth": (int, "N", "router sheds batch when every pod has this many waiting"),
    "shed-kv-usage": (float, "FRACTION", "... or this KV-cache use (share of slots in use)"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("load-dependent pool (on when --max-num-seqs is given)")
    for name, (kind, metavar, help_text) in FLAGS.items():
        group.add_argument(f"--{name}", type=kind, default=None, metavar=metavar, help=help_text)
    group.add_argument("--preemption", action="store_true", default=None,
                       help="interactive requests preempt running batch ones")  # fmt: skip


def config_from_args(args: dict[str, Any]) -> PoolConfig | None:
    """Takes the pool's flags out of ``args``; a PoolConfig when --max-num-seqs was given."""
    values = {k.replace("-", "_"): args.pop(k.replace("-", "_")) for k in [*FLAGS, "preemption"]}
    if values["max_num_seqs"] is None:
        if any(v is not None for v in values.values()):
            raise ValueError("the pool flags need --max-num-seqs")
        return None
    return PoolConfig(**{k: v for k, v in values.items() if v is not None})
