"""Pool admission: run the pool gate for one message until it admits, ends or hands back.

Input: a ``Work`` item inside a worker, the pool's gate and the limits. Output: ``None``
when admitted, else an outcome for the worker to settle: a ``Final`` result (drop,
gate error) or a ``HandBack`` (refused, shutting down).

Wait parks the worker without spinning, for as long as the worker's cancel scope for the
message lets it: until its deadline (a ``DEADLINE_EXCEEDED`` result) or
``--gate-wait-timeout`` (handed back to the broker instead of failing, since the deadline
may be hours away; the reference failed it with DEADLINE_EXCEEDED), whichever is first.
That scope also bounds a gate that waits inside ``apply`` (``local-max-concurrency`` in
``blocking`` mode). A gate that can signal a change (``gates.base.WaitsForChange``: a
freed slot, a new reading) wakes its parked workers itself, and they re-check on their
own only every ``WAIT_FALLBACK`` (a wake-up lost to a race costs at most that); a gate
that cannot is re-asked every ``gates.base.WAIT_POLL_INTERVAL``. Re-asking every 50 ms
regardless cost 8-16 % of a core with 72 workers parked.
"""

from __future__ import annotations

from dataclasses import dataclass

import anyio
import structlog

from async_processor.gates.base import (
    WAIT_POLL_INTERVAL,
    Action,
    Gate,
    Releases,
    WaitsForChange,
    refusal_decision,
)
from async_processor.messages import (
    GATE_DROPPED_TEXT,
    ErrorCode,
    Result,
)
from async_processor.metrics import QueueMetrics
from async_processor.retry import REFUSE_DELAY, Final, HandBack
from async_processor.work import Work

log = structlog.get_logger(__name__)

WAIT_FALLBACK = 1.0  # re-asking a gate that can, in case a wake-up was missed


@dataclass(frozen=True, slots=True)
class PoolGate:
    gate: Gate
    metrics: QueueMetrics  # the pool's series (empty queue labels)
    wait_timeout: float


async def admit(
    work: Work, pool: PoolGate, releases: Releases, stopping: anyio.Event
) -> Final | HandBack | None:
    """The verdict of ``pool``'s gate, waiting while it says Wait. Unbounded here: the
    caller's cancel scope ends the wait (a Wait or a gate that blocks in ``apply``) at
    the deadline or ``--gate-wait-timeout`` (``worker.Worker._admit``)."""
    envelope = work.envelope
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
        if stopping.is_set():
            return HandBack(0.0)
        await _park(pool.gate, stopping)


async def _park(gate: Gate, stopping: anyio.Event) -> None:
    if not isinstance(gate, WaitsForChange):
        await anyio.sleep(WAIT_POLL_INTERVAL)
        return
    async with anyio.create_task_group() as tg:

        async def stop_early() -> None:
            # A parked worker may sleep up to WAIT_FALLBACK: shutdown must not wait that long.
            await stopping.wait()
            tg.cancel_scope.cancel()

        tg.start_soon(stop_early)
        with anyio.move_on_after(WAIT_FALLBACK):
            await gate.wait_changed(WAIT_FALLBACK)
        tg.cancel_scope.cancel()
