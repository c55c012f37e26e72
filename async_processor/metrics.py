"""Metrics: the reference's ``llm_d_async_async_*`` families on an injected registry.

Input: events from every stage. Output: Prometheus series. Stages get an object bound to
their (queue, pool) once (``Metrics.queue``), not label triples at every call. Counters are
declared without ``_total``; prometheus-client adds it.

Beyond the reference (added, none of its names or labels changed): the process and Python
collectors, ``llm_d_async_build_info``, error results by ``error_code``, and per result the
time from submission and the deadline slack left (``QueueMetrics.result_written``).
``failed_requests_total`` keeps the reference's fixed labels (a new label would split its
series and break every query summing it), so the error code has its own counter.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import (
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
)
from prometheus_client.metrics import MetricWrapperBase

from async_processor.backlog_metrics import BacklogMetrics
from async_processor.messages import ErrorCode, Request, Result
from async_processor.sortedset_metrics import SortedSetFamilies

PREFIX = "llm_d_async_async_"
Q_LABELS = ("queue_id", "queue_name", "pool_name")
G_LABELS = (*Q_LABELS, "inference_pool")
GATE_REASONS = ("gate_closed", "quota_exhausted", "dropped", "error")
# Why a message without a usable id is parked (decode_envelope's, the sorted set's "superseded").
DEAD_LETTER_REASONS = ("malformed", "missing_id", "too_large", "unknown_kind",
                       "invalid_deadline", "superseded")  # fmt: skip
# Each redis_errors action and Pub/Sub RPC the daemon runs (" " as "_"), at 0 from the start.
BROKER_OPERATIONS = (
    "claim", "complete", "defer", "dead_letter", "retry_move", "retry_put_back", "expire",
    "cancel_check", "dataset", "queue_discovery", "ping", "probe", "backlog", "publish_result",
    "publish", "pull", "acknowledge", "extend", "get_subscription", "payload_fetch",
    "payload_delete", "result_ttl")  # fmt: skip

INFERENCE_BUCKETS = (10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 30000, 60000, 120000)
RESIDENCE_BUCKETS = (500, 1000, 2000, 5000, 10000, 30000, 60000, 120000, 300000, 600000,
                     1800000, 3600000, 7200000, 21600000, 43200000, 86400000)  # fmt: skip
MESSAGE_LATENCY_BUCKETS = (100, 1000, 5000, 10000, 20000, 50000, 100000, 200000, 500000, 1000000)
# Deadline slack at completion: the le="0" bucket counts results past their deadline.
SLACK_BUCKETS = (0, 1000, 10000, 60000, 300000, 900000, 1800000, 3600000, 7200000, 21600000,
                 43200000, 86400000)  # fmt: skip
TOKEN_DIRECTIONS = {"prompt": "input", "completion": "output", "total": ""}  # kind: upstream's
NO_TENANT = "none"  # the message has no usable tenant attribute


class Metrics(SortedSetFamilies):
    """Every family the daemon exports, registered on one registry."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry

        def counter(name: str, doc: str, labels: tuple[str, ...] = Q_LABELS) -> Counter:
            return Counter(PREFIX + name, doc, labels, registry=r)

        def gauge(name: str, doc: str, labels: tuple[str, ...] = Q_LABELS) -> Gauge:
            return Gauge(PREFIX + name, doc, labels, registry=r)

        SortedSetFamilies.__init__(self, r, PREFIX)

        self.request_total = counter("request", "Requests pulled for the first time.")
        self.retries_total = counter("request_retries", "Requests re-enqueued with backoff.")
        self.successful_total = counter("successful_requests", "HTTP calls answered < 400.")
        self.failed_total = counter("failed_requests", "Requests ended by a failure.")
        self.exceeded_deadline_total = counter(
            "exceeded_deadline_requests", "Requests whose deadline passed."
        )
        self.shedded_total = counter("shedded_requests", "Attempts answered 429 by the gateway.")
        self.dispatched_total = counter("dispatched_requests", "HTTP attempts, retries included.")
        self.gate_wait_requeues_total = counter(
            "gate_wait_requeues", "Messages handed back at --gate-wait-timeout (not failed)."
        )
        self.dead_letter_total = counter(
            "dead_letter",
            "Messages with no usable id parked on the dead-letter list.",
            (*Q_LABELS, "reason"),
        )
        self.result_route_rejected_total = counter(
            "result_route_rejected",
            "Results whose message-named list was refused; written to the configured list.",
            ("queue_name", "reason"),
        )
        self.duplicates_suppressed_total = counter(
            "duplicates_suppressed",
            "Results not written because the submission was already answered (dedup marker).",
        )
        self.broker_errors_total = counter(
            "broker_errors",
            "Broker calls that failed (Redis or Pub/Sub unreachable, refused, timed out), by "
            "operation; each is retried or its message comes back.",
            ("operation",),
        )
        for operation in BROKER_OPERATIONS:
            self.broker_errors_total.labels(operation)
        self.metrics_renders_total = counter(
            "metrics_renders",
            "Renders of the /metrics page (at most one a second per form, however many ask).",
            (),
        )
        self.tokens_total = counter(
            "tokens",
            "Tokens in gateway answers' usage: direction input/output (upstream's), and by "
            "tenant and kind (prompt, completion; total, deprecated: no direction).",
            (*Q_LABELS, "direction", "tenant", "kind"),
        )
        self.token_usage_invalid_total = counter(
            "token_usage_invalid",
            "Successful answers whose usage held a malformed or out-of-range count (not added).",
            ("queue_name", "pool_name"),
        )
        self.no_answer_total = counter(
            "gateway_no_answer",
            "HTTP attempts without a usable answer, by reason (timeout, refused, closed, "
            "cut_short, malformed, head_too_large, framing_too_large, too_large, bad_status, "
            "unsendable, no_answer).",
            (*Q_LABELS, "reason"),
        )
        self.gate_decisions_total = counter(
            "gate_decisions", "Gate decisions other than continue.", (*Q_LABELS, "reason")
        )
        self.inference_latency = Histogram(
            PREFIX + "inference_latency_time_millis",
            "HTTP attempt latency (ms).",
            Q_LABELS,
            buckets=INFERENCE_BUCKETS,
            registry=r,
        )
        self.queue_residence = Histogram(
            PREFIX + "queue_residence_time_millis",
            "Fetch to worker pickup (ms).",
            Q_LABELS,
            buckets=RESIDENCE_BUCKETS,
            registry=r,
        )
        self.queue_depth = gauge("queue_depth", "Messages waiting for a worker in-process.")
        self.inflight = gauge("inflight_requests", "Requests being dispatched.")
        self.broker_backlog = gauge("broker_backlog", "Messages waiting on the broker.")
        self.backlog = BacklogMetrics(r, PREFIX, Q_LABELS)  # source_available, proximity
        self.dispatch_budget = gauge("dispatch_budget", "Queue gate budget in [0,1].")
        self.pool_worker_limit = gauge("pool_worker_limit", "Workers per pool.", ("pool_name",))
        self.gate_metric_value = gauge("gate_metric_value", "Gate metric reading.", G_LABELS)
        self.gate_metric_threshold = gauge(
            "gate_metric_threshold", "Gate metric threshold.", G_LABELS
        )
        self.gate_metric_source_available = gauge(
            "gate_metric_source_available", "1 when the gate's metric source answered.", G_LABELS
        )
        self.error_results_total = counter(
            "error_results",
            "Error results written, by error_code (every terminal error, not only failures).",
            (*Q_LABELS, "error_code"),
        )
        self.submit_to_result = Histogram(
            PREFIX + "submit_to_result_time_millis",
            "Request created (its 'created' field) to result written (ms).",
            Q_LABELS,
            buckets=RESIDENCE_BUCKETS,
            registry=r,
        )
        self.deadline_slack = Histogram(
            PREFIX + "deadline_slack_time_millis",
            "Deadline minus the time the result was written (ms); le=0: too late.",
            Q_LABELS,
            buckets=SLACK_BUCKETS,
            registry=r,
        )
        self.build_info = build_info_gauge(r)
        process_collectors(r)
        self._bound: dict[tuple[str, str, str], QueueMetrics] = {}
        self._message_latency: Histogram | None = None

    @property
    def message_latency(self) -> Histogram:
        """Registered on first use: only Pub/Sub acks observe it, and the reference
        registers it only for the transports that support it (not on Redis)."""
        if self._message_latency is None:
            self._message_latency = Histogram(
                PREFIX + "message_latency_time_millis",
                "Publish to ack (ms), Pub/Sub only.",
                Q_LABELS,
                buckets=MESSAGE_LATENCY_BUCKETS,
                registry=self.registry,
            )
        return self._message_latency

    def set_build_info(self, version: str, transport: str) -> None:
        self.build_info.labels(version, transport).set(1)

    def queue(self, queue_id: str, queue_name: str, pool: str) -> QueueMetrics:
        """Series bound to one (queue, pool); cached, so every stage shares them."""
        key = (queue_id, queue_name, pool)
        bound = self._bound.get(key)
        if bound is None:
            bound = self._bound[key] = QueueMetrics.bind(self, key)
        return bound

    def forget_queue(self, queue_name: str, *, gauges_only: bool = False, **labels: str) -> None:
        """Drop the series of ``queue_name`` (and ``labels``): churn must not grow the registry.
        ``gauges_only`` (a reload's): counters stay. The cache of bound series stays, so a late
        result binds none again; ``rebind`` when the queue is served again."""
        match = {"queue_name": queue_name, **labels}
        self.backlog.forget(match)  # levels only, whatever gauges_only says
        kind = Gauge if gauges_only else MetricWrapperBase
        for family in vars(self).values():
            # Only families with such a series: remove_by_labels refuses one without a
            # queue_name label (public API only: an upgrade must not break this quietly).
            if isinstance(family, kind) and any(
                _matches(s.labels, match) for m in family.collect() for s in m.samples
            ):
                family.remove_by_labels(match)

    def rebind(self, labels: tuple[str, str, str]) -> None:
        """A queue served again after ``forget_queue``: fresh series (or its cache freed)."""
        self._bound.pop(labels, None)

    def pool(self, pool: str) -> QueueMetrics:
        """Pool-level series (pool gates): empty queue labels, as the reference does."""
        return self.queue("", "", pool)


def _matches(labels: dict[str, str], match: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in match.items())


class LoopGauge:
    """A gauge child changed only on the event loop: a plain int, read when scraped.

    ``queue_depth`` and ``inflight`` go up and down once per message each; a
    prometheus-client gauge takes a lock for every change (0.5 µs, issue 13), which the
    daemon's one event-loop thread does not need.
    """

    __slots__ = ("value",)

    def __init__(self, child: Gauge) -> None:
        self.value = 0
        child.set_function(self.get)

    def get(self) -> float:
        return self.value

    def inc(self) -> None:
        self.value += 1

    def dec(self) -> None:
        self.value -= 1


@dataclass(frozen=True, slots=True)
class QueueMetrics:
    """The families of ``Metrics`` with (queue_id, queue_name, pool_name) already bound."""

    labels: tuple[str, str, str]
    request_total: Counter
    retries_total: Counter
    successful_total: Counter
    failed_total: Counter
    exceeded_deadline_total: Counter
    shedded_total: Counter
    dispatched_total: Counter
    gate_wait_requeues_total: Counter
    inference_latency: Histogram
    queue_residence: Histogram
    queue_depth: LoopGauge
    inflight: LoopGauge
    broker_backlog: Gauge
    dispatch_budget: Gauge
    gate_decisions: dict[str, Counter]
    submit_to_result: Histogram
    deadline_slack: Histogram
    _parent: Metrics

    @classmethod
    def bind(cls, m: Metrics, labels: tuple[str, str, str]) -> QueueMetrics:
        if labels[1]:  # a queue, not a pool's own series: its counters at 0 from the start
            for reason in DEAD_LETTER_REASONS:
                m.dead_letter_total.labels(*labels, reason)
            for code in ErrorCode:
                m.error_results_total.labels(*labels, code.value)
            for kind in ("prompt", "completion"):  # upstream's pair; tenants come as they count
                m.tokens_total.labels(*labels, TOKEN_DIRECTIONS[kind], NO_TENANT, kind)
        return cls(
            labels=labels,
            request_total=m.request_total.labels(*labels),
            retries_total=m.retries_total.labels(*labels),
            successful_total=m.successful_total.labels(*labels),
            failed_total=m.failed_total.labels(*labels),
            exceeded_deadline_total=m.exceeded_deadline_total.labels(*labels),
            shedded_total=m.shedded_total.labels(*labels),
            dispatched_total=m.dispatched_total.labels(*labels),
            gate_wait_requeues_total=m.gate_wait_requeues_total.labels(*labels),
            inference_latency=m.inference_latency.labels(*labels),
            queue_residence=m.queue_residence.labels(*labels),
            queue_depth=LoopGauge(m.queue_depth.labels(*labels)),
            inflight=LoopGauge(m.inflight.labels(*labels)),
            broker_backlog=m.broker_backlog.labels(*labels),
            dispatch_budget=m.dispatch_budget.labels(*labels),
            gate_decisions={r: m.gate_decisions_total.labels(*labels, r) for r in GATE_REASONS},
            submit_to_result=m.submit_to_result.labels(*labels),
            deadline_slack=m.deadline_slack.labels(*labels),
            _parent=m,
        )

    @property
    def message_latency(self) -> Histogram:
        """Bound on first use, not with the rest (see ``Metrics.message_latency``)."""
        return self._parent.message_latency.labels(*self.labels)

    def no_answer(self, reason: str) -> None:
        """Bound at the first such attempt: most queues never see one."""
        self._parent.no_answer_total.labels(*self.labels, reason).inc()

    def gate_decision(self, reason: str) -> None:
        self.gate_decisions[reason].inc()

    def result_written(self, result: Result, request: Request | None, now: float) -> None:
        """One result landed on the broker (``now``, epoch seconds): its error code, and
        for a decoded request the time since it was created (when the producer said) and
        the slack left before its deadline."""
        if result.error_code:
            self._parent.error_results_total.labels(*self.labels, result.error_code).inc()
        if request is None:
            return
        if request.created > 0:
            self.submit_to_result.observe(max(0.0, now - request.created) * 1000)
        self.deadline_slack.observe((request.deadline - now) * 1000)

    def dead_letter(self, reason: str) -> None:
        self._parent.dead_letter_total.labels(*self.labels, reason).inc()

    def gate_gauges(self, inference_pool: str) -> tuple[Gauge, Gauge, Gauge]:
        """(value, threshold, source_available) gauges for a metric gate of this owner."""
        labels = (*self.labels, inference_pool)
        p = self._parent
        return (
            p.gate_metric_value.labels(*labels),
            p.gate_metric_threshold.labels(*labels),
            p.gate_metric_source_available.labels(*labels),
        )


def build_info_gauge(registry: CollectorRegistry) -> Gauge:  # the daemon's and the exporter's
    return Gauge("llm_d_async_build_info", "1, labelled with the version and transport.",
                 ("version", "transport"), registry=registry)  # fmt: skip


def process_collectors(registry: CollectorRegistry) -> None:
    """process_* (CPU, memory, fds) and python_* (version, GC) on ``registry`` (the
    default registry has them already; an injected one needs its own)."""
    if registry is not REGISTRY:
        ProcessCollector(registry=registry)
        PlatformCollector(registry=registry)
        GCCollector(registry=registry)
