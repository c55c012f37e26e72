"""``async-processor exporter``: the queues' backlog for autoscalers, with or without daemons.

Stage: outside the daemon (one small Deployment of the same image, so KEDA can scale the
daemon between 0 and N: at zero replicas nobody else reports the backlog). Input: the
daemon's own flags and config. Output, refreshed every ``--interval``:

- ``/metrics`` on ``--metrics-port``: per queue ``llm_d_async_exporter_queue_depth``,
  ``_in_flight``, ``_dead_letters``, ``_oldest_deadline_seconds``; per retry set
  ``_retries{state="due"|"parked"}`` (counted by score, so cheap at any size); per result
  list ``_result_list_length``; the total
  ``llm_d_async_exporter_backlog`` and ``llm_d_async_exporter_up`` (1 when the last
  refresh reached the broker);
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

PREFIX = "llm_d_async_exporter_"
DEFAULT_INTERVAL = 5.0
# QueueStatus field -> (gauge name, help)
QUEUE_GAUGES = {
    "depth": ("queue_depth", "Requests waiting on the broker, not claimed."),
    "in_flight": ("in_flight", "Requests claimed under a lease."),
    "dead_letters": ("dead_letters", "Entries on the dead-letter list."),
    "oldest_deadline": ("oldest_deadline_seconds", "Deadline of the most urgent waiting request."),
}


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

    def __init__(self, config: AppConfig, registry: CollectorRegistry) -> None:
        self.config = config
        self.backlog = 0
        self.error: str | None = "not refreshed yet"
        labels = ("queue_name", "pool_name")
        self._queue = {
            attr: Gauge(PREFIX + name, doc, labels, registry=registry)
            for attr, (name, doc) in QUEUE_GAUGES.items()
        }
        self._retries = Gauge(PREFIX + "retries", "Retry-set members, due now or parked.",
                              ("retry_set", "state"), registry=registry)  # fmt: skip
        self._results = Gauge(PREFIX + "result_list_length", "Results waiting to be read.",
                              ("result_list",), registry=registry)  # fmt: skip
        self._backlog = Gauge(PREFIX + "backlog", "Waiting + in flight + retries.",
                              registry=registry)  # fmt: skip
        self._up = Gauge(PREFIX + "up", "1 when the last refresh reached the broker.",
                         registry=registry)  # fmt: skip

    async def refresh(self) -> None:
        try:
            # Totals only: attributing each retry to its queue reads the whole retry set;
            # no result ages: no gauge shows them.
            status = await collect(self.config, per_queue_retries=False, result_ages=False)
        except TransportError as exc:
            if self.error is None:
                log.warning("exporter_refresh_failed", error=str(exc))
            self.error = str(exc)
            self._up.set(0)
            return
        self.error = None
        self._up.set(1)
        self.backlog = backlog(status)
        self._backlog.set(self.backlog)
        for queue in status.queues:
            self._set_queue(queue)
        for retry_set, counts in status.retry_sets.items():
            for state, count in counts.items():
                self._retries.labels(retry_set, state).set(count)
        for name, length in status.result_lists.items():
            if length is not None:
                self._results.labels(name).set(length)

    def _set_queue(self, queue: QueueStatus) -> None:
        for attr, gauge in self._queue.items():
            value = getattr(queue, attr)
            if value is not None:  # unknown stays absent, never 0
                gauge.labels(queue.queue, queue.pool).set(value)

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
    task_status: TaskStatus[tuple[int, int]] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Refresh every ``interval`` and serve; ``task_status`` gets (health, metrics) ports."""
    registry = CollectorRegistry()
    process_collectors(registry)  # process_* and python_*, as the daemon's /metrics has
    build_info_gauge(registry).labels(__version__, config.transport).set(1)
    exporter = Exporter(config, registry)
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


def main(argv: list[str]) -> int:
    shown = (*CONFIG_FLAGS, "health-port", "metrics-port", "bind-address",
             "metrics-bearer-token-file")  # fmt: skip
    config, opts = daemon_config(argv, "async-processor exporter", _flags, shown)
    if opts["interval"] <= 0:
        raise ConfigError(f"--interval must be > 0, not {opts['interval']:g}s")
    try:
        anyio.run(serve, config, opts["interval"])
    except KeyboardInterrupt:
        print("async-processor exporter: stopped", file=sys.stderr)
    return 0
