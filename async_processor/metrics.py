"""Metrics: the reference's ``llm_d_async_async_*`` families on an injected registry.

Input: events from every stage. Output: Prometheus series. Stages get an object bound
to their (queue, pool) once (``Metrics.queue``), not label triples at every call.
Counters are declared without ``_total``; prometheus-client adds it.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

PREFIX = "llm_d_async_async_"
Q_LABELS = ("queue_id", "queue_name", "pool_name")
G_LABELS = (*Q_LABELS, "inference_pool")
GATE_REASONS = ("gate_closed", "quota_exhausted", "dropped", "error")

INFERENCE_BUCKETS = (10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 30000, 60000, 120000)
RESIDENCE_BUCKETS = (
    500, 1000, 2000, 5000, 10000, 30000, 60000, 120000, 300000, 600000,
    1800000, 3600000, 7200000, 21600000, 43200000, 86400000,
)  # fmt: skip
MESSAGE_LATENCY_BUCKETS = (100, 1000, 5000, 10000, 20000, 50000, 100000, 200000, 500000, 1000000)


class Metrics:
    """Every family the daemon exports, registered on one registry."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry

        def counter(name: str, doc: str, labels: tuple[str, ...] = Q_LABELS) -> Counter:
            return Counter(PREFIX + name, doc, labels, registry=r)

        def gauge(name: str, doc: str, labels: tuple[str, ...] = Q_LABELS) -> Gauge:
            return Gauge(PREFIX + name, doc, labels, registry=r)

        self.request_total = counter("request", "Requests pulled for the first time.")
        self.retries_total = counter("request_retries", "Requests re-enqueued with backoff.")
        self.successful_total = counter("successful_requests", "HTTP calls answered < 400.")
        self.failed_total = counter("failed_requests", "Requests ended by a failure.")
        self.exceeded_deadline_total = counter(
            "exceeded_deadline_requests", "Requests whose deadline passed."
        )
        self.shedded_total = counter("shedded_requests", "Attempts answered 429 by the gateway.")
        self.dead_letter_total = counter(
            "dead_letter",
            "Messages with no usable id parked on the dead-letter list.",
            (*Q_LABELS, "reason"),
        )
        self.result_route_rejected_total = Counter(
            PREFIX + "result_route_rejected",
            "Results whose message-named list was refused; written to the configured list.",
            ("queue_name", "reason"),
            registry=r,
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
        self.dispatch_budget = gauge("dispatch_budget", "Queue gate budget in [0,1].")
        self.pool_worker_limit = gauge("pool_worker_limit", "Workers per pool.", ("pool_name",))
        self.gate_metric_value = gauge("gate_metric_value", "Gate metric reading.", G_LABELS)
        self.gate_metric_threshold = gauge(
            "gate_metric_threshold", "Gate metric threshold.", G_LABELS
        )
        self.gate_metric_source_available = gauge(
            "gate_metric_source_available", "1 when the gate's metric source answered.", G_LABELS
        )
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

    def queue(self, queue_id: str, queue_name: str, pool: str) -> QueueMetrics:
        """Series bound to one (queue, pool); cached, so every stage shares them."""
        key = (queue_id, queue_name, pool)
        bound = self._bound.get(key)
        if bound is None:
            bound = self._bound[key] = QueueMetrics.bind(self, key)
        return bound

    def pool(self, pool: str) -> QueueMetrics:
        """Pool-level series (pool gates): empty queue labels, as the reference does."""
        return self.queue("", "", pool)


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
    inference_latency: Histogram
    queue_residence: Histogram
    queue_depth: Gauge
    inflight: Gauge
    broker_backlog: Gauge
    dispatch_budget: Gauge
    gate_decisions: dict[str, Counter]
    _parent: Metrics

    @classmethod
    def bind(cls, m: Metrics, labels: tuple[str, str, str]) -> QueueMetrics:
        return cls(
            labels=labels,
            request_total=m.request_total.labels(*labels),
            retries_total=m.retries_total.labels(*labels),
            successful_total=m.successful_total.labels(*labels),
            failed_total=m.failed_total.labels(*labels),
            exceeded_deadline_total=m.exceeded_deadline_total.labels(*labels),
            shedded_total=m.shedded_total.labels(*labels),
            inference_latency=m.inference_latency.labels(*labels),
            queue_residence=m.queue_residence.labels(*labels),
            queue_depth=m.queue_depth.labels(*labels),
            inflight=m.inflight.labels(*labels),
            broker_backlog=m.broker_backlog.labels(*labels),
            dispatch_budget=m.dispatch_budget.labels(*labels),
            gate_decisions={r: m.gate_decisions_total.labels(*labels, r) for r in GATE_REASONS},
            _parent=m,
        )

    @property
    def message_latency(self) -> Histogram:
        """Bound on first use, not with the rest (see ``Metrics.message_latency``)."""
        return self._parent.message_latency.labels(*self.labels)

    def gate_decision(self, reason: str) -> None:
        self.gate_decisions[reason].inc()

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
