"""The unit handed between stages: a fetched, decoded, queue-admitted message.

Input: built by the poller. Output: read by the merge policy (which stamps headers),
the pool admission gate, the transforms and the dispatch worker.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from async_processor.gates.base import Releases
from async_processor.messages import Envelope
from async_processor.metrics import QueueMetrics
from async_processor.transports.base import Delivery, QueueSpec


@dataclass(slots=True, eq=False)
class Work:
    delivery: Delivery
    envelope: Envelope
    metrics: QueueMetrics
    # Reservations taken by the queue gate; given back when the message leaves the worker.
    releases: Releases = field(default_factory=Releases)
    # Headers stamped by the merge policy (fairness, priority, lane objective), in order.
    stamped_headers: list[tuple[str, str]] = field(default_factory=list)
    enqueued_at: float = field(default_factory=time.monotonic)

    @property
    def queue(self) -> QueueSpec:
        return self.delivery.queue
