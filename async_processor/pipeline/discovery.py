"""Queue discovery, processor side: the pollers follow the transport's queue list.

Stage: wiring, beside the pollers. Input: ``transport.discover()`` every
``refresh_seconds``. Output: for a new queue, a poller and a merge source (and one more
slot in its pool, as for a configured queue); for a removed one, its poller cancelled,
and once it has drained, what was kept for the queue freed (``forget``: its gate entry and
metric series) unless it was found again meanwhile.
A cancelled poller hands back what it fetched and has not forwarded (a claim in the
making completes first, the transport shields it), then closes its lane; the merge and
the workers finish what was forwarded, so nothing is lost and no claim is left behind.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping

import anyio
import structlog
from anyio.abc import TaskGroup
from anyio.streams.memory import MemoryObjectSendStream

from async_processor.config.queues import QueueSpec
from async_processor.errors import TransportError
from async_processor.merge.base import Source
from async_processor.pipeline.capacity import PoolCapacity
from async_processor.pipeline.poller import Poller

log = structlog.get_logger(__name__)

Wire = Callable[[QueueSpec], tuple[Source, Poller]]
Forget = Callable[[QueueSpec], None]


class QueueRefresh:
    def __init__(
        self,
        discover: Callable[[], Awaitable[list[QueueSpec]]],
        wire: Wire,
        forget: Forget,
        capacities: Mapping[str, PoolCapacity],
        interval: float,
    ) -> None:
        self._discover = discover
        self._wire = wire
        self._forget = forget
        self._capacities = capacities
        self._interval = interval
        # pool -> where its merge policy takes sources added later
        self.feeds: dict[str, MemoryObjectSendStream[Source]] = {}
        self._running: dict[str, anyio.CancelScope] = {}

    @property
    def running(self) -> list[str]:
        return list(self._running)

    async def run(self, tg: TaskGroup) -> None:
        """Refresh until cancelled; pollers run in ``tg`` (the pollers' group)."""
        try:
            while True:
                await self.refresh(tg)
                await anyio.sleep(self._interval)
        finally:
            for feed in self.feeds.values():  # the merges may finish once the pollers have
                feed.close()

    async def refresh(self, tg: TaskGroup) -> None:
        try:
            specs = await self._discover()
        except TransportError as exc:  # keep polling what we have; try again next time
            log.warning("queue_discovery_failed", error=str(exc))
            return
        wanted = {spec.name: spec for spec in specs}
        for name in [n for n in self._running if n not in wanted]:
            log.info("queue_removed", queue=name)
            self._running.pop(name).cancel()
        for spec in specs:
            if spec.name not in self._running:
                await self._start(spec, tg)

    async def _start(self, spec: QueueSpec, tg: TaskGroup) -> None:
        source, poller = self._wire(spec)
        scope = anyio.CancelScope()
        self._running[spec.name] = scope
        capacity = self._capacities[spec.pool]
        capacity.resize(1)  # its message for the merge, as for a configured queue
        await self.feeds[spec.pool].send(source)
        tg.start_soon(self._poll, spec, poller, scope, capacity)
        log.info("queue_added", queue=spec.name, pool=spec.pool)

    async def _poll(
        self, spec: QueueSpec, poller: Poller, scope: anyio.CancelScope, capacity: PoolCapacity
    ) -> None:
        try:
            with scope:
                await poller.run()
        finally:
            capacity.resize(-1)
            if spec.name not in self._running:  # removed, not found again meanwhile
                self._forget(spec)
