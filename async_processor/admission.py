"""Pool admission: run the pool gate for one message until it admits, ends or hands back.

Input: a ``Work`` item inside a worker, the pool's gate and the limits. Output: ``None``
when admitted, else an outcome for the worker to settle: a ``Final`` result (drop,
gate error, deadline) or a ``HandBack`` (refused, waited too long, shutting down).

Wait parks the worker without spinning: it re-asks the gate at most every 50 ms, or
sooner when the gate can signal a change (``gates.base.WaitsForChange``). Past
``--gate-wait-timeout`` the message goes back to the broker instead of failing, since
its deadline may be hours away (the reference failed it with DEADLINE_EXCEEDED).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import anyio
import structlog

from async_processor.gates.base import Action, Gate, Releases, WaitsForChange, refusal_decision
from async_processor.messages import (
    GATE_DROPPED_TEXT,
    ErrorCode,
    Result,
)
from async_processor.metrics import QueueMetrics
from async_processor.retry import REFUSE_DELAY, Final, expired, last_answer
from async_processor.work import Work

log = structlog.get_logger(__name__)

WAIT_STEP = 0.05


@dataclass(frozen=True, slots=True)
class HandBack:
    """Back to the broker without counting a retry, due after ``delay`` seconds."""

    delay: float


@dataclass(frozen=True, slots=True)
class PoolGate:
    gate: Gate
    metrics: QueueMetrics  # the pool's series (empty queue labels)
    wait_timeout: float


async def admit(
    work: Work, pool: PoolGate, releases: Releases, stopping: anyio.Event
) -> Final | HandBack | None:
    envelope = work.envelope
    deadline = float(envelope.request.deadline)
    wait_until = time.time() + pool.wait_timeout
    waited = False
    while True:
        try:
            verdict = await pool.gate.apply(envelope, releases)
        except Exception as exc:  # the gate's backend failed: fail closed, as the reference
            pool.metrics.gate_decision("error")
            log.warning("pool_gate_error", request_id=envelope.id, error=str(exc))
            message = f"Pool gating error: {exc}"
            return Final(Result.failure(envelope.id, ErrorCode.GATE_ERROR, message), None)
        if verdict.action is Action.CONTINUE:
            return None
        if verdict.action is Action.DROP:
            pool.metrics.gate_decision("dropped")
            result = verdict.result or Result.failure(
                envelope.id, ErrorCode.GATE_DROPPED, GATE_DROPPED_TEXT
            )
            return Final(result, None)
        if not waited:
            pool.metrics.gate_decision(refusal_decision(envelope))
        if verdict.action is Action.REFUSE:
            return HandBack(REFUSE_DELAY)
        waited = True
        now = time.time()
        if now >= deadline:
            return expired(envelope.id, last_answer(envelope.routing))
        if now >= wait_until or stopping.is_set():
            return HandBack(0.0)
        await _park(pool.gate, min(WAIT_STEP, deadline - now, wait_until - now))


async def _park(gate: Gate, timeout: float) -> None:
    if not isinstance(gate, WaitsForChange):
        await anyio.sleep(timeout)
        return
    with anyio.move_on_after(timeout):
        await gate.wait_changed(timeout)
