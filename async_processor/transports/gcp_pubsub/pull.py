"""The pull side of gcp-pubsub: unary pulls, read once from the raw protobuf, and a
read-ahead per subscription sized by the measured pull round trip.

Stage: fetch for ``gcp_pubsub``. Input: the poller's ``fetch(queue, limit, wait)``.
Output: held ``Delivery`` objects (in the transport's ``Leases``, so extended).

Why a read-ahead: the pool's prefetch (a quarter of the workers, at most 256) covers a
few pull round trips, but a loaded Pub/Sub answers a pull late at times (on a loaded
machine the emulator took 83 ms at the median and 0.6 s at p95), and every late answer
left workers idle. So each subscription keeps about rate x the p95 pull round trip
messages pulled and leased ahead (at most ``READ_AHEAD_MAX``): a fetch takes from them at
once and the refill pulls run behind it. They are handed back (nacked, redelivered at
once) when no fetch came for ``READ_AHEAD_IDLE`` (a closed gate, a drain) and on close.
Not under a dead-letter policy: there a hand-back spends a delivery attempt, and
``max_delivery_attempts`` of them would dead-letter a message nobody processed.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio
from google.api_core import exceptions as gexc
from google.pubsub_v1 import SubscriberAsyncClient
from google.pubsub_v1.types import PullResponse

from async_processor.config.queues import QueueSpec
from async_processor.errors import TransportError
from async_processor.transports.base import Delivery
from async_processor.transports.gcp_pubsub.leases import Leases, Receipt
from async_processor.transports.gcp_pubsub.publish import RPC_TIMEOUT, RpcScope

MIN_ACK_DEADLINE = 10  # Pub/Sub's minimum (and default)
PULL_GRACE = 1.0  # the pull RPC deadline is the fetch's wait plus this
MAX_PULL = 1000  # Pub/Sub's limit on max_messages per pull
READ_AHEAD_MAX = 1000  # messages held ahead per subscription: one full pull
# s without a fetch after which the read-ahead is handed back: longer than the lull
# between waves of answers at a 1 s gateway (0.5 s handed back and pulled again 2-5 % of
# the messages of bench.pubsub's 1 s cells).
READ_AHEAD_IDLE = 2.0
RATE_WINDOW = 2.0  # s of fetches the rate is measured over
RTT_SAMPLES = 64  # pull round trips the p95 is taken over
REFILL_PULLS = 2  # refill pulls in flight per subscription (an answer may come short)

HandBack = Callable[[list[Delivery], str], Awaitable[None]]


@dataclass(slots=True)
class ReadAhead:
    """One subscription's messages pulled before a fetch asked, and what sizes them."""

    ready: deque[Delivery] = field(default_factory=deque)
    pending: int = 0  # asked for by refill pulls under way
    rtts: deque[float] = field(default_factory=lambda: deque(maxlen=RTT_SAMPLES))
    p95: float = 0.0  # of ``rtts``, kept as they come (read at every fetch)
    taken: deque[tuple[float, int]] = field(default_factory=deque)  # (when, count) fetched
    taken_sum: int = 0  # of ``taken``'s counts
    last_fetch: float = -math.inf
    short: anyio.Event = field(default_factory=anyio.Event)  # set when below target
    # Redeliveries count towards a dead-letter policy (or may: unknown): every hand-back
    # would spend one of each message's delivery attempts, so nothing is read ahead.
    counted: bool = False

    def measured(self, rtt: float) -> None:
        self.rtts.append(rtt)
        self.p95 = sorted(self.rtts)[int(len(self.rtts) * 0.95)]

    def target(self, now: float) -> int:
        """Messages to hold ahead: the fetch rate x the p95 pull round trip, bounded."""
        if self.counted:
            return 0
        while self.taken and self.taken[0][0] < now - RATE_WINDOW:
            self.taken_sum -= self.taken.popleft()[1]
        return min(READ_AHEAD_MAX, int(self.taken_sum / RATE_WINDOW * self.p95))

    def wanted(self, now: float) -> int:
        """How many to pull now: none until below the target, then up to twice it, so a
        refill pull brings a p95 round trip's worth at once, not the few just taken."""
        low, held = self.target(now), len(self.ready) + self.pending
        return 0 if held >= low else min(READ_AHEAD_MAX, 2 * low) - held

    def take(self, limit: int) -> list[Delivery]:
        return [self.ready.popleft() for _ in range(min(limit, len(self.ready)))]

    def took(self, count: int) -> None:
        self.last_fetch = now = time.monotonic()
        self.taken.append((now, count))
        self.taken_sum += count
        if self.wanted(now) > 0:
            self.short.set()


class Puller:
    """Pulls for the transport: through its client, RPC scope and leases."""

    def __init__(
        self,
        client: Callable[[], SubscriberAsyncClient],
        rpc: RpcScope,
        leases: Leases,
        hand_back: HandBack,
    ) -> None:
        self._client = client
        self._rpc = rpc
        self._leases = leases
        self._hand_back = hand_back  # nack at once, shielded and bounded
        self._ack_deadlines: dict[str, int] = {}  # subscription -> its own ack deadline
        self._ahead: dict[str, ReadAhead] = {}

    def ahead(self, subscription: str) -> ReadAhead:
        if (ahead := self._ahead.get(subscription)) is None:
            ahead = self._ahead[subscription] = ReadAhead()
        return ahead

    async def fetch(
        self, queue: QueueSpec, subscription: str, limit: int, wait: float
    ) -> list[Delivery]:
        """Up to ``limit`` from the read-ahead at once, else one Pull held up to ``wait`` s."""
        ahead = self.ahead(subscription)
        if ahead.ready:
            deliveries = ahead.take(limit)
        else:
            deliveries = await self.pull(queue, subscription, limit, wait + PULL_GRACE)
        ahead.took(len(deliveries))
        try:
            await anyio.lowlevel.checkpoint_if_cancelled()
        except anyio.get_cancelled_exc_class():
            await self._hand_back(deliveries, "cancelled_fetch")
            raise
        return deliveries

    async def pull(
        self, queue: QueueSpec, subscription: str, limit: int, timeout: float
    ) -> list[Delivery]:
        """One Pull; its round trip is measured when it brought messages (an empty one
        measures how long the server waited, not the network)."""
        lease = await self.ack_deadline(subscription)
        started = time.monotonic()
        # Shielded: a pull cancelled mid-flight strands its messages until their deadline.
        with anyio.CancelScope(shield=True), self._rpc(subscription, "pull"):
            try:
                response = await self._client().pull(
                    subscription=subscription, max_messages=limit, timeout=timeout, retry=None
                )
            except gexc.DeadlineExceeded:
                return []
        now = time.monotonic()
        # The raw protobuf: each proto-plus field access costs a marshalling step.
        received = PullResponse.pb(response).received_messages
        if received:
            self.ahead(subscription).measured(now - started)
        lease_until = now + lease
        return [self._hold(queue, subscription, m, lease_until) for m in received]

    def _hold(
        self, queue: QueueSpec, subscription: str, received: Any, lease_until: float
    ) -> Delivery:
        """Every field read once from the raw ``ReceivedMessage`` protobuf."""
        message = received.message
        published = message.publish_time
        held = Receipt(
            ack_id=received.ack_id,
            subscription=subscription,
            message_id=message.message_id,
            delivery_attempt=received.delivery_attempt,
            publish_time=published.seconds + published.nanos / 1e9,
            lease_until=lease_until,
        )
        delivery = Delivery(
            queue=queue, raw=message.data, handle=held, attributes=dict(message.attributes)
        )
        self._leases.hold(delivery)
        return delivery

    async def ack_deadline(self, subscription: str) -> int:
        """The subscription's own ack deadline (learned once; also proves it exists)."""
        known = self._ack_deadlines.get(subscription)
        if known is not None:
            return known
        try:
            with self._rpc(subscription, "get_subscription"):
                found = await self._client().get_subscription(
                    subscription=subscription, timeout=RPC_TIMEOUT, retry=None
                )
            deadline = int(found.ack_deadline_seconds) or MIN_ACK_DEADLINE
            counted = bool(found.dead_letter_policy.dead_letter_topic)
        except TransportError as exc:
            # roles/pubsub.subscriber may pull but not describe: assume the minimum, so the
            # first lease extension comes in time whatever the real deadline is, and a
            # dead-letter policy (no read-ahead, as before it existed).
            if not isinstance(exc.__cause__, gexc.PermissionDenied):
                raise
            deadline, counted = MIN_ACK_DEADLINE, True
        self.ahead(subscription).counted = counted
        self._ack_deadlines[subscription] = deadline
        return deadline

    # ------------------------------------------------------------------ read-ahead

    async def run(self, subscriptions: Sequence[tuple[QueueSpec, str]]) -> None:
        """Keep each subscription's read-ahead filled, until cancelled (then hand it back)."""
        try:
            async with anyio.create_task_group() as tg:
                for queue, subscription in subscriptions:
                    for _ in range(REFILL_PULLS):
                        tg.start_soon(self._refill, queue, subscription)
        finally:
            with anyio.CancelScope(shield=True):
                for subscription in self._ahead:
                    await self.release(subscription, "close")

    async def _refill(self, queue: QueueSpec, subscription: str) -> None:
        ahead = self.ahead(subscription)
        while True:
            await self._shortfall(ahead)
            now = time.monotonic()
            if now - ahead.last_fetch > READ_AHEAD_IDLE:
                await self.release(subscription, "idle")  # nobody takes them: hand back
                continue
            want = min(MAX_PULL, ahead.wanted(now))
            if want <= 0:
                continue
            ahead.pending += want
            try:
                got = await self.pull(queue, subscription, want, queue.poll_interval + PULL_GRACE)
            except TransportError:
                await anyio.sleep(queue.poll_interval)  # the poller's own fetch reports it
                continue
            finally:
                ahead.pending -= want
            ahead.ready.extend(got)

    async def _shortfall(self, ahead: ReadAhead) -> None:
        """Until a fetch leaves it short (or READ_AHEAD_IDLE passes, to look for idleness)."""
        idle = READ_AHEAD_IDLE if ahead.ready else math.inf
        with anyio.move_on_after(idle):
            await ahead.short.wait()
        if ahead.short.is_set():
            ahead.short = anyio.Event()

    async def release(self, subscription: str, why: str) -> None:
        """Hand back whatever is read ahead (nacked: redelivered at once)."""
        ahead = self.ahead(subscription)
        if ahead.ready:
            await self._hand_back(ahead.take(len(ahead.ready)), f"read_ahead_{why}")
