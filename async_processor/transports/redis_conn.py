"""Redis connections: the one factory for the Redis transports, the Redis gates and the client.

Input: a ``RedisConnection`` (URL, mode, sentinels, TLS files). Output: a ``redis.asyncio``
client whose failures the callers map to their own errors.

- ``standalone`` (default): the URL names the server, as the Go reference.
- ``sentinel``: the sentinels (``host:port``) name the master of ``sentinel_master``; the
  URL carries only credentials, db and TLS. The pool asks the sentinels again whenever a
  connection fails, so after a failover the next call reaches the new master, and while no
  master is known every call fails (the daemon's /readyz turns 503).
- ``cluster``: the URL names any node; redis-py's asyncio cluster client finds the rest
  and follows slot moves (``redis_keyspace`` keeps each queue's keys in one slot).
- TLS (``rediss://``) takes a CA file, a client certificate and key, or skips verification;
  the sentinels are spoken to with the same TLS settings. ACL users and passwords come in
  the URL (``redis://user:password@host``) and are masked wherever a URL is logged.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, cast

from pydantic import BaseModel, BeforeValidator
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.connection import parse_url
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel
from redis.backoff import ExponentialBackoff

DEFAULT_URL = "redis://localhost:6379/0"
SCHEMES = ("redis://", "rediss://", "unix://")
CONNECT_TIMEOUT = 5.0

Mode = Literal["standalone", "sentinel", "cluster"]


def _host_ports(value: Any) -> Any:
    """A list, or (from Helm and env) one comma-separated string."""
    if isinstance(value, str):
        return [part.strip() for part in value.split(",") if part.strip()]
    return value


HostPorts = Annotated[tuple[str, ...], BeforeValidator(_host_ports)]


class RedisConnectionFields(BaseModel):
    """Connection fields shared by the transport configs and the Redis gates' params
    (each adds its own mode field: ``mode`` there, ``redis_mode`` on gates)."""

    sentinels: HostPorts = ()
    sentinel_master: str = ""
    tls_ca_cert: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    tls_insecure_skip_verify: bool = False

    def connection(self, url: str, mode: Mode) -> RedisConnection:
        fields = {name: getattr(self, name) for name in RedisConnectionFields.model_fields}
        return RedisConnection(url=url, mode=mode, **fields)


@dataclass(frozen=True)
class RedisConnection:
    """Where and how to connect; ``check`` raises ValueError naming the first problem."""

    url: str = DEFAULT_URL
    mode: Mode = "standalone"
    sentinels: tuple[str, ...] = ()
    sentinel_master: str = ""
    tls_ca_cert: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    tls_insecure_skip_verify: bool = field(default=False)

    @property
    def tls(self) -> bool:
        return self.url.startswith("rediss://")

    def check(self) -> RedisConnection:
        check_url(self.url)
        tls_fields = (self.tls_ca_cert, self.tls_cert, self.tls_key, self.tls_insecure_skip_verify)
        if any(tls_fields) and not self.tls:
            raise ValueError("tls_* fields need a rediss:// url")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("tls_cert and tls_key must be given together")
        if self.mode == "sentinel":
            self._check_sentinel()
        elif self.mode == "cluster" and self.url.startswith("unix://"):
            raise ValueError("mode cluster needs a redis:// or rediss:// url")
        elif self.sentinels or self.sentinel_master:
            raise ValueError(f"sentinels and sentinel_master need mode sentinel, not {self.mode}")
        return self

    def _check_sentinel(self) -> None:
        if not self.sentinels or not self.sentinel_master:
            raise ValueError("mode sentinel needs sentinels (host:port list) and sentinel_master")
        if self.url.startswith("unix://"):
            raise ValueError("mode sentinel needs a redis:// or rediss:// url")
        for address in self.sentinels:
            _host_port(address)

    def tls_options(self) -> dict[str, Any]:
        """redis-py's ssl_* arguments (empty without TLS)."""
        if not self.tls:
            return {}
        return {
            "ssl_ca_certs": self.tls_ca_cert or None,
            "ssl_certfile": self.tls_cert or None,
            "ssl_keyfile": self.tls_key or None,
            "ssl_cert_reqs": "none" if self.tls_insecure_skip_verify else "required",
            "ssl_check_hostname": not self.tls_insecure_skip_verify,
        }


def check_url(url: str) -> str:
    if not url.startswith(SCHEMES):
        raise ValueError("must be a redis://, rediss:// or unix:// URL")
    return url


def connect(
    conn: RedisConnection, *, socket_timeout: float | None = 30.0, retry_cap: float = 0.5
) -> Redis:
    """One client (and pool) for ``conn``; it connects lazily, on its first command.

    One quick retry covers a pooled connection gone stale (a restart, a failover); longer
    outages surface as errors so the callers' own backoff applies.
    """
    options: dict[str, Any] = {
        "socket_connect_timeout": CONNECT_TIMEOUT,
        "socket_timeout": socket_timeout,
        "health_check_interval": 30,
        "retry": Retry(ExponentialBackoff(cap=retry_cap, base=0.05), retries=1),
        **conn.tls_options(),
    }
    if conn.mode == "sentinel":
        return _sentinel_master(conn, options)
    if conn.mode == "cluster":
        # Typed as Redis: callers use only commands both clients have (keys, scripts,
        # pipelines); the cluster tests run the transport and the client on a real cluster.
        return cast(Redis, RedisCluster.from_url(conn.url, **options))
    return Redis.from_url(conn.url or DEFAULT_URL, **options)


class _SentinelMaster(Redis):
    """The master's client; closing it also closes the sentinel clients it asks."""

    sentinel_manager: Sentinel | None = None

    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        await super().aclose(close_connection_pool)
        if self.sentinel_manager is not None:
            for client in self.sentinel_manager.sentinels:
                await client.aclose()


def _sentinel_master(conn: RedisConnection, options: dict[str, Any]) -> Redis:
    parsed = parse_url(conn.url)
    credentials = {k: v for k, v in parsed.items() if k in ("username", "password", "db")}
    sentinel_options = {k: v for k, v in options.items() if k != "health_check_interval"}
    if conn.tls:
        sentinel_options["ssl"] = True
    sentinel = Sentinel(  # type: ignore[no-untyped-call]
        [_host_port(address) for address in conn.sentinels],
        sentinel_kwargs=sentinel_options,
        **options,
        **credentials,
        ssl=conn.tls,
    )
    client: _SentinelMaster = sentinel.master_for(conn.sentinel_master, redis_class=_SentinelMaster)
    client.sentinel_manager = sentinel
    return client


def _host_port(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"sentinel {address!r} is not host:port")
    return host, int(port)
