"""Running queues: each queue's poller under its own cancel scope, so the queue list can
change while the daemon runs (hot reload, queue discovery).

Stage: wiring, beside the pollers. Input: queues to start (the configured ones at startup,
then those a reload or a discovery refresh adds) and queues to stop, each under a key
(``("configured", id)``, ``("discovered", name)``). Output: their pollers running in the
pollers' task group; a queue started later gets its merge source through its pool's feed
(the merge policies take sources while running) and one more pool slot.

A stopped queue's poller is cancelled: it hands back what it fetched and has not
forwarded (a claim in the making completes first, the transport shields it), then closes
its lane; the merge and the workers finish what was forwarded, so nothing is lost and no
claim is left behind. Once it has drained, its ``forget`` frees what was kept for it
(gate entry, metric series) unless another poller serves that queue meanwhile (a changed
queue's new poller, a discovered queue configured by a reload, one found again).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import anyio
from anyio.abc import ObjectReceiveStream, TaskGroup
from anyio.streams.memory import MemoryObjectSendStream

from async_processor.config.queues import QueueSpec
from async_processor.gates.owners import QueueGates
from async_processor.merge.base import Source
from async_processor.metrics import Metrics
from async_processor.pipeline.capacity import PoolCapacity
from async_processor.pipeline.poller import Poller

Wire = Callable[[QueueSpec], tuple[Source, Poller]]
Forget = Callable[[QueueSpec], None]
Key = tuple[str, str]  # (origin, id or name)
CONFIGURED = "configured"


def configured_key(queue: QueueSpec) -> Key:
    """A configured queue's key: its id, else its name. Pub/Sub queues have no id: under
    one key, the second replaced the first, which was never polled while the merge waited
    on its lane (the demo over redis-pubsub and gcp-pubsub answered nothing)."""
    return (CONFIGURED, queue.id or queue.name)


Labels = tuple[str, str, str]  # (queue_id, queue_name, pool_name)


@dataclass(slots=True)
class _Running:
    spec: QueueSpec
    poller: Poller
    forget: Forget
    sized: bool  # it took a pool slot of its own when started (given back when drained)
    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)


class RunningQueues:
    def __init__(
        self,
        wire: Wire,
        capacities: Mapping[str, PoolCapacity],
        gates: QueueGates,
        metrics: Metrics,
        upkeep: Callable[[], Iterable[QueueSpec]],
    ) -> None:
        self._wire = wire
        self._capacities = capacities
        self._gates = gates
        self._metrics = metrics
        self._feeds: dict[str, MemoryObjectSendStream[Source]] = {}  # by pool
        self._running: dict[Key, _Running] = {}
        self._tg: TaskGroup | None = None
        self._upkeep = upkeep  # the queues the transport still settles claims of
        # Removed queues whose bound series stay cached until no result of theirs can
        # land (a late one bound every series again: a dispatch_budget of 0 for a queue
        # nobody serves); freed by ``prune``, bound afresh if served again.
        self._retired: set[Labels] = set()

    def feed(self, pool: str) -> ObjectReceiveStream[Source]:
        """Where ``pool``'s merge takes the sources started later (``more``)."""
        self._feeds[pool], more = anyio.create_memory_object_stream[Source](1)
        return more

    def wire(self, key: Key, spec: QueueSpec, forget: Forget) -> Source:
        """A queue known at startup: its source goes to the merge with its pool's others
        (its slot is in the pool's size); its poller starts with ``begin``."""
        source, poller = self._wired(spec)
        self._running[key] = _Running(spec, poller, forget, sized=False)
        return source

    def begin(self, tg: TaskGroup) -> None:
        """Run the pollers wired so far, and those started later, in ``tg``."""
        self._tg = tg
        for entry in self._running.values():
            tg.start_soon(self._poll, entry)

    async def start(self, key: Key, spec: QueueSpec, forget: Forget) -> None:
        """Wire and run a queue found or configured while running (after ``begin``)."""
        assert self._tg is not None
        source, poller = self._wired(spec)
        entry = self._running[key] = _Running(spec, poller, forget, sized=True)
        self._capacities[spec.pool].resize(1)  # its message for the merge, as at startup
        await self._feeds[spec.pool].send(source)
        self._tg.start_soon(self._poll, entry)

    def _wired(self, spec: QueueSpec) -> tuple[Source, Poller]:
        labels = (spec.id, spec.name, spec.pool)
        if labels in self._retired:  # forgotten: fresh series, not the detached ones
            self._retired.discard(labels)
            self._metrics.rebind(labels)
        return self._wire(spec)

    def stop(self, key: Key) -> None:
        """Cancel the queue's poller (it hands back what it holds, then drains)."""
        entry = self._running.pop(key, None)
        if entry is not None:
            entry.scope.cancel()

    def keys(self, origin: str) -> list[str]:
        return [name for kind, name in self._running if kind == origin]

    def specs(self) -> list[QueueSpec]:
        """The queues polled now (not those still draining)."""
        return [entry.spec for entry in self._running.values()]

    def serving(self, name: str) -> list[QueueSpec]:
        """The running queues named ``name`` (a queue may be served under two keys)."""
        return [e.spec for e in self._running.values() if e.spec.name == name]

    def forget_discovered(self, queue: QueueSpec) -> None:
        """A removed discovered queue has drained: its gate entry and every series go
        (tenant churn must not grow the registry), unless it is served again."""
        if not self.serving(queue.name):
            self._gates.forget(queue.name)
            self._metrics.forget_queue(queue.name)
            self._retire(queue)

    def forget_configured(self, queue: QueueSpec) -> None:
        """A queue a reload removed or changed has drained: its gauges go unless a poller
        serves it under the same labels; its counters stay, as upstream's."""
        served = self.serving(queue.name)
        if not served:
            self._gates.forget(queue.name)
        if not any(q.id == queue.id and q.pool == queue.pool for q in served):
            labels = {"queue_id": queue.id, "pool_name": queue.pool}
            self._metrics.forget_queue(queue.name, gauges_only=True, **labels)
            self._retire(queue)

    def _retire(self, queue: QueueSpec) -> None:
        self._retired.add((queue.id, queue.name, queue.pool))

    def prune(self) -> None:
        """Free the cached series of removed queues the transport no longer keeps in
        upkeep: they hold no claim, so no result of theirs can land (churn must not grow
        the cache)."""
        kept = {queue.name for queue in self._upkeep()}
        for labels in [labels for labels in self._retired if labels[1] not in kept]:
            self._retired.discard(labels)
            self._metrics.rebind(labels)

    def close_feeds(self) -> None:
        """The pollers have stopped: the merges may finish once their sources have."""
        for feed in self._feeds.values():
            feed.close()

    async def _poll(self, entry: _Running) -> None:
        try:
            with entry.scope:
                await entry.poller.run()
        finally:
            if entry.sized:
                self._capacities[entry.spec.pool].resize(-1)
            entry.forget(entry.spec)
