"""A worker whose outcome the result writer cannot take in time gives its claim up
(docs/architecture.md G11).

The 10 s settle timeout used to drop the outcome silently while the transport kept
renewing the lease until the deadline; now the claim is abandoned (logged and counted by
the transport) so the broker hands the message out again.
"""

from __future__ import annotations

import dataclasses

import anyio
import pytest
from structlog.testing import capture_logs

from async_processor.pipeline import settle as settle_module
from async_processor.pipeline.results import Op
from async_processor.transports.base import Delivery
from tests.fixtures.inprocess import http_client
from tests.fixtures.simulator import LocalSimulator
from tests.unit.test_tracing import _work, _worker

pytestmark = pytest.mark.anyio


class Abandoning:
    kind = "redis-sortedset"

    def __init__(self) -> None:
        self.abandoned: list[tuple[str, str]] = []

    async def is_cancelled(self, delivery: Delivery) -> bool:
        return False

    def abandon(self, delivery: Delivery, reason: str) -> None:
        self.abandoned.append((delivery.queue.name, reason))


async def test_a_settle_timeout_abandons_the_claim(
    local_simulator: LocalSimulator, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(settle_module, "SETTLE_TIMEOUT", 0.2)
    transport = Abandoning()
    send, receive = anyio.create_memory_object_stream[Op](0)  # a writer that never reads
    async with http_client() as http, send, receive:
        worker = _worker(http, send)
        worker.settler.transport = transport  # type: ignore[assignment]
        worker = dataclasses.replace(worker, transport=transport)  # type: ignore[arg-type]
        with capture_logs() as logs, anyio.fail_after(5):
            await worker.handle(_work(local_simulator.url))
    assert transport.abandoned == [("qname", "settle_timeout")]
    # The slot comes back even though the write was cut short (one free + the one released).
    assert worker.settler.capacity.free == 2
    assert [x["log_level"] for x in logs if x["event"] == "settle_timed_out"] == ["error"]
