"""Pool admission inside the daemon, over the in-memory transport: each verdict of a pool
gate ends where admission.py says (Drop and errors final, Refuse and a timed-out Wait
handed back without counting a retry, Continue sent) - docs/architecture.md G5, G6."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import anyio
import pytest

from async_processor.gates.base import CONTINUE, DROP, REFUSE, WAIT, Releases, Verdict
from async_processor.gates.shared import ChangeSignal
from async_processor.messages import Envelope, ErrorCode
from async_processor.pipeline import admission
from async_processor.pipeline.admission import PoolGate
from async_processor.pipeline.processor import Processor
from async_processor.retry import REFUSE_DELAY
from async_processor.sim.app import Simulator
from tests.doubles.daemon import QUEUE, daemon, message
from tests.doubles.memory_transport import MemoryTransport

pytestmark = pytest.mark.anyio


class ScriptedGate:
    """A pool gate answering from ``verdicts`` in turn (the last one repeats)."""

    def __init__(self, *verdicts: Verdict | Exception) -> None:
        self._verdicts = list(verdicts)
        self.asked = 0

    async def budget(self) -> float:
        return 1.0

    async def apply(self, message: Envelope, releases: Releases) -> Verdict:
        self.asked += 1
        verdict = self._verdicts.pop(0) if len(self._verdicts) > 1 else self._verdicts[0]
        if isinstance(verdict, Exception):
            raise verdict
        return verdict


@asynccontextmanager
async def gated(
    gate: ScriptedGate, wait_timeout: float = 5.0
) -> AsyncIterator[tuple[MemoryTransport, Simulator]]:
    def install(processor: Processor) -> None:
        # Before the workers start: the same as configuring a gate type that behaves like
        # the script.
        pool = processor.pools[0]
        pool.gate = PoolGate(gate, processor.metrics.pool(pool.config.id), wait_timeout)

    async with daemon(before_run=install) as (_, transport, simulator):
        yield transport, simulator


async def until(condition: Callable[[], bool]) -> None:
    with anyio.fail_after(5):
        while not condition():
            await anyio.sleep(0.01)


async def test_drop_is_a_final_gate_dropped_result_and_no_request() -> None:
    async with gated(ScriptedGate(DROP)) as (transport, simulator):
        transport.put(QUEUE, message("d", time.time() + 60))
        results = await transport.wait_results(1)
        assert simulator.stats["total"] == 0
    assert results["d"].error_code == ErrorCode.GATE_DROPPED.value


async def test_a_failing_gate_fails_closed_with_gate_error() -> None:
    async with gated(ScriptedGate(RuntimeError("backend down"))) as (transport, simulator):
        transport.put(QUEUE, message("e", time.time() + 60))
        results = await transport.wait_results(1)
        assert simulator.stats["total"] == 0
    assert results["e"].error_code == ErrorCode.GATE_ERROR.value


async def test_refuse_hands_back_after_the_refuse_delay_without_a_retry() -> None:
    gate = ScriptedGate(REFUSE, CONTINUE)
    async with gated(gate) as (transport, simulator):
        transport.put(QUEUE, message("r", time.time() + 60))
        results = await transport.wait_results(1, timeout=REFUSE_DELAY + 5)
        assert simulator.stats["total"] == 1
    [deferral] = transport.deferred
    assert deferral.delay == REFUSE_DELAY
    assert deferral.delivery.envelope is not None
    assert deferral.delivery.envelope.routing.retry_count == 0  # a refusal is not a retry
    assert results["r"].status_code == 200 and gate.asked == 2


async def test_wait_parks_the_message_until_the_gate_opens() -> None:
    gate = ScriptedGate(WAIT, WAIT, WAIT, CONTINUE)
    async with gated(gate) as (transport, _sim):
        transport.put(QUEUE, message("w", time.time() + 60))
        results = await transport.wait_results(1)
    assert results["w"].status_code == 200
    assert transport.deferred == [] and gate.asked == 4


async def test_a_wait_past_the_gate_wait_timeout_goes_back_to_the_broker() -> None:
    async with gated(ScriptedGate(WAIT), wait_timeout=0.2) as (transport, simulator):
        transport.put(QUEUE, message("t", time.time() + 60))
        await until(lambda: bool(transport.deferred))
        assert simulator.stats["total"] == 0
    assert transport.deferred[0].delay == 0.0
    assert "t" not in transport.results


async def test_a_wait_that_reaches_the_deadline_is_answered_deadline_exceeded() -> None:
    async with gated(ScriptedGate(WAIT), wait_timeout=60) as (transport, _sim):
        transport.put(QUEUE, message("x", time.time() + 1))
        results = await transport.wait_results(1, timeout=5)
    assert results["x"].error_code == ErrorCode.DEADLINE_EXCEEDED.value


class SignallingGate(ScriptedGate):
    """A scripted gate that wakes its parked workers itself (``WaitsForChange``)."""

    def __init__(self, *verdicts: Verdict | Exception) -> None:
        super().__init__(*verdicts)
        self.changed = ChangeSignal()

    async def wait_changed(self, timeout: float) -> None:
        await self.changed.wait(timeout)


async def test_a_worker_parked_on_a_signalling_gate_sleeps_until_signalled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(admission, "WAIT_FALLBACK", 60.0)  # only the signal can wake it
    gate = SignallingGate(WAIT, CONTINUE)
    async with gated(gate) as (transport, _sim):
        transport.put(QUEUE, message("s", time.time() + 60))
        await until(lambda: gate.asked == 1)
        await anyio.sleep(0.3)  # six of the WAIT_POLL_INTERVAL re-asks a polling gate gets
        assert gate.asked == 1
        gate.changed.notify(1)
        results = await transport.wait_results(1)
    assert results["s"].status_code == 200 and gate.asked == 2


async def test_a_missed_signal_is_made_up_by_the_fallback_re_ask(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(admission, "WAIT_FALLBACK", 0.05)
    gate = SignallingGate(WAIT, WAIT, CONTINUE)  # opens, but never says so
    async with gated(gate) as (transport, _sim):
        transport.put(QUEUE, message("f", time.time() + 60))
        results = await transport.wait_results(1)
    assert results["f"].status_code == 200 and gate.asked == 3


async def test_stopping_wakes_a_parked_worker_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(admission, "WAIT_FALLBACK", 60.0)
    gate = SignallingGate(WAIT)
    with anyio.fail_after(10):  # not the 60 s fallback
        async with gated(gate, wait_timeout=600) as (transport, _sim):
            transport.put(QUEUE, message("p", time.time() + 600))
            await until(lambda: gate.asked == 1)
    assert [d.delay for d in transport.deferred] == [0.0]  # handed back, not lost
