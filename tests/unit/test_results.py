"""Result writer: batching, retries through an outage, and isolating one bad item."""

from __future__ import annotations

import time
from collections.abc import Sequence

import anyio
import pytest

from async_processor.config.queues import QueueSpec
from async_processor.errors import PartialWrite, TransportError
from async_processor.messages import Result, decode_envelope
from async_processor.pipeline import results as results_mod
from async_processor.pipeline.results import ResultWriter
from async_processor.transports.base import Completion, Deferral, Delivery

pytestmark = pytest.mark.anyio


@pytest.fixture(autouse=True)
def fast_sleep(monkeypatch: pytest.MonkeyPatch) -> None:
    real_sleep = anyio.sleep
    monkeypatch.setattr(results_mod.anyio, "sleep", lambda s: real_sleep(0))


def _delivery(request_id: str) -> Delivery:
    raw = f'{{"id":"{request_id}","deadline":1900000000,"payload":{{}}}}'.encode()
    return Delivery(queue=QueueSpec(id="q", name="q"), raw=raw, envelope=decode_envelope(raw))


class FlakyTransport:
    """Fails every write containing ``poison``; fails everything while ``down``."""

    def __init__(self, poison: str = "", down_for: int = 0) -> None:
        self.poison = poison
        self.down_for = down_for
        self.written: list[str] = []
        self.calls = 0

    async def complete(self, items: Sequence[Completion]) -> None:
        self.calls += 1
        if self.down_for > 0:
            self.down_for -= 1
            raise TransportError("connection refused")
        if any(r.id == self.poison for _, r in items):
            raise TransportError("ERR wrong kind of value")
        self.written += [r.id for _, r in items]

    async def defer(self, items: Sequence[Deferral]) -> None:
        self.written += [f"defer:{d.delivery.envelope.id}" for d in items]  # type: ignore[union-attr]

    async def health(self) -> None:
        if self.down_for > 0:
            raise TransportError("down")


async def _run(transport: FlakyTransport, ids: list[str]) -> None:
    writer = ResultWriter(transport)  # type: ignore[arg-type]
    sender = writer.sender()
    writer.close()
    async with sender:
        for request_id in ids:  # all queued before the writer runs: one batch
            await sender.send(Completion(_delivery(request_id), Result.http(request_id, 200, b"")))
        await sender.send(Deferral(_delivery("later"), 1.0))
    with anyio.fail_after(10):
        await writer.run()


async def test_one_batch_per_ready_group() -> None:
    transport = FlakyTransport()
    await _run(transport, [f"r{i}" for i in range(10)])
    assert transport.written == [*(f"r{i}" for i in range(10)), "defer:later"]
    assert transport.calls == 1


async def test_an_outage_is_waited_out_not_abandoned() -> None:
    transport = FlakyTransport(down_for=30)  # far more failures than ABANDON_AFTER
    await _run(transport, ["a", "b"])
    assert transport.written == ["a", "b", "defer:later"]


async def test_one_bad_item_is_left_to_its_lease_and_the_rest_land() -> None:
    transport = FlakyTransport(poison="bad")
    await _run(transport, ["a", "bad", "c"])
    assert transport.written == ["a", "c", "defer:later"]


async def test_landed_results_are_measured_abandoned_ones_are_not() -> None:
    """Error code, time since creation and deadline slack, once per result written."""
    from prometheus_client import CollectorRegistry

    from async_processor.messages import ErrorCode
    from async_processor.metrics import Metrics

    metrics = Metrics(CollectorRegistry())
    writer = ResultWriter(FlakyTransport(poison="bad"), metrics=metrics)  # type: ignore[arg-type]
    sender = writer.sender()
    writer.close()
    now = time.time()
    created = _delivery("ok")
    created.envelope.request.created = int(now - 30)  # type: ignore[union-attr]
    created.envelope.request.deadline = int(now + 90)  # type: ignore[union-attr]
    async with sender:
        await sender.send(Completion(created, Result.http("ok", 200, b"")))
        late = Result.failure("late", ErrorCode.DEADLINE_EXCEEDED, "too late")
        await sender.send(Completion(_delivery("late"), late))
        await sender.send(
            Completion(_delivery("bad"), Result.failure("bad", ErrorCode.GATE_DROPPED, ""))
        )
    with anyio.fail_after(10):
        await writer.run()
    labels = {"queue_id": "q", "queue_name": "q", "pool_name": "default"}
    sample = metrics.registry.get_sample_value
    codes = {c: sample("llm_d_async_async_error_results_total", {**labels, "error_code": c})
             for c in ("DEADLINE_EXCEEDED", "GATE_DROPPED")}  # fmt: skip
    assert codes == {"DEADLINE_EXCEEDED": 1.0, "GATE_DROPPED": 0.0}  # "bad" never landed
    slack = "llm_d_async_async_deadline_slack_time_millis"
    assert sample(f"{slack}_count", labels) == 2.0
    assert sample(f"{slack}_bucket", {**labels, "le": "60000.0"}) == 0.0  # ok: 90 s left
    assert sample(f"{slack}_bucket", {**labels, "le": "300000.0"}) == 1.0
    latency = "llm_d_async_async_submit_to_result_time_millis"
    assert sample(f"{latency}_count", labels) == 1.0  # only "ok" said when it was created
    assert 29_000 <= sample(f"{latency}_sum", labels) <= 35_000


class PartialTransport(FlakyTransport):
    """Writes every item but ``poison`` and says which failed (``PartialWrite``), as
    redis-sortedset's batched complete does for an item whose keys have the wrong type."""

    async def complete(self, items: Sequence[Completion]) -> None:
        self.calls += 1
        failed = [i for i, (_, r) in enumerate(items) if r.id == self.poison]
        self.written += [r.id for _, r in items if r.id != self.poison]
        if failed:
            raise PartialWrite("WRONGTYPE", failed)

    async def health(self) -> None:
        return None

    def abandon(self, delivery: Delivery, reason: str) -> None:
        self.written.append(f"abandoned:{delivery.envelope.id}")  # type: ignore[union-attr]


async def test_a_partial_write_retries_only_the_items_that_failed() -> None:
    # Written again, the landed items would each be taken for a duplicate submission.
    transport = PartialTransport(poison="bad")
    await _run(transport, ["a", "bad", "c"])
    assert transport.written == ["a", "c", "abandoned:bad", "defer:later"]


class RefusingWrites(FlakyTransport):
    """Refuses the first ``refusals`` writes while PING answers (NOREPLICAS, READONLY...);
    holds no leases (as redis-pubsub)."""

    def __init__(self, refusals: int) -> None:
        super().__init__()
        self.refusals = refusals

    async def complete(self, items: Sequence[Completion]) -> None:
        if self.refusals > 0:
            self.refusals -= 1
            raise TransportError("NOREPLICAS Not enough good replicas to write.")
        await super().complete(items)

    async def health(self) -> None:
        return None


class RefusingTransport(RefusingWrites):
    """``RefusingWrites`` with leases that an abandon lets lapse."""

    def __init__(self, refusals: int) -> None:
        super().__init__(refusals)
        self.abandoned: list[tuple[str, str]] = []

    def abandon(self, delivery: Delivery, reason: str) -> None:
        self.abandoned.append((delivery.envelope.id, reason))  # type: ignore[union-attr]


async def _written_while_open(transport: RefusingWrites, ids: list[str]) -> None:
    """Send results for ``ids`` and wait until all are written, the writer still open (so
    only the held retries can have written them)."""
    writer = ResultWriter(transport)  # type: ignore[arg-type]
    sender = writer.sender()
    writer.close()
    async with anyio.create_task_group() as tg:
        tg.start_soon(writer.run)
        async with sender:
            for request_id in ids:
                await sender.send(
                    Completion(_delivery(request_id), Result.http(request_id, 200, b""))
                )
            with anyio.fail_after(10):
                while len(transport.written) < len(ids):
                    await anyio.sleep(0.01)


async def test_an_abandoned_result_stops_its_lease_and_is_written_later() -> None:
    # Used to be logged and thrown away, while the claim stayed leased until the deadline.
    transport = RefusingTransport(refusals=3 + 5 + 1 + 4)  # batch, item a, item b, held tries
    await _written_while_open(transport, ["a", "b"])
    assert transport.abandoned == [("a", "write_failed"), ("b", "write_failed")]
    assert sorted(transport.written) == ["a", "b"]
    assert transport.refusals == 0


async def test_held_results_are_bounded_oldest_dropped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(results_mod, "HELD_MAX", 2)
    monkeypatch.setattr(results_mod, "HELD_ATTEMPTS", 1)  # held results fail once: dropped
    transport = RefusingTransport(refusals=10_000)
    await _run(transport, ["a", "b", "c"])
    assert [request_id for request_id, _ in transport.abandoned] == ["a", "b", "c"]
    assert transport.written == ["defer:later"]


async def test_without_leases_a_held_result_is_kept_until_it_lands() -> None:
    # redis-pubsub holds no lease: nothing brings a message back, its held result is its
    # only copy. It was dropped after HELD_ATTEMPTS writes (a refusal of some 5 minutes).
    transport = RefusingWrites(refusals=5 + results_mod.HELD_ATTEMPTS + 5)
    await _written_while_open(transport, ["a"])
    assert transport.written == ["a"]


class SlowRoundTripTransport(FlakyTransport):
    """Asks for larger batches, as gcp-pubsub does (a publish + ack is tens of ms)."""

    write_batch = 1000


@pytest.mark.parametrize(("kind", "calls"), [(FlakyTransport, 5), (SlowRoundTripTransport, 1)])
async def test_a_transport_may_take_larger_batches(kind: type[FlakyTransport], calls: int) -> None:
    transport = kind()
    await _run(transport, [f"r{i}" for i in range(300)])
    assert transport.calls == calls  # 300 ready results: 5 batches of up to 64, or one
    assert len(transport.written) == 301


async def test_a_hand_back_past_its_deadline_is_written_as_its_result() -> None:
    """A deferral that waited in the writer's queue past its deadline is answered, not
    handed back to come round again; one still in time is handed back."""
    transport = FlakyTransport()
    writer = ResultWriter(transport)  # type: ignore[arg-type]
    sender = writer.sender()
    writer.close()
    raw = f'{{"id":"late","deadline":{int(time.time()) - 1},"payload":{{}}}}'.encode()
    late = Delivery(queue=QueueSpec(id="q", name="q"), raw=raw, envelope=decode_envelope(raw))
    async with sender:
        await sender.send(Deferral(late, 0.0))
        await sender.send(Deferral(_delivery("later"), 1.0))
    seen: list[Completion] = []
    complete = transport.complete

    async def keep(items: Sequence[Completion]) -> None:
        seen.extend(items)
        await complete(items)

    transport.complete = keep  # type: ignore[method-assign]
    with anyio.fail_after(10):
        await writer.run()
    assert transport.written == ["late", "defer:later"]
    assert [x.result.error_code for x in seen] == ["DEADLINE_EXCEEDED"]
