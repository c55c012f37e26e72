"""An in-memory ``Transport``: a queue per ``QueueSpec``, results and hand-backs recorded.

For unit tests of the stages above the broker (admission, ``Processor``): no Redis, no
Pub/Sub, same seam. It keeps the contract's shape (docs/architecture.md G1): a fetched
message is held until ``complete``, ``defer`` or ``dead_letter``; ``defer`` puts it back
on its queue once its delay has passed (``run`` moves due ones, as the Redis mover does);
``complete`` keeps the first result per request id (G2).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence

import anyio
from anyio.abc import TaskStatus

from async_processor.config.queues import QueueSpec
from async_processor.messages import Envelope, Result, decode_envelope
from async_processor.transports.base import Completion, Deferral, Delivery

MOVE_INTERVAL = 0.01


class MemoryTransport:
    kind = "memory"

    def __init__(self, queues: Sequence[QueueSpec]) -> None:
        self.queues: Sequence[QueueSpec] = list(queues)
        self._waiting: dict[str, deque[bytes]] = {q.name: deque() for q in self.queues}
        self._arrived = anyio.Event()
        self.held: dict[int, Delivery] = {}  # id(delivery) -> delivery, until settled
        self.results: dict[str, Result] = {}  # request id -> its first result
        self.duplicates: list[Result] = []  # later results for an id already answered
        self.deferred: list[Deferral] = []
        self.dead_letters: list[tuple[bytes, str]] = []  # (raw, reason)
        self.cancelled_ids: set[str] = set()
        self._due: list[tuple[float, str, bytes]] = []  # (due at, queue name, raw)

    # ------------------------------------------------------------------ producer side

    def put(self, queue: str, *raws: bytes) -> None:
        self._waiting[queue].extend(raws)
        self._arrived.set()

    def waiting(self, queue: str) -> list[bytes]:
        """What is on ``queue``, not fetched."""
        return list(self._waiting[queue])

    def on_broker(self, queue: str) -> list[bytes]:
        """What ``queue`` holds once every hand-back is due: waiting plus deferred."""
        return [*self._waiting[queue], *(raw for _, name, raw in self._due if name == queue)]

    async def wait_results(self, count: int, timeout: float = 5.0) -> dict[str, Result]:
        with anyio.fail_after(timeout):
            while len(self.results) < count:
                await anyio.sleep(0.005)
        return self.results

    # ------------------------------------------------------------------ the seam

    def decode(self, delivery: Delivery) -> Envelope:
        envelope = decode_envelope(delivery.raw)
        envelope.routing.request_queue_name = delivery.queue.name
        return envelope

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            self._move_due()
            await anyio.sleep(MOVE_INTERVAL)

    async def fetch(self, queue: QueueSpec, limit: int, wait: float) -> list[Delivery]:
        waiting = self._waiting[queue.name]
        if not waiting:
            self._arrived = anyio.Event()
            with anyio.move_on_after(wait):
                await self._arrived.wait()
        taken = [waiting.popleft() for _ in range(min(limit, len(waiting)))]
        deliveries = [Delivery(queue=queue, raw=raw) for raw in taken]
        self.held.update((id(d), d) for d in deliveries)
        return deliveries

    async def complete(self, items: Sequence[Completion]) -> None:
        for delivery, result in items:
            self.held.pop(id(delivery), None)
            if result.id in self.results:
                self.duplicates.append(result)
            else:
                self.results[result.id] = result

    async def defer(self, items: Sequence[Deferral]) -> None:
        for item in items:
            delivery = self.held.pop(id(item.delivery))
            raw = delivery.envelope.encode() if delivery.envelope else delivery.raw
            self.deferred.append(item)
            self._due.append((time.monotonic() + item.delay, delivery.queue.name, raw))

    async def dead_letter(self, delivery: Delivery, reason: str, detail: str) -> None:
        self.held.pop(id(delivery), None)
        self.dead_letters.append((delivery.raw, reason))

    async def is_cancelled(self, delivery: Delivery) -> bool:
        return delivery.envelope is not None and delivery.envelope.id in self.cancelled_ids

    async def backlog(self, queue: QueueSpec) -> int | None:
        return len(self.waiting(queue.name))

    async def health(self) -> None:
        return None

    async def aclose(self) -> None:
        return None

    def _move_due(self) -> None:
        now = time.monotonic()
        due = [entry for entry in self._due if entry[0] <= now]
        self._due = [entry for entry in self._due if entry[0] > now]
        for _, queue, raw in due:
            self.put(queue, raw)
