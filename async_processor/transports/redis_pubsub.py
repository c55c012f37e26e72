"""redis-pubsub transport (deprecated): channels in, a shared retry set, results PUBLISHed.

Stage: broker I/O for ``--transport redis-pubsub``. Input: ``RedisPubSubConfig`` (one
channel per queue; payload = envelope JSON or a bare request). Output: ``Delivery``
objects for the poller; results PUBLISHed on ``result_queue_name``; hand-backs in the
retry sorted set (the redis-sortedset format: member = envelope JSON, score = due time).

Real limits (Redis pub/sub itself, not fixable here; use redis-sortedset instead):
- every replica subscribed to a channel receives every message (fan-out: N replicas do
  the work N times; the dedup marker below still lets only one result through);
- a message published while nobody is subscribed (restart, reconnect) is lost, and so is
  a result published while nobody listens on the result channel;
- when this process stops reading (its buffer is full), Redis buffers for it up to its
  ``client-output-buffer-limit pubsub`` (default 32 MB hard, 8 MB for 60 s) and then
  disconnects it, dropping what it held.

Within those limits: no message is dropped by our own buffers (one bounded buffer per
channel; when it is full the subscriber stops reading the socket), due retries go back
within 250 ms straight into this process's buffer (no fan-out, no 30 s idle sleep), and
a lost subscription is re-made within a second. Moving due retries is idempotent (a pop
re-sent by redis-py after a lost reply gets the same batch), and a dead letter Redis
refuses is held and written again, not dropped.
"""

from __future__ import annotations

import itertools
import uuid
from collections import deque
from collections.abc import Sequence
from contextlib import suppress

import anyio
import structlog
from anyio.abc import TaskStatus
from redis.asyncio import Redis
from redis.asyncio.client import PubSub

from async_processor.config import RedisPubSubConfig
from async_processor.config.queues import QueueSpec
from async_processor.errors import InvalidMessage, TransportError
from async_processor.messages import Envelope, Result
from async_processor.redis import entries, keys
from async_processor.redis.conn import REDIS_AWAY, connect, redis_errors, warn_if_evicting
from async_processor.redis.scripts import lua_source
from async_processor.transports.base import (
    TRANSPORTS,
    Completion,
    Deferral,
    Delivery,
    TransportContext,
)

log = structlog.get_logger(__name__)

RETRY_CHECK_INTERVAL = 0.25  # seconds between looks at the retry set when nothing was due
RETRY_SCAN = 200  # due members examined per look
READ_TIMEOUT = 1.0  # a subscriber's read wakes this often (to notice cancellation)
RESUBSCRIBE_MAX_BACKOFF = 1.0
POP_RECORD_TTL = 60  # s a pop's record answers a re-sent pop (deleted once handed over)
# Dead letters Redis refused, held and written again (oldest first) by the retry mover;
# when this many wait, dead_letter waits too (backpressure onto the poller, not a drop).
DEAD_LETTER_HOLD = 1000
DEDUP_TTL_SECONDS = 86400
CLOSE_TIMEOUT = 10.0
DEPRECATION = (
    "redis-pubsub is deprecated (it is the default only as in the Go daemon): set "
    "--transport redis-sortedset (or ASYNC_PROCESSOR_TRANSPORT). Its limits: every replica "
    "receives every message (fan-out), and messages or results published while nobody is "
    "subscribed are lost."
)


class RedisPubSubTransport:
    kind = "redis-pubsub"

    def __init__(
        self, config: RedisPubSubConfig, ctx: TransportContext, *, client: Redis | None = None
    ) -> None:
        self.config = config
        self.queues: Sequence[QueueSpec] = config.queue_specs()
        self._ctx = ctx
        self._redis = client if client is not None else connect(config.redis_connection())
        self._publish_result = self._redis.register_script(lua_source("pubsub_publish_result"))
        self._defer = self._redis.register_script(lua_source("pubsub_defer"))
        self._pop_due = self._redis.register_script(
            lua_source("lib") + lua_source("pubsub_pop_due")
        )
        self._by_name = {q.name: q for q in self.queues}
        self._buffers: dict[str, _Buffer] = {}
        for queue in self.queues:
            self._buffers[queue.name] = _Buffer(queue.batch_size)
        self._subscribed = {q.name: False for q in self.queues}
        self._owner = uuid.uuid4().hex
        self._pops = itertools.count()
        self._held: deque[tuple[str, str]] = deque()  # (dead-letter key, entry) to write
        log.warning("redis_pubsub_deprecated", message=DEPRECATION)

    # ------------------------------------------------------------------ fetch and decode

    async def fetch(self, queue: QueueSpec, limit: int, wait: float) -> list[Delivery]:
        """Up to ``limit`` buffered messages, waiting up to ``wait`` s for the first."""
        if limit <= 0:
            return []
        buffer = self._buffers[queue.name]
        with anyio.move_on_after(wait):
            await buffer.wait_for_items()
        return buffer.take(limit)

    def decode(self, delivery: Delivery) -> Envelope:
        """The envelope; its channel is where it came from (and where retries return)."""
        delivery.envelope = entries.decode_queued(
            delivery.raw, delivery.queue, self._ctx.max_message_bytes
        )
        return delivery.envelope

    # ------------------------------------------------------------------ writes

    async def complete(self, items: Sequence[Completion]) -> None:
        """PUBLISH each result on the result channel, once per submission (dedup marker)."""
        if not items:
            return
        channel = self.config.result_queue_name
        with redis_errors("publish result"):
            async with self._redis.pipeline(transaction=False) as pipe:
                for delivery, result in items:
                    await self._publish_result(
                        keys=[keys.done_key(result.id, entries.fingerprint(delivery.envelope))],
                        args=[channel, result.encode(), DEDUP_TTL_SECONDS],
                        client=pipe,
                    )
                receivers = await pipe.execute()
        for (delivery, result), count in zip(items, receivers, strict=True):
            if count == 0:
                log.warning("result_published_without_subscriber", request_id=result.id)
            elif count < 0:
                self._duplicate(delivery, result)

    def _duplicate(self, delivery: Delivery, result: Result) -> None:
        """A submission already answered: by another replica (fan-out: every replica gets
        every message, so expect N - 1 per message with N replicas) or a redelivery.
        Logged at info, as fan-out makes it routine; counted as on redis-sortedset."""
        queue = delivery.queue
        log.info("duplicate_result_skipped", request_id=result.id, queue=queue.name)
        self._ctx.count_duplicate(queue)

    async def defer(self, items: Sequence[Deferral]) -> None:
        """Into the retry set, due after each delay; the mover brings them back."""
        if not items:
            return
        members = [(item, self._member(item.delivery)) for item in items]
        with redis_errors("defer"):
            async with self._redis.pipeline(transaction=False) as pipe:
                for item, member in members:
                    if member is not None:
                        await self._defer(
                            keys=[self.config.retry_queue_name],
                            args=[member, max(0.0, item.delay)],
                            client=pipe,
                        )
                await pipe.execute()
        for item, member in members:
            if member is None:
                await self.dead_letter(item.delivery, "malformed", "handed back undecodable")

    def _member(self, delivery: Delivery) -> bytes | None:
        """The envelope to retry (decoded now if it never was); None if it cannot be."""
        try:
            envelope = delivery.envelope or self.decode(delivery)
        except InvalidMessage:
            return None
        return envelope.encode()

    async def dead_letter(self, delivery: Delivery, reason: str, detail: str) -> None:
        """Park on ``<channel>:dead-letter`` as {reason, detail, raw, time, queue}.

        A channel keeps nothing: if Redis refuses the write, the entry is held and written
        again by the retry mover (a raise would lose the message)."""
        while len(self._held) >= DEAD_LETTER_HOLD:
            if await self.write_held():
                break
            await anyio.sleep(RETRY_CHECK_INTERVAL)
        name = delivery.queue.name
        entry = entries.dead_letter_entry(delivery.raw, name, reason, detail)
        self._held.append((keys.dead_letter_key(name), entry))
        await self.write_held()

    async def write_held(self) -> bool:
        """Write the held dead letters, oldest first; False while Redis refuses."""
        while self._held:
            key, entry = self._held[0]
            try:
                with redis_errors("dead_letter"):
                    await self._redis.lpush(key, entry)
            except TransportError as exc:
                log.warning("dead_letter_held", held=len(self._held), error=str(exc))
                return False
            self._held.popleft()
        return True

    # ------------------------------------------------------------------ queries

    async def is_cancelled(self, delivery: Delivery) -> bool:
        return (await self.cancelled([delivery]))[0]

    async def cancelled(self, deliveries: Sequence[Delivery]) -> list[bool]:
        """``request-cancel:<id>`` holding the message's ``request_token`` cancels it, as
        on redis-sortedset (the Go daemon reads no markers here; a message without a
        token cannot be cancelled). One MGET for all."""
        markers = [
            (keys.cancel_key(d.envelope.id), d.envelope.routing.request_token)
            if d.envelope
            else ("", "")
            for d in deliveries
        ]
        return await entries.marked_cancelled(self._redis, markers)

    async def backlog(self, queue: QueueSpec) -> int | None:
        return None  # a channel has no backlog to count

    async def health(self) -> None:
        """PING, and every channel subscribed right now."""
        with redis_errors("ping"):
            await self._redis.ping()
        lost = [name for name, ok in self._subscribed.items() if not ok]
        if lost:
            raise TransportError(f"redis-pubsub: not subscribed to {', '.join(lost)}")

    async def aclose(self) -> None:
        """Hand buffered, never fetched messages to the retry set (due now); close."""
        with anyio.CancelScope(shield=True), anyio.move_on_after(CLOSE_TIMEOUT):
            left = [d for buffer in self._buffers.values() for d in buffer.take(buffer.size)]
            if left:
                try:
                    await self.defer([Deferral(d, 0.0) for d in left])
                    log.info("buffered_messages_handed_back", count=len(left))
                except TransportError as exc:
                    log.warning("hand_back_on_close_failed", count=len(left), error=str(exc))
            if not await self.write_held():
                log.error("dead_letters_unwritten_at_close", count=len(self._held))
        await self._redis.aclose()

    # ------------------------------------------------------------------ upkeep

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """One subscriber per channel and the retry mover, until cancelled.

        Started once every channel had its first subscription attempt, so messages
        published after start-up are not missed when Redis is up.
        """
        async with anyio.create_task_group() as tg:
            for queue in self.queues:
                await tg.start(self._subscriber, queue)
            tg.start_soon(self._retry_mover)
            tg.start_soon(warn_if_evicting, self._redis)
            task_status.started()

    async def _subscriber(
        self, queue: QueueSpec, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Subscribe, pump into the buffer, re-subscribe quickly after any failure."""
        backoff = 0.05
        started = False
        while True:
            try:
                async with self._redis.pubsub(ignore_subscribe_messages=True) as pubsub:
                    await pubsub.subscribe(queue.name)
                    self._subscribed[queue.name] = True
                    log.info("channel_subscribed", channel=queue.name)
                    if not started:
                        task_status.started()
                        started = True
                    backoff = 0.05
                    await self._pump(pubsub, queue)
            except REDIS_AWAY as exc:
                log.warning("channel_subscription_lost", channel=queue.name, error=str(exc))
            finally:
                self._subscribed[queue.name] = False
            if not started:
                task_status.started()
                started = True
            await anyio.sleep(backoff)
            backoff = min(RESUBSCRIBE_MAX_BACKOFF, backoff * 2)

    async def _pump(self, pubsub: PubSub, queue: QueueSpec) -> None:
        buffer = self._buffers[queue.name]
        while True:
            message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=READ_TIMEOUT)
            if message is None or message.get("type") != "message":
                continue
            # Blocks while the buffer is full: backpressure onto the socket, never a drop.
            await buffer.put(Delivery(queue=queue, raw=bytes(message["data"])))

    async def _retry_mover(self) -> None:
        """Held dead letters first, then due retries; backs off while Redis refuses."""
        failures = 0
        while True:
            moved = 0
            try:
                if await self.write_held():
                    moved = await self.move_due()
                    failures = 0
                else:
                    failures += 1
            except TransportError as exc:
                failures += 1
                log.warning("retry_move_failed", error=str(exc), failures=failures)
            if not moved:
                await anyio.sleep(min(5.0, RETRY_CHECK_INTERVAL * 2**failures))

    async def move_due(self) -> int:
        """Pop due retries of our channels (as many as our buffers can take) into them."""
        room = [(name, buffer.room()) for name, buffer in self._buffers.items()]
        args: list[str | int] = [RETRY_SCAN, POP_RECORD_TTL]
        for name, free in room:
            args += [name, int(free)]
        if not any(free for _, free in room):
            return 0
        retry = self.config.retry_queue_name
        record = f"{retry}:pop:{self._owner}:{next(self._pops)}"
        # Shielded: cancelled between Redis popping and the reply arriving (the transport
        # stopping), the popped retries would be gone.
        with anyio.CancelScope(shield=True), redis_errors("retry move"):
            flat = await self._pop_due(keys=[retry, record], args=args)
        popped = [(flat[i].decode(), bytes(flat[i + 1])) for i in range(0, len(flat), 2)]
        await self._hand_over(popped)
        if popped:
            with suppress(*REDIS_AWAY):  # else it expires
                await self._redis.delete(record)
        return len(popped)

    async def _hand_over(self, popped: list[tuple[str, bytes]]) -> None:
        """Into the buffers; on cancellation, what was not handed over goes back due now."""
        sent = 0
        try:
            for name, member in popped:
                await self._buffers[name].put(Delivery(queue=self._by_name[name], raw=member))
                sent += 1
        finally:
            rest = popped[sent:]
            if rest:
                with anyio.CancelScope(shield=True), redis_errors("retry put back"):
                    await self._redis.zadd(
                        self.config.retry_queue_name, dict.fromkeys((m for _, m in rest), 0)
                    )  # score 0: due at once


class _Buffer:
    """Bounded FIFO between a channel's reader and ``fetch``.

    Not a memory object stream: there, a receive cancelled just as an item is handed to
    it (a fetch timing out, or stopped at shutdown) takes that item down with it. Here
    waiting never consumes anything; ``take`` is synchronous.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self._items: deque[Delivery] = deque()
        self._changed = anyio.Event()

    async def put(self, item: Delivery) -> None:
        """Append; waits while full (backpressure onto the socket)."""
        while len(self._items) >= self.size:
            await self._changed.wait()
        self._items.append(item)
        self._notify()

    async def wait_for_items(self) -> None:
        while not self._items:
            await self._changed.wait()

    def take(self, limit: int) -> list[Delivery]:
        out = [self._items.popleft() for _ in range(min(limit, len(self._items)))]
        if out:
            self._notify()
        return out

    def room(self) -> int:
        return self.size - len(self._items)

    def _notify(self) -> None:
        changed, self._changed = self._changed, anyio.Event()
        changed.set()


@TRANSPORTS.register("redis-pubsub", RedisPubSubConfig)
def build(config: RedisPubSubConfig, ctx: TransportContext) -> RedisPubSubTransport:
    return RedisPubSubTransport(config, ctx)
