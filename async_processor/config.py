"""The one config surface: settings (flags + environment) and the JSON config files.

Input: command-line flags, ``ASYNC_PROCESSOR_*`` environment variables (flags win),
``REDIS_URL``, and the transport / pool / merge-policy / transform files. Output: one
frozen ``AppConfig`` for ``processor.run``. Field names and defaults follow the Go
reference; unknown fields are errors (DESIGN.md §5.9).
"""

from __future__ import annotations

import json
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator

from async_processor.durations import Duration
from async_processor.transports.base import QueueSpec

DEFAULT_POOL = "default"
DEFAULT_REQUEST_PATH = "/v1/completions"


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _json_object_or_string(value: Any) -> Any:
    """``gate_params`` may be an object or a JSON-encoded string of one (Helm does that)."""
    if isinstance(value, str):
        if not value.strip():
            return {}
        try:
            return json.loads(value)
        except ValueError as exc:
            raise ValueError(f"not a JSON object: {exc}") from exc
    return {} if value is None else value


GateParams = Annotated[dict[str, Any], BeforeValidator(_json_object_or_string)]


def _zero_is_default(default: int) -> Any:
    def coerce(value: Any) -> Any:
        return default if value in (0, None) else value

    return BeforeValidator(coerce)


class QueueEntry(Strict):
    """Fields shared by every queue/topic entry."""

    igw_base_url: str
    request_path_url: str = DEFAULT_REQUEST_PATH
    inference_objective: str = ""
    worker_pool_id: str = DEFAULT_POOL
    labels: dict[str, str] = Field(default_factory=dict)
    gate_type: str = ""
    gate_params: GateParams = Field(default_factory=dict)

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


class RedisQueue(QueueEntry):
    queue_name: str = Field(min_length=1)


class PubSubTopic(QueueEntry):
    subscriber_id: str = Field(min_length=1)


class RedisTransportBase(Strict):
    url: str = ""
    retry_queue_name: Annotated[str, BeforeValidator(lambda v: v or "retry-sortedset")] = (
        "retry-sortedset"
    )
    enable_tracing: bool = False

    @field_validator("url")
    @classmethod
    def _redis_url(cls, value: str) -> str:
        if value and not value.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError("must be a redis://, rediss:// or unix:// URL")
        return value


class SortedSetConfig(RedisTransportBase):
    """``--transport redis-sortedset``."""

    result_queue_name: Annotated[str, BeforeValidator(lambda v: v or "result-list")] = "result-list"
    poll_interval_ms: Annotated[int, _zero_is_default(1000), Field(gt=0)] = 1000
    batch_size: Annotated[int, _zero_is_default(10), Field(gt=0)] = 10
    # Ours: in-flight lease (kill -9 safety) and how long a request id's result is remembered.
    lease_seconds: Annotated[float, Field(gt=0)] = 30.0
    dedup_ttl_seconds: Annotated[int, Field(gt=0)] = 86400
    queues: list[SortedSetQueue] = Field(min_length=1)

    @model_validator(mode="after")
    def _unique(self) -> SortedSetConfig:
        _require_unique("queues[].id", [q.id or q.queue_name for q in self.queues])
        _require_unique("queues[].queue_name", [q.queue_name for q in self.queues])
        return self

    def queue_specs(self) -> list[QueueSpec]:
        return [
            _spec(q, q.id or q.queue_name, q.queue_name, self.batch_size, self.poll_interval_ms,
                  result_queue_name=q.result_queue_name)
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
        _require_unique("queues[].queue_name", [q.queue_name for q in self.queues])
        return self

    def queue_specs(self) -> list[QueueSpec]:
        return [_spec(q, "", q.queue_name, 100, 1000) for q in self.queues]


class GcpPubSubConfig(Strict):
    """``--transport gcp-pubsub``."""

    project_id: str = Field(min_length=1)
    result_topic_id: str = Field(min_length=1)
    batch_size: Annotated[int, Field(gt=0)] = 10
    topics: list[PubSubTopic] = Field(min_length=1)

    @model_validator(mode="after")
    def _unique(self) -> GcpPubSubConfig:
        _require_unique("topics[].subscriber_id", [t.subscriber_id for t in self.topics])
        return self

    def queue_specs(self) -> list[QueueSpec]:
        return [_spec(t, "", t.subscriber_id, self.batch_size, 1000) for t in self.topics]


TRANSPORT_CONFIGS: dict[str, type[SortedSetConfig | RedisPubSubConfig | GcpPubSubConfig]] = {
    "redis-sortedset": SortedSetConfig,
    "redis-pubsub": RedisPubSubConfig,
    "gcp-pubsub": GcpPubSubConfig,
}
TransportConfig = SortedSetConfig | RedisPubSubConfig | GcpPubSubConfig


class PoolConfig(Strict):
    """One entry of ``--pool-config-file`` (a JSON array)."""

    id: str = Field(min_length=1)
    workers: Annotated[int, Field(gt=0)]
    gate_type: str = ""
    gate_params: GateParams = Field(default_factory=dict)


class MergePolicyConfig(Strict):
    """``--request-merge-policy-config-file``: ``{type, parameters}``."""

    type: str = "random-robin"
    parameters: dict[str, Any] = Field(default_factory=dict)


class TransformEntry(Strict):
    name: str = Field(min_length=1)
    type: str = Field(min_length=1)
    parameters: dict[str, Any] = Field(default_factory=dict)


class TransformConfig(Strict):
    """``--transform-config-file``: ``{"requestTransforms": [...]}``."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)
    request_transforms: list[TransformEntry] = Field(
        default_factory=list, alias="requestTransforms"
    )


class TLSConfig(Strict):
    ca_cert: str = ""
    cert: str = ""
    key: str = ""
    insecure_skip_verify: bool = False


class RuntimeConfig(Strict):
    """Flag-level settings the pipeline reads (the rest of ``AppConfig``)."""

    concurrency: Annotated[int, Field(gt=0)] = 64
    request_timeout: Duration = 300.0
    drain_timeout: Duration = 120.0
    gate_wait_timeout: Duration | None = None  # None = request_timeout
    prometheus_url: str = ""
    prometheus_cache_ttl: Duration = 5.0
    metrics_backlog_poll_interval: Duration = 15.0
    health_port: int = 8081
    metrics_port: int = 9090
    bind_address: str = "0.0.0.0"  # noqa: S104 - a pod's probes and scrapes come from outside
    deadline_header: str = "x-request-deadline"
    max_message_bytes: Annotated[int, Field(gt=0)] = 4 * 1024 * 1024
    metrics_bearer_token: str = ""
    tls: TLSConfig = Field(default_factory=TLSConfig)

    @property
    def effective_gate_wait_timeout(self) -> float:
        return self.request_timeout if self.gate_wait_timeout is None else self.gate_wait_timeout


class AppConfig(Strict):
    """Everything ``processor.run`` needs, validated."""

    transport: str
    transport_config: TransportConfig
    runtime: RuntimeConfig = Field(default_factory=RuntimeConfig)
    pools: list[PoolConfig] = Field(default_factory=list)
    merge_policy: MergePolicyConfig = Field(default_factory=MergePolicyConfig)
    transforms: TransformConfig = Field(default_factory=TransformConfig)

    def queue_specs(self) -> list[QueueSpec]:
        return self.transport_config.queue_specs()

    def effective_pools(self) -> list[PoolConfig]:
        """The pools file, or one ``default`` pool of ``--concurrency`` workers."""
        return self.pools or [PoolConfig(id=DEFAULT_POOL, workers=self.runtime.concurrency)]


def check_http_url(value: str) -> str:
    from urllib.parse import urlsplit  # noqa: PLC0415 - only at startup

    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{value!r} is not an http(s) URL with a host")
    return value


def _spec(
    entry: QueueEntry,
    queue_id: str,
    name: str,
    batch_size: int,
    poll_interval_ms: int,
    *,
    result_queue_name: str = "",
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
        result_queue_name=result_queue_name,
        batch_size=batch_size,
        poll_interval=poll_interval_ms / 1000,
    )


def _require_unique(what: str, values: list[str]) -> None:
    seen: set[str] = set()
    for value in values:
        if value in seen:
            raise ValueError(f"{what}: duplicate {value!r}")
        seen.add(value)
