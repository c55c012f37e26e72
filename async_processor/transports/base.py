"""The transport seam: broker I/O only (fetch, complete, defer, dead-letter, backlog, health).

Input: the transport's config. Output: ``Delivery`` objects for the poller, and durable
writes of results and hand-backs. Every transport type registers in ``TRANSPORTS``.

Durability contract (docs/architecture.md G1, G2): a delivery stays owned by the broker until
``complete`` (result written and message acknowledged in one step) or ``defer`` (message
handed back, due after a delay). ``complete`` writes at most one terminal result per
request id even when a message was delivered twice.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, runtime_checkable

import anyio
from anyio.abc import TaskStatus

from async_processor.backlog_metrics import Backlog
from async_processor.config.queues import QueueSpec
from async_processor.messages import Envelope, Result
from async_processor.registry import Registry

if TYPE_CHECKING:
    from async_processor.metrics import Metrics


@dataclass(slots=True, eq=False)
class Delivery:
    """One message as fetched: its bytes, the broker's receipt, and (once decoded) its envelope."""

    queue: QueueSpec
    raw: bytes
    handle: Any = None  # transport receipt: lease member, ack id, ...
    attributes: dict[str, str] = field(default_factory=dict)
    received_at: float = field(default_factory=time.time)  # wall clock, for residence time
    envelope: Envelope | None = None


class Completion(NamedTuple):
    """A delivery's terminal result, to be written and the message acknowledged.

    A named tuple, so a transport may still unpack it as ``delivery, result``.
    """

    delivery: Delivery
    result: Result


@dataclass(frozen=True, slots=True)
class Deferral:
    """Hand a delivery back to the broker, due after ``delay`` seconds.

    The delivery's (possibly updated) envelope is what is written back: retry_count,
    labels stamped by gates, routing filled by the poller.
    """

    delivery: Delivery
    delay: float


class Transport(Protocol):
    kind: str
    queues: Sequence[QueueSpec]

    def decode(self, delivery: Delivery) -> Envelope:
        """The delivery's envelope in this transport's wire format (raises InvalidMessage)."""
        ...

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Background upkeep (leases, retry moves, subscriptions) until cancelled."""
        ...

    async def fetch(self, queue: QueueSpec, limit: int, wait: float) -> list[Delivery]:
        """Up to ``limit`` messages, waiting at most ``wait`` s for the first; [] if none."""
        ...

    async def complete(self, items: Sequence[Completion]) -> None:
        """Durably write each result and acknowledge its message, atomically per message."""
        ...

    async def defer(self, items: Sequence[Deferral]) -> None:
        """Hand messages back, each due after its delay (0 = at once)."""
        ...

    async def dead_letter(self, delivery: Delivery, reason: str, detail: str) -> None:
        """Park a message that has no usable id, with the reason; acknowledge it."""
        ...

    async def is_cancelled(self, delivery: Delivery) -> bool: ...

    async def backlog(self, queue: QueueSpec) -> int | None:
        """Messages waiting on the broker for ``queue``, or None when unknown."""
        ...

    async def health(self) -> None:
        """Raise TransportError when the broker cannot be used."""
        ...

    async def aclose(self) -> None: ...


@runtime_checkable
class ReadsBacklogs(Protocol):
    """Optional: every queue's backlog in one go, with the deadlines' proximity (the
    sorted set). A queue whose read failed maps to None; a failure of all raises."""

    async def backlogs(
        self, queues: Sequence[QueueSpec], now: float
    ) -> dict[str, Backlog | None]: ...


@dataclass(slots=True)
class TransportContext:
    """Process-wide settings a transport may need."""

    max_message_bytes: int = 4 * 1024 * 1024
    metrics: Metrics | None = None
    # The pools' gate parameters: their Redis keys are the daemon's own (never a result list).
    gate_params: Sequence[Mapping[str, Any]] = ()

    def count_duplicate(self, queue: QueueSpec) -> None:
        """A result not written because its submission was already answered."""
        if self.metrics is not None:
            self.metrics.duplicates_suppressed_total.labels(queue.id, queue.name, queue.pool).inc()


@runtime_checkable
class Abandons(Protocol):
    """A transport that keeps its deliveries leased itself (heartbeats, lease extension)."""

    def abandon(self, delivery: Delivery, reason: str) -> None:
        """Stop keeping ``delivery`` leased (logged and counted): its lease expires and the
        broker hands the message out again, so another attempt finishes it."""
        ...


@runtime_checkable
class LetsGo(Protocol):
    """A transport that gets a message's bytes back from the broker when it needs them
    again (a hand-back's re-encoding, a dead letter, a lapsed lease's removal), so a
    delivery need not hold them while its request waits at the gateway."""

    def let_go(self, delivery: Delivery) -> None:
        """Drop the delivery's bytes and its payload's view of them. Called with its
        request about to be written: the HTTP client holds the body until it is."""
        ...


@runtime_checkable
class LoadsPayloads(Protocol):
    """A transport whose messages may keep their payload apart from the envelope
    (redis-sortedset: upstream's payload keys). The poller asks for the payloads of the
    messages its queue gate let through, all of a fetch's together, before they go on."""

    def stored_apart(self, delivery: Delivery) -> bool:
        """Whether the decoded delivery's payload must be loaded before it is dispatched."""
        ...

    async def load_payloads(self, deliveries: Sequence[Delivery]) -> list[Result | None]:
        """Per delivery: None once its payload is in its request, else the result it ends
        with (the payload missing or unusable). Raises ``TransportError``."""
        ...


@runtime_checkable
class LimitsResults(Protocol):
    """A transport that carries a result only up to ``max_result_bytes`` encoded, less than
    ``dispatch.MAX_RESPONSE_BYTES``: a bigger answer becomes an INFERENCE_ERROR naming its
    size instead of a write that fails on every retry until the deadline."""

    max_result_bytes: int


@runtime_checkable
class WatchesCancels(Protocol):
    """A transport with cancel markers that can read many of them in one round trip."""

    async def cancelled(self, deliveries: Sequence[Delivery]) -> list[bool]:
        """Per delivery, whether its producer has cancelled it (raises TransportError)."""
        ...


@runtime_checkable
class DiscoversQueues(Protocol):
    """A transport whose queue list can change while running (``queue_discovery``)."""

    async def discover(self) -> list[QueueSpec]:
        """The discovered queues to poll now (raises TransportError)."""
        ...


@runtime_checkable
class ReloadsQueues(Protocol):
    """A transport whose configured queues a hot reload may change (redis-sortedset)."""

    async def reconfigure(self, config: Any) -> None:
        """Serve ``config`` (its queues changed, nothing else; raises TransportError)."""
        ...


@runtime_checkable
class SignalsMessages(Protocol):
    """A transport that can say when an empty queue may hold messages again, so a poller
    waits for that instead of fetching again every poll interval (redis-sortedset)."""

    async def until_ready(self, queue: QueueSpec) -> None:
        """Return once ``queue`` may hold messages: at once unless a fetch found it empty."""
        ...


def abandon(transport: Transport, delivery: Delivery, reason: str) -> None:
    """Give a delivery whose write was given up back to the broker's redelivery
    (docs/architecture.md G11); a transport that holds no leases of its own needs nothing done."""
    if isinstance(transport, Abandons):
        transport.abandon(delivery, reason)


# Only the module of the transport in use is imported, so a Redis deployment never loads
# the Pub/Sub client libraries.
TRANSPORTS: Registry[Transport, TransportContext] = Registry(
    "transport",
    modules={
        "redis-sortedset": "async_processor.transports.redis_sortedset.transport",
        "redis-pubsub": "async_processor.transports.redis_pubsub",
        "gcp-pubsub": "async_processor.transports.gcp_pubsub.transport",
    },
)
