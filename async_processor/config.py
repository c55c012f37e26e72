"""The one config surface: settings (flags + environment) and the JSON config files.

Input: command-line flags, ``ASYNC_PROCESSOR_*`` environment variables (flags win),
``REDIS_URL``, and the transport / pool / merge-policy / transform files. Output: one
frozen ``AppConfig`` for ``processor.run``. Field names and defaults follow the Go
reference; unknown fields are errors (docs/architecture.md G15).
"""

from __future__ import annotations

import argparse
import json
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Annotated, Any, Literal, NoReturn, TypeVar, cast, get_args
from urllib.parse import urlsplit

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from async_processor.durations import Duration, format_duration
from async_processor.errors import ConfigError
from async_processor.logs import FORMATS, LEVELS
from async_processor.registry import describe_validation
from async_processor.transports.base import QueueSpec
from async_processor.transports.redis_settings import (
    DEFAULT_URL,
    Mode,
    RedisConnection,
    RedisConnectionFields,
    check_url,
    cluster_problem,
)

DEFAULT_POOL = "default"
DEFAULT_REQUEST_PATH = "/v1/completions"
# RFC 7230 token: what a header name may be made of.
_HEADER_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
Port = Annotated[int, Field(ge=0, le=65535)]


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


_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


def _env_refs(params: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
    """A gate param whose whole value is ``${NAME}`` takes the environment variable NAME.

    So a credential (a Redis URL with a password) comes from a Secret through the
    environment, not from the config file, which the chart keeps in a ConfigMap. The
    environment is the loader's (validation context ``env``), else the process's.
    """
    env: Mapping[str, str] = (info.context or {}).get("env", os.environ)
    out = dict(params)
    for key, value in params.items():
        match = _ENV_REF.fullmatch(value) if isinstance(value, str) else None
        if match is None:
            continue
        if not env.get(match.group(1)):
            raise ValueError(f"{key}: environment variable {match.group(1)} is not set")
        out[key] = env[match.group(1)]
    return out


GateParams = Annotated[
    dict[str, Any], BeforeValidator(_json_object_or_string), AfterValidator(_env_refs)
]


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
    poll_interval_ms: Annotated[int, _zero_is_default(1000), Field(gt=0)] = 1000
    batch_size: Annotated[int, _zero_is_default(10), Field(gt=0)] = 10
    # Ours: in-flight lease (kill -9 safety) and how long a request id's result is remembered.
    lease_seconds: Annotated[float, Field(gt=0)] = 30.0
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
    queues: list[SortedSetQueue] = Field(min_length=1)

    def result_ttls(self) -> dict[str, int]:
        """Configured result list -> its retention TTL: the smallest non-zero one of the
        queues writing to it (0 = kept)."""
        ttls: dict[str, int] = {self.result_queue_name: self.result_ttl_seconds}
        for q in self.queues:
            name = q.result_queue_name or self.result_queue_name
            ttl = self.result_ttl_seconds if q.result_ttl_seconds is None else q.result_ttl_seconds
            known = ttls.get(name, 0)
            ttls[name] = min(known, ttl) if known and ttl else known or ttl
        return ttls

    @model_validator(mode="after")
    def _unique(self) -> SortedSetConfig:
        _require_unique("queues[].id", [q.id or q.queue_name for q in self.queues])
        _require_unique("queues[].queue_name", [q.queue_name for q in self.queues])
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

    def queue_specs(self) -> list[QueueSpec]:
        return [
            _spec(
                q,
                q.id or q.queue_name,
                q.queue_name,
                self.batch_size,
                self.poll_interval_ms,
                result_queue_name=q.result_queue_name,
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
        _require_unique("queues[].queue_name", [q.queue_name for q in self.queues])
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
        _require_unique("topics[].subscriber_id", [t.subscriber_id for t in self.topics])
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
        _require_unique("requestTransforms[].name", [t.name for t in self.request_transforms])
        return self


class TLSConfig(Strict):
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
    health_port: Port = 8081
    metrics_port: Port = 9090
    bind_address: str = "0.0.0.0"  # noqa: S104 - a pod's probes and scrapes come from outside
    deadline_header: str = "x-request-deadline"  # empty: no deadline header
    max_message_bytes: Annotated[int, Field(gt=0)] = 4 * 1024 * 1024
    metrics_bearer_token: str = ""
    # Distinct tenants counted in tokens_total per process; the rest count as "other".
    tenant_label_limit: Annotated[int, Field(ge=0)] = 100
    tls: TLSConfig = Field(default_factory=TLSConfig)

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
    """Everything ``processor.run`` needs, validated."""

    transport: str
    transport_config: TransportConfig
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
        for q in self.queue_specs():
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


def check_http_url(value: str) -> str:
    try:
        parts = urlsplit(value)
        parts.port  # noqa: B018 - parsed lazily: raises ValueError for a bad port
    except ValueError:  # e.g. an unclosed IPv6 literal
        parts = None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
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
        gate_group=entry.gate_group,
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


# ------------------------------------------------------------------------------ loading

ENV_PREFIX = "ASYNC_PROCESSOR_"
TRANSPORT_SOURCES = ("transport_config", "transport_config_file")


@dataclass(frozen=True, slots=True)
class Flag:
    """One command-line flag; ``field`` is its path in ``RuntimeConfig`` (if any)."""

    name: str
    help: str
    field: str = ""
    default: str = ""  # for flags outside RuntimeConfig (which holds the others' defaults)
    choices: tuple[str, ...] = ()
    boolean: bool = False

    @property
    def option(self) -> str:
        return f"--{self.name}"

    @property
    def dest(self) -> str:
        return self.name.replace("-", "_")

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.dest.upper()


FLAGS: tuple[Flag, ...] = (
    Flag("transport", "message transport", default="redis-pubsub",
         choices=tuple(TRANSPORT_CONFIGS)),
    Flag("transport-config", "transport config as inline JSON"),
    Flag("transport-config-file", "transport config JSON file"),
    Flag("pool-config-file", "worker pools JSON file (default: one pool 'default')"),
    Flag("request-merge-policy-config-file", "merge policy JSON file (default random-robin)"),
    Flag("transform-config-file", "request body transforms JSON file"),
    Flag("concurrency", "workers of the default pool", "concurrency"),
    Flag("request-timeout", "per-attempt HTTP cap (Go duration)", "request_timeout"),
    Flag("drain-timeout", "shutdown drain budget (Go duration)", "drain_timeout"),
    Flag("gate-wait-timeout", "longest pool-gate wait (default: --request-timeout)",
         "gate_wait_timeout"),
    Flag("prometheus-url", "Prometheus base URL for prometheus-* gates", "prometheus_url"),
    Flag("prometheus-cache-ttl", "gate metric cache TTL (0 disables)", "prometheus_cache_ttl"),
    Flag("budget-scope", "what a queue gate's budget bounds: in-flight (budget × pool slots) "
         "or fetch (each fetch only, as the Go reference)", "budget_scope"),
    Flag("shed-pause", "after a 429 the pool sends nothing new for Retry-After, at most this "
         "long (0 disables)", "shed_pause"),
    Flag("tenant-label-limit", "distinct tenants in tokens_total per replica; more count "
         "as 'other'", "tenant_label_limit"),
    Flag("metrics-backlog-poll-interval", "broker backlog gauge interval (0 disables)",
         "metrics_backlog_poll_interval"),
    Flag("health-port", "port of /healthz and /readyz", "health_port"),
    Flag("metrics-port", "port of /metrics", "metrics_port"),
    Flag("bind-address", "address the health and metrics servers listen on", "bind_address"),
    Flag("deadline-header", "header carrying the remaining deadline (empty disables)",
         "deadline_header"),
    Flag("max-message-bytes", "largest accepted message", "max_message_bytes"),
    Flag("metrics-bearer-token-file", "file holding a bearer token required on /metrics"),
    Flag("tls-ca-cert", "CA bundle for the gateway", "tls.ca_cert"),
    Flag("tls-cert", "client certificate for the gateway", "tls.cert"),
    Flag("tls-key", "client key for the gateway", "tls.key"),
    Flag("tls-insecure-skip-verify", "skip gateway certificate checks", "tls.insecure_skip_verify",
         boolean=True),
    Flag("log-level", "log level", default="info", choices=LEVELS),
    Flag("log-format", "log format (auto: json unless stderr is a TTY)", default="auto",
         choices=FORMATS),
)  # fmt: skip
_BY_FIELD = {flag.field: flag for flag in FLAGS if flag.field}
_BY_DEST = {flag.dest: flag for flag in FLAGS}


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad command line as a one-line ConfigError."""

    def error(self, message: str) -> NoReturn:
        raise ConfigError(message)


# Adds a command's own flags (e.g. ``status --json``) next to the config flags.
ExtendParser = Callable[[argparse.ArgumentParser], None]


def flag_parser(
    prog: str = "async-processor run", extend: ExtendParser | None = None
) -> argparse.ArgumentParser:
    parser = _Parser(
        prog=prog,
        allow_abbrev=False,
        epilog=(f"Every flag can also be set as {ENV_PREFIX}<FLAG_IN_UPPER_SNAKE>; flags win."),
    )
    for flag in FLAGS:
        default = flag.default or _field_default(flag.field)
        # A default the help text already explains (or none at all) is not repeated.
        shown = f"default: {default}; " if default and "(default" not in flag.help else ""
        help_text = f"{flag.help} ({shown}env {flag.env})"
        if flag.boolean:
            parser.add_argument(
                flag.option, dest=flag.dest, nargs="?", const="true", metavar="BOOL", help=help_text
            )
        else:
            parser.add_argument(flag.option, dest=flag.dest, metavar=_metavar(flag), help=help_text)
    if extend is not None:
        extend(parser)
    return parser  # fmt: skip


def _metavar(flag: Flag) -> str:
    """What kind of value a flag takes, for ``--help`` (FILE, PORT, DURATION, ...)."""
    if flag.choices:
        return "{" + ",".join(flag.choices) + "}"
    if flag.name.endswith("-file") or flag.name.startswith("tls-"):
        return "FILE"
    if flag.name.endswith("-port"):
        return "PORT"
    if flag.name.endswith("-url"):
        return "URL"
    if flag.field:
        group, _, name = flag.field.rpartition(".")
        annotation = (TLSConfig if group else RuntimeConfig).model_fields[name].annotation
        # Unwrap Optional and Annotated: ``Annotated[Duration, ...] | None`` counts as float.
        args = get_args(annotation)
        kinds = {annotation, *args, *(inner for arg in args for inner in get_args(arg))}
        if float in kinds:  # the Duration fields (Go syntax)
            return "DURATION"
        if int in kinds:
            return "N"
    return "VALUE"


@dataclass(frozen=True, slots=True)
class Settings:
    """Flag values as given (flag, else environment); absent ones take the defaults.

    An empty environment variable counts as unset (Kubernetes renders unset values as
    ""); an empty flag value is kept (``--deadline-header=`` turns the header off).
    """

    values: Mapping[str, str]
    sources: Mapping[str, str]  # dest -> "--flag" or "ENV_NAME", for error messages
    extra: Mapping[str, Any] = field(default_factory=dict)  # a command's own flags (extend)

    def get(self, dest: str) -> str:
        flag = next(f for f in FLAGS if f.dest == dest)
        return self.values.get(dest, flag.default)

    @property
    def log_level(self) -> str:
        return self.get("log_level")

    @property
    def log_format(self) -> str:
        return self.get("log_format")


def parse_settings(
    argv: Sequence[str],
    env: Mapping[str, str],
    *,
    prog: str = "async-processor run",
    extend: ExtendParser | None = None,
) -> Settings:
    """Flags, then ``ASYNC_PROCESSOR_*`` for the flags not given; choices checked."""
    parsed = vars(flag_parser(prog, extend).parse_args(list(argv)))
    extra = {k: parsed.pop(k) for k in list(parsed) if k not in _BY_DEST}
    given = {k: v for k, v in parsed.items() if v is not None}
    values: dict[str, str] = {}
    sources: dict[str, str] = {}
    # The two transport sources are one setting: a flag for either hides the env of both.
    skip_env = set(TRANSPORT_SOURCES) if given.keys() & set(TRANSPORT_SOURCES) else set()
    for flag in FLAGS:
        if flag.dest in given:
            values[flag.dest], sources[flag.dest] = given[flag.dest], flag.option
        elif flag.dest not in skip_env and usable_env(env.get(flag.env, "")):
            values[flag.dest], sources[flag.dest] = env[flag.env], flag.env
        if flag.choices and flag.dest in values and values[flag.dest] not in flag.choices:
            raise ConfigError(f"{sources[flag.dest]}: {values[flag.dest]!r} is not one of "
                              f"{', '.join(flag.choices)}")  # fmt: skip
    return Settings(values, sources, extra)


def usable_env(value: str) -> bool:
    """Empty means unset; so does a Kubernetes service link (``tcp://10.0.0.1:9090``).

    A Service named ``async-processor-metrics`` makes Kubernetes inject
    ``ASYNC_PROCESSOR_METRICS_PORT=tcp://...`` into every pod of the namespace; taking it
    for our flag would crash-loop the daemon.
    """
    return value != "" and not value.startswith(("tcp://", "udp://"))


def load_config(argv: Sequence[str], env: Mapping[str, str]) -> AppConfig:
    """Flags + environment + files -> a validated ``AppConfig`` (ConfigError otherwise)."""
    return build_config(parse_settings(argv, env), env)


def build_config(settings: Settings, env: Mapping[str, str]) -> AppConfig:
    transport = settings.get("transport")
    transport_config, source = _transport_config(settings, transport, env)
    pools = _pools(settings, env)
    _check_pools(transport_config, pools, source)
    merge_path = settings.get("request_merge_policy_config_file")
    transforms_path = settings.get("transform_config_file")
    return AppConfig(
        transport=transport,
        transport_config=transport_config,
        runtime=_runtime(settings),
        pools=pools,
        merge_policy=_from_file(MergePolicyFile, "--request-merge-policy-config-file",
                                merge_path) if merge_path else MergePolicyConfig(),
        transforms=_from_file(TransformConfig, "--transform-config-file", transforms_path)
        if transforms_path else TransformConfig(),
    )  # fmt: skip


def _transport_config(
    settings: Settings, transport: str, env: Mapping[str, str]
) -> tuple[TransportConfig, str]:
    inline, path = settings.get("transport_config"), settings.get("transport_config_file")
    if inline and path:
        raise ConfigError("--transport-config and --transport-config-file are mutually exclusive")
    if not inline and not path:
        raise ConfigError("one of --transport-config or --transport-config-file is required")
    source = f"--transport-config-file {path}" if path else "--transport-config"
    raw = _parse_json(source, inline) if inline else _read_json("--transport-config-file", path)
    if "transport" not in settings.values:  # the default transport is only a guess
        _suggest_transport(source, raw, transport)
    model = TRANSPORT_CONFIGS[transport]
    is_redis = issubclass(model, RedisTransportBase)
    if is_redis and isinstance(raw, dict) and not raw.get("url"):
        # REDIS_URL only fills an empty url: an explicit one wins.
        raw = {**raw, "url": env.get("REDIS_URL", "")}
        if not raw["url"]:
            raise ConfigError(f"{source}: url is required for {transport} (or set REDIS_URL)")
    validate = partial(model.model_validate, context={"env": env})
    config = cast(TransportConfig, _validate(validate, source, raw))
    return config, source


def _suggest_transport(source: str, raw: Any, assumed: str) -> None:
    """ConfigError naming the transport ``raw`` is a config of, when not ``assumed``'s.

    Without ``--transport`` the default (redis-pubsub) is assumed, and a sorted-set config
    would otherwise fail as ``queues.0.id: Extra inputs are not permitted``.
    """
    fits = [name for name, model in TRANSPORT_CONFIGS.items() if _fits(model, raw)]
    if fits and assumed not in fits:
        raise ConfigError(
            f"{source}: this looks like a {fits[0]} config; pass --transport {fits[0]}"
        )


def _fits(model: type[BaseModel], raw: Any) -> bool:
    try:
        model.model_validate(raw)
    except ValidationError:
        return False
    return True


def redis_connection_file(path: str, url: str) -> RedisConnection:
    """The connection a Redis transport config file describes (its queues are ignored);
    ``url`` fills an empty one. For the producer commands, so they connect as the daemon."""
    raw = _read_json("--transport-config-file", path)
    if not isinstance(raw, dict):
        raise ConfigError(f"--transport-config-file {path}: not a JSON object")
    wanted = {"url", "mode", *RedisConnectionFields.model_fields}
    fields = {k: v for k, v in raw.items() if k in wanted}
    fields["url"] = fields.get("url") or url
    source = f"--transport-config-file {path}"
    return _validate(RedisTransportBase.model_validate, source, fields).redis_connection()


def _pools(settings: Settings, env: Mapping[str, str]) -> list[PoolConfig]:
    path = settings.get("pool_config_file")
    if not path:
        return []
    source = f"--pool-config-file {path}"
    pools = _validate(
        partial(TypeAdapter(list[PoolConfig]).validate_python, context={"env": env}),
        source,
        _read_json("--pool-config-file", path),
    )
    if not pools:
        raise ConfigError(f"{source}: at least one pool is required")
    try:
        _require_unique("[].id", [p.id for p in pools])
    except ValueError as exc:
        raise ConfigError(f"{source}: {exc}") from None
    return pools


def _check_pools(transport_config: TransportConfig, pools: list[PoolConfig], source: str) -> None:
    known = [p.id for p in pools] or [DEFAULT_POOL]
    for spec in transport_config.queue_specs():
        if spec.pool not in known:
            raise ConfigError(
                f"{source}: queue {spec.name!r} names unknown worker_pool_id {spec.pool!r} "
                f"(pools: {', '.join(known)})"
            )


def _runtime(settings: Settings) -> RuntimeConfig:
    given: dict[str, Any] = {"tls": {}}
    for flag in FLAGS:
        if flag.field and flag.dest in settings.values:
            group, _, name = flag.field.rpartition(".")
            (given[group] if group else given)[name] = settings.values[flag.dest]
    token_file = settings.get("metrics_bearer_token_file")
    if token_file:
        given["metrics_bearer_token"] = _read_text("--metrics-bearer-token-file", token_file)
        if not given["metrics_bearer_token"]:
            raise ConfigError(f"--metrics-bearer-token-file {token_file}: the file is empty")
    for name, path in given["tls"].items():
        if name != "insecure_skip_verify" and path and not os.path.isfile(path):
            raise ConfigError(f"--tls-{name.replace('_', '-')} {path}: no such file")
    try:
        return RuntimeConfig.model_validate(given)
    except ValidationError as exc:
        raise ConfigError(_describe_flag_error(exc, settings)) from None


def _describe_flag_error(exc: ValidationError, settings: Settings) -> str:
    first = exc.errors()[0]
    message = first["msg"].removeprefix("Value error, ")
    flag = _BY_FIELD.get(".".join(str(part) for part in first["loc"]))
    if flag is None:
        return message
    value = settings.values.get(flag.dest, "")
    return f"{settings.sources.get(flag.dest, flag.option)}={value!r}: {message}"


T = TypeVar("T")
ModelT = TypeVar("ModelT", bound=BaseModel)


def _from_file(model: type[ModelT], option: str, path: str) -> ModelT:
    return _validate(model.model_validate, f"{option} {path}", _read_json(option, path))


def _validate(validate: Callable[[Any], T], source: str, raw: Any) -> T:
    try:
        return validate(raw)
    except ValidationError as exc:
        raise ConfigError(f"{source}: {describe_validation(exc)}") from None


def _read_text(option: str, path: str) -> str:
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.read().strip()
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else str(exc)
        raise ConfigError(f"{option} {path}: cannot read: {reason}") from None


def _read_json(option: str, path: str) -> Any:
    return _parse_json(f"{option} {path}", _read_text(option, path))


def _parse_json(source: str, text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"{source}: malformed JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
        ) from None


def _field_default(path: str) -> str:
    """The model default of a flag's field, as text for ``--help``."""
    if not path:
        return ""
    group, _, name = path.rpartition(".")
    model: type[BaseModel] = TLSConfig if group else RuntimeConfig
    default = model.model_fields[name].get_default(call_default_factory=True)
    return format_duration(default) if isinstance(default, float) else str(default)
