"""Which names a redis-sortedset daemon may serve as tenant queues (docs/architecture.md
G14): the names a discovery source lists and those restored from ``REMOVED_QUEUES_KEY``
are untrusted input, held to the same checks here.

Stage: broker I/O (which queues exist). Input: a name (and, for ``sorted_sets``, the
types of their keys in Redis). Output: the reason it is refused, if it is; every refusal
counted by reason (``queue_discovery_refused_total``) and the first ones logged.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import structlog
from redis.asyncio import Redis

from async_processor.config.redis import cluster_problem
from async_processor.config.transports import QueueDiscovery
from async_processor.redis.keys import OWN_PREFIXES, OwnKeys

if TYPE_CHECKING:
    from async_processor.metrics import Metrics

log = structlog.get_logger(__name__)

MAX_NAME_BYTES = 512
REFUSALS = ("daemon_key", "bad_name", "cross_slot", "over_cap", "wrong_type")
LOGGED_REFUSALS = 1000  # distinct refused names logged per process (then only counted)
# Shapes of the keys the daemon and the client derive from a queue name.
_DERIVED = re.compile(
    r"(:inflight|:inflight:meta|:claimed|:claim-owners|:claims-idx|:dead-letter|:retry|:pushed"
    r"|:marks)$|:live:|:seq:"
    r"|(^|\}:)(" + "|".join(re.escape(p) for p in OWN_PREFIXES) + ")"
)
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def text(raw: bytes | str) -> str | None:
    """A name read from Redis as text, or None when it is not UTF-8."""
    if isinstance(raw, str):
        return raw
    try:
        return raw.decode()
    except UnicodeDecodeError:
        return None


class NameRules:
    """Which names may be served as tenant queues, and the refused ones counted (by reason)
    and logged: for the names a discovery source lists and for those restored from
    ``REMOVED_QUEUES_KEY``, which anyone who can write to Redis may fill as well."""

    def __init__(
        self,
        discovery: QueueDiscovery | None,
        *,
        cluster: bool,
        own: OwnKeys,
        result_list: str,
        metrics: Metrics | None,
    ) -> None:
        self._discovery = discovery
        self._cluster = cluster
        self._own = own
        self._result_list = result_list  # the transport's; the template's may say <queue>
        self._metrics = metrics
        self._logged: set[str] = set()
        if metrics is not None:
            for reason in REFUSALS:
                metrics.discovery_refused_total.labels(reason)

    def refusal(self, name: str) -> str | None:
        """Why ``name`` may not be polled as a tenant queue (None: it may)."""
        if not name or len(name.encode()) > MAX_NAME_BYTES or _CONTROL.search(name):
            return "bad_name"
        template = self._discovery.template if self._discovery else None
        results = (template.result_list(name) if template else None) or self._result_list
        set_key = self._discovery.set_key if self._discovery else None
        if name in (results, self._result_list, set_key) or _DERIVED.search(name):
            return "daemon_key"
        if self._own.rejection(name) == "reserved_key":
            return "daemon_key"
        if self._cluster and cluster_problem(name, results):
            return "cross_slot"
        return None

    def refuse(self, name: str, reason: str) -> None:
        if self._metrics is not None:
            self._metrics.discovery_refused_total.labels(reason).inc()
        if name not in self._logged and len(self._logged) < LOGGED_REFUSALS:
            self._logged.add(name)
            log.warning("queue_refused", queue=name[:MAX_NAME_BYTES], reason=reason)

    async def sorted_sets(self, redis: Redis, names: list[str]) -> list[str]:
        """``names`` without the keys that exist and are not sorted sets (a set may name
        any key; the upkeep scripts cover many queues per call, so one such key would
        fail them for every queue)."""
        if not names:
            return names
        async with redis.pipeline(transaction=False) as pipe:
            for name in names:
                pipe.type(name)
            types = await pipe.execute()
        kept = []
        for name, kind in zip(names, types, strict=True):
            if text(kind) in ("zset", "none"):
                kept.append(name)
            else:
                self.refuse(name, "wrong_type")
        return kept
