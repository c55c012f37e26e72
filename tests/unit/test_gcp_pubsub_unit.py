"""gcp-pubsub transport paths the emulator cannot produce (permission and ack errors)."""

from __future__ import annotations

import time
from typing import Any, cast

import pytest
from aiohttp import web
from google.api_core import exceptions as gexc
from google.pubsub_v1 import PublisherAsyncClient, SubscriberAsyncClient
from google.pubsub_v1.types import PullResponse

from async_processor import retry
from async_processor.config import GcpPubSubConfig
from async_processor.errors import TransportError
from async_processor.messages import Result
from async_processor.retry import LAST_BODY_LIMIT
from async_processor.transports.base import Completion, Deferral, Delivery, TransportContext
from async_processor.transports.gcp_pubsub.backlog import BacklogReader
from async_processor.transports.gcp_pubsub.leases import Receipt
from async_processor.transports.gcp_pubsub.publish import dead_letter_topic
from async_processor.transports.gcp_pubsub.pull import RATE_WINDOW, READ_AHEAD_MAX, ReadAhead
from async_processor.transports.gcp_pubsub.transport import (
    CARRIED_BODY_CHARS,
    GcpPubSubTransport,
    resource_path,
)
from tests.fixtures.monitoring import StaticToken, monitoring_api

pytestmark = [pytest.mark.anyio, pytest.mark.gcp]


def api_error(kind: type[gexc.GoogleAPICallError], message: str) -> gexc.GoogleAPICallError:
    return kind(message)


class Denied:
    """A client whose describe calls are denied (roles/pubsub.subscriber / publisher only)."""

    def __init__(self) -> None:
        self.pulls = 0

    async def get_subscription(self, **_: Any) -> Any:
        raise api_error(gexc.PermissionDenied, "pubsub.subscriptions.get denied")

    async def get_topic(self, **_: Any) -> Any:
        raise api_error(gexc.PermissionDenied, "pubsub.topics.get denied")

    async def pull(self, **_: Any) -> PullResponse:
        self.pulls += 1
        return PullResponse()


class Rejecting(Denied):
    """Publishes fine; every acknowledge fails with ``error``."""

    def __init__(self, error: Exception) -> None:
        super().__init__()
        self.error = error
        self.published = 0

    async def publish(self, **kwargs: Any) -> None:
        self.published += len(kwargs["request"].messages)

    async def acknowledge(self, **_: Any) -> None:
        raise self.error


def delivery_of(t: GcpPubSubTransport) -> Delivery:
    held = Receipt("ack-1", "projects/proj/subscriptions/sub", "m1", 0, time.time(), 0.0)
    return Delivery(queue=t.queues[0], raw=b"{}", handle=held)


async def test_expired_ack_ids_do_not_block_the_result_writer() -> None:
    client = Rejecting(api_error(gexc.FailedPrecondition, "ack id expired (exactly-once delivery)"))
    t = transport(client)
    await t.complete([Completion(delivery_of(t), Result.http("r", 200, b"{}"))])
    assert client.published == 1
    await t.health()  # about those ack ids only, not the subscription


async def test_deleted_subscription_on_ack_moves_on_but_is_unready() -> None:
    t = transport(Rejecting(api_error(gexc.NotFound, "subscription gone")))
    await t.complete([Completion(delivery_of(t), Result.http("r", 200, b"{}"))])
    with pytest.raises(TransportError, match="NotFound"):
        await t.health()


async def test_transient_ack_failure_is_retried_without_publishing_again() -> None:
    client = Rejecting(api_error(gexc.ServiceUnavailable, "try again"))
    t = transport(client)
    item = Completion(delivery_of(t), Result.http("r", 200, b"{}"))
    for _ in range(2):
        with pytest.raises(TransportError):
            await t.complete([item])
    assert client.published == 1


async def test_a_result_sized_by_the_worker_is_published_without_encoding_it_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    client = Rejecting(api_error(gexc.ServiceUnavailable, "ack later"))
    t = transport(client)
    result = Result.http("r", 200, b'{"text": "answer"}')
    encoded = result.encode()  # the worker's size check (worker.py ``_fitting``)

    def encode_again(self: Result) -> dict[str, Any]:
        raise AssertionError("the result was JSON-encoded a second time")

    monkeypatch.setattr(Result, "to_obj", encode_again)
    with pytest.raises(TransportError):
        await t.complete([Completion(delivery_of(t), result)])
    assert client.published == 1 and result.encode() is encoded


def transport(client: Denied) -> GcpPubSubTransport:
    config = GcpPubSubConfig.model_validate(
        {
            "project_id": "proj",
            "result_topic_id": "projects/other/topics/results",
            "topics": [{"subscriber_id": "sub", "igw_base_url": "http://127.0.0.1:1"}],
        }
    )
    return GcpPubSubTransport(
        config,
        TransportContext(),
        subscriber=cast(SubscriberAsyncClient, client),
        publisher=cast(PublisherAsyncClient, client),
    )


async def test_pull_works_without_permission_to_describe_the_subscription() -> None:
    client = Denied()
    t = transport(client)
    assert await t.fetch(t.queues[0], 10, 0.0) == []
    assert await t.fetch(t.queues[0], 10, 0.0) == []
    assert client.pulls == 2


async def test_health_counts_permission_denied_probes_as_healthy() -> None:
    t = transport(Denied())
    await t.health()


class Deferring(Denied):
    """Takes every ack deadline change."""

    async def modify_ack_deadline(self, **_: Any) -> None:
        return None


def deferred_delivery(t: GcpPubSubTransport, n: int) -> Delivery:
    """Message ``m<n>`` as pulled (a new receipt each call), decoded."""
    held = Receipt(f"ack-{n}", "projects/proj/subscriptions/sub", f"m{n}", 0, time.time(), 0)
    delivery = Delivery(queue=t.queues[0], raw=b'{"id": "r", "deadline": 1900000000}', handle=held)
    t.decode(delivery)
    return delivery


async def test_routing_remembered_for_deferred_messages_is_bounded_in_size() -> None:
    # Each deferred message's routing is kept until it comes back to this process, with
    # the gateway's last answer (up to 64 KiB): with replicas most come back elsewhere,
    # so 65,536 such entries (4 GiB of 503 pages) stayed until evicted by count.
    t = transport(Deferring())
    answer = retry.Attempt(503, b"x" * LAST_BODY_LIMIT)
    count = CARRIED_BODY_CHARS // LAST_BODY_LIMIT + 50
    for n in range(count):
        delivery = deferred_delivery(t, n)
        routing = delivery.envelope.routing  # type: ignore[union-attr]
        routing.retry_count = 1
        retry.remember_answer(routing, answer)
        await t.defer([Deferral(delivery, 600)])
    assert sum(len(routing.last_body) for routing in t._carried.values()) <= CARRIED_BODY_CHARS
    # The newest are kept: the oldest are the likeliest to have come back elsewhere.
    assert deferred_delivery(t, count - 1).envelope.routing.last_status == 503  # type: ignore[union-attr]


def test_full_paths_are_kept_and_short_ids_get_the_project() -> None:
    assert resource_path("proj", "subscriptions", "sub") == "projects/proj/subscriptions/sub"
    full = "projects/other/topics/results"
    assert resource_path("proj", "topics", full) == full
    dead = dead_letter_topic("projects/p1/subscriptions/orders")
    assert dead == "projects/p1/topics/orders-dead-letter"


async def test_backlog_reader_queries_cloud_monitoring() -> None:
    seen: list[web.Request] = []

    async def series(request: web.Request) -> web.Response:
        seen.append(request)
        point = {"interval": {"endTime": "2026-01-01T00:00:00Z"}, "value": {"int64Value": "42"}}
        return web.json_response({"timeSeries": [{"points": [point]}]})

    async with monitoring_api(series) as url:
        reader = BacklogReader("proj", base_url=url, credentials=StaticToken())
        try:
            assert await reader.undelivered("projects/p2/subscriptions/orders") == 42
        finally:
            await reader.aclose()
    [request] = seen
    assert request.match_info["project"] == "p2"
    assert request.headers["Authorization"] == "Bearer secret-token"
    assert 'resource.labels.subscription_id = "orders"' in request.query["filter"]
    assert "num_undelivered_messages" in request.query["filter"]


async def test_backlog_unknown_when_monitoring_fails() -> None:
    reader = BacklogReader("proj", base_url="http://127.0.0.1:1/v3", credentials=StaticToken())
    try:
        assert await reader.undelivered("projects/proj/subscriptions/orders") is None
    finally:
        await reader.aclose()


def test_read_ahead_is_the_fetch_rate_times_the_p95_pull_round_trip_and_bounded() -> None:
    ahead = ReadAhead()
    now = time.monotonic()
    assert ahead.target(now) == 0  # nothing measured yet: nothing held ahead
    for rtt in [0.04] * 60 + [0.6] * 4:  # 1 pull in 16 answered late
        ahead.measured(rtt)
    ahead.took(512 * int(RATE_WINDOW))  # 512 msg/s
    assert ahead.target(now) == int(512 * 0.6)  # covers a p95 answer, not the median
    assert ahead.short.is_set()  # the refill is woken, to pull up to twice the target
    assert ahead.wanted(now) == 2 * int(512 * 0.6)
    ahead.pending = int(512 * 0.6)  # at the target: no pull of the few taken since
    assert ahead.wanted(now) == 0
    ahead.took(4000)
    assert ahead.target(now) == READ_AHEAD_MAX  # bounded however fast it is taken
    assert ahead.target(time.monotonic() + RATE_WINDOW + 0.1) == 0  # no recent fetch
