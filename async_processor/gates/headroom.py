"""``pool-headroom``: admit batch work while the inference pool keeps ``headroom`` slots free.

Input: the pool's ``/metrics`` page (``vllm:num_requests_running`` and
``vllm:num_requests_waiting`` per pod, or any pair of names), read at most every
``interval``; the requests this gate admitted and released since. Output: a ``Verdict``
(``wait`` or ``refuse`` when full) and the gauge ``llm_d_async_async_pool_headroom_limit``.

A headroom controller, not a share of the daemon's workers: with capacity C = pods ×
``max_num_seqs`` and ``others`` = running + waiting − this gate's own requests at the
scrape, the gate lets its own requests in flight reach
``limit = floor(share × (C − others)) − headroom``, i.e. with ``share`` 1 "the free slots
minus ``headroom``, plus what is already ours". Between scrapes it counts its own
admissions and releases exactly, so it never overshoots on its own account, and a
request it finishes frees its slot at once; only other traffic waits for the next scrape.
A failed scrape admits nothing new until one succeeds (fails closed) and warns. So does a
429 or a drop reason on one of its requests: the router is shedding, whatever the last
reading said, so nothing new goes in until a reading begun after the shed.
"""

from __future__ import annotations

import math
import time
from typing import Literal

import anyio
import structlog
from prometheus_client.metrics_core import Metric
from pydantic import Field

from async_processor.errors import ConfigError, GateError
from async_processor.gates.base import (
    CONTINUE,
    GATES,
    REFUSE,
    WAIT,
    Gate,
    GateContext,
    Releases,
    Verdict,
)
from async_processor.gates.params import Duration, Float, Int, Params, StrMap
from async_processor.gates.scrape import Names, fetch_page, select
from async_processor.gates.shared import ChangeSignal, Throttle, owner_gauge
from async_processor.messages import Envelope

log = structlog.get_logger(__name__)


class HeadroomParams(Params):
    url: Names  # one page with every pod's series, or one page per pod
    running_metric: Names = Field(default_factory=lambda: ["vllm:num_requests_running"])
    waiting_metric: Names = Field(default_factory=lambda: ["vllm:num_requests_waiting"])
    labels: StrMap = Field(default_factory=dict)
    max_num_seqs: Int = Field(ge=1)  # running slots per pod
    pods: Int = Field(default=0, ge=0)  # 0: one pod per series of running_metric
    headroom: Int = Field(default=0, ge=0)  # slots kept free for other traffic
    share: Float = Field(default=1.0, gt=0, le=1)  # of the slots others leave
    interval: Duration = Field(default=0.1, gt=0)  # scrape at most this often
    when_full: Literal["wait", "refuse"] = "wait"


class PoolHeadroomGate:
    def __init__(self, ctx: GateContext, params: HeadroomParams) -> None:
        self._ctx = ctx
        self.params = params
        self.own = 0  # admitted by this gate, not yet released
        self.limit = 0  # how many of its own may be in flight, from the last scrape
        self._full = WAIT if params.when_full == "wait" else REFUSE
        self._until = -math.inf  # when the last scrape goes stale
        self._lock = anyio.Lock()
        self._changed = ChangeSignal()
        self._timer = False  # a parked waiter will wake to re-scrape when the reading is stale
        self._sheds = 0  # 429s / drop reasons heard: a reading begun before one is void
        self._warn = Throttle()
        self._gauge = owner_gauge(ctx, "pool_headroom_limit", "In-flight limit of pool-headroom.")

    async def budget(self) -> float:
        await self._refresh()
        return 1.0 if self.own < self.limit else 0.0

    async def apply(self, message: Envelope, releases: Releases) -> Verdict:
        await self._refresh()
        if self.own >= self.limit:
            return self._full
        self.own += 1

        async def release() -> None:
            self.own -= 1
            self._changed.notify(1)

        releases.add(release)
        return CONTINUE

    def observe(
        self, message: Envelope, status: int | None, latency: float, dropped_reason: str
    ) -> None:
        """A shed closes the gate until the next reading. Without this, each 429 released its
        slot and the exact own count sent the next request into the same shedding pool at
        once: a loop of 429s until the reading went stale (251 in one bench run)."""
        if status == 429 or dropped_reason:
            self._sheds += 1
            self._set_limit(0)

    async def wait_changed(self, timeout: float) -> None:
        """Until a slot frees or a scrape ends. One parked waiter (the timer) also wakes when
        the reading goes stale, to scrape again; the rest sleep until woken, not all
        of them at every ``interval``."""
        if self._timer or self._lock.locked():
            await self._changed.wait(timeout)
            return
        self._timer = True
        try:
            stale_in = max(0.0, self._until - time.monotonic())
            if min(timeout, stale_in) > 0:
                await self._changed.wait(min(timeout, stale_in))
        finally:
            self._timer = False

    async def _refresh(self) -> None:
        """One scrape at a time, when the last one is stale; callers meanwhile use it."""
        if time.monotonic() < self._until or self._lock.locked():
            return
        async with self._lock:
            own_at_scrape, sheds = self.own, self._sheds
            try:
                running, waiting, pods = await self._read()
            except GateError as exc:
                self._set_limit(0)
                if self._warn.ready():
                    reads = [f"GET {u}" for u in self.params.url]
                    log.warning("gate_using_fallback", gate="pool-headroom", reason=str(exc),
                                queries=reads, fallback_budget=0)  # fmt: skip
            else:
                self._warn.reset()
                if sheds == self._sheds:  # else the pool shed after this page was read
                    self._set_limit(self._limit(running + waiting - own_at_scrape, pods))
            self._until = time.monotonic() + self.params.interval
            # One waiter per slot to take, and one to become the timer if none is parked as it
            # (waiters parked during the scrape did not, so nothing would re-scrape).
            self._changed.notify(max(self.limit - self.own, 0 if self._timer else 1))

    def _set_limit(self, limit: int) -> None:
        self.limit = limit
        if self._gauge is not None:
            self._gauge.set(limit)

    def _limit(self, others: float, pods: int) -> int:
        p = self.params
        free_for_us = p.share * (pods * p.max_num_seqs - max(0.0, others))
        return max(0, math.floor(free_for_us) - p.headroom)

    async def _read(self) -> tuple[float, float, int]:
        """Running and waiting summed over every page, and the pods (series) counted."""
        p = self.params
        pages: list[list[Metric] | GateError] = []
        async with anyio.create_task_group() as tg:
            for url in p.url:
                tg.start_soon(self._fetch, url, pages)
        for error in (page for page in pages if isinstance(page, GateError)):
            raise error
        read = [page for page in pages if not isinstance(page, GateError)]
        running = [s for page in read for s in select(page, p.running_metric, p.labels)]
        if len(running) < len(p.url):
            raise GateError(f"no series of {p.running_metric} on some of {p.url}")
        waiting = [s for page in read for s in select(page, p.waiting_metric, p.labels)]
        pods = p.pods or len(running)
        return sum(s.value for s in running), sum(s.value for s in waiting), pods

    async def _fetch(self, url: str, pages: list[list[Metric] | GateError]) -> None:
        try:
            pages.append(await fetch_page(self._ctx, url))
        except GateError as exc:
            pages.append(exc)


@GATES.register("pool-headroom", HeadroomParams)
def _pool_headroom(params: HeadroomParams, ctx: GateContext) -> Gate:
    if ctx.owner.queue_name and params.when_full == "wait":
        # Wait means Continue at queue level: a full gate would let every message through.
        raise ConfigError("pool-headroom with when_full wait belongs on a pool (or use refuse)")
    return PoolHeadroomGate(ctx, params)
