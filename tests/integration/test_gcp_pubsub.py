"""gcp-pubsub transport against the real Pub/Sub emulator (fetch, results, leases, errors)."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest
from google.pubsub_v1 import PublisherAsyncClient

from async_processor.config import GcpPubSubConfig
from async_processor.errors import InvalidMessage, TransportError
from async_processor.messages import Result
from async_processor.metrics import Metrics
from async_processor.transports.base import Completion, Deferral, Delivery, TransportContext
from async_processor.transports.gcp_pubsub import pull as gcp_pull
from async_processor.transports.gcp_pubsub.backlog import newest_point
from async_processor.transports.gcp_pubsub.leases import Receipt
from async_processor.transports.gcp_pubsub.transport import DEAD_LETTER_RETRY, GcpPubSubTransport
from tests.fixtures.pubsub import PubSubAdmin, PubSubEmulator, pubsub_admin
from tests.fixtures.servers import free_port

pytestmark = [pytest.mark.anyio, pytest.mark.xdist_group("pubsub")]


def request(request_id: str, ttl: int = 300, **extra: Any) -> bytes:
    body = {"id": request_id, "deadline": int(time.time()) + ttl, "payload": {"prompt": "hi"}}
    return json.dumps({**body, **extra}).encode()


def transport_for(
    names: dict[str, str],
    *,
    batch_size: int = 10,
    metrics: Metrics | None = None,
    publisher: PublisherAsyncClient | None = None,
) -> GcpPubSubTransport:
    config = GcpPubSubConfig.model_validate(
        {
            "project_id": "test-project",
            "result_topic_id": names["results"],
            "batch_size": batch_size,
            "topics": [
                {
                    "subscriber_id": names["sub"],
                    "igw_base_url": "http://127.0.0.1:1",
                    "labels": {"team": "a"},
                }
            ],
        }
    )
    return GcpPubSubTransport(config, TransportContext(metrics=metrics), publisher=publisher)


@pytest.fixture
async def admin(pubsub_env: PubSubEmulator) -> AsyncIterator[PubSubAdmin]:
    async with pubsub_admin(pubsub_env.project) as a:
        yield a


@pytest.fixture
async def names(admin: PubSubAdmin, unique: str) -> dict[str, str]:
    """A request topic + subscription and a result topic + subscription, all fresh."""
    names = {
        "requests": f"{unique}-req",
        "sub": f"{unique}-sub",
        "results": f"{unique}-res",
        "results_sub": f"{unique}-res-sub",
    }
    await admin.create_subscription(names["sub"], names["requests"])
    await admin.create_subscription(names["results_sub"], names["results"])
    return names


async def fetch_n(t: GcpPubSubTransport, n: int, timeout: float = 10.0) -> list[Delivery]:
    out: list[Delivery] = []
    with anyio.fail_after(timeout):
        while len(out) < n:
            out += await t.fetch(t.queues[0], n - len(out), 1.0)
    return out


async def test_round_trip_publishes_result_then_acks(
    admin: PubSubAdmin, names: dict[str, str]
) -> None:
    metrics = Metrics()
    t = transport_for(names, metrics=metrics)
    try:
        [msg_id] = await admin.publish(
            names["requests"], [request("r1", metadata={"k": "body", "x": "1"})], {"k": "attr"}
        )
        [delivery] = await fetch_n(t, 1)
        envelope = t.decode(delivery)
        assert envelope.kind == "pubsub"
        assert envelope.request.metadata == {"k": "attr", "x": "1"}  # attributes win
        assert envelope.routing.transport_correlation_id == msg_id
        assert envelope.routing.request_queue_name == names["sub"]
        assert envelope.routing.labels == {"team": "a"}
        assert envelope.routing.retry_count == 0
        await t.complete([Completion(delivery, Result.http("r1", 200, b'{"ok":true}'))])
        [result] = await admin.pull_until(names["results_sub"], 1)
        assert Result.decode(result.message.data) == Result.http("r1", 200, b'{"ok":true}')
        # Acked: nacking the old ack id does not bring the message back.
        await admin.subscriber.modify_ack_deadline(
            subscription=admin.subscription(names["sub"]),
            ack_ids=[delivery.handle.ack_id],
            ack_deadline_seconds=0,
        )
        assert await t.fetch(t.queues[0], 5, 1.0) == []
        await t.health()
        latency = metrics.registry.get_sample_value(
            "llm_d_async_async_message_latency_time_millis_count",
            {"queue_id": "", "queue_name": names["sub"], "pool_name": "default"},
        )
        assert latency == 1
    finally:
        await t.aclose()


async def test_complete_retried_after_publish_does_not_duplicate(
    admin: PubSubAdmin, names: dict[str, str]
) -> None:
    t = transport_for(names)
    try:
        await admin.publish(names["requests"], [request("dup")])
        [delivery] = await fetch_n(t, 1)
        t.decode(delivery)
        result = Result.http("dup", 200, b"{}")
        await t.complete([Completion(delivery, result)])
        await t.complete([Completion(delivery, result)])  # the writer retrying after a failed ack
        results = await admin.pull_until(names["results_sub"], 2, timeout=3.0)
        assert [Result.decode(m.message.data).id for m in results] == ["dup"]
    finally:
        await t.aclose()


async def test_defer_redelivers_no_earlier_than_the_delay(
    admin: PubSubAdmin, names: dict[str, str]
) -> None:
    t = transport_for(names)
    try:
        await admin.publish(names["requests"], [request("later")])
        [delivery] = await fetch_n(t, 1)
        t.decode(delivery)
        deferred_at = time.monotonic()
        await t.defer([Deferral(delivery, 1.5)])  # rounded up to 2 s
        [again] = await fetch_n(t, 1)
        waited = time.monotonic() - deferred_at
        assert 1.5 <= waited < 6.0
        assert t.decode(again).id == "later"
        await t.complete([Completion(again, Result.http("later", 200, b"{}"))])
    finally:
        await t.aclose()


async def test_defer_during_a_lease_extension_keeps_its_delay(
    admin: PubSubAdmin, names: dict[str, str]
) -> None:
    t = transport_for(names)
    try:
        await admin.publish(names["requests"], [request("race")])
        [delivery] = await fetch_n(t, 1)
        t.decode(delivery)
        receipt = delivery.handle
        assert isinstance(receipt, Receipt)
        receipt.lease_until = 0.0  # due for extension now
        deferred_at = time.monotonic()
        async with anyio.create_task_group() as tg:
            tg.start_soon(t.extend_leases)
            tg.start_soon(t.defer, [Deferral(delivery, 1.0)])
        # Had the 60 s extension landed after the 1 s deadline, this would time out.
        [again] = await fetch_n(t, 1, timeout=8.0)
        assert time.monotonic() - deferred_at >= 1.0
        await t.complete([Completion(again, Result.http("race", 200, b"{}"))])
    finally:
        await t.aclose()


async def test_nack_on_close_redelivers_at_once(admin: PubSubAdmin, names: dict[str, str]) -> None:
    t = transport_for(names)
    await admin.publish(names["requests"], [request("held")])
    await fetch_n(t, 1)
    await t.aclose()  # the subscription's ack deadline is 10 s; a nack beats it
    started = time.monotonic()
    [again] = await admin.pull_until(names["sub"], 1, timeout=5.0)
    assert time.monotonic() - started < 5.0
    assert json.loads(again.message.data)["id"] == "held"


async def test_pull_in_flight_at_shutdown_hands_its_messages_back_at_once(
    admin: PubSubAdmin, names: dict[str, str]
) -> None:
    """Shutdown cancels a pull the server is about to answer: its messages are nacked."""
    t = transport_for(names)
    fetched: list[Delivery] = []
    shutdown = anyio.CancelScope()

    async def pull() -> None:
        with shutdown:
            fetched.extend(await t.fetch(t.queues[0], 5, 5.0))

    try:
        await t.fetch(t.queues[0], 1, 0.1)  # learns the ack deadline: the next call pulls at once
        async with anyio.create_task_group() as tg:
            tg.start_soon(pull)
            await anyio.sleep(0.5)  # the pull is waiting on the server now
            shutdown.cancel()
            await admin.publish(names["requests"], [request("in-flight")])
        assert fetched == []  # cancelled: nothing reached the caller...
        assert len(t._leases) == 0  # ... nor is anything still held
        started = time.monotonic()
        # ... and it is redelivered at once, not after the 10 s ack deadline.
        [again] = await admin.pull_until(names["sub"], 1, timeout=5.0)
        assert time.monotonic() - started < 5.0
        assert json.loads(again.message.data)["id"] == "in-flight"
    finally:
        await t.aclose()


async def test_more_than_ten_held_at_once(admin: PubSubAdmin, names: dict[str, str]) -> None:
    t = transport_for(names, batch_size=100)
    try:
        ids = [f"m{i}" for i in range(40)]
        await admin.publish(names["requests"], [request(i) for i in ids])
        held = await fetch_n(t, 40)
        assert len(held) == 40  # all leased to us at the same time, not 10
        results = [Completion(d, Result.http(t.decode(d).id, 200, b"{}")) for d in held]
        await t.complete(results)
        published = await admin.pull_until(names["results_sub"], 40)
        assert sorted(Result.decode(m.message.data).id for m in published) == sorted(ids)
    finally:
        await t.aclose()


async def test_missing_subscription_fails_then_recovers(admin: PubSubAdmin, unique: str) -> None:
    names = {"sub": f"{unique}-late", "results": f"{unique}-res"}
    await admin.create_topic(names["results"])
    t = transport_for(names)
    try:
        with pytest.raises(TransportError, match="NotFound"):
            await t.fetch(t.queues[0], 5, 0.5)
        with pytest.raises(TransportError):
            await t.health()
        await admin.create_subscription(names["sub"], f"{unique}-req")
        await admin.publish(f"{unique}-req", [request("late")])
        [delivery] = await fetch_n(t, 1)
        assert t.decode(delivery).id == "late"
        await t.health()
    finally:
        await t.aclose()


async def test_missing_result_topic_is_unhealthy(admin: PubSubAdmin, unique: str) -> None:
    await admin.create_subscription(f"{unique}-sub", f"{unique}-req")
    t = transport_for({"sub": f"{unique}-sub", "results": f"{unique}-nowhere"})
    try:
        with pytest.raises(TransportError, match="nowhere"):
            await t.health()
    finally:
        await t.aclose()


async def test_dead_letter_copies_and_acks(admin: PubSubAdmin, names: dict[str, str]) -> None:
    dead_sub = await admin.create_subscription(
        f"{names['sub']}-dl-sub", f"{names['sub']}-dead-letter"
    )
    t = transport_for(names)
    try:
        await admin.publish(names["requests"], [b'{"no": "id"}'])
        [delivery] = await fetch_n(t, 1)
        with pytest.raises(InvalidMessage) as info:
            t.decode(delivery)
        assert info.value.request_id is None
        await t.dead_letter(delivery, info.value.reason, str(info.value))
        [copy] = await admin.pull_until(dead_sub.rsplit("/", 1)[1], 1)
        assert copy.message.data == b'{"no": "id"}'
        assert copy.message.attributes["reason"] == "missing_id"
        assert await t.fetch(t.queues[0], 5, 0.5) == []
    finally:
        await t.aclose()


async def test_dead_letter_without_its_topic_is_acked_uncopied(
    admin: PubSubAdmin, names: dict[str, str]
) -> None:
    """No ``<subscription>-dead-letter`` topic: the operator chose none; no hot loop."""
    t = transport_for(names)
    try:
        await admin.publish(names["requests"], [b'{"no": "id"}'])
        [delivery] = await fetch_n(t, 1)
        await t.dead_letter(delivery, "missing_id", "no id")  # NotFound: not an error
        await t.defer([Deferral(delivery, 0.0)])  # would bring it back had it not been acked
        assert await admin.pull_until(names["sub"], 1, timeout=2.0) == []
    finally:
        await t.aclose()


async def test_dead_letter_unconfirmed_is_redelivered_not_acked(
    admin: PubSubAdmin,
    names: dict[str, str],
    pubsub_env: PubSubEmulator,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The dead-letter topic exists but the copy cannot be published: nothing is acked."""
    await admin.create_topic(f"{names['sub']}-dead-letter")
    monkeypatch.setenv("PUBSUB_EMULATOR_HOST", f"127.0.0.1:{free_port()}")  # nobody listens
    unreachable = PublisherAsyncClient()
    monkeypatch.setenv("PUBSUB_EMULATOR_HOST", pubsub_env.host)
    t = transport_for(names, publisher=unreachable)
    try:
        await admin.publish(names["requests"], [b'{"no": "id"}'])
        [delivery] = await fetch_n(t, 1)
        with pytest.raises(InvalidMessage) as info:
            t.decode(delivery)
        with pytest.raises(TransportError):
            await t.dead_letter(delivery, info.value.reason, "bad")
        # Handed back: another consumer gets it once the short retry delay has passed.
        [again] = await admin.pull_until(names["sub"], 1, timeout=DEAD_LETTER_RETRY + 5)
        assert again.message.data == b'{"no": "id"}'
    finally:
        await t.aclose()


async def test_retry_count_follows_delivery_attempts(admin: PubSubAdmin, unique: str) -> None:
    names = {"sub": f"{unique}-sub", "results": f"{unique}-res"}
    await admin.create_topic(names["results"])
    await admin.create_subscription(
        names["sub"], f"{unique}-req", dead_letter_topic=f"{unique}-dlq", max_delivery_attempts=5
    )
    t = transport_for(names)
    try:
        await admin.publish(f"{unique}-req", [request("again")])
        counts = []
        for _ in range(3):
            [delivery] = await fetch_n(t, 1)
            counts.append(t.decode(delivery).routing.retry_count)
            await t.defer([Deferral(delivery, 0.0)])
        assert counts == [0, 1, 2]
    finally:
        await t.aclose()


async def test_dead_letter_policy_after_max_delivery_attempts(
    admin: PubSubAdmin, unique: str
) -> None:
    names = {"sub": f"{unique}-sub", "results": f"{unique}-res"}
    await admin.create_topic(names["results"])
    await admin.create_subscription(
        names["sub"], f"{unique}-req", dead_letter_topic=f"{unique}-dlq", max_delivery_attempts=5
    )
    dlq = await admin.create_subscription(f"{unique}-dlq-sub", f"{unique}-dlq")
    t = transport_for(names)
    try:
        await admin.publish(f"{unique}-req", [request("doomed")])
        for attempt in range(5):
            [delivery] = await fetch_n(t, 1)
            assert t.decode(delivery).routing.retry_count == attempt
            await t.defer([Deferral(delivery, 0.0)])  # every attempt failed
        # The broker forwards it instead of delivering a sixth time.
        assert await t.fetch(t.queues[0], 5, 1.0) == []
        [dead] = await admin.pull_until(dlq.rsplit("/", 1)[1], 1, timeout=5.0)
        assert json.loads(dead.message.data)["id"] == "doomed"
    finally:
        await t.aclose()


async def test_no_read_ahead_where_redeliveries_are_counted(
    admin: PubSubAdmin, unique: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under a dead-letter policy every hand-back of a read-ahead (a gate closed for a
    while, a drain) would spend one of each message's delivery attempts, and after
    ``max_delivery_attempts`` Pub/Sub dead-letters it unprocessed, with no result: so
    such a subscription is only pulled for what a fetch asks."""
    monkeypatch.setattr(gcp_pull, "READ_AHEAD_IDLE", 0.5)
    names = {"sub": f"{unique}-sub", "results": f"{unique}-res"}
    await admin.create_topic(names["results"])
    await admin.create_subscription(
        names["sub"], f"{unique}-req", dead_letter_topic=f"{unique}-dlq", max_delivery_attempts=5
    )
    t = transport_for(names)
    await admin.publish(f"{unique}-req", [request(f"m{i}") for i in range(40)])
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(t.run)
            ahead = t._puller.ahead(t._subscriptions[names["sub"]])
            for _ in range(gcp_pull.RTT_SAMPLES):
                ahead.measured(5.0)  # a slow Pub/Sub: the most would be held ahead
            taken = await fetch_n(t, 4)
            for _ in range(10):
                taken += await t.fetch(t.queues[0], 1, 1.0)  # keeps the rate up
                await anyio.sleep(0.05)
            assert (len(ahead.ready), ahead.pending) == (0, 0)
            assert len(t._leases) == len(taken)
            tg.cancel_scope.cancel()
        assert {t.decode(d).routing.retry_count for d in taken} == {0}
    finally:
        await t.aclose()


async def test_backlog_unknown_on_emulator(admin: PubSubAdmin, names: dict[str, str]) -> None:
    t = transport_for(names)
    try:
        assert await t.backlog(t.queues[0]) is None
    finally:
        await t.aclose()


@pytest.mark.slow
async def test_lease_extension_keeps_a_long_message(
    admin: PubSubAdmin, names: dict[str, str]
) -> None:
    t = transport_for(names)
    try:
        await admin.publish(names["requests"], [request("long")])
        [delivery] = await fetch_n(t, 1)
        async with anyio.create_task_group() as tg:
            await tg.start(t.run)
            # Past the subscription's 10 s ack deadline: nobody else may get it meanwhile.
            assert await admin.pull_until(names["sub"], 1, timeout=12.0) == []
            tg.cancel_scope.cancel()
        assert isinstance(delivery.handle, Receipt)
        t.decode(delivery)
        await t.complete([Completion(delivery, Result.http("long", 200, b"{}"))])
        assert len(await admin.pull_until(names["results_sub"], 1)) == 1
    finally:
        await t.aclose()


@pytest.mark.slow
async def test_an_abandoned_message_is_no_longer_extended_and_comes_back(
    admin: PubSubAdmin, names: dict[str, str]
) -> None:
    metrics = Metrics()
    t = transport_for(names, metrics=metrics)
    try:
        await admin.publish(names["requests"], [request("given-up")])
        [delivery] = await fetch_n(t, 1)
        async with anyio.create_task_group() as tg:
            await tg.start(t.run)  # extends whatever is still held
            t.abandon(delivery, "write_failed")  # the result writer gave its write up
            # Past the subscription's 10 s ack deadline, another consumer gets it.
            [again] = await admin.pull_until(names["sub"], 1, timeout=15.0)
            tg.cancel_scope.cancel()
        assert json.loads(again.message.data)["id"] == "given-up"
        labels = {"queue_name": names["sub"], "reason": "write_failed"}
        assert (
            metrics.registry.get_sample_value("llm_d_async_async_abandoned_claims_total", labels)
            == 1
        )
    finally:
        await t.aclose()


@pytest.mark.slow
async def test_a_hand_back_whose_nack_fails_is_not_held_for_ever(
    admin: PubSubAdmin, names: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read-ahead handed back (or a cancelled fetch's messages) while the nack fails: no
    longer extended either, so the ack deadline lapses and they come back, rather than
    being leased on for ever by a process that will never hand them to a worker."""
    t = transport_for(names)
    await admin.publish(names["requests"], [request("handed-back")])
    try:
        [delivery] = await fetch_n(t, 1)

        async def unavailable(*args: object) -> None:
            raise TransportError("modify_ack_deadline: unavailable")

        with monkeypatch.context() as patched:
            patched.setattr(t, "_modify", unavailable)
            await t._nack_quietly([delivery], "read_ahead_idle")
        assert len(t._leases) == 0
        async with anyio.create_task_group() as tg:
            await tg.start(t.run)  # extends whatever is still held
            [again] = await admin.pull_until(names["sub"], 1, timeout=15.0)
            tg.cancel_scope.cancel()
        assert json.loads(again.message.data)["id"] == "handed-back"
    finally:
        await t.aclose()


def test_newest_point_of_cloud_monitoring_answer() -> None:
    body = {
        "timeSeries": [
            {
                "points": [
                    {"interval": {"endTime": "2026-01-01T00:01:00Z"}, "value": {"int64Value": "7"}}
                ]
            },
            {
                "points": [
                    {"interval": {"endTime": "2026-01-01T00:02:00Z"}, "value": {"int64Value": "9"}}
                ]
            },
        ]
    }
    assert newest_point(body) == 9
    assert newest_point({}) is None


async def test_read_ahead_serves_fetches_and_is_handed_back_once_they_stop(
    admin: PubSubAdmin, names: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Held ahead up to its bound while fetches come; nacked at once when they stop (a
    drain, a closed gate), not kept leased until the ack deadline."""
    monkeypatch.setattr(gcp_pull, "READ_AHEAD_MAX", 8)
    monkeypatch.setattr(gcp_pull, "READ_AHEAD_IDLE", 0.5)
    t = transport_for(names)
    ids = [f"m{i}" for i in range(40)]
    await admin.publish(names["requests"], [request(i) for i in ids])
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(t.run)
            ahead = t._puller.ahead(t._subscriptions[names["sub"]])
            for _ in range(gcp_pull.RTT_SAMPLES):
                ahead.measured(5.0)  # a slow Pub/Sub: hold the most
            taken = await fetch_n(t, 4)
            with anyio.fail_after(5):
                while len(ahead.ready) < 8:
                    taken += await t.fetch(t.queues[0], 1, 1.0)  # keeps the rate up
                    await anyio.sleep(0.05)
            assert len(ahead.ready) == 8  # bounded, and ...
            served = await t.fetch(t.queues[0], 3, 1.0)
            assert len(served) == 3 and len(ahead.ready) == 5  # ... fetched from at once
            taken += served
            ahead_ids = {json.loads(d.raw)["id"] for d in ahead.ready}
            with anyio.fail_after(5):  # no more fetches: handed back, and only what was
                while len(t._leases) > len(taken):  # fetched is still held
                    await anyio.sleep(0.05)
            assert not ahead.ready
            # Redelivered at once (the subscription's ack deadline is 10 s).
            again = await admin.pull_until(names["sub"], len(ids) - len(taken), timeout=5.0)
            assert ahead_ids <= {json.loads(m.message.data)["id"] for m in again}
            tg.cancel_scope.cancel()
    finally:
        await t.aclose()
