"""Processor: wires the stages in one task group; start, ready, drain, stop.

Input: a validated ``AppConfig``. Output: a running daemon: pollers -> merge lanes ->
workers -> result writer, plus /healthz, /readyz, /metrics and broker upkeep.

Shutdown (SIGTERM): /readyz turns 503, pollers stop (handing back what they hold),
merge lanes flush to the workers, which hand back anything not yet started and finish
what is in flight within ``--drain-timeout``; past it, in-flight calls are cancelled
and handed back at once. A second signal hands back at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass
from functools import partial

import anyio
import structlog
from anyio.abc import TaskGroup, TaskStatus

from async_processor import __version__
from async_processor.broker_errors import counting_broker_errors
from async_processor.config import AppConfig, PoolConfig, SortedSetConfig
from async_processor.config.queues import QueueSpec
from async_processor.gates.base import GateContext, GateOwner
from async_processor.gates.owners import QueueGates, pool_gate
from async_processor.headers import DEFAULT_FAIRNESS_ATTRIBUTE
from async_processor.health import serve_health, serve_metrics
from async_processor.httpclients import build_http_client
from async_processor.httpclients.base import HttpClient
from async_processor.merge import build_merge_policy
from async_processor.merge.base import MergeContext, MergePolicy, Source
from async_processor.metrics import Metrics
from async_processor.pipeline.admission import PoolGate
from async_processor.pipeline.backlog import poll_backlogs
from async_processor.pipeline.cancels import CancelWatch
from async_processor.pipeline.capacity import PoolCapacity, ShedPause, lane_size, pool_slots
from async_processor.pipeline.discovery import QueueRefresh
from async_processor.pipeline.dispatch import DispatchSettings, stamped_header_names
from async_processor.pipeline.held import HeldWork
from async_processor.pipeline.idle_gates import IdleGates
from async_processor.pipeline.poller import Poller
from async_processor.pipeline.reload import QueueReload, ReloadMetrics
from async_processor.pipeline.results import ResultWriter
from async_processor.pipeline.running import RunningQueues, configured_key
from async_processor.pipeline.settle import Settler
from async_processor.pipeline.usage import TokenAccounting
from async_processor.pipeline.worker import Aborter, Worker
from async_processor.transforms import TransformChain, build_transform_chain
from async_processor.transforms.base import TransformContext
from async_processor.transports import build_transport
from async_processor.transports.base import (
    DiscoversQueues,
    ReloadsQueues,
    Transport,
    TransportContext,
)
from async_processor.work import Work

log = structlog.get_logger(__name__)

WRITER_FLUSH_TIMEOUT = 30.0


@dataclass(slots=True)
class _Pool:
    config: PoolConfig
    queues: list[QueueSpec]
    capacity: PoolCapacity
    gate: PoolGate | None
    held: HeldWork | None = None  # set when the pipeline starts (it settles to the writer)


class Processor:
    def __init__(
        self,
        config: AppConfig,
        *,
        metrics: Metrics | None = None,
        transport: Transport | None = None,
    ) -> None:
        self.config = config
        self.metrics = metrics or Metrics()
        self.metrics.set_build_info(__version__, config.transport)
        rt = config.runtime
        self.transport = transport or build_transport(
            config.transport,
            config.transport_config,
            TransportContext(
                max_message_bytes=rt.max_message_bytes,
                metrics=self.metrics,
                gate_params=[pool.gate_params for pool in config.pools],
            ),
        )
        self.gate_ctx = GateContext(
            owner=GateOwner(),
            metrics=self.metrics,
            prometheus_url=rt.prometheus_url,
            prometheus_cache_ttl=rt.prometheus_cache_ttl,
            request_timeout=rt.request_timeout,
        )
        self.merge_policy: MergePolicy = build_merge_policy(
            config.merge_policy, MergeContext(metrics=self.metrics)
        )
        self.queue_gates = QueueGates(self.gate_ctx)
        specs = [*config.queue_specs(), *_template(config)]
        for queue in specs:
            self.queue_gates.of(queue)  # every gate built (and checked) at startup
        # Idle queues' gates, read at the shortest poll interval (their gauges stay true).
        self._idle_gates = IdleGates(min((q.poll_interval for q in specs), default=1.0))
        self._discovery: QueueRefresh | None = None
        self._reload: QueueReload | None = None
        self._queues: RunningQueues | None = None  # set when the pipeline starts
        self.pools = [self._pool(p, config.queue_specs()) for p in config.effective_pools()]
        self.ready = False
        self.stopping = anyio.Event()
        self.health_port = 0
        self.metrics_port = 0
        self._stop_requested = anyio.Event()
        self._force = anyio.Event()
        self._aborter = Aborter()
        self._cancels = CancelWatch(self.transport)
        self._tokens = TokenAccounting(
            self.metrics.tokens_total,
            self.metrics.token_usage_invalid_total,
            str(config.merge_policy.parameters.get("fairness_attribute") or "")
            or DEFAULT_FAIRNESS_ATTRIBUTE,
            rt.tenant_label_limit,
            total=rt.tokens_kind_total,
        )

    # ------------------------------------------------------------------ lifecycle

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        rt = self.config.runtime
        async with AsyncExitStack() as stack:
            stack.enter_context(counting_broker_errors(self.metrics.broker_errors_total))
            stack.push_async_callback(self._close_gates)
            stack.push_async_callback(self.transport.aclose)
            workers = sum(p.config.workers for p in self.pools)
            http = build_http_client(rt.http_client, rt.tls, workers)
            stack.push_async_callback(http.aclose)
            transforms = await stack.enter_async_context(
                build_transform_chain(
                    self.config.transforms,
                    TransformContext(max_message_bytes=rt.max_message_bytes),
                ).opened()
            )
            async with anyio.create_task_group() as services:
                await self._start_services(services)
                await self._run_pipeline(http, transforms, task_status)
                services.cancel_scope.cancel()
        log.info("processor_stopped")

    def request_stop(self, *, force: bool = False) -> None:
        """Begin a graceful drain; ``force`` (a second signal) hands everything back now."""
        if not self.stopping.is_set():
            log.info("drain_started", drain_timeout=self.config.runtime.drain_timeout)
        self.ready = False
        self.stopping.set()
        self._stop_requested.set()
        if force:
            self._force.set()

    async def readiness(self) -> str | None:
        if not self.ready:
            return "draining" if self.stopping.is_set() else "starting"
        try:
            await self.transport.health()
        except Exception as exc:
            return f"transport unhealthy: {exc}"
        return None

    # ------------------------------------------------------------------ wiring

    async def _start_services(self, tg: TaskGroup) -> None:
        rt = self.config.runtime
        self.health_port = await tg.start(
            serve_health, rt.bind_address, rt.health_port, self.readiness
        )
        self.metrics_port = await tg.start(
            partial(
                serve_metrics,
                rt.bind_address,
                rt.metrics_port,
                self.metrics.registry,
                bearer_token=rt.metrics_bearer_token,
                renders=self.metrics.metrics_renders_total,
            )
        )
        await tg.start(self.transport.run)
        tg.start_soon(self._cancels.run)
        tg.start_soon(self._idle_gates.run)
        if rt.metrics_backlog_poll_interval > 0:
            tg.start_soon(
                poll_backlogs,
                self.transport,
                self._polled,
                self.metrics,
                rt.metrics_backlog_poll_interval,
            )

    async def _run_pipeline(
        self,
        http: HttpClient,
        transforms: TransformChain,
        task_status: TaskStatus[None],
    ) -> None:
        writer = ResultWriter(self.transport, metrics=self.metrics)
        async with anyio.create_task_group() as pipeline:
            pipeline.start_soon(writer.run)
            timer = anyio.CancelScope()
            pipeline.start_soon(self._drain_timer, timer)
            # Merge lanes and workers are never cancelled as a whole: at the drain timeout
            # only in-flight calls are cut, so everything buffered is still handed back.
            async with anyio.create_task_group() as work:
                queues = self._start_pools(work, writer, http, transforms)
                try:
                    await self._poll(queues, task_status)
                finally:
                    queues.close_feeds()  # the merges may finish once the pollers have
            timer.cancel()
            writer.close()
            pipeline.cancel_scope.deadline = anyio.current_time() + WRITER_FLUSH_TIMEOUT

    async def _poll(self, queues: RunningQueues, task_status: TaskStatus[None]) -> None:
        """The pollers, queue discovery and hot reload, until a stop is requested."""
        async with anyio.create_task_group() as polling:
            queues.begin(polling)
            if self._discovery is not None:
                await self._discovery.refresh()  # ready with what is listed
                polling.start_soon(self._discovery.run)
            if self._reload is not None:
                polling.start_soon(self._reload.run)
            self.ready = True
            log.info(
                "processor_ready",
                queues=[q.name for q in self.transport.queues],
                pools=[p.config.id for p in self.pools],
                health_port=self.health_port,
                metrics_port=self.metrics_port,
            )
            task_status.started()
            await self._stop_requested.wait()
            polling.cancel_scope.cancel()

    async def _drain_timer(self, scope: anyio.CancelScope) -> None:
        """Past ``--drain-timeout`` (or at a second signal) cut what is still in flight."""
        with scope:
            await self._stop_requested.wait()
            with anyio.move_on_after(self.config.runtime.drain_timeout):
                await self._force.wait()
            log.info("drain_timeout_reached", in_flight=len(self._aborter))
            self._aborter.abort()

    def _start_pools(
        self,
        tg: TaskGroup,
        writer: ResultWriter,
        http: HttpClient,
        transforms: TransformChain,
    ) -> RunningQueues:
        rt = self.config.runtime
        settings = DispatchSettings(
            rt.request_timeout,
            rt.deadline_header,
            stamped_header_names(self.config.merge_policy.parameters),
            rt.inference_ttl_header,
        )
        pools = {pool.config.id: pool for pool in self.pools}
        queues = self._queues = RunningQueues(
            lambda queue: self._wire_queue(pools[queue.pool], queue, writer),
            {pool_id: pool.capacity for pool_id, pool in pools.items()},
            self.queue_gates,
            self.metrics,
            lambda: self.transport.queues,
        )
        self._discovery = self._queue_refresh(queues)
        self._reload = self._queue_reload(queues)
        growing = self._discovery is not None or self._reload is not None
        for pool in self.pools:
            # One message between the merge and the workers: the merge chooses at each free
            # worker among every queue's offer (a buffer of one per queue held most of the
            # pool's slots, so it chose among the few queues left with an offer).
            sink, merged = anyio.create_memory_object_stream[Work](1)
            settler = self._settler(writer, pool.capacity)
            pool.held = HeldWork(settler)
            sources = [
                queues.wire(configured_key(q), q, queues.forget_configured) for q in pool.queues
            ]
            more = queues.feed(pool.config.id) if growing else None
            tg.start_soon(self.merge_policy.run, pool.config.id, sources, sink, more)
            worker = Worker(
                pool=pool.config.id,
                settings=settings,
                http=http,
                transport=self.transport,
                settler=settler,
                transforms=transforms,
                stopping=self.stopping,
                aborter=self._aborter,
                held=pool.held,
                pool_gate=pool.gate,
                shed_pause=ShedPause(rt.shed_pause),
                cancels=self._cancels,
                tokens=self._tokens,
            )
            tg.start_soon(worker.serve, pool.config.workers, merged)
        return queues

    def _queue_refresh(self, queues: RunningQueues) -> QueueRefresh | None:
        discovery = getattr(self.config.transport_config, "queue_discovery", None)
        if discovery is None or not isinstance(self.transport, DiscoversQueues):
            return None
        return QueueRefresh(
            self.transport.discover, queues, queues.forget_discovered, discovery.refresh_seconds
        )

    def _queue_reload(self, queues: RunningQueues) -> QueueReload | None:
        if not self.config.runtime.transport_config_watch_interval:
            return None
        assert isinstance(self.transport, ReloadsQueues)  # config.load: redis-sortedset only
        return QueueReload(
            self.config,
            transport=self.transport,
            gates=self.queue_gates,
            queues=queues,
            forget=queues.forget_configured,
            metrics=ReloadMetrics(self.metrics.registry),
            applied=lambda config: setattr(self, "config", config),
        )

    def _wire_queue(
        self, pool: _Pool, queue: QueueSpec, writer: ResultWriter
    ) -> tuple[Source, Poller]:
        """A queue's lane (the merge's source) and its poller."""
        assert pool.held is not None  # the pipeline is running: _start_pools made it
        workers, queues = pool.config.workers, len(pool.queues)
        lane = lane_size(queue, pool.capacity.slots, workers, queues)
        lane_in, lane_out = anyio.create_memory_object_stream[Work](lane)
        poller = Poller(
            queue=queue,
            transport=self.transport,
            gate=self.queue_gates.of(queue),
            settler=self._settler(writer, pool.capacity),
            lane=lane_in,
            metrics=self.metrics.queue(queue.id, queue.name, pool.config.id),
            held=pool.held,
            idle_gates=self._idle_gates,
            bound_in_flight=self.config.runtime.budget_scope == "in-flight",
            gate_wait=self.config.runtime.effective_gate_wait_timeout,
        )
        return Source(queue, lane_out), poller

    def _settler(self, writer: ResultWriter, capacity: PoolCapacity) -> Settler:
        return Settler(transport=self.transport, writer=writer.sender(), capacity=capacity)

    def _pool(self, config: PoolConfig, queues: Sequence[QueueSpec]) -> _Pool:
        self.metrics.pool_worker_limit.labels(config.id).set(config.workers)
        gate = None
        if config.gate_type:
            gate = PoolGate(
                pool_gate(config, self.gate_ctx),
                self.metrics.pool(config.id),
                self.config.runtime.effective_gate_wait_timeout,
            )
        mine = [q for q in queues if q.pool == config.id]
        return _Pool(config, mine, PoolCapacity(pool_slots(config.workers, len(mine))), gate)

    def _polled(self) -> Sequence[QueueSpec]:
        """The queues the backlog poll reads: discovered ones too, not those removed."""
        return self._queues.specs() if self._queues else self.transport.queues

    async def _close_gates(self) -> None:
        for close in self.gate_ctx.closers:
            with anyio.CancelScope(shield=True):
                await close()


def _template(config: AppConfig) -> list[QueueSpec]:
    """The discovery template as a queue, so its gate is checked at startup."""
    transport = config.transport_config
    return transport.template_specs() if isinstance(transport, SortedSetConfig) else []
