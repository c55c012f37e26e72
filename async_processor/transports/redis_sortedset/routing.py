"""Where a redis-sortedset result goes: the configured list, or the one its message names
when that is safe (docs/architecture.md G10).

Queue config > the envelope's routing > the transport default (the reference's order),
frozen at the first fetch (``entries.decode_queued``), except that a message may not
name one of the daemon's own keys, a name outside ``result_queue_pattern`` or (cluster
mode) a list in another slot: then the configured list, and the rejection is logged and
counted.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import structlog

from async_processor.config import SortedSetConfig
from async_processor.redis.keys import OwnKeys
from async_processor.redis.keyspace import KeySpace
from async_processor.transports.base import Delivery

if TYPE_CHECKING:
    from async_processor.metrics import Metrics

log = structlog.get_logger(__name__)

ROUTE_REJECTIONS = ("reserved_key", "pattern_mismatch", "wrong_type", "cross_slot")


class ResultRouting:
    def __init__(
        self, config: SortedSetConfig, keyspace: KeySpace, own: OwnKeys, metrics: Metrics | None
    ) -> None:
        self._config = config
        self._keys = keyspace
        self.own = own  # replaced when discovered queues change
        self._metrics = metrics

    def target(self, delivery: Delivery) -> str:
        """The list this delivery's result is written to. A route frozen at the first
        fetch (``result_routing_resolved``, upstream's since v0.9.1: a config change cannot
        reroute a message in flight) is the message's name, else the transport default;
        it is checked like any name a message gives, unless it is the configured one."""
        configured = self.configured(delivery)
        routing = delivery.envelope.routing if delivery.envelope else None
        routed = routing.result_queue_name if routing else ""
        if routing is not None and routing.result_routing_resolved:
            if not routed:
                return self._config.result_queue_name
            if routed == configured:
                return routed
        elif delivery.queue.result_queue_name or not routed:
            return configured
        reason = self.own.rejection(routed)
        if reason is None and not self._keys.routable(delivery.queue.name, routed):
            reason = "cross_slot"
        if reason is not None:
            self.rejected(delivery, routed, reason)
            return configured
        return routed

    def configured(self, delivery: Delivery) -> str:
        return delivery.queue.result_queue_name or self._config.result_queue_name

    def rejected(self, delivery: Delivery, routed: str, reason: str) -> None:
        """Log and count a message-named result list the result did not go to."""
        queue = delivery.queue.name
        log.warning(
            "result_route_rejected",
            request_id=delivery.envelope.id if delivery.envelope else None,
            queue=queue,
            result_list=routed,
            reason=reason,
            written_to=self.configured(delivery),
        )
        if self._metrics is not None:
            self._metrics.result_route_rejected_total.labels(queue, reason).inc()
