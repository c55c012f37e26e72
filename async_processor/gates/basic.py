"""In-process gates: ``local-max-concurrency``, ``composite``, ``wait-on-refuse``.

Input: a message and the caller's ``Releases``. Output: a ``Verdict``. None of these
talk to a backend themselves; composite and wait-on-refuse wrap inner gates built from
nested ``{gate_type, gate_params}`` configs with the same owner.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import anyio
from pydantic import Field

from async_processor.errors import ConfigError
from async_processor.gates.base import (
    CONTINUE,
    GATES,
    REFUSE,
    WAIT,
    Action,
    Gate,
    GateContext,
    Releases,
    Verdict,
    build_gate,
    waits_in_apply,
)
from async_processor.gates.params import GateSpec, GateSpecObject, GateSpecs, Int, Params
from async_processor.gates.shared import ChangeSignal, InnerGate, observe_all, wait_any_changed
from async_processor.messages import Envelope


def build_inner(spec: GateSpec, ctx: GateContext, what: str) -> Gate:
    """An inner gate of a wrapper; its config error names the wrapper."""
    try:
        return build_gate(spec.gate_type, spec.gate_params, ctx)
    except ConfigError as exc:
        raise ConfigError(f"{what} failed to create inner gate {spec.gate_type!r}: {exc}") from exc


# ----------------------------------------------------------------- local-max-concurrency


class LocalMaxConcurrencyParams(Params):
    limit: Int = Field(gt=0)
    # "classifying" (the reference default) refuses when full; it stamps no label.
    gating_mode: Literal["classifying", "blocking"] = "classifying"


class LocalMaxConcurrencyGate:
    """At most ``limit`` admitted messages in this process; blocking mode parks in apply."""

    def __init__(self, limit: int, blocking: bool) -> None:
        self.limit = limit
        self.in_flight = 0
        self._blocking = self.waits_in_apply = blocking
        self._slots: anyio.Semaphore | None = None  # blocking mode; made in the loop
        self._changed = ChangeSignal()

    async def budget(self) -> float:
        if self.in_flight >= self.limit:
            return 0.0
        return (self.limit - self.in_flight) / self.limit

    async def apply(self, message: Envelope, releases: Releases) -> Verdict:
        if self._blocking:
            if self._slots is None:
                self._slots = anyio.Semaphore(self.limit)
            await self._slots.acquire()  # the caller's cancel scope bounds the wait
        elif self.in_flight >= self.limit:
            return REFUSE
        self.in_flight += 1
        releases.add(self._release)
        return CONTINUE

    async def _release(self) -> None:
        self.in_flight -= 1
        if self._slots is not None:
            self._slots.release()
        self._changed.notify(1)

    async def wait_changed(self, timeout: float) -> None:
        await self._changed.wait(timeout)


@GATES.register("local-max-concurrency", LocalMaxConcurrencyParams)
def _local_max(params: LocalMaxConcurrencyParams, ctx: GateContext) -> Gate:
    return LocalMaxConcurrencyGate(params.limit, params.gating_mode == "blocking")


# ----------------------------------------------------------------------------- composite


class CompositeParams(Params):
    gates: GateSpecs = Field(min_length=1)


class CompositeGate:
    """Minimum budget; all-or-nothing apply (the first non-CONTINUE rolls the rest back)."""

    def __init__(self, gates: Sequence[Gate]) -> None:
        self.gates = list(gates)
        self.waits_in_apply = any(waits_in_apply(gate) for gate in self.gates)

    async def budget(self) -> float:
        return min([await gate.budget() for gate in self.gates], default=1.0)

    async def apply(self, message: Envelope, releases: Releases) -> Verdict:
        mark = releases.mark()
        try:
            for gate in self.gates:
                verdict = await gate.apply(message, releases)
                if verdict.action is not Action.CONTINUE:
                    await releases.rollback(mark)
                    return verdict
        except BaseException:
            # Labels already stamped stay (reference); reservations do not.
            with anyio.CancelScope(shield=True):
                await releases.rollback(mark)
            raise
        return CONTINUE

    def observe(
        self, message: Envelope, status: int | None, latency: float, dropped_reason: str
    ) -> None:
        observe_all(self.gates, message, status, latency, dropped_reason)

    async def wait_changed(self, timeout: float) -> None:
        await wait_any_changed(self.gates, timeout)


@GATES.register("composite", CompositeParams)
def _composite(params: CompositeParams, ctx: GateContext) -> Gate:
    return CompositeGate([build_inner(spec, ctx, "composite gate") for spec in params.gates])


# ------------------------------------------------------------------------ wait-on-refuse


class WaitOnRefuseParams(Params):
    gate: GateSpecObject


class WaitOnRefuseGate(InnerGate):
    """The inner gate, with REFUSE turned into WAIT (park the worker, pool level)."""

    async def apply(self, message: Envelope, releases: Releases) -> Verdict:
        verdict = await self.apply_inner(message, releases)
        return WAIT if verdict.action is Action.REFUSE else verdict


@GATES.register("wait-on-refuse", WaitOnRefuseParams)
def _wait_on_refuse(params: WaitOnRefuseParams, ctx: GateContext) -> Gate:
    return WaitOnRefuseGate(build_inner(params.gate, ctx, "wait-on-refuse gate"))
