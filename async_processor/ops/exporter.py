"""``async-processor exporter``: the queues' backlog for autoscalers, with or without daemons.

Stage: outside the daemon (one small Deployment of the same image, so KEDA can scale the
daemon between 0 and N: at zero replicas nobody else reports the backlog). Input: the
daemon's own flags and config. Output, refreshed every ``--interval``:

- ``/metrics`` on ``--metrics-port``, in the daemon's scheme (``llm_d_async_async_``,
  queue labels ``queue_id``/``queue_name``/``pool_name``): per queue ``broker_backlog``
  (waiting, the daemon's gauge of that name), ``broker_in_flight``,
  ``dead_letter_list_length``, ``broker_oldest_deadline_timestamp_seconds`` and
  ``broker_backlog_source_available`` (1 when the last refresh reached the broker, the
  Go daemon's name); per retry set ``retry_set_members{state="due"|"parked"}`` (counted
  by score, so cheap at any size); per result list ``result_list_length``; the total
  ``unanswered_requests`` (what ``/backlog`` serves). The first names
  (``llm_d_async_exporter_*``, listed in ``LEGACY``) are served too for one release,
  deprecated; ``--no-legacy-metric-names`` drops them;
- ``/backlog`` on the same port: ``{"backlog": N}`` for KEDA's ``metrics-api`` trigger
  (no Prometheus needed);
- ``/healthz`` and ``/readyz`` on ``--health-port`` (ready while the broker answers).

The backlog is the work not yet answered: waiting + in flight + retries (due or parked),
summed over queues. An unknown figure (a channel has no depth) counts as 0; the exporter
is meant for the sorted set, whose figures are all known. The same ``--metrics-bearer-
token-file`` protects ``/metrics`` and ``/backlog`` as the daemon's.
"""

from __future__ import annotations

import argparse
import sys
from functools import partial

import anyio
import structlog
from aiohttp import web
from anyio.abc import TaskStatus
from prometheus_client import CollectorRegistry, Gauge

from async_processor import __version__
from async_processor.cli.args import CONFIG_FLAGS, daemon_config, duration
from async_processor.config import AppConfig
from async_processor.errors import ConfigError, TransportError
from async_processor.health import serve_health, serve_metrics
from async_processor.metrics import build_info_gauge, process_collectors
from async_processor.ops.status import collect
from async_processor.ops.status_table import QueueStatus, Status

log = structlog.get_logger(__name__)

PREFIX = "llm_d_async_async_"
LEGACY_PREFIX = "llm_d_async_exporter_"  # deprecated: served while legacy names are on
DEFAULT_INTERVAL = 5.0
QUEUE_LABELS = ("queue_id", "queue_name", "pool_name")
# QueueStatus field -> (name, deprecated name, help)
QUEUE_GAUGES = {
    "depth": ("broker_backlog", "queue_depth", "Requests waiting on the broker, not claimed."),
    "in_flight": ("broker_in_flight", "in_flight", "Requests claimed under a lease."),
    "dead_letters": ("dead_letter_list_length", "dead_letters", "Entries on the dead-letter list."),
    "oldest_deadline": ("broker_oldest_deadline_timestamp_seconds", "oldest_deadline_seconds",
                        "Deadline of the most urgent waiting request (Unix seconds)."),
}  # fmt: skip
# Every deprecated name -> its name now (docs/metrics-and-alerts.md has the same table).
LEGACY = {
    **{LEGACY_PREFIX + old: PREFIX + new for new, old, _ in QUEUE_GAUGES.values()},
    LEGACY_PREFIX + "retries": PREFIX + "retry_set_members",
    LEGACY_PREFIX + "result_list_length": PREFIX + "result_list_length",
    LEGACY_PREFIX + "backlog": PREFIX + "unanswered_requests",
    LEGACY_PREFIX + "up": PREFIX + "broker_backlog_source_available",
}


class Twin:
    """One figure under its name and, while legacy names are on, its deprecated one
    (whose labels lack ``queue_id``)."""

    def __init__(
        self,
        registry: CollectorRegistry,
        names: tuple[str, str],
        doc: str,
        labels: tuple[str, ...],
        legacy_labels: tuple[str, ...] | None,
    ) -> None:
        self.gauge = Gauge(PREFIX + names[0], doc, labels, registry=registry)
        self.legacy = None
        self._drop = len(labels) - len(legacy_labels or ())
        if legacy_labels is not None:
            doc = f"Deprecated, use {PREFIX + names[0]}. {doc}"
            self.legacy = Gauge(LEGACY_PREFIX + names[1], doc, legacy_labels, registry=registry)

    def set(self, value: float, *labels: str) -> None:
        (self.gauge.labels(*labels) if labels else self.gauge).set(value)
        if self.legacy is not None:
            old = labels[self._drop :]
            (self.legacy.labels(*old) if old else self.legacy).set(value)


def backlog(status: Status) -> int:
    """Work not yet answered: waiting and in flight on every queue, plus the retry sets
    (unknown figures count as 0). A removed discovered queue still draining counts its
    claims and retries (a replica must reap and move them) but not what waits on it:
    nobody polls it, so that would keep KEDA from scaling to zero for good."""
    queued = sum(
        (q.depth or 0 if q.origin != "removed" else 0) + (q.in_flight or 0) for q in status.queues
    )
    return queued + sum(sum(counts.values()) for counts in status.retry_sets.values())


class Exporter:
    """Gauges on ``registry``, refreshed from ``status.collect``."""

    def __init__(
        self, config: AppConfig, registry: CollectorRegistry, *, legacy_names: bool = True
    ) -> None:
        self.config = config
        self.backlog = 0
        self.error: str | None = "not refreshed yet"
        old = QUEUE_LABELS[1:] if legacy_names else None

        def twin(names: tuple[str, str], doc: str, labels: tuple[str, ...] = ()) -> Twin:
            legacy = None if old is None else (labels[1:] if labels == QUEUE_LABELS else labels)
            return Twin(registry, names, doc, labels, legacy)

        self._queue = {
            attr: twin((name, legacy), doc, QUEUE_LABELS)
            for attr, (name, legacy, doc) in QUEUE_GAUGES.items()
        }
        self._retries = twin(
            ("retry_set_members", "retries"),
            "Retry-set members, due now or parked.",
            ("retry_set", "state"),
        )
        self._results = twin(
            ("result_list_length", "result_list_length"),
            "Results waiting to be read.",
            ("result_list",),
        )
        self._backlog = twin(
            ("unanswered_requests", "backlog"),
            "Waiting + in flight + retries, over every queue (/backlog).",
        )
        # Per queue, as the Go daemon's; the deprecated "up" has no labels.
        up, doc = (
            PREFIX + "broker_backlog_source_available",
            "1 when the last refresh reached the broker.",
        )
        self._up = Gauge(up, doc, QUEUE_LABELS, registry=registry)
        self._legacy_up = None
        if legacy_names:
            doc = f"Deprecated, use {up}. {doc}"
            self._legacy_up = Gauge(LEGACY_PREFIX + "up", doc, registry=registry)
        self._ids = {spec.name: spec.id for spec in config.queue_specs()}
        # The configured queues' availability exists (at 0) before the first refresh.
        self._seen = {(spec.id, spec.name, spec.pool) for spec in config.queue_specs()}
        self._available(0)

    def _available(self, value: int) -> None:
        for labels in self._seen:
            self._up.labels(*labels).set(value)
        if self._legacy_up is not None:
            self._legacy_up.set(value)

    async def refresh(self) -> None:
        try:
            # Totals only: attributing each retry to its queue reads the whole retry set;
            # no result ages: no gauge shows them.
            status = await collect(self.config, per_queue_retries=False, result_ages=False)
        except TransportError as exc:
            if self.error is None:
                log.warning("exporter_refresh_failed", error=str(exc))
            self.error = str(exc)
            self._available(0)
            return
        self.error = None
        self.backlog = backlog(status)
        self._backlog.set(self.backlog)
        for queue in status.queues:
            self._set_queue(queue)
        self._available(1)
        for retry_set, counts in status.retry_sets.items():
            for state, count in counts.items():
                self._retries.set(count, retry_set, state)
        for name, length in status.result_lists.items():
            if length is not None:
                self._results.set(length, name)

    def _set_queue(self, queue: QueueStatus) -> None:
        # A queue not configured was discovered: its id is its name, as in the daemon.
        labels = (self._ids.get(queue.queue, queue.queue), queue.queue, queue.pool)
        self._seen.add(labels)
        for attr, twin in self._queue.items():
            value = getattr(queue, attr)
            if value is not None:  # unknown stays absent, never 0
                twin.set(value, *labels)

    async def readiness(self) -> str | None:
        return self.error

    async def backlog_json(self, _: web.Request) -> web.Response:
        if self.error is not None:  # KEDA keeps its last decision rather than read 0
            return web.json_response({"error": self.error}, status=503)
        return web.json_response({"backlog": self.backlog})

    async def run(self, interval: float) -> None:
        while True:
            await self.refresh()
            await anyio.sleep(interval)


async def serve(
    config: AppConfig,
    interval: float,
    *,
    legacy_names: bool = True,
    task_status: TaskStatus[tuple[int, int]] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Refresh every ``interval`` and serve; ``task_status`` gets (health, metrics) ports."""
    registry = CollectorRegistry()
    process_collectors(registry)  # process_* and python_*, as the daemon's /metrics has
    build_info_gauge(registry).labels(__version__, config.transport).set(1)
    exporter = Exporter(config, registry, legacy_names=legacy_names)
    rt = config.runtime
    metrics = partial(serve_metrics, bearer_token=rt.metrics_bearer_token,
                      routes={"/backlog": exporter.backlog_json})  # fmt: skip
    async with anyio.create_task_group() as tg:
        await exporter.refresh()  # the first answer is real, not "0 while starting"
        health_port = await tg.start(serve_health, rt.bind_address, rt.health_port,
                                     exporter.readiness)  # fmt: skip
        metrics_port = await tg.start(metrics, rt.bind_address, rt.metrics_port, registry)
        log.info("exporter_ready", backlog=exporter.backlog, interval=interval)
        task_status.started((health_port, metrics_port))
        await exporter.run(interval)


def _flags(parser: argparse.ArgumentParser) -> None:
    parser.description = "Export the queues' backlog (for KEDA) on /metrics and /backlog."
    parser.add_argument(
        "--interval", type=duration, default=DEFAULT_INTERVAL, metavar="DURATION",
        help="time between refreshes (default: 5s)",
    )  # fmt: skip
    parser.add_argument(
        "--no-legacy-metric-names", action="store_true",
        help="serve only the llm_d_async_async_* names, not the deprecated "
        "llm_d_async_exporter_* ones (docs/metrics-and-alerts.md)",
    )  # fmt: skip


def main(argv: list[str]) -> int:
    shown = (*CONFIG_FLAGS, "health-port", "metrics-port", "bind-address",
             "metrics-bearer-token-file")  # fmt: skip
    config, opts = daemon_config(argv, "async-processor exporter", _flags, shown)
    if opts["interval"] <= 0:
        raise ConfigError(f"--interval must be > 0, not {opts['interval']:g}s")
    try:
        legacy = not opts["no_legacy_metric_names"]
        anyio.run(partial(serve, config, opts["interval"], legacy_names=legacy))
    except KeyboardInterrupt:
        print("async-processor exporter: stopped", file=sys.stderr)
    return 0
