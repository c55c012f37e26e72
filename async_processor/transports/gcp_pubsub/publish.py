"""The publish side of gcp-pubsub: results onto the result topic, unusable messages onto
``<subscription>-dead-letter``.

Requests are built as raw protobufs (proto-plus marshals on every field access) and cut
to Pub/Sub's per-request limits. A result whose publish was confirmed is remembered per
message, so a retried ``complete`` (its ack failed) does not publish it twice
(docs/architecture.md G2: per process, by message id). The transport owns the clients and
readiness; this module only sends.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Any

import structlog
from google.pubsub_v1 import PublisherAsyncClient
from google.pubsub_v1.types import PublishRequest, PubsubMessage

from async_processor.transports.base import Completion, Delivery
from async_processor.transports.gcp_pubsub.leases import Receipt, receipt

log = structlog.get_logger(__name__)

RPC_TIMEOUT = 10.0
PUBLISH_CHUNK_COUNT = 1000  # Pub/Sub's per-request limits: 1000 messages, 10 MB
PUBLISH_CHUNK_BYTES = 9 * 1024 * 1024
DEDUP_MEMORY = 65536  # message ids whose result this process published
ATTRIBUTE_BYTES = 1024  # Pub/Sub's limit on an attribute value
# The raw protobuf classes behind proto-plus: built and read without marshalling per field.
RAW_MESSAGE: Any = PubsubMessage.pb()
RAW_PUBLISH: Any = PublishRequest.pb()

# ``rpc(resource, action)``: the transport's scope that records the outcome for readiness
# and turns a Google API failure into TransportError.
RpcScope = Callable[[str, str], AbstractContextManager[None]]


def dead_letter_topic(subscription: str) -> str:
    """The optional topic undecodable messages are copied to: ``<subscription>-dead-letter``."""
    project, _, short = subscription.removeprefix("projects/").partition("/subscriptions/")
    return f"projects/{project}/topics/{short}-dead-letter"


def message_key(held: Receipt) -> str:
    """One message across redeliveries: ``<subscription>/<message id>``."""
    return f"{held.subscription}/{held.message_id}"


class Publisher:
    """Publishes through the transport's client and RPC scope."""

    def __init__(self, client: Callable[[], PublisherAsyncClient], rpc: RpcScope) -> None:
        self._client = client
        self._rpc = rpc
        self._published: OrderedDict[str, None] = OrderedDict()  # message_key of each

    async def results(self, topic: str, items: Sequence[Completion]) -> None:
        """Publish each result not yet published for its message; returns once confirmed."""
        pending = [(d, r.encode()) for d, r in items if not self._already_published(receipt(d))]
        for chunk in _publish_chunks(pending):
            await self.publish(topic, [RAW_MESSAGE(data=data) for _, data in chunk])
            for delivery, _ in chunk:
                self._remember_published(receipt(delivery))

    async def dead_letter(self, delivery: Delivery, reason: str, detail: str) -> str:
        """Copy ``delivery`` to its dead-letter topic (returned); raises TransportError."""
        held = receipt(delivery)
        topic = dead_letter_topic(held.subscription)
        attributes = {"reason": reason, "detail": _attribute(detail), "message_id": held.message_id}
        await self.publish(topic, [RAW_MESSAGE(data=delivery.raw, attributes=attributes)])
        return topic

    async def publish(self, topic: str, messages: list[Any]) -> None:
        """Publish raw ``PubsubMessage`` protobufs (built without proto-plus, sent as is)."""
        request = PublishRequest.wrap(RAW_PUBLISH(topic=topic, messages=messages))
        with self._rpc(topic, "publish"):
            await self._client().publish(request=request, timeout=RPC_TIMEOUT, retry=None)

    def _already_published(self, held: Receipt) -> bool:
        if held.published or message_key(held) in self._published:
            if not held.published:
                log.info("duplicate_result_skipped", message_id=held.message_id)
            return True
        return False

    def _remember_published(self, held: Receipt) -> None:
        held.published = True
        self._published[message_key(held)] = None
        if len(self._published) > DEDUP_MEMORY:
            self._published.popitem(last=False)


def _publish_chunks(
    items: Sequence[tuple[Delivery, bytes]],
) -> Iterator[list[tuple[Delivery, bytes]]]:
    """Split into publish requests within Pub/Sub's count and size limits."""
    chunk: list[tuple[Delivery, bytes]] = []
    size = 0
    for item in items:
        if chunk and (
            len(chunk) >= PUBLISH_CHUNK_COUNT or size + len(item[1]) > PUBLISH_CHUNK_BYTES
        ):
            yield chunk
            chunk, size = [], 0
        chunk.append(item)
        size += len(item[1])
    if chunk:
        yield chunk


def _attribute(text: str) -> str:
    """``text`` cut to an attribute value's byte limit, on a character boundary."""
    return text.encode()[:ATTRIBUTE_BYTES].decode(errors="ignore")
