"""The broker backlog poll: every queue's depth, and what else the transport can tell.

Stage: beside the pipeline, every ``--metrics-backlog-poll-interval``. Input: the
queues being served (discovered ones too, not those a reload removed). Output:
``broker_backlog`` and ``broker_backlog_source_available`` per queue and, from a
transport that reads every queue at once with the deadlines' proximity
(``ReadsBacklogs``: the sorted set, in two round trips whatever the number of queues),
``deadline_proximity_millis``. Other transports are asked queue by queue
(``Transport.backlog``); a queue whose transport cannot tell (None) gets no series.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import anyio
import structlog

from async_processor.backlog_metrics import Backlog
from async_processor.config.queues import QueueSpec
from async_processor.metrics import Metrics
from async_processor.transports.base import ReadsBacklogs, Transport

log = structlog.get_logger(__name__)

FAILED = None  # a queue's read failed


async def poll_backlogs(
    transport: Transport,
    polled: Callable[[], Sequence[QueueSpec]],
    metrics: Metrics,
    interval: float,
) -> None:
    """Every ``interval``, the backlog of the queues ``polled`` names at that moment."""
    while True:
        await read_backlogs(transport, list(polled()), metrics)
        await anyio.sleep(interval)


async def read_backlogs(transport: Transport, queues: list[QueueSpec], metrics: Metrics) -> None:
    """One round: every queue's reading recorded, or its failure."""
    together = isinstance(transport, ReadsBacklogs)
    if isinstance(transport, ReadsBacklogs):
        readings = await _all_at_once(transport, queues)
    else:
        readings = await _each(transport, queues)
    for queue in queues:
        if queue.name not in readings:  # the transport cannot tell
            continue
        bound = metrics.queue(queue.id, queue.name, queue.pool)
        reading = readings[queue.name]
        if reading is FAILED:
            metrics.backlog.failed(bound.labels, proximity=together)
            continue
        bound.broker_backlog.set(reading.depth)
        metrics.backlog.read(bound.labels, reading)


async def _all_at_once(
    transport: ReadsBacklogs, queues: list[QueueSpec]
) -> dict[str, Backlog | None]:
    try:
        return await transport.backlogs(queues, time.time())
    except Exception as exc:  # the broker is away: every queue's read failed
        log.warning("backlog_poll_failed", queues=len(queues), error=str(exc))
        return dict.fromkeys((q.name for q in queues), FAILED)


async def _each(transport: Transport, queues: list[QueueSpec]) -> dict[str, Backlog | None]:
    """Queue by queue; a queue whose transport cannot tell (None) is left out."""
    readings: dict[str, Backlog | None] = {}
    for queue in queues:
        try:
            depth = await transport.backlog(queue)
        except Exception as exc:
            log.warning("backlog_poll_failed", queue=queue.name, error=str(exc))
            readings[queue.name] = FAILED
            continue
        if depth is not None:
            readings[queue.name] = Backlog(depth)
    return readings
