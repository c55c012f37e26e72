"""The redis-sortedset transport's own families (ours: the reference has none of them):
claims abandoned or taken back, dead letters and results trimmed, discovered queues, idle
probes, a lost data set.

Stage: broker I/O bookkeeping (``transports/redis_sortedset``). Input: the registry.
Output: the families, as attributes of ``metrics.Metrics`` (a base class of it, so
``metrics.py`` stays one screenful of the reference's families).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge


class SortedSetFamilies:
    """The redis-sortedset families, registered on ``registry``."""

    def __init__(self, registry: CollectorRegistry, prefix: str) -> None:
        def counter(name: str, doc: str, labels: tuple[str, ...]) -> Counter:
            return Counter(prefix + name, doc, labels, registry=registry)

        def gauge(name: str, doc: str, labels: tuple[str, ...]) -> Gauge:
            return Gauge(prefix + name, doc, labels, registry=registry)

        self.dead_letter_trimmed_total = counter(
            "dead_letter_trimmed",
            "Oldest dead-letter entries trimmed to keep a list within its cap.",
            ("queue_name",),
        )
        self.results_trimmed_total = counter(
            "results_trimmed",
            "Results trimmed from a result list unconsumed past result_ttl_seconds.",
            ("result_list",),
        )
        self.discovery_refused_total = counter(
            "queue_discovery_refused",
            "Names in the discovery set or scan not polled, by reason (daemon_key, bad_name, "
            "cross_slot, over_cap).",
            ("reason",),
        )
        self.discovered_queues = gauge(
            "queue_discovery_queues", "Discovered queues being polled.", ()
        )
        self.abandoned_total = counter(
            "abandoned_claims",
            "Claims given up after a write failed (lease left to expire), by reason.",
            ("queue_name", "reason"),
        )
        self.legacy_claims_returned_total = counter(
            "legacy_claims_returned", "Previous release's claims put back.", ("queue_name",)
        )
        self.idle_probe_errors_total = counter(
            "idle_probe_errors",
            "redis-sortedset idle-queue probes that failed (those queues were claimed instead).",
            (),
        )
        self.redis_dataset_lost_total = counter(
            "redis_dataset_lost",
            "redis-sortedset: times the Redis data set was found replaced by an empty one.",
            (),
        )
