"""Pub/Sub receipts and the leases the gcp-pubsub transport keeps on held messages.

Stage: lease and ack-id bookkeeping for ``gcp_pubsub``. Input: deliveries as pulled,
acked or handed back. Output: which ack ids need their deadline extended now, ack ids
grouped per subscription in request-sized chunks, and which ack rejections are final.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import structlog
from google.api_core import exceptions as gexc

from async_processor.errors import TransportError
from async_processor.transports.base import Delivery

log = structlog.get_logger(__name__)

LEASE_SECONDS = 60  # ack deadline each extension buys
EXTEND_BEFORE = 20.0  # extend a lease once less than this is left
ACK_CHUNK = 1000  # ack ids per acknowledge / modify_ack_deadline request
STALE_GRACE = 300.0  # stop extending a message this long after its deadline (a leak)
UNDECODED_HOLD = 600.0  # ... or this long after it was pulled when it never decoded
# Rejections about particular ack ids (expired under exactly-once delivery, malformed).
ACK_ID_ERRORS = (gexc.InvalidArgument, gexc.FailedPrecondition)


@dataclass(slots=True)
class Receipt:
    """A delivery's Pub/Sub receipt and lease state."""

    ack_id: str
    subscription: str
    message_id: str
    delivery_attempt: int
    publish_time: float  # wall clock seconds
    lease_until: float  # monotonic
    published: bool = False  # result confirmed; a retried complete only acks


def receipt(delivery: Delivery) -> Receipt:
    if not isinstance(delivery.handle, Receipt):
        raise TypeError("delivery was not fetched by the gcp-pubsub transport")
    return delivery.handle


def ack_groups(deliveries: Iterable[Delivery]) -> list[tuple[str, list[str]]]:
    """Ack ids per subscription, in request-sized chunks."""
    grouped: dict[str, list[str]] = defaultdict(list)
    for delivery in deliveries:
        r = receipt(delivery)
        grouped[r.subscription].append(r.ack_id)
    return [
        (subscription, ack_ids[start : start + ACK_CHUNK])
        for subscription, ack_ids in grouped.items()
        for start in range(0, len(ack_ids), ACK_CHUNK)
    ]


class Leases:
    """Messages this process holds (pulled, not yet acked or handed back), by ack id."""

    def __init__(self) -> None:
        self._held: dict[str, Delivery] = {}

    def __len__(self) -> int:
        return len(self._held)

    def hold(self, delivery: Delivery) -> None:
        self._held[receipt(delivery).ack_id] = delivery

    def forget(self, deliveries: Iterable[Delivery]) -> None:
        """No more extension for these (acked or handed back)."""
        for delivery in deliveries:
            self._held.pop(receipt(delivery).ack_id, None)

    def take_all(self) -> list[Delivery]:
        held, self._held = list(self._held.values()), {}
        return held

    def due(self) -> list[Delivery]:
        """Held messages whose lease runs out soon, marked as extended to LEASE_SECONDS.

        A message held long past its deadline is a leak upstream: it is dropped from the
        set so its lease lapses and Pub/Sub redelivers it.
        """
        now = time.monotonic()
        due = [d for d in self._held.values() if receipt(d).lease_until - now < EXTEND_BEFORE]
        live = [d for d in due if not self._drop_if_stale(d)]
        for delivery in live:
            receipt(delivery).lease_until = now + LEASE_SECONDS
        return live

    def extension_failed(self, deliveries: Iterable[Delivery]) -> None:
        """Due again at the next look (``due`` marked them extended in advance)."""
        for delivery in deliveries:
            receipt(delivery).lease_until = time.monotonic()

    def _drop_if_stale(self, delivery: Delivery) -> bool:
        envelope = delivery.envelope
        if envelope is not None:
            stale = time.time() > envelope.request.deadline + STALE_GRACE
        else:
            stale = time.time() > delivery.received_at + UNDECODED_HOLD
        if stale:
            r = receipt(delivery)
            log.warning("stale_message_released", message_id=r.message_id)
            self._held.pop(r.ack_id, None)
        return stale


@contextmanager
def unless_hopeless(ack_ids: Sequence[str]) -> Iterator[None]:
    """Swallow an ack/modack rejection that no retry can fix, so the result writer moves on.

    Expired ack ids (exactly-once delivery), a deleted subscription or a missing permission
    fail the same way every time; the messages come back by themselves after their ack
    deadline, and their results are not published again by this process. Readiness still
    sees a deleted subscription or a denied permission.
    """
    try:
        yield
    except TransportError as exc:
        cause = exc.__cause__
        transient = isinstance(
            cause, gexc.TooManyRequests | gexc.ResourceExhausted | gexc.Cancelled
        )
        if transient or not isinstance(cause, gexc.ClientError):
            raise
        log.warning("ack_ids_rejected", count=len(ack_ids), error=str(exc))
