"""In-process gates: local-max-concurrency, composite, wait-on-refuse, tier admission, AIMD."""

from __future__ import annotations

import time
from typing import Any

import anyio
import pytest
from prometheus_client import CollectorRegistry

from async_processor.errors import GateError
from async_processor.gates.adaptive import AdaptiveConcurrencyGate, AdaptiveParams
from async_processor.gates.base import (
    CONTINUE,
    DROP,
    OPEN_GATE,
    REFUSE,
    WAIT,
    Action,
    Gate,
    GateContext,
    GateOwner,
    Observes,
    Releases,
    Verdict,
    WaitsForChange,
    build_gate,
    waits_in_apply,
)
from async_processor.gates.basic import CompositeGate, LocalMaxConcurrencyGate, WaitOnRefuseGate
from async_processor.gates.tiers import TOO_MANY_REQUESTS, TierPriorityAdmissionGate
from async_processor.messages import Envelope, Request, Routing
from async_processor.metrics import Metrics


def msg(request_id: str = "r1", **labels: str) -> Envelope:
    return Envelope(Request(id=request_id, deadline=2_000_000_000), Routing(labels=dict(labels)))


class Scripted:
    """A gate answering a fixed verdict (or raising), recording its reservations."""

    def __init__(self, verdict: Verdict | Exception, budget: float = 1.0) -> None:
        self.verdict, self._budget = verdict, budget
        self.held = 0
        self.observed: list[int | None] = []

    async def budget(self) -> float:
        return self._budget

    async def apply(self, message: Envelope, releases: Releases) -> Verdict:
        if isinstance(self.verdict, Exception):
            raise self.verdict
        if self.verdict.action is Action.CONTINUE:
            self.held += 1

            async def give_back() -> None:
                self.held -= 1

            releases.add(give_back)
        return self.verdict

    def observe(self, message: Envelope, status: int | None, latency: float, reason: str) -> None:
        self.observed.append(status)


class Stamping(Scripted):
    async def apply(self, message: Envelope, releases: Releases) -> Verdict:
        message.routing.labels["classification"] = "overflow"
        return await super().apply(message, releases)


# ------------------------------------------------------------------ local-max-concurrency


@pytest.mark.anyio
async def test_local_max_refuses_when_full_and_frees_on_release() -> None:
    gate = LocalMaxConcurrencyGate(limit=2, blocking=False)
    first, second, third = Releases(), Releases(), Releases()
    assert await gate.apply(msg("a"), first) == CONTINUE
    assert await gate.budget() == 0.5
    assert await gate.apply(msg("b"), second) == CONTINUE
    assert await gate.budget() == 0.0
    assert await gate.apply(msg("c"), third) == REFUSE
    assert len(third) == 0
    await first.release_all()
    assert gate.in_flight == 1 and await gate.budget() == 0.5
    assert await gate.apply(msg("c"), third) == CONTINUE
    assert "classification" not in msg().routing.labels


@pytest.mark.anyio
async def test_local_max_wakes_a_waiter_when_a_slot_frees() -> None:
    gate = LocalMaxConcurrencyGate(limit=1, blocking=False)
    held = Releases()
    await gate.apply(msg("a"), held)
    woke_after: list[float] = []

    async def waiter() -> None:
        start = time.monotonic()
        await gate.wait_changed(5.0)
        woke_after.append(time.monotonic() - start)

    async with anyio.create_task_group() as tg:
        tg.start_soon(waiter)
        await anyio.sleep(0.05)
        await held.release_all()
    assert woke_after and woke_after[0] < 1.0
    assert await gate.apply(msg("b"), Releases()) == CONTINUE


@pytest.mark.anyio
async def test_local_max_blocking_parks_in_apply_until_a_release() -> None:
    gate = build_gate("local-max-concurrency", {"limit": 1, "gating_mode": "blocking"}, ctx())
    held = Releases()
    assert await gate.apply(msg("a"), held) == CONTINUE
    admitted: list[str] = []

    async def second() -> None:
        await gate.apply(msg("b"), Releases())
        admitted.append("b")

    async with anyio.create_task_group() as tg:
        tg.start_soon(second)
        await anyio.sleep(0.1)
        assert admitted == []
        await held.release_all()
    assert admitted == ["b"]
    with anyio.move_on_after(0.1) as scope:  # full again: the caller's scope ends the wait
        await gate.apply(msg("c"), Releases())
    assert scope.cancelled_caught


# ------------------------------------------------------------------------------ composite


@pytest.mark.anyio
async def test_composite_budget_is_the_minimum() -> None:
    gate = CompositeGate([Scripted(CONTINUE, 0.7), Scripted(CONTINUE, 0.3)])
    assert await gate.budget() == 0.3
    assert await CompositeGate([]).budget() == 1.0


@pytest.mark.anyio
@pytest.mark.parametrize("late", [REFUSE, WAIT, DROP, GateError("backend down")])
async def test_composite_rolls_back_earlier_reservations(late: Verdict | Exception) -> None:
    first, second = Scripted(CONTINUE), Stamping(CONTINUE)
    gate = CompositeGate([first, second, Scripted(late)])
    outer = Releases()

    async def before() -> None:
        pass

    outer.add(before)  # taken before the composite: must survive its rollback
    message = msg()
    if isinstance(late, Exception):
        with pytest.raises(GateError):
            await gate.apply(message, outer)
    else:
        assert await gate.apply(message, outer) == late
    assert (first.held, second.held, len(outer)) == (0, 0, 1)
    assert message.routing.labels["classification"] == "overflow"  # labels stay (reference)


@pytest.mark.anyio
async def test_composite_keeps_everything_on_continue_and_forwards_hooks() -> None:
    inner = [Scripted(CONTINUE), Scripted(CONTINUE)]
    gate = CompositeGate(inner)
    releases = Releases()
    assert await gate.apply(msg(), releases) == CONTINUE
    assert [g.held for g in inner] == [1, 1] and len(releases) == 2
    gate.observe(msg(), 429, 0.1, "")
    assert [g.observed for g in inner] == [[429], [429]]
    await releases.release_all()
    assert [g.held for g in inner] == [0, 0]


@pytest.mark.anyio
async def test_composite_rolls_back_when_cancelled_mid_chain() -> None:
    class Hanging(Scripted):
        async def apply(self, message: Envelope, releases: Releases) -> Verdict:
            await anyio.sleep_forever()
            raise AssertionError

    first = Scripted(CONTINUE)
    gate = CompositeGate([first, Hanging(CONTINUE)])
    with anyio.move_on_after(0.05):
        await gate.apply(msg(), Releases())
    assert first.held == 0


# ------------------------------------------------------------------------- wait-on-refuse


@pytest.mark.anyio
async def test_wait_on_refuse_turns_refuse_into_wait_only() -> None:
    assert await WaitOnRefuseGate(Scripted(REFUSE)).apply(msg(), Releases()) == WAIT
    assert await WaitOnRefuseGate(Scripted(CONTINUE)).apply(msg(), Releases()) == CONTINUE
    assert await WaitOnRefuseGate(Scripted(DROP)).apply(msg(), Releases()) == DROP
    assert await WaitOnRefuseGate(Scripted(CONTINUE, 0.4)).budget() == 0.4
    with pytest.raises(GateError, match="inner gate apply failed: boom"):
        await WaitOnRefuseGate(Scripted(GateError("boom"))).apply(msg(), Releases())


@pytest.mark.anyio
async def test_wrappers_expose_the_optional_hooks() -> None:
    local = LocalMaxConcurrencyGate(limit=1, blocking=False)
    wrapped = WaitOnRefuseGate(local)
    assert isinstance(wrapped, WaitsForChange) and isinstance(wrapped, Observes)
    assert isinstance(local, WaitsForChange) and not isinstance(local, Observes)
    held = Releases()
    await wrapped.apply(msg("a"), held)
    assert await wrapped.apply(msg("b"), Releases()) == WAIT
    start = time.monotonic()
    async with anyio.create_task_group() as tg:
        tg.start_soon(wrapped.wait_changed, 5.0)
        await anyio.sleep(0.02)
        await held.release_all()
    assert time.monotonic() - start < 1.0


@pytest.mark.anyio
async def test_waiting_on_a_closed_gate_does_not_spin() -> None:
    """64 parked workers re-asking a closed gate (no wake-ups) cost almost no CPU."""
    gate: Gate = WaitOnRefuseGate(Scripted(REFUSE, 0.0))
    asked = 0

    async def worker() -> None:
        nonlocal asked
        with anyio.move_on_after(1.0):
            while True:
                asked += 1
                assert await gate.apply(msg(), Releases()) == WAIT
                await gate.wait_changed(0.05)  # type: ignore[attr-defined]

    cpu = time.process_time()
    async with anyio.create_task_group() as tg:
        for _ in range(64):
            tg.start_soon(worker)
    used = time.process_time() - cpu
    assert 64 * 5 <= asked <= 64 * 25  # about one re-check per 50 ms each (never a spin)
    assert used < 0.5, used


# ------------------------------------------------------------------ tier-priority-admission


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("labels", "expected"),
    [
        ({"classification": "reserved", "tier": "batch"}, Action.WAIT),
        ({"classification": "overflow", "tier": "interactive"}, Action.DROP),
        ({"classification": "overflow", "tier": "async"}, Action.REFUSE),
        ({"classification": "overflow"}, Action.REFUSE),
        ({"tier": "interactive"}, Action.REFUSE),
        ({}, Action.REFUSE),
    ],
)
async def test_tiers_when_saturated(labels: dict[str, str], expected: Action) -> None:
    gate = TierPriorityAdmissionGate(Scripted(REFUSE), "tier")
    verdict = await gate.apply(msg("req-9", **labels), Releases())
    assert verdict.action is expected
    if expected is Action.DROP:
        assert verdict.result is not None
        assert verdict.result.id == "req-9"
        assert verdict.result.payload == TOO_MANY_REQUESTS
        assert TOO_MANY_REQUESTS == '{"error": "Too Many Requests", "code": 429}'
        assert (verdict.result.status_code, verdict.result.error_code) == (0, "")


@pytest.mark.anyio
@pytest.mark.parametrize("inner", [CONTINUE, WAIT, DROP])
async def test_tiers_admit_everything_when_not_saturated(inner: Verdict) -> None:
    gate = TierPriorityAdmissionGate(Scripted(inner), "tier")
    labels = {"classification": "overflow", "tier": "interactive"}
    assert await gate.apply(msg(**labels), Releases()) == CONTINUE


@pytest.mark.anyio
async def test_tiers_use_the_configured_label_and_wrap_errors() -> None:
    gate = TierPriorityAdmissionGate(Scripted(REFUSE), "lane")
    verdict = await gate.apply(msg(classification="overflow", lane="interactive"), Releases())
    assert verdict.action is Action.DROP
    with pytest.raises(GateError, match="saturation gate failed"):
        await TierPriorityAdmissionGate(Scripted(GateError("x")), "tier").apply(msg(), Releases())


# -------------------------------------------------------------------- adaptive-concurrency


def ctx(**kwargs: Any) -> GateContext:
    return GateContext(owner=GateOwner("", "", "pool-a"), **kwargs)


def adaptive(**params: Any) -> AdaptiveConcurrencyGate:
    gate = build_gate("adaptive-concurrency", params, ctx())
    assert isinstance(gate, AdaptiveConcurrencyGate)
    return gate


@pytest.mark.anyio
async def test_adaptive_waits_at_its_limit() -> None:
    gate = adaptive(initial_limit=2)
    held = [Releases() for _ in range(3)]
    assert await gate.apply(msg("a"), held[0]) == CONTINUE
    assert await gate.apply(msg("b"), held[1]) == CONTINUE
    assert await gate.apply(msg("c"), held[2]) == WAIT
    assert await gate.budget() == 0.0
    await held[0].release_all()
    assert gate.in_flight == 1 and await gate.budget() == 0.5
    assert await adaptive(initial_limit=1, when_full="refuse").apply(msg(), Releases()) == CONTINUE


@pytest.mark.anyio
async def test_adaptive_grows_additively_while_busy_and_fast() -> None:
    gate = adaptive(initial_limit=4, increase_step=1, max_limit=5)
    held = [Releases() for _ in range(4)]
    for i, r in enumerate(held):
        await gate.apply(msg(f"m{i}"), r)
    for i in range(4):  # one limit's worth of successes = one step
        gate.observe(msg(f"m{i}"), 200, 0.01, "")
    assert 4.9 < gate.limit < 5.0
    for i in range(40):
        gate.observe(msg(f"m{i % 4}"), 200, 0.01, "")
    assert gate.limit == 5.0  # capped at max_limit
    idle = adaptive(initial_limit=8)
    idle.observe(msg(), 200, 0.01, "")  # nothing in flight: no evidence the limit is too low
    assert idle.limit == 8.0


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("status", "reason", "latency"),
    [(429, "", 0.01), (503, "", 0.01), (200, "capacity", 0.01), (200, "", 3.0)],
)
async def test_adaptive_cuts_multiplicatively_once_per_window(
    status: int, reason: str, latency: float
) -> None:
    gate = adaptive(initial_limit=20, decrease_factor=0.5, latency_target="1s")
    held = [Releases() for _ in range(10)]
    for i, r in enumerate(held):
        await gate.apply(msg(f"m{i}"), r)
    for i in range(10):  # a burst sent before the first cut counts once
        gate.observe(msg(f"m{i}"), status, latency, reason)
    assert gate.limit == 10.0
    await gate.apply(msg("late"), Releases())  # admitted after the cut: may cut again
    gate.observe(msg("late"), status, latency, reason)
    assert gate.limit == 5.0


@pytest.mark.anyio
async def test_adaptive_ignores_neutral_outcomes_and_respects_min_limit() -> None:
    gate = adaptive(initial_limit=4, min_limit=3, decrease_factor=0.1)
    await gate.apply(msg("a"), Releases())
    for status in (None, 400, 404, 500):
        gate.observe(msg("a"), status, 0.01, "")
    assert gate.limit == 4.0
    gate.observe(msg("a"), 429, 0.01, "")
    assert gate.limit == 3.0


@pytest.mark.anyio
async def test_adaptive_limit_is_a_gauge() -> None:
    metrics = Metrics(CollectorRegistry())
    context = ctx(metrics=metrics)
    gate = build_gate("adaptive-concurrency", {"initial_limit": 12}, context)
    assert isinstance(gate, AdaptiveConcurrencyGate)
    labels = {"queue_id": "", "queue_name": "", "pool_name": "pool-a"}
    name = "llm_d_async_async_adaptive_concurrency_limit"
    assert metrics.registry.get_sample_value(name, labels) == 12.0
    await gate.apply(msg(), Releases())
    gate.observe(msg(), 429, 0.01, "")
    assert metrics.registry.get_sample_value(name, labels) == pytest.approx(12 * 0.9)
    # A second gate on the same registry reuses the family instead of re-registering it.
    other = build_gate("adaptive-concurrency", {}, context.for_owner(GateOwner("q", "q", "b")))
    assert isinstance(other, AdaptiveConcurrencyGate)
    labels_b = {"queue_id": "q", "queue_name": "q", "pool_name": "b"}
    assert metrics.registry.get_sample_value(name, labels_b) == 16.0


def test_adaptive_params_defaults() -> None:
    p = AdaptiveParams()
    assert (p.min_limit, p.initial_limit, p.increase_step, p.decrease_factor) == (1, 16, 1.0, 0.9)
    assert p.latency_target == 0.0 and p.when_full == "wait"


def test_only_a_gate_that_can_wait_in_apply_says_so_through_its_wrappers() -> None:
    """The poller bounds a queue gate's check by the deadlines only where it can wait
    (``waits_in_apply``): a blocking ``local-max-concurrency``, alone, in a composite or
    wrapped; the rest end by themselves and pay no cancel scope."""
    limit: dict[str, Any] = {"limit": 1}
    blocking = {
        "gate_type": "local-max-concurrency",
        "gate_params": {**limit, "gating_mode": "blocking"},
    }
    refusing = {"gate_type": "local-max-concurrency", "gate_params": limit}
    cases = {
        ("local-max-concurrency", "blocking"): True,
        ("composite", "blocking"): True,
        ("wait-on-refuse", "blocking"): True,
        ("local-max-concurrency", "refusing"): False,
        ("composite", "refusing"): False,
    }
    specs = {"blocking": blocking, "refusing": refusing}
    for (kind, inner), expected in cases.items():
        spec = specs[inner]
        if kind == "composite":
            params: dict[str, Any] = {"gates": [spec]}
        elif kind == "wait-on-refuse":
            params = {"gate": spec}
        else:
            params = dict(spec["gate_params"])
        assert waits_in_apply(build_gate(kind, params, ctx())) is expected, (kind, inner)
    assert not waits_in_apply(OPEN_GATE)
