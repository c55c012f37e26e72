"""``adaptive-concurrency``: an AIMD in-flight limiter that learns from dispatch outcomes.

Input: messages to admit (``apply``) and the outcome of each HTTP attempt (``observe``,
called by the dispatcher for pool gates). Output: a ``Verdict`` and the limit gauge
``llm_d_async_async_adaptive_concurrency_limit``.

It needs no Prometheus: the gateway's own answers are the signal. The limit grows by
``increase_step`` per round trip's worth of fast successes (``step / limit`` each) while
at least half of it is in use, and is multiplied by ``decrease_factor`` on a 429, a 503,
an ``x-llm-d-request-dropped-reason`` drop or a latency above ``latency_target``, at most
once per window: only an attempt admitted after the last cut can cut again (as TCP does),
so one burst of 429s is one decrease, not a collapse to ``min_limit``.
"""

from __future__ import annotations

import math
from typing import Literal, Self

import structlog
from prometheus_client import Gauge
from pydantic import Field, model_validator

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
from async_processor.gates.params import Duration, Float, Int, Params
from async_processor.gates.shared import ChangeSignal, owner_gauge
from async_processor.messages import Envelope

log = structlog.get_logger(__name__)

OVERLOAD_STATUSES = frozenset((429, 503))


class AdaptiveParams(Params):
    min_limit: Int = Field(default=1, ge=1)
    max_limit: Int = Field(default=1000, ge=1)
    initial_limit: Int = Field(default=16, ge=1)
    increase_step: Float = Field(default=1.0, gt=0)
    decrease_factor: Float = Field(default=0.9, gt=0, lt=1)
    latency_target: Duration = Field(default=0.0, ge=0)  # 0 = latency is not a signal
    # What a full limiter answers: "wait" parks the pool worker, "refuse" hands it back.
    when_full: Literal["wait", "refuse"] = "wait"

    @model_validator(mode="after")
    def _ordered(self) -> Self:
        if not self.min_limit <= self.initial_limit <= self.max_limit:
            raise ValueError("need min_limit <= initial_limit <= max_limit")
        return self


class AdaptiveConcurrencyGate:
    def __init__(self, params: AdaptiveParams, gauge: Gauge | None = None) -> None:
        self.params = params
        self.limit = float(params.initial_limit)
        self.in_flight = 0
        self._full = WAIT if params.when_full == "wait" else REFUSE
        self._epoch = 0  # bumped by every decrease
        self._admitted: dict[str, int] = {}  # request id -> epoch at admission
        self._changed = ChangeSignal()
        self._gauge = gauge
        self._publish()

    @property
    def slots(self) -> int:
        return max(self.params.min_limit, math.floor(self.limit))

    async def budget(self) -> float:
        return max(0.0, (self.slots - self.in_flight) / self.slots)

    async def apply(self, message: Envelope, releases: Releases) -> Verdict:
        if self.in_flight >= self.slots:
            return self._full
        self.in_flight += 1
        request_id = message.id
        self._admitted[request_id] = self._epoch

        async def release() -> None:
            self.in_flight -= 1
            self._admitted.pop(request_id, None)
            self._changed.notify(1)

        releases.add(release)
        return CONTINUE

    def observe(
        self, message: Envelope, status: int | None, latency: float, dropped_reason: str
    ) -> None:
        p = self.params
        slow = p.latency_target > 0 and latency > p.latency_target
        if status in OVERLOAD_STATUSES or dropped_reason or (slow and status is not None):
            self._decrease(self._admitted.get(message.id, self._epoch))
        elif status is not None and 200 <= status < 300 and self.in_flight * 2 >= self.slots:
            before = self.slots
            self.limit = min(float(p.max_limit), self.limit + p.increase_step / self.limit)
            self._publish()
            self._changed.notify(self.slots - before)  # one waiter per new slot

    def _decrease(self, admitted_epoch: int) -> None:
        if admitted_epoch < self._epoch:
            return  # sent before the last cut: that overload is already accounted for
        self._epoch += 1
        before = self.limit
        self.limit = max(float(self.params.min_limit), self.limit * self.params.decrease_factor)
        self._publish()
        log.debug("adaptive_limit_decreased", before=round(before, 2), after=round(self.limit, 2))

    def _publish(self) -> None:
        if self._gauge is not None:
            self._gauge.set(self.limit)

    async def wait_changed(self, timeout: float) -> None:
        await self._changed.wait(timeout)


@GATES.register("adaptive-concurrency", AdaptiveParams)
def _adaptive(params: AdaptiveParams, ctx: GateContext) -> Gate:
    if ctx.owner.queue_name:
        # Only pool gates hear dispatch outcomes: at queue level the limit never moves.
        log.warning("adaptive_concurrency_needs_pool_level", queue=ctx.owner.queue_name)
    gauge = owner_gauge(ctx, "adaptive_concurrency_limit", "AIMD in-flight limit of the gate.")
    return AdaptiveConcurrencyGate(params, gauge)
