"""Queue discovery, processor side: the pollers follow the transport's queue list.

Stage: wiring, beside the pollers. Input: ``transport.discover()`` every
``refresh_seconds``. Output: for a new queue, its poller started (``running``: a merge
source and one more pool slot, as for a configured queue); for a removed one, its poller
stopped, and once it has drained, what was kept for the queue freed (``forget``: its gate
entry and metric series) unless it is served again meanwhile (found again, or configured
by a hot reload). Nothing is lost and no claim is left behind (``running``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import anyio
import structlog

from async_processor.config.queues import QueueSpec
from async_processor.errors import TransportError
from async_processor.pipeline.running import Forget, RunningQueues

log = structlog.get_logger(__name__)

DISCOVERED = "discovered"


class QueueRefresh:
    def __init__(
        self,
        discover: Callable[[], Awaitable[list[QueueSpec]]],
        queues: RunningQueues,
        forget: Forget,
        interval: float,
    ) -> None:
        self._discover = discover
        self._queues = queues
        self._forget = forget
        self._interval = interval

    @property
    def running(self) -> list[str]:
        return self._queues.keys(DISCOVERED)

    async def run(self) -> None:
        """Refresh until cancelled (the pollers run in ``RunningQueues``' group)."""
        while True:
            await self.refresh()
            await anyio.sleep(self._interval)

    async def refresh(self) -> None:
        try:
            specs = await self._discover()
        except TransportError as exc:  # keep polling what we have; try again next time
            log.warning("queue_discovery_failed", error=str(exc))
            return
        wanted = {spec.name for spec in specs}
        running = self.running
        for name in [n for n in running if n not in wanted]:
            log.info("queue_removed", queue=name)
            self._queues.stop((DISCOVERED, name))
        for spec in specs:
            if spec.name not in running:
                await self._queues.start((DISCOVERED, spec.name), spec, self._forget)
                log.info("queue_added", queue=spec.name, pool=spec.pool)
        self._queues.prune()
