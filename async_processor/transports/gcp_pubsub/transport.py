"""gcp-pubsub transport: unary pulls sized by demand, our own leases, ack after publish.

Stage: broker I/O for ``--transport gcp-pubsub``. Input: ``GcpPubSubConfig`` (one
subscription per topic entry; message data is the bare request JSON). Output:
``Delivery`` objects for the poller; results published on ``result_topic_id``.

Why unary ``Pull`` with the asyncio GAPIC client, not the streaming-pull ``SubscriberClient``
(docs/transports.md): the poller asks for its free slots x queue-gate budget, up to 1,000
per pull (``QueueSpec.max_fetch``), so flow control follows capacity with no callback
threads and nothing to tear down when a gate closes (the poller simply stops calling
``fetch``). The pull side, with its read-ahead sized by the pull round trip, is
``pull``. Held messages are kept alive by ``run``: a lease loop extends every held
message before its ack deadline runs out (``modify_ack_deadline``). Messages are read,
and requests built, as raw protobufs: proto-plus marshals on every field access.

Guarantees: at-least-once. ``complete`` acks a message only after its result's publish
is confirmed; a failed ack after a confirmed publish is retried without publishing again
(the receipt remembers). A redelivered message whose result this process already
published is acked without a second result (best effort: per process, by message id;
another replica or a restart can still publish a duplicate). ``defer`` honours the
computed backoff through the ack deadline (capped at 600 s, the Pub/Sub maximum).
``aclose`` nacks whatever is still held (the read-ahead too); publishes are awaited in
``complete``, so there is never an unflushed result. A dead letter is acked only once its
copy is confirmed.
Honours ``PUBSUB_EMULATOR_HOST`` (insecure channel, no credentials) and Application
Default Credentials otherwise.
"""

from __future__ import annotations

import math
import os
import time
from collections import OrderedDict, defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

import anyio
import structlog
from anyio.abc import TaskStatus
from google.api_core import exceptions as gexc
from google.auth.exceptions import GoogleAuthError
from google.pubsub_v1 import PublisherAsyncClient, SubscriberAsyncClient
from google.pubsub_v1.types import (
    AcknowledgeRequest,
)
from prometheus_client import Histogram

from async_processor.config import GcpPubSubConfig
from async_processor.config.queues import QueueSpec
from async_processor.errors import TransportError
from async_processor.messages import Envelope, Routing, decode_request
from async_processor.transports.base import (
    TRANSPORTS,
    Completion,
    Deferral,
    Delivery,
    TransportContext,
)
from async_processor.transports.gcp_pubsub.backlog import BacklogReader
from async_processor.transports.gcp_pubsub.health import Readiness
from async_processor.transports.gcp_pubsub.leases import (
    LEASE_SECONDS,
    Leases,
    ack_groups,
    receipt,
    unless_hopeless,
)
from async_processor.transports.gcp_pubsub.publish import (
    DEDUP_MEMORY,
    PUBLISH_CHUNK_COUNT,
    RPC_TIMEOUT,
    Publisher,
    dead_letter_topic,
    message_key,
)
from async_processor.transports.gcp_pubsub.pull import Puller

log = structlog.get_logger(__name__)
# Why the pipeline gives a message up to its ack deadline (``abandon``).
ABANDON_REASONS = ("write_failed", "settle_timeout", "dead_letter_failed")

LEASE_TICK = 1.0
MAX_ACK_DEADLINE = 600  # Pub/Sub's maximum; longer deferrals come back after 600 s
# The raw protobuf classes behind proto-plus: built and read without marshalling per field.
RAW_ACK: Any = AcknowledgeRequest.pb()
DEAD_LETTER_RETRY = 5.0  # an uncopied dead letter comes back after this, not in a hot loop
# Last answers kept with the routing of deferred messages, in characters, at most: most
# come back to another replica, so what is kept here waits to be evicted.
CARRIED_BODY_CHARS = 16 * 1024 * 1024


def resource_path(project: str, kind: str, name: str) -> str:
    """``projects/<project>/<kind>/<name>``, or ``name`` as is when already a full path."""
    return name if name.startswith("projects/") else f"projects/{project}/{kind}/{name}"


class GcpPubSubTransport:
    kind = "gcp-pubsub"
    # Pub/Sub refuses publish requests over 10 MB (10^7 bytes); the headroom is for the
    # request's own fields (transports.base.LimitsResults).
    max_result_bytes = 10_000_000 - 64 * 1024
    # Results per complete() call: with tens of ms per publish and per ack, one call per
    # 64 results would cap a replica near 400 results/s; batches grow to what is ready.
    write_batch = PUBLISH_CHUNK_COUNT

    def __init__(
        self,
        config: GcpPubSubConfig,
        ctx: TransportContext,
        *,
        backlog_reader: BacklogReader | None = None,
        subscriber: SubscriberAsyncClient | None = None,
        publisher: PublisherAsyncClient | None = None,
    ) -> None:
        self.config = config
        self.queues: Sequence[QueueSpec] = config.queue_specs()
        self._ctx = ctx
        self._subscriptions = {
            q.name: resource_path(config.project_id, "subscriptions", q.name) for q in self.queues
        }
        self._result_topic = resource_path(config.project_id, "topics", config.result_topic_id)
        if ctx.metrics is not None:  # every series at 0 from the start, so alerts see a rise
            for queue in self.queues:
                for reason in ABANDON_REASONS:
                    ctx.metrics.abandoned_total.labels(queue.name, reason)
        self._emulator = bool(os.environ.get("PUBSUB_EMULATOR_HOST"))
        self._backlog = backlog_reader or BacklogReader(
            config.project_id, enabled=not self._emulator
        )
        # Usually None: created on first use (see _clients); given by tests.
        self._subscriber = subscriber
        self._publisher = publisher
        self._leases = Leases()  # held messages, extended by run()
        # Orders extensions and hand-backs: an extension landing after a deferral's shorter
        # deadline would hold the message for a whole lease instead of the backoff.
        self._deadline_lock = anyio.Lock()
        self._readiness = Readiness()
        self._puller = Puller(
            lambda: self._clients()[0], self._readiness.rpc, self._leases, self._nack_quietly
        )
        self._publishing = Publisher(lambda: self._clients()[1], self._readiness.rpc)
        # Routing of messages this process deferred: Pub/Sub cannot carry it back, and its
        # delivery_attempt exists only with a dead-letter policy (best effort, per process).
        self._carried: OrderedDict[str, Routing] = OrderedDict()
        self._carried_chars = 0  # of their last answers (CARRIED_BODY_CHARS)

    # ------------------------------------------------------------------ clients

    def _clients(self) -> tuple[SubscriberAsyncClient, PublisherAsyncClient]:
        """Created on first use, inside the event loop their gRPC channels belong to."""
        try:
            self._subscriber = self._subscriber or SubscriberAsyncClient()
            self._publisher = self._publisher or PublisherAsyncClient()
        except GoogleAuthError as exc:
            raise TransportError(f"pubsub credentials: {exc}") from exc
        return self._subscriber, self._publisher

    # ------------------------------------------------------------------ fetch and decode

    async def fetch(self, queue: QueueSpec, limit: int, wait: float) -> list[Delivery]:
        """Up to ``limit`` messages: read ahead, or one Pull held up to about ``wait`` s."""
        if limit <= 0:
            return []
        return await self._puller.fetch(queue, self._subscriptions[queue.name], limit, wait)

    async def _nack_quietly(self, deliveries: Sequence[Delivery], why: str) -> None:
        """Hand back at once, shielded and bounded; a failure only delays their redelivery."""
        if not deliveries:
            return
        with anyio.CancelScope(shield=True), anyio.move_on_after(RPC_TIMEOUT):
            try:
                await self.defer([Deferral(d, 0.0) for d in deliveries])
                log.info("held_messages_nacked", count=len(deliveries), why=why)
            except TransportError as exc:
                log.warning("nack_failed", count=len(deliveries), why=why, error=str(exc))
        # Extended no more, nacked or not: a failed (or timed out) nack leaves them to their
        # ack deadline. Held on, nobody would ever take them: they are no longer read ahead.
        self._leases.forget(deliveries)

    def decode(self, delivery: Delivery) -> Envelope:
        """The bare request, attributes merged into metadata (attributes win), routing filled."""
        request = decode_request(delivery.raw, max_bytes=self._ctx.max_message_bytes)
        request.metadata = {**request.metadata, **delivery.attributes}
        held = receipt(delivery)
        carried = self._uncarry(message_key(held))
        routing = Routing(
            # delivery_attempt counts redeliveries only under a dead-letter policy; what this
            # process deferred it remembers itself.
            retry_count=max(held.delivery_attempt - 1, carried.retry_count if carried else 0),
            queue_id=delivery.queue.id,
            request_queue_name=delivery.queue.name,
            transport_correlation_id=held.message_id,
            labels=dict(delivery.queue.labels),
            last_status=carried.last_status if carried else 0,
            last_body=carried.last_body if carried else "",
        )
        delivery.envelope = Envelope(request=request, routing=routing, kind="pubsub")
        return delivery.envelope

    # ------------------------------------------------------------------ acknowledgements

    async def complete(self, items: Sequence[Completion]) -> None:
        """Publish the results, await their confirmation, then ack the messages."""
        if not items:
            return
        await self._publishing.results(self._result_topic, items)
        await self._acknowledge([d for d, _ in items])
        self._observe_latency(d for d, _ in items)

    async def _acknowledge(self, deliveries: Sequence[Delivery]) -> None:
        subscriber, _ = self._clients()
        for subscription, ack_ids in ack_groups(deliveries):
            request = AcknowledgeRequest.wrap(RAW_ACK(subscription=subscription, ack_ids=ack_ids))
            with unless_hopeless(ack_ids), self._readiness.rpc(subscription, "acknowledge"):
                await subscriber.acknowledge(request=request, timeout=RPC_TIMEOUT, retry=None)
        self._leases.forget(deliveries)

    def _observe_latency(self, deliveries: Iterable[Delivery]) -> None:
        """Publish -> ack time (the reference's ``message_latency_time_millis``)."""
        if self._ctx.metrics is None:
            return
        now = time.time()
        histograms: dict[str, Histogram] = {}
        for delivery in deliveries:
            q = delivery.queue
            if (histogram := histograms.get(q.name)) is None:
                histogram = self._ctx.metrics.queue(q.id, q.name, q.pool).message_latency
                histograms[q.name] = histogram
            histogram.observe(max(0.0, now - receipt(delivery).publish_time) * 1000)

    async def defer(self, items: Sequence[Deferral]) -> None:
        """Redeliver each message after its delay, via its ack deadline (0 = nack now)."""
        by_delay: dict[int, list[Delivery]] = defaultdict(list)
        for item in items:
            self._carry(item.delivery)
            # Rounded up: a retry never comes back before its backoff.
            seconds = min(MAX_ACK_DEADLINE, max(0, math.ceil(item.delay)))
            by_delay[seconds].append(item.delivery)
        async with self._deadline_lock:
            for seconds, deliveries in by_delay.items():
                await self._modify(ack_groups(deliveries), seconds, "defer")
                self._leases.forget(deliveries)

    def abandon(self, delivery: Delivery, reason: str) -> None:
        """Stop extending a message whose write was given up (DESIGN.md §5.15): its ack
        deadline lapses and Pub/Sub hands it out again, so another attempt finishes it."""
        self._leases.forget([delivery])
        queue = delivery.queue.name
        log.warning("message_abandoned", queue=queue, message_id=receipt(delivery).message_id,
                    reason=reason)  # fmt: skip
        if self._ctx.metrics is not None:
            self._ctx.metrics.abandoned_total.labels(queue, reason).inc()

    def _carry(self, delivery: Delivery) -> None:
        envelope = delivery.envelope
        if envelope is None or not (envelope.routing.retry_count or envelope.routing.last_status):
            return
        key = message_key(receipt(delivery))
        self._uncarry(key)
        self._carried[key] = envelope.routing
        self._carried_chars += len(envelope.routing.last_body)
        while len(self._carried) > DEDUP_MEMORY or self._carried_chars > CARRIED_BODY_CHARS:
            self._uncarry(next(iter(self._carried)))  # the oldest

    def _uncarry(self, key: str) -> Routing | None:
        routing = self._carried.pop(key, None)
        if routing is not None:
            self._carried_chars -= len(routing.last_body)
        return routing

    async def dead_letter(self, delivery: Delivery, reason: str, detail: str) -> None:
        """Copy an unusable message to ``<subscription>-dead-letter``, then ack it.

        Acked only once the copy is confirmed, or when that topic does not exist (it is
        optional: then the message is only logged and counted). Any other publish failure
        hands the message back for redelivery and raises: an unconfirmed copy is no copy.
        """
        try:
            await self._publishing.dead_letter(delivery, reason, detail)
        except TransportError as exc:
            if not isinstance(exc.__cause__, gexc.NotFound):
                await self._redeliver_later(delivery, DEAD_LETTER_RETRY)
                raise
            topic = dead_letter_topic(receipt(delivery).subscription)
            log.warning("dead_letter_not_copied", topic=topic, error=str(exc))
        log.warning(
            "message_dead_lettered",
            queue=delivery.queue.name,
            message_id=receipt(delivery).message_id,
            reason=reason,
            detail=detail,
        )
        await self._acknowledge([delivery])

    async def _redeliver_later(self, delivery: Delivery, seconds: float) -> None:
        """Hand back after ``seconds``; if even that fails, stop extending its lease."""
        try:
            await self.defer([Deferral(delivery, seconds)])
        except TransportError as exc:
            log.warning("nack_failed", count=1, why="dead_letter_failed", error=str(exc))
            self._leases.forget([delivery])  # its ack deadline brings it back

    async def _modify(
        self, groups: Sequence[tuple[str, list[str]]], seconds: int, action: str
    ) -> None:
        subscriber, _ = self._clients()
        for subscription, ack_ids in groups:
            with unless_hopeless(ack_ids), self._readiness.rpc(subscription, action):
                await subscriber.modify_ack_deadline(
                    subscription=subscription,
                    ack_ids=ack_ids,
                    ack_deadline_seconds=seconds,
                    timeout=RPC_TIMEOUT,
                    retry=None,
                )

    # ------------------------------------------------------------------ queries

    async def is_cancelled(self, delivery: Delivery) -> bool:
        return False  # Pub/Sub has no cancellation markers (as the reference)

    async def backlog(self, queue: QueueSpec) -> int | None:
        """Undelivered messages from Cloud Monitoring; None on the emulator or when unknown."""
        return await self._backlog.undelivered(self._subscriptions[queue.name])

    async def health(self) -> None:
        """Raise unless every subscription and the result topic answered recently or now."""
        for resource in [*self._subscriptions.values(), self._result_topic]:
            if self._readiness.needs_probe(resource):
                await self._probe(resource)

    async def _probe(self, resource: str) -> None:
        subscriber, publisher = self._clients()
        try:
            with self._readiness.rpc(resource, "probe"):
                if "/subscriptions/" in resource:
                    await subscriber.get_subscription(
                        subscription=resource, timeout=RPC_TIMEOUT, retry=None
                    )
                else:
                    await publisher.get_topic(topic=resource, timeout=RPC_TIMEOUT, retry=None)
        except TransportError as exc:
            # Allowed to use it but not to describe it: that counts as healthy.
            if not isinstance(exc.__cause__, gexc.PermissionDenied):
                raise
            self._readiness.ok(resource)

    # ------------------------------------------------------------------ upkeep

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Extend the leases of held messages before their ack deadline and keep the
        read-ahead filled, until cancelled."""
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._puller.run, [(q, self._subscriptions[q.name]) for q in self.queues])
            task_status.started()
            while True:
                await anyio.sleep(LEASE_TICK)
                try:
                    await self.extend_leases()
                except TransportError as exc:
                    log.warning("lease_extension_failed", error=str(exc))

    async def extend_leases(self) -> None:
        async with self._deadline_lock:
            due = self._leases.due()
            try:
                await self._modify(ack_groups(due), LEASE_SECONDS, "extend")
            except TransportError:
                self._leases.extension_failed(due)
                raise

    async def aclose(self) -> None:
        """Nack what is still held (redelivered at once elsewhere), then close the channels."""
        with anyio.CancelScope(shield=True):
            await self._nack_quietly(self._leases.take_all(), "close")
            for client in (self._subscriber, self._publisher):
                if client is not None:
                    await client.transport.close()  # type: ignore[no-untyped-call]
            self._subscriber = self._publisher = None
            await self._backlog.aclose()


@TRANSPORTS.register("gcp-pubsub", GcpPubSubConfig)
def build(config: GcpPubSubConfig, ctx: TransportContext) -> GcpPubSubTransport:
    return GcpPubSubTransport(config, ctx)
