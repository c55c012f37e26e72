"""Claim bookkeeping for redis-sortedset: what a fetched delivery's receipt is and which
claims this process holds.

A fetch records each claim here (``hold``); the heartbeat renews the ones still held and
not long past their deadline (``renewable``); an ack in flight is marked ``acking`` so a
heartbeat that misses its claim does not take it for a lost lease; whatever settles or is
abandoned is ``release``d (docs/architecture.md G1, G11). ``defer_args`` is what a
hand-back writes: the member and its place (upstream's §5 score) or its due time.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import structlog

from async_processor.routing import queue_score
from async_processor.transports.base import Deferral, Delivery

log = structlog.get_logger(__name__)

# Stop extending a claim this long after its deadline: by then the pipeline has answered
# it, so a claim still held is a leak, and letting it expire hands the message back. Also
# upstream's cap on a lease: never past the deadline plus this.
STALE_CLAIM_GRACE = 300.0


@dataclass(slots=True)
class Claim:
    """A delivery's receipt: its claim key in upstream's claim layout (``<queue>:claimed``,
    ``:claim-owners``, ``:claims-idx``; ``id`` NUL ``request_token``) and its original score.

    ``cancelled`` is the last reading of its cancel marker, taken at ``read_at``
    (monotonic): with the fetch (one read per claim round instead of a GET per message),
    then with every marker read while it is held (redis_sortedset/markers.py); ``is_cancelled``
    answers from a reading younger than ``MARKER_FRESH``, else asks Redis. Set in place
    (a ``dataclasses.replace`` per message twice cost ~3 µs).
    ``size`` is the member's size in bytes; ``digest`` (its SHA-1) is set only for a member
    over ``--max-message-bytes``, of which the delivery holds a prefix only.
    ``let_go``: the delivery let go of its bytes once its request was written (they are
    read back from ``<queue>:claimed`` for a hand-back or a dead letter).
    """

    id: str
    score: float
    size: int = 0
    digest: str = ""
    cancelled: bool | None = None
    read_at: float = -math.inf
    cancel_key: str = ""  # its cancel marker's key, once asked (redis_sortedset/markers.py)
    # Its result was sent and the reply lost: the write may have landed, so a marker
    # found and the claim gone on the next send are most likely its own (not counted).
    unsure: bool = False
    # Set when the delivery let its bytes go (``SortedSetTransport.let_go``), with its
    # dedup fingerprint, which is a digest of the request with them.
    let_go: bool = False
    fingerprint: str = ""


def key_text(raw: bytes) -> str:
    """A claim key read from Redis as text: an id is whatever bytes the message holds (not
    always UTF-8), kept exact by ``surrogateescape`` and sent back by ``key_bytes``."""
    return raw.decode(errors="surrogateescape")


def key_bytes(claim: Claim) -> bytes:
    return claim.id.encode(errors="surrogateescape")


def claim_of(delivery: Delivery) -> Claim:
    if not isinstance(delivery.handle, Claim):
        raise TypeError("delivery was not fetched by the redis-sortedset transport")
    return delivery.handle


def token_of(delivery: Delivery) -> str:
    return delivery.envelope.routing.request_token if delivery.envelope else ""


def by_queue(deliveries: Sequence[Delivery]) -> dict[str, list[int]]:
    """Indexes of ``deliveries`` per queue name, in order: a queue's keys share one cluster
    slot (its hash tag), so one script or MGET may touch them all."""
    groups: dict[str, list[int]] = {}
    for index, delivery in enumerate(deliveries):
        groups.setdefault(delivery.queue.name, []).append(index)
    return groups


def deadline_of(delivery: Delivery) -> float:
    envelope = delivery.envelope
    return float(envelope.request.deadline) if envelope else claim_of(delivery).score


class ClaimBook:
    """The claims this process holds, per queue name, and those whose ack is on its way."""

    def __init__(self, queue_names: Sequence[str]) -> None:
        self.held: dict[str, dict[str, Delivery]] = {name: {} for name in queue_names}
        self._settling: set[str] = set()

    def hold(self, delivery: Delivery) -> None:
        self.held.setdefault(delivery.queue.name, {})[claim_of(delivery).id] = delivery

    def all_held(self) -> Iterator[Delivery]:
        return (d for held in self.held.values() for d in held.values())

    def release(self, delivery: Delivery) -> None:
        self.held.get(delivery.queue.name, {}).pop(claim_of(delivery).id, None)

    def prune(self, served: Iterable[str]) -> None:
        """Forget the queues no longer served that hold no claim (removed, drained)."""
        keep = set(served)
        for name in [n for n, held in self.held.items() if not held and n not in keep]:
            del self.held[name]

    @contextmanager
    def acking(self, deliveries: Iterable[Delivery]) -> Iterator[None]:
        ids = {claim_of(d).id for d in deliveries}
        self._settling |= ids
        try:
            yield
        finally:
            self._settling -= ids

    def renewable(self, queue_name: str) -> list[tuple[bytes, float]]:
        """Held claim keys, each with the latest lease expiry upstream allows it (deadline
        + ``STALE_CLAIM_GRACE``), dropping those long past their deadline (a leak)."""
        held = self.held.get(queue_name, {})
        cutoff = time.time() - STALE_CLAIM_GRACE
        stale = [key for key, d in held.items() if deadline_of(d) < cutoff]
        for key in stale:
            log.warning("stale_claim_released", claim=key)
            del held[key]
        return [(key_bytes(claim_of(d)), deadline_of(d) + STALE_CLAIM_GRACE) for d in held.values()]

    def forget_lost(self, queue_name: str, claim_ids: Iterable[str]) -> list[str]:
        """Forget claims no longer ours in Redis; a claim acked while the renewal
        was on its way is not lost, only done; nor is one whose result write lost its reply
        (``Claim.unsure``): most likely that write acknowledged it. Returns the ones really
        lost."""
        held = self.held.get(queue_name, {})
        return [
            c
            for c in claim_ids
            if c not in self._settling
            and (gone := held.pop(c, None)) is not None
            and not claim_of(gone).unsure
        ]


def defer_args(item: Deferral) -> list[bytes | float | str]:
    """(member, score, mode, cap): the updated envelope at its place in the queue, or due
    after the delay (capped at its deadline)."""
    delivery = item.delivery
    member = delivery.envelope.encode() if delivery.envelope else delivery.raw
    if item.delay > 0:
        return [member, item.delay, "delay", deadline_of(delivery)]
    return [member, queue_score_of(delivery), "at", 0]


def queue_score_of(delivery: Delivery) -> float:
    """Where a handed-back message goes in its queue: its deadline plus upstream's order
    fraction (``enqueue_seq``); without one, the score it was claimed with when that is
    of its deadline (the current release's own fraction, or a bare deadline)."""
    envelope, claimed = delivery.envelope, claim_of(delivery).score
    if envelope is None:
        return claimed
    deadline = envelope.request.deadline
    if envelope.routing.enqueue_seq > 0:
        return queue_score(deadline, envelope.routing.enqueue_seq)
    return claimed if math.floor(claimed) == deadline else float(deadline)
