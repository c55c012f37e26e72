"""Transport config models: one per ``--transport``, each listing its queues or topics."""

from __future__ import annotations

from dataclasses import replace
from typing import Annotated, Any

from pydantic import (
    BeforeValidator,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from async_processor.config.base import (
    DEFAULT_POOL,
    DEFAULT_REQUEST_PATH,
    GateParams,
    Strict,
    check_http_url,
    require_unique,
    zero_is_default,
)
from async_processor.config.queues import QueueSpec
from async_processor.config.redis import (
    DEFAULT_URL,
    Mode,
    RedisConnection,
    RedisConnectionFields,
    check_url,
    cluster_problem,
)


class QueueEntry(Strict):
    """Fields shared by every queue/topic entry."""

    igw_base_url: str
    request_path_url: str = DEFAULT_REQUEST_PATH
    inference_objective: str = ""
    worker_pool_id: str = DEFAULT_POOL
    labels: dict[str, str] = Field(default_factory=dict)
    gate_type: str = ""
    gate_params: GateParams = Field(default_factory=dict)
    # Ours: queues naming one group share one queue-gate instance (same endpoint and gate).
    gate_group: str = ""

    @field_validator("igw_base_url")
    @classmethod
    def _url(cls, value: str) -> str:
        return check_http_url(value)

    @field_validator("worker_pool_id", mode="before")
    @classmethod
    def _pool(cls, value: Any) -> Any:
        return value or DEFAULT_POOL


class SortedSetQueue(QueueEntry):
    queue_name: str = Field(min_length=1)
    id: str = ""
    result_queue_name: str = ""
    # Ours: results on this queue's result list unconsumed this long are trimmed (None:
    # the transport's result_ttl_seconds).
    result_ttl_seconds: Annotated[int, Field(ge=0)] | None = None


QUEUE_PLACEHOLDER = "<queue>"


class QueueTemplate(QueueEntry):
    """What every discovered queue takes: pool, endpoint, gate, labels (weight). In
    ``result_queue_name``, ``<queue>`` stands for the queue's name (cluster mode: e.g.
    ``{<queue>}:results``, a result list in each queue's slot)."""

    result_queue_name: str = ""

    def result_list(self, queue: str) -> str:
        return self.result_queue_name.replace(QUEUE_PLACEHOLDER, queue)


class QueueDiscovery(Strict):
    """Ours: queues listed in a Redis set (``set_key``) or found by a key-prefix SCAN on
    every primary (``key_prefix``), refreshed every ``refresh_seconds`` without a restart
    (docs/transports.md, "Tenant queues found in Redis")."""

    set_key: str = ""
    key_prefix: str = ""
    refresh_seconds: Annotated[float, Field(gt=0)] = 10.0
    max_queues: Annotated[int, Field(gt=0)] = 1000
    template: QueueTemplate

    @model_validator(mode="after")
    def _one_source(self) -> QueueDiscovery:
        if bool(self.set_key) == bool(self.key_prefix):
            raise ValueError("queue_discovery: give exactly one of set_key or key_prefix")
        return self


class RedisQueue(QueueEntry):
    queue_name: str = Field(min_length=1)


class PubSubTopic(QueueEntry):
    subscriber_id: str = Field(min_length=1)


class RedisTransportBase(Strict, RedisConnectionFields):
    """``url`` plus the connection mode, sentinels and TLS files (``transports/redis_conn``)."""

    url: str = ""
    mode: Mode = "standalone"
    retry_queue_name: Annotated[str, BeforeValidator(lambda v: v or "retry-sortedset")] = (
        "retry-sortedset"
    )
    enable_tracing: bool = False

    @field_validator("url")
    @classmethod
    def _redis_url(cls, value: str) -> str:
        return check_url(value) if value else value

    @model_validator(mode="after")
    def _connection(self) -> RedisTransportBase:
        self.redis_connection().check()
        return self

    def redis_connection(self) -> RedisConnection:
        return self.connection(self.url or DEFAULT_URL, self.mode)


class SortedSetConfig(RedisTransportBase):
    """``--transport redis-sortedset``."""

    result_queue_name: Annotated[str, BeforeValidator(lambda v: v or "result-list")] = "result-list"
    poll_interval_ms: Annotated[int, zero_is_default(1000), Field(gt=0)] = 1000
    batch_size: Annotated[int, zero_is_default(10), Field(gt=0)] = 10
    # Ours: in-flight lease (kill -9 safety) and how long a request id's result is remembered.
    lease_seconds: Annotated[float, Field(gt=0)] = 30.0
    # Upstream's names (Go v0.9.1+, so its configs load unchanged; 0 = default, negative is
    # an error, as upstream): the lease when ``lease_seconds`` is not given, and how often
    # expired claims are reclaimed (default: every ``lease_seconds / 2``).
    claim_lease_ttl_seconds: Annotated[int, Field(ge=0)] = 0
    claim_reclaim_interval_ms: Annotated[int, Field(ge=0)] = 0
    dedup_ttl_seconds: Annotated[int, Field(gt=0)] = 86400
    # Ours: a glob a message's own result_queue_name must match ("" = any name that is not
    # one of the daemon's keys); otherwise its result goes to the configured list.
    result_queue_pattern: str = ""
    # Ours: results nobody consumed for this long are trimmed from the result lists (0 = kept).
    result_ttl_seconds: Annotated[int, Field(ge=0)] = 0
    # Ours: each <queue>:dead-letter list keeps at most this many entries (oldest trimmed).
    dead_letter_max_entries: Annotated[int, Field(gt=0)] = 100_000
    # Ours: after each result+ack step, WAIT for this many replicas (0 = off) up to the timeout.
    wait_replicas: Annotated[int, Field(ge=0)] = 0
    wait_timeout_ms: Annotated[int, Field(gt=0)] = 1000
    # Ours: with more than one queue, a claim waits up to this long for other queues'
    # claims to join its round trip (docs/sizing-and-backpressure.md; 0 = sent at once).
    claim_gather_ms: Annotated[int, Field(ge=0, le=1000)] = 10
    queues: list[SortedSetQueue] = Field(default_factory=list)
    # Ours: more queues, listed in Redis and refreshed while running (None: only ``queues``).
    queue_discovery: QueueDiscovery | None = None

    def result_ttls(self) -> dict[str, int]:
        """Configured result list -> its retention TTL: the smallest non-zero one of the
        queues writing to it (0 = kept)."""
        ttls: dict[str, int] = {self.result_queue_name: self.result_ttl_seconds}
        template = self.queue_discovery.template if self.queue_discovery else None
        if (
            template
            and template.result_queue_name
            and QUEUE_PLACEHOLDER not in template.result_queue_name
        ):
            ttls[template.result_queue_name] = self.result_ttl_seconds
        for q in self.queues:
            name = q.result_queue_name or self.result_queue_name
            ttl = self.result_ttl_seconds if q.result_ttl_seconds is None else q.result_ttl_seconds
            known = ttls.get(name, 0)
            ttls[name] = min(known, ttl) if known and ttl else known or ttl
        return ttls

    @model_validator(mode="before")
    @classmethod
    def _upstream_lease(cls, data: Any) -> Any:
        """Upstream's ``claim_lease_ttl_seconds`` is the lease unless ours is given too."""
        if isinstance(data, dict) and "lease_seconds" not in data:
            ttl = data.get("claim_lease_ttl_seconds")
            if isinstance(ttl, int) and not isinstance(ttl, bool) and ttl > 0:
                return {**data, "lease_seconds": ttl}
        return data

    def reclaim_interval(self) -> float:
        """Seconds between reaper rounds: upstream's ``claim_reclaim_interval_ms`` if set."""
        if self.claim_reclaim_interval_ms:
            return self.claim_reclaim_interval_ms / 1000
        return self.lease_seconds / 2

    @model_validator(mode="after")
    def _unique(self, info: ValidationInfo) -> SortedSetConfig:
        # A hot reload may empty the list (upstream allows it: every queue stopped).
        reload = bool(info.context and info.context.get("reload"))
        if not self.queues and self.queue_discovery is None and not reload:
            raise ValueError("queues: at least one queue is required (or queue_discovery)")
        require_unique("queues[].id", [q.id or q.queue_name for q in self.queues])
        require_unique("queues[].queue_name", [q.queue_name for q in self.queues])
        return self

    @model_validator(mode="after")
    def _one_slot_per_queue(self) -> SortedSetConfig:
        """Cluster mode: each queue's result list must share its hash slot (docs/transports.md)."""
        if self.mode != "cluster":
            return self
        if self.wait_replicas:
            raise ValueError("wait_replicas is not supported in mode cluster")
        for q in self.queues:
            problem = cluster_problem(q.queue_name, q.result_queue_name or self.result_queue_name)
            if problem:
                raise ValueError(problem)
        return self

    def discovered_spec(self, name: str) -> QueueSpec:
        """A discovered queue, from the discovery template."""
        assert self.queue_discovery is not None
        template = self.queue_discovery.template
        return _spec(
            template,
            name,
            name,
            self.batch_size,
            self.poll_interval_ms,
            result_queue_name=template.result_list(name),
        )

    def template_specs(self) -> list[QueueSpec]:
        """The discovery template as a queue (for config checks), or none."""
        return [self.discovered_spec("<discovered>")] if self.queue_discovery else []

    def queue_specs(self) -> list[QueueSpec]:
        return [
            _spec(
                q,
                q.id or q.queue_name,
                q.queue_name,
                self.batch_size,
                self.poll_interval_ms,
                result_queue_name=q.result_queue_name,
                result_ttl_seconds=q.result_ttl_seconds or 0,
            )
            for q in self.queues
        ]


class RedisPubSubConfig(RedisTransportBase):
    """``--transport redis-pubsub`` (deprecated, as in the product doc)."""

    result_queue_name: Annotated[str, BeforeValidator(lambda v: v or "result-queue")] = (
        "result-queue"
    )
    queues: list[RedisQueue] = Field(min_length=1)

    @model_validator(mode="after")
    def _unique(self) -> RedisPubSubConfig:
        require_unique("queues[].queue_name", [q.queue_name for q in self.queues])
        if self.mode == "cluster":
            raise ValueError("mode cluster is for redis-sortedset (redis-pubsub is deprecated)")
        return self

    def queue_specs(self) -> list[QueueSpec]:
        return [_spec(q, "", q.queue_name, 100, 1000) for q in self.queues]


PUBSUB_MAX_PULL = 1000  # Pub/Sub's limit on max_messages per pull
# A pull may bring fewer than asked (the emulator: 100 at most), so a second one is kept
# in flight; a third or fourth cost ~15 % more CPU per message with no measurable gain.
PUBSUB_PULLS_IN_FLIGHT = 2


class GcpPubSubConfig(Strict):
    """``--transport gcp-pubsub``."""

    project_id: str = Field(min_length=1)
    result_topic_id: str = Field(min_length=1)
    batch_size: Annotated[int, Field(gt=0)] = 10
    topics: list[PubSubTopic] = Field(min_length=1)

    @model_validator(mode="after")
    def _unique(self) -> GcpPubSubConfig:
        require_unique("topics[].subscriber_id", [t.subscriber_id for t in self.topics])
        return self

    def queue_specs(self) -> list[QueueSpec]:
        return [
            replace(
                _spec(t, "", t.subscriber_id, self.batch_size, 1000),
                max_fetch=PUBSUB_MAX_PULL,
                fetches_in_flight=PUBSUB_PULLS_IN_FLIGHT,
            )
            for t in self.topics
        ]


TRANSPORT_CONFIGS: dict[str, type[SortedSetConfig | RedisPubSubConfig | GcpPubSubConfig]] = {
    "redis-sortedset": SortedSetConfig,
    "redis-pubsub": RedisPubSubConfig,
    "gcp-pubsub": GcpPubSubConfig,
}
TransportConfig = SortedSetConfig | RedisPubSubConfig | GcpPubSubConfig


def _spec(
    entry: QueueEntry,
    queue_id: str,
    name: str,
    batch_size: int,
    poll_interval_ms: int,
    *,
    result_queue_name: str = "",
    result_ttl_seconds: int = 0,
) -> QueueSpec:
    return QueueSpec(
        id=queue_id,
        name=name,
        pool=entry.worker_pool_id,
        igw_base_url=entry.igw_base_url,
        request_path_url=entry.request_path_url,
        inference_objective=entry.inference_objective,
        labels=dict(entry.labels),
        gate_type=entry.gate_type,
        gate_params=dict(entry.gate_params),
        gate_group=entry.gate_group,
        result_queue_name=result_queue_name,
        result_ttl_seconds=result_ttl_seconds,
        batch_size=batch_size,
        poll_interval=poll_interval_ms / 1000,
    )
