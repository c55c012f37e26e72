"""The merge seam: a pool's per-queue streams in, one bounded stream per pool out.

Input: ``(QueueSpec, receive stream of Work)`` for each queue of one pool, and (with queue
discovery) a stream of sources added while running. Output: Work sent into the pool's
stream, with ``stamped_headers`` set (fairness, priority, lane objective). A policy's
``run`` returns when every source (and ``more``) is closed, and closes the sink.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from anyio.abc import ObjectReceiveStream, ObjectSendStream
from pydantic import BaseModel, ConfigDict, Field, field_validator

from async_processor.config.queues import QueueSpec
from async_processor.headers import (
    DEFAULT_FAIRNESS_ATTRIBUTE,
    DEFAULT_FAIRNESS_HEADER,
    check_header_name,
    fairness_id,
)
from async_processor.messages import Envelope
from async_processor.registry import Registry
from async_processor.work import Work, put

if TYPE_CHECKING:
    from async_processor.metrics import Metrics


class MergeParams(BaseModel):
    """Params every merge policy takes: the fairness pair. Unknown fields are errors."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # None (absent or JSON null) means the default header; "" turns stamping off.
    fairness_header: str | None = Field(default=None, validate_default=True)
    fairness_attribute: str = DEFAULT_FAIRNESS_ATTRIBUTE

    @field_validator("fairness_header")
    @classmethod
    def _fairness_header(cls, value: str | None) -> str:
        if value is None:
            return DEFAULT_FAIRNESS_HEADER
        return check_header_name(value) if value else ""

    @field_validator("fairness_attribute")
    @classmethod
    def _fairness_attribute(cls, value: str) -> str:
        return value or DEFAULT_FAIRNESS_ATTRIBUTE

    def fairness_stamp(self, envelope: Envelope) -> tuple[str, str] | None:
        """The fairness header for this message, or None to leave caller headers alone."""
        if not self.fairness_header:
            return None
        value = fairness_id(envelope.request.metadata, self.fairness_attribute)
        return None if value is None else (self.fairness_header, value)


@dataclass(frozen=True, slots=True)
class Source:
    queue: QueueSpec
    stream: ObjectReceiveStream[Work]


class MergePolicy(Protocol):
    async def run(
        self,
        pool: str,
        sources: Sequence[Source],
        sink: ObjectSendStream[Work],
        more: ObjectReceiveStream[Source] | None = None,
    ) -> None:
        """Merge until every source (and ``more``, the sources added later) is closed,
        then close ``sink``."""
        ...


class Readers(Protocol):
    """A policy's count of its open source readers."""

    open_readers: int

    def reader_done(self) -> None: ...


async def admit_sources(
    more: ObjectReceiveStream[Source], readers: Readers, start: Callable[[Source], None]
) -> None:
    """Start a reader (``start``) for each source arriving on ``more``; ``more`` counts as
    one open reader until it is closed, so the policy does not finish before it."""
    try:
        async with more:
            async for source in more:
                readers.open_readers += 1
                start(source)
    finally:
        readers.reader_done()


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
    fast worker never sees it below zero; a send that fails takes the count back. A message
    answered at its deadline while it waited here (``pipeline.held``) is passed by.
    """
    work.picked()
    if work.answered:
        return
    work.metrics.queue_depth.inc()
    try:
        await put(sink, work)
    except BaseException:
        work.metrics.queue_depth.dec()
        raise
