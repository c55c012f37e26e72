"""Idle gates (issue 30, item 3): the gates of waiting queues are read every round, a
shared gate once however many queues wait behind it, and a queue that stops waiting is
left to its poller."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import structlog
from prometheus_client import CollectorRegistry, Gauge
from structlog.testing import capture_logs

from async_processor.gates.base import CONTINUE, Releases, Verdict
from async_processor.messages import Envelope
from async_processor.pipeline.idle_gates import IdleGates

pytestmark = pytest.mark.anyio
LOG = structlog.get_logger("test")


@dataclass
class CountingGate:
    value: float = 1.0
    reads: int = 0
    fails: bool = False

    async def budget(self) -> float:
        self.reads += 1
        if self.fails:
            raise RuntimeError("source away")
        return self.value

    async def apply(self, message: Envelope, releases: Releases) -> Verdict:
        return CONTINUE


def _gauges(n: int) -> list[Gauge]:
    family = Gauge("budget", "b", ["queue"], registry=CollectorRegistry())
    return [family.labels(str(i)) for i in range(n)]


async def test_a_shared_gate_is_read_once_a_round_for_all_its_waiting_queues() -> None:
    shared, own = CountingGate(0.25), CountingGate(2.0)
    a, b, c = _gauges(3)
    idle = IdleGates(interval=1.0)
    with idle.waiting(shared, a, LOG), idle.waiting(shared, b, LOG), idle.waiting(own, c, LOG):
        await idle.read_round()
        await idle.read_round()
        assert (shared.reads, own.reads) == (2, 2)
        assert (a._value.get(), b._value.get(), c._value.get()) == (0.25, 0.25, 1.0)  # clamped
        with idle.waiting(shared, a, LOG):  # the same queue twice is still one read
            await idle.read_round()
        assert shared.reads == 3


async def test_a_queue_that_stops_waiting_is_no_longer_read_here() -> None:
    gate = CountingGate(0.5)
    (gauge,) = _gauges(1)
    idle = IdleGates(interval=1.0)
    with idle.waiting(gate, gauge, LOG):
        await idle.read_round()
    gate.value = 0.0
    await idle.read_round()
    assert gate.reads == 1 and gauge._value.get() == 0.5


async def test_a_failing_gate_reads_as_closed_and_says_why() -> None:
    gate = CountingGate(fails=True)
    (gauge,) = _gauges(1)
    gauge.set(1.0)
    idle = IdleGates(interval=1.0)
    with capture_logs() as logs, idle.waiting(gate, gauge, LOG.bind(queue="q")):
        await idle.read_round()
    assert gauge._value.get() == 0.0
    assert [(e["event"], e["queue"]) for e in logs] == [("queue_gate_budget_failed", "q")]
