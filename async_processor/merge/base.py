"""The merge seam: a pool's per-queue streams in, one bounded stream per pool out.

Input: ``(QueueSpec, receive stream of Work)`` for each queue of one pool. Output: Work
sent into the pool's stream, with ``stamped_headers`` set (fairness, priority, lane
objective). A policy's ``run`` returns when every source is closed, and closes the sink.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from anyio.abc import ObjectReceiveStream, ObjectSendStream

from async_processor.registry import Registry
from async_processor.transports.base import QueueSpec
from async_processor.work import Work, put

if TYPE_CHECKING:
    from async_processor.metrics import Metrics


@dataclass(frozen=True, slots=True)
class Source:
    queue: QueueSpec
    stream: ObjectReceiveStream[Work]


class MergePolicy(Protocol):
    async def run(self, pool: str, sources: Sequence[Source], sink: ObjectSendStream[Work]) -> None:
        """Merge until every source is closed, then close ``sink``."""
        ...


@dataclass(slots=True)
class MergeContext:
    metrics: Metrics | None = None


MERGE_POLICIES: Registry[MergePolicy, MergeContext] = Registry(
    "merge policy",
    plugins=[
        f"async_processor.merge.{name}"
        for name in ("random_robin", "tier_priority", "weighted_fair")
    ],
)


async def emit(sink: ObjectSendStream[Work], work: Work) -> None:
    """Send ``work`` into the pool's stream, counting it in ``queue_depth`` while it waits.

    The worker decrements ``queue_depth`` on pickup. The gauge goes up before the send so a
    fast worker never sees it below zero; a send that fails takes the count back.
    """
    work.picked()
    work.metrics.queue_depth.inc()
    try:
        await put(sink, work)
    except BaseException:
        work.metrics.queue_depth.dec()
        raise
