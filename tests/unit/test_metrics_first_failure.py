"""Alerts see the first failure: every label set the daemon knows exists at 0 from startup.

``increase(x[10m]) > 0`` cannot see a series whose first sample is already 1, so a
counter created by its first event hides that event from every alert. The
``dead_letter_total`` reasons, the error codes, the abandon reason ``lease_entry_missing``
and the new ``broker_errors_total`` operations were created only by their first event.
"""

from __future__ import annotations

import re
from pathlib import Path

import anyio
import pytest
from google.api_core import exceptions as gexc
from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from async_processor.broker_errors import broker_error, counting_broker_errors
from async_processor.config import GcpPubSubConfig, SortedSetConfig
from async_processor.errors import TransportError
from async_processor.messages import ErrorCode
from async_processor.metrics import BROKER_OPERATIONS, DEAD_LETTER_REASONS, Metrics
from async_processor.redis.conn import redis_errors
from async_processor.transports.base import TransportContext
from async_processor.transports.gcp_pubsub.health import Readiness
from async_processor.transports.gcp_pubsub.transport import GcpPubSubTransport
from async_processor.transports.redis_sortedset.transport import SortedSetTransport

pytestmark = pytest.mark.anyio
PACKAGE = Path(__file__).resolve().parents[2] / "async_processor"
P = "llm_d_async_async_"
Q = {"queue_id": "q", "queue_name": "q", "pool_name": "default"}


def value(m: Metrics, name: str, **labels: str) -> float | None:
    return m.registry.get_sample_value(P + name, labels)


def test_a_bound_queue_has_every_dead_letter_reason_and_error_code_at_0() -> None:
    m = Metrics()
    m.queue("q", "q", "default")
    for reason in DEAD_LETTER_REASONS:
        assert value(m, "dead_letter_total", **Q, reason=reason) == 0, reason
    for code in ErrorCode:
        assert value(m, "error_results_total", **Q, error_code=code.value) == 0, code
    m.pool("gpu")  # a pool's own series: no queue, so no per-queue counters
    assert value(m, "dead_letter_total", queue_id="", queue_name="", pool_name="gpu",
                 reason="malformed") is None  # fmt: skip


def test_dead_letter_reasons_cover_every_reason_decoding_gives() -> None:
    source = (PACKAGE / "messages.py").read_text()
    reasons = set(re.findall(r'reason="([a-z_]+)"', source))
    assert reasons and reasons <= set(DEAD_LETTER_REASONS), reasons - set(DEAD_LETTER_REASONS)


def test_broker_errors_start_at_0_for_every_operation() -> None:
    m = Metrics()
    for operation in BROKER_OPERATIONS:
        assert value(m, "broker_errors_total", operation=operation) == 0, operation


def _daemon_sources() -> list[Path]:
    """Modules the daemon runs (operator tools and the client have their own actions)."""
    skip = ("ops", "client", "sim", "demo", "cli")
    return [p for p in PACKAGE.rglob("*.py") if p.relative_to(PACKAGE).parts[0] not in skip]


def test_every_broker_operation_the_daemon_names_is_pre_initialised() -> None:
    pattern = re.compile(
        r'(?:redis_errors|transport_error)\(\s*"([^"]+)"|rpc\([^,()]+, "([^"]+)"\)'
        r'|_modify\(.*"([a-z_]+)"\)'
    )
    found = {
        next(g for g in match.groups() if g).replace(" ", "_").replace("-", "_")
        for path in _daemon_sources()
        for match in pattern.finditer(path.read_text())
    }
    assert {"claim", "defer", "pull", "extend"} <= found  # the scan finds them
    assert found <= set(BROKER_OPERATIONS), found - set(BROKER_OPERATIONS)


async def test_a_refused_redis_call_counts_under_its_operation() -> None:
    m = Metrics()
    client = Redis(host="127.0.0.1", port=1, retry=Retry(NoBackoff(), 0))
    try:
        with (
            counting_broker_errors(m.broker_errors_total),
            pytest.raises(TransportError),
            redis_errors("retry move"),
        ):
            await client.ping()
        with pytest.raises(TransportError), redis_errors("retry move"):
            await client.ping()  # outside a daemon (operator tools): not counted
    finally:
        await client.aclose()
    assert value(m, "broker_errors_total", operation="retry_move") == 1


def test_a_failed_pubsub_rpc_counts_under_its_operation() -> None:
    m = Metrics()
    pull = Readiness().rpc("projects/p/subscriptions/s", "pull")
    with counting_broker_errors(m.broker_errors_total), pytest.raises(TransportError), pull:
        raise gexc.ServiceUnavailable("down")
    assert value(m, "broker_errors_total", operation="pull") == 1


async def test_counting_follows_the_daemons_tasks_only() -> None:
    async def fail() -> None:
        broker_error("claim")

    m = Metrics()
    with counting_broker_errors(m.broker_errors_total):
        async with anyio.create_task_group() as tg:
            tg.start_soon(fail)  # a task the daemon starts inherits the counting
    broker_error("claim")
    assert value(m, "broker_errors_total", operation="claim") == 1


def test_sorted_set_transport_starts_every_abandon_reason_at_0() -> None:
    config = SortedSetConfig(url="redis://127.0.0.1:1/0",
                             queues=[{"queue_name": "q", "igw_base_url": "http://gw"}])  # fmt: skip
    m = Metrics()
    SortedSetTransport(config, TransportContext(metrics=m))
    reason = "lease_entry_missing"
    assert value(m, "abandoned_claims_total", queue_name="q", reason=reason) == 0


def test_pubsub_transport_starts_its_abandon_reasons_at_0() -> None:
    topics = [{"subscriber_id": "s", "igw_base_url": "http://gw"}]
    config = GcpPubSubConfig(project_id="p", result_topic_id="r", topics=topics)
    m = Metrics()
    GcpPubSubTransport(config, TransportContext(metrics=m))
    for reason in ("write_failed", "settle_timeout", "dead_letter_failed"):
        assert value(m, "abandoned_claims_total", queue_name="s", reason=reason) == 0
