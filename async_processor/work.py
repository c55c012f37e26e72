"""The unit handed between stages: a fetched, decoded, queue-admitted message.

Input: built by the poller. Output: read by the merge policy (which stamps headers),
the pool admission gate, the transforms and the dispatch worker.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import anyio
from anyio.abc import ObjectReceiveStream, ObjectSendStream
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from async_processor.config.queues import QueueSpec
from async_processor.gates.base import Releases
from async_processor.messages import Envelope
from async_processor.metrics import QueueMetrics
from async_processor.transports.base import Delivery

T = TypeVar("T")

# ``Work.held``: where a message is for ``pipeline.held`` (its deadline's expiry).
FREE, HELD, TAKEN, ANSWERED = 0, 1, 2, 3


@dataclass(slots=True, eq=False)
class Work:
    delivery: Delivery
    envelope: Envelope
    metrics: QueueMetrics
    # Reservations taken by the queue gate; given back when the message leaves the worker.
    releases: Releases = field(default_factory=Releases)
    # Headers stamped by the merge policy (fairness, priority, lane objective), in order.
    stamped_headers: list[tuple[str, str]] = field(default_factory=list)
    # Called once when the merge policy takes it (the poller counts what still waits).
    picked: Callable[[], None] = field(default=lambda: None)
    # FREE (not held), HELD (waiting in memory for a worker), TAKEN (by a worker) or
    # ANSWERED (at its deadline, while held: whoever meets it passes it by).
    held: int = FREE

    @property
    def answered(self) -> bool:
        return self.held == ANSWERED

    @property
    def queue(self) -> QueueSpec:
        return self.delivery.queue


async def put(stream: ObjectSendStream[T], item: T) -> None:
    """Send; when the buffer has room, without a trip through the event loop.

    anyio's ``send`` always yields to the loop first (a checkpoint). Each message crosses
    three hand-offs, so on the hot path that was three extra loop iterations per message.
    """
    if not put_nowait(stream, item):
        await stream.send(item)


def put_nowait(stream: ObjectSendStream[T], item: T) -> bool:
    """Send if the buffer has room now (a memory stream); False, and nothing sent, if not."""
    if not isinstance(stream, MemoryObjectSendStream):
        return False
    try:
        stream.send_nowait(item)
    except anyio.WouldBlock:
        return False
    return True


async def take(stream: ObjectReceiveStream[T]) -> T:
    """Receive; at once when something is buffered (see ``put``). EndOfStream when done."""
    if isinstance(stream, MemoryObjectReceiveStream):
        try:
            item: T = stream.receive_nowait()
            return item
        except anyio.WouldBlock:
            pass
    return await stream.receive()
