"""Config models: the transport, pool, merge-policy, transform and runtime settings.

Field names and defaults follow the Go reference; unknown fields are errors
(docs/architecture.md G15). Filled by ``config.load`` from flags, environment and files.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from pydantic import (
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

from async_processor.config.base import (
    DEFAULT_POOL,
    GateParams,
    Port,
    Strict,
    check_http_url,
    require_unique,
)
from async_processor.config.queues import QueueSpec
from async_processor.config.transports import SortedSetConfig, TransportConfig
from async_processor.durations import Duration
from async_processor.headers import DEFAULT_DEADLINE_HEADER

# RFC 7230 token: what a header name may be made of.
_HEADER_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")


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


class MergePolicyFile(MergePolicyConfig):
    """The file form: ``type`` is required there, as the reference requires it (no file
    means random-robin; a file that forgot its type is a mistake, not a request for it)."""

    type: str


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

    @model_validator(mode="after")
    def _unique(self) -> TransformConfig:
        require_unique("requestTransforms[].name", [t.name for t in self.request_transforms])
        return self


class TLSConfig(Strict):
    text_values = True  # from flags
    ca_cert: str = ""
    cert: str = ""
    key: str = ""
    insecure_skip_verify: bool = False

    @model_validator(mode="after")
    def _pair(self) -> TLSConfig:
        if bool(self.cert) != bool(self.key):
            raise ValueError("--tls-cert and --tls-key must be given together")
        return self


class RuntimeConfig(Strict):
    """Flag-level settings the pipeline reads (the rest of ``AppConfig``)."""

    text_values = True  # from flags

    concurrency: Annotated[int, Field(gt=0)] = 64
    request_timeout: Annotated[Duration, Field(gt=0)] = 300.0
    drain_timeout: Annotated[Duration, Field(ge=0)] = 120.0
    # None = request_timeout. Not 0: a Wait would hand back at once, to be re-claimed at once.
    gate_wait_timeout: Annotated[Duration, Field(gt=0)] | None = None
    prometheus_url: str = ""
    prometheus_cache_ttl: Annotated[Duration, Field(ge=0)] = 5.0  # 0 disables the cache
    # in-flight: a queue's budget caps its messages in flight at budget x pool slots;
    # fetch: it only sizes each fetch (the reference), so fetches follow at once.
    budget_scope: Literal["in-flight", "fetch"] = "in-flight"
    shed_pause: Annotated[Duration, Field(ge=0)] = 0.0  # longest pool pause after a 429; 0 = off
    metrics_backlog_poll_interval: Annotated[Duration, Field(ge=0)] = 15.0  # 0 disables
    # Re-read the transport config file this often and apply its queues (0 = off, upstream's).
    transport_config_watch_interval: Annotated[Duration, Field(ge=0)] = 0.0
    health_port: Port = 8081
    metrics_port: Port = 9090
    bind_address: str = "0.0.0.0"  # noqa: S104 - a pod's probes and scrapes come from outside
    deadline_header: str = DEFAULT_DEADLINE_HEADER  # empty: no deadline header
    inference_ttl_header: bool = False  # send x-llm-d-inference-ttl (upstream sends none)
    max_message_bytes: Annotated[int, Field(gt=0)] = 4 * 1024 * 1024
    metrics_bearer_token: str = ""
    # Distinct tenants counted in tokens_total per process; the rest count as "other".
    tenant_label_limit: Annotated[int, Field(ge=0)] = 100
    tokens_kind_total: bool = True  # tokens_total{kind="total"}: deprecated, off next release
    tls: TLSConfig = Field(default_factory=TLSConfig)
    # The gateway's HTTP client (async_processor.httpclients); pyreqwest is an extra.
    http_client: Literal["httptools", "aiohttp", "pyreqwest"] = "httptools"

    @field_validator("prometheus_url")
    @classmethod
    def _prometheus_url(cls, value: str) -> str:
        return check_http_url(value) if value else value

    @field_validator("deadline_header")
    @classmethod
    def _header(cls, value: str) -> str:
        if value and not _HEADER_TOKEN.fullmatch(value):
            raise ValueError(f"{value!r} is not a legal HTTP header name")
        return value

    @model_validator(mode="after")
    def _distinct_ports(self) -> RuntimeConfig:
        # Both servers would bind the same port, and the daemon would fail at start-up.
        if self.health_port and self.health_port == self.metrics_port:
            raise ValueError(
                f"--health-port and --metrics-port are both {self.health_port}; they must differ"
            )
        return self

    @property
    def effective_gate_wait_timeout(self) -> float:
        return self.request_timeout if self.gate_wait_timeout is None else self.gate_wait_timeout


class AppConfig(Strict):
    """Everything ``pipeline.daemon.run`` needs, validated."""

    transport: str
    transport_config: TransportConfig
    transport_config_file: str = ""  # where it was read from ("" = inline): hot reload reads it
    runtime: RuntimeConfig = Field(default_factory=RuntimeConfig)
    pools: list[PoolConfig] = Field(default_factory=list)
    merge_policy: MergePolicyConfig = Field(default_factory=MergePolicyConfig)
    transforms: TransformConfig = Field(default_factory=TransformConfig)

    def queue_specs(self) -> list[QueueSpec]:
        return self.transport_config.queue_specs()

    @model_validator(mode="after")
    def _gate_groups(self) -> AppConfig:
        """Queues share a gate only when they send to one endpoint with one gate: anything
        else would gate one queue on another endpoint's capacity."""
        first: dict[str, QueueSpec] = {}
        transport = self.transport_config
        templates = transport.template_specs() if isinstance(transport, SortedSetConfig) else []
        for q in [*self.queue_specs(), *templates]:
            if not q.gate_group:
                continue
            lead = first.setdefault(q.gate_group, q)
            if _gated_endpoint(q) != _gated_endpoint(lead):
                raise ValueError(
                    f"gate_group {q.gate_group!r}: queue {q.name!r} differs from {lead.name!r} "
                    "in igw_base_url, request_path_url, gate_type or gate_params; queues "
                    "sharing a gate must send to one endpoint through one gate"
                )
        return self

    def effective_pools(self) -> list[PoolConfig]:
        """The pools file, or one ``default`` pool of ``--concurrency`` workers."""
        return self.pools or [PoolConfig(id=DEFAULT_POOL, workers=self.runtime.concurrency)]


def _gated_endpoint(q: QueueSpec) -> tuple[str, str, str]:
    url = q.igw_base_url.rstrip("/") + "/" + q.request_path_url.lstrip("/")
    return url, q.gate_type, json.dumps(dict(q.gate_params), sort_keys=True)
