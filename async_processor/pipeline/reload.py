"""Hot reload of the sorted-set queues (``--transport-config-watch-interval``, upstream #407).

Stage: wiring, beside the pollers. Input: the transport config file, read at once and
then every interval. Output: its ``queues`` served without a restart (``running``):
queues are matched by ``id`` (the queue name when it has none); an unchanged one keeps
its poller, gate and lane; a changed one gets new ones (its old poller stops as a removed
one does); an added one starts (in any pool, beside discovered queues); a removed one
stops: its poller hands back what it has not forwarded, what was forwarded is answered,
its claims stay renewed, reaped and settled (the transport keeps it in upkeep until it
holds none), what waits on the broker stays there, and once it has drained its gauges go
(its counters stay, as upstream's).

Upstream's rules: only ``queues`` may change; any other change is refused ("restart
required"). Every failure (unreadable file, malformed JSON, a validation error, an
unknown pool, a gate that does not build, Redis refusing the removal's record) keeps the
last good config, is logged, and counts ``queue_config_reloads_total{result="error"}``;
an applied one counts ``success`` and sets ``queue_config_last_success_timestamp_seconds``.
A file that did not change (or changed back) does nothing. A Kubernetes ConfigMap mounted
as a file is updated in place by the kubelet: the next pass applies it, no restart.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import anyio
import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge

from async_processor.config import AppConfig, reread_transport_config
from async_processor.config.queues import QueueSpec
from async_processor.errors import ConfigError
from async_processor.gates.base import Gate
from async_processor.gates.owners import QueueGates
from async_processor.metrics import PREFIX
from async_processor.pipeline.running import Forget, RunningQueues, configured_key
from async_processor.transports.base import ReloadsQueues

log = structlog.get_logger(__name__)

RESULTS = ("success", "error")  # upstream's label values


class ReloadMetrics:
    """The two families upstream exports for reloads, every label value at 0 from start."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.reloads_total = Counter(
            PREFIX + "queue_config_reloads",
            "Transport config reloads by result (success: queues applied; error: refused "
            "or failed, the last good config kept).",
            ("result",),
            registry=registry,
        )
        for result in RESULTS:
            self.reloads_total.labels(result)
        self.last_success = Gauge(
            PREFIX + "queue_config_last_success_timestamp_seconds",
            "Unix time of the last reload that applied a change.",
            registry=registry,
        )


@dataclass(frozen=True, slots=True)
class _Plan:
    config: AppConfig
    added: list[QueueSpec]
    changed: list[QueueSpec]
    removed: list[QueueSpec]
    gates: dict[str, Gate]  # queue name -> its new gate (added and changed ones)


class QueueReload:
    def __init__(
        self,
        config: AppConfig,
        *,
        transport: ReloadsQueues,
        gates: QueueGates,
        queues: RunningQueues,
        forget: Forget,
        metrics: ReloadMetrics,
        applied: Callable[[AppConfig], None],
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.config = config  # the last good one
        self._transport = transport
        self._gates = gates
        self._queues = queues
        self._forget = forget
        self._metrics = metrics
        self._applied = applied
        self._env = os.environ if env is None else env
        self._interval = config.runtime.transport_config_watch_interval
        self._failure = ""  # the last failure logged, until a pass succeeds
        self._content: bytes | None = None  # the file's bytes at the last pass

    async def run(self) -> None:
        """A pass at once (the file may have changed since startup), then every interval."""
        while True:
            self._queues.prune()  # removed queues out of upkeep: their cached series freed
            await self.reload()
            await anyio.sleep(self._interval)

    async def reload(self) -> bool | None:
        """One pass: True applied, False refused or failed (last good config kept), None
        when the file holds the config being served."""
        # The bytes of the config being served: nothing to parse. (A failed pass is tried
        # whole again: Redis may be back, a gate's source may answer.)
        if self._same_bytes() and not self._failure:
            return None
        try:
            plan = self._plan()
            if plan is None:
                self._failure = ""
                return None
            await self._apply(plan)
        except Exception as exc:  # whatever failed, the daemon goes on with the last good
            self._failed(str(exc) or type(exc).__name__)
            return False
        self._failure = ""
        self._metrics.reloads_total.labels("success").inc()
        self._metrics.last_success.set(time.time())
        log.info(
            "queue_config_reloaded",
            added=[q.id for q in plan.added],
            changed=[q.id for q in plan.changed],
            removed=[q.id for q in plan.removed],
        )
        return True

    def _same_bytes(self) -> bool:
        """Whether the file holds the bytes the last pass read. Parsing and checking cost
        ~90 ms at 1,000 queues (on the event loop) at every interval; a read costs µs."""
        try:
            with open(self.config.transport_config_file, "rb") as handle:
                content = handle.read()
        except OSError:  # the pass reports it
            content = None
        same = content is not None and content == self._content
        self._content = content
        return same

    def _failed(self, error: str) -> None:
        """Counted at every pass (an alert fires while the file stays bad), logged once
        per distinct failure (not every interval)."""
        self._metrics.reloads_total.labels("error").inc()
        if error != self._failure:
            log.warning(
                "queue_config_reload_failed", file=self.config.transport_config_file, error=error
            )
        self._failure = error

    def _plan(self) -> _Plan | None:
        """What the file asks for, checked whole before anything changes (gates built)."""
        new = reread_transport_config(self.config, self._env)
        before, after = self.config.transport_config, new.transport_config
        if after == before:
            return None
        fields = [f for f in type(before).model_fields if f != "queues"]
        other = [f for f in fields if getattr(after, f) != getattr(before, f)]
        if other:
            raise ConfigError(
                f"--transport-config-file {self.config.transport_config_file}: "
                f"{', '.join(other)} changed; only queues change without a restart "
                "(restart required)"
            )
        # Matched under the key their pollers run under (``running.configured_key``).
        old = {configured_key(q): q for q in before.queue_specs()}
        now = {configured_key(q): q for q in after.queue_specs()}
        kept = [q for key, q in now.items() if old.get(key) == q]
        added = [q for key, q in now.items() if key not in old]
        changed = [q for key, q in now.items() if key in old and old[key] != q]
        removed = [q for key, q in old.items() if key not in now]
        gates = self._new_gates([*added, *changed], kept)
        return _Plan(new, added, changed, removed, gates)

    def _new_gates(self, fresh: list[QueueSpec], kept: list[QueueSpec]) -> dict[str, Gate]:
        """Gates of the added and changed queues, built now so that one that fails keeps
        the last config; a queue joining a ``gate_group`` a kept queue is in shares its
        gate (the config check holds a group's queues to one gate)."""
        groups = {q.gate_group: self._gates[q.name] for q in kept if q.gate_group}
        built: dict[str, Gate] = {}
        for queue in fresh:
            gate = groups.get(queue.gate_group) if queue.gate_group else None
            if gate is None:
                gate = self._gates.build(queue)
                if queue.gate_group:
                    groups[queue.gate_group] = gate
            built[queue.name] = gate
        return built

    async def _apply(self, plan: _Plan) -> None:
        # The transport first: it names the removed queues in Redis (so a kill from here
        # on strands none of their claims); if that fails nothing has changed yet.
        await self._transport.reconfigure(plan.config.transport_config)
        self.config = plan.config
        self._applied(plan.config)
        for queue in [*plan.removed, *plan.changed]:
            self._queues.stop(configured_key(queue))
        for queue in [*plan.added, *plan.changed]:
            self._gates.install(queue, plan.gates[queue.name])
            await self._queues.start(configured_key(queue), queue, self._forget)
