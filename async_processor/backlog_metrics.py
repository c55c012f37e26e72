"""Broker backlog families beyond the depth: did the read work, how near are the deadlines.

Stage: the backlog poll (``pipeline.backlog``). Input: one ``Backlog`` reading per queue
per poll, or its failure. Output: ``llm_d_async_async_broker_backlog_source_available``
(1 when the queue's last backlog read succeeded, else 0) and, for transports that can tell
(the sorted set), ``llm_d_async_async_deadline_proximity_millis`` as upstream defines it:
a histogram of the waiting messages by time left to their deadline, a snapshot that each
poll replaces (not monotonic: ``rate()`` means nothing on it; read the buckets as they
are). Its ``_sum`` is estimated from bucket midpoints (the ``0`` bucket, overdue
messages, at 0, those past the last bound at that bound); a failed read publishes
all-zero buckets, as upstream.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from itertools import pairwise

from prometheus_client import CollectorRegistry, Gauge
from prometheus_client.core import HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

# Upstream's bounds (ms): due now, within 1 s, 5 s, ... 1 day.
PROXIMITY_BUCKETS = (
    0, 1000, 5000, 15000, 30000, 60000, 120000, 300000, 600000, 1800000, 3600000, 7200000,
    21600000, 86400000,
)  # fmt: skip
_MIDPOINTS = (0.0, *((a + b) / 2 for a, b in pairwise(PROXIMITY_BUCKETS)))
# The ``le`` text prometheus-client's own histograms use (``1.8e+06``); it has no types.
_LE = (*(floatToGoString(b) for b in PROXIMITY_BUCKETS), "+Inf")  # type: ignore[no-untyped-call]

Labels = tuple[str, str, str]


@dataclass(frozen=True, slots=True)
class Backlog:
    """One queue's read: its depth and, from a sorted set, how many of the waiting messages
    are due within each ``PROXIMITY_BUCKETS`` bound (cumulative, as ``le`` buckets are)."""

    depth: int
    due: tuple[int, ...] = ()


class DeadlineProximity(Collector):
    """The latest snapshot per queue, exported as a histogram at each scrape."""

    def __init__(self, registry: CollectorRegistry, name: str, labels: tuple[str, ...]) -> None:
        self._name = name
        self._labels = labels
        self._snapshots: dict[Labels, tuple[tuple[int, ...], int]] = {}
        registry.register(self)

    def set(self, labels: Labels, due: tuple[int, ...], depth: int) -> None:
        self._snapshots[labels] = (due, depth)

    def describe(self) -> list[Metric]:
        return [self._family()]

    def collect(self) -> Iterator[Metric]:
        family = self._family()
        for labels, (due, depth) in list(self._snapshots.items()):
            counts = (*due, depth)
            within = [c - p for c, p in zip(counts, (0, *due), strict=True)]
            values = (*_MIDPOINTS, PROXIMITY_BUCKETS[-1])
            estimate = sum(n * m for n, m in zip(within, values, strict=True))
            buckets = list(zip(_LE, map(float, counts), strict=True))
            family.add_metric(list(labels), buckets, estimate)
        yield family

    def forget(self, match: dict[str, str]) -> None:
        names = self._labels
        kept = {k: v for k, v in self._snapshots.items() if not _matches(names, k, match)}
        self._snapshots = kept

    def _family(self) -> HistogramMetricFamily:
        return HistogramMetricFamily(
            self._name,
            "Waiting messages by time left to their deadline (ms), a snapshot per backlog "
            "poll (sorted set only; not monotonic).",
            labels=self._labels,
        )


class BacklogMetrics:
    """What the backlog poll records per queue, besides ``broker_backlog`` itself."""

    def __init__(self, registry: CollectorRegistry, prefix: str, labels: tuple[str, ...]) -> None:
        """``prefix`` and the queue ``labels`` are ``metrics``' (which builds this)."""
        self.available = Gauge(
            prefix + "broker_backlog_source_available",
            "1 when the queue's last broker backlog read succeeded, else 0.",
            labels,
            registry=registry,
        )
        self.proximity = DeadlineProximity(registry, prefix + "deadline_proximity_millis", labels)
        self._names = labels
        self._seen: set[Labels] = set()

    def read(self, labels: Labels, backlog: Backlog) -> None:
        self._seen.add(labels)
        self.available.labels(*labels).set(1)
        if backlog.due:
            self.proximity.set(labels, backlog.due, backlog.depth)

    def failed(self, labels: Labels, *, proximity: bool) -> None:
        """The read failed: unavailable, and the snapshot all zeros where there is one."""
        self._seen.add(labels)
        self.available.labels(*labels).set(0)
        if proximity:
            self.proximity.set(labels, (0,) * len(PROXIMITY_BUCKETS), 0)

    def forget(self, match: dict[str, str]) -> None:
        """A removed queue's series go (``Metrics.forget_queue``: ``match`` holds its
        ``queue_name`` and maybe more labels)."""
        for labels in [s for s in self._seen if _matches(self._names, s, match)]:
            self._seen.discard(labels)
            self.available.remove(*labels)
        self.proximity.forget(match)


def _matches(names: tuple[str, ...], labels: Labels, match: dict[str, str]) -> bool:
    named = dict(zip(names, labels, strict=True))
    return all(named.get(k) == v for k, v in match.items())
