"""Redis connection settings and cluster slot rules: plain data, no Redis client.

Input: the transport config's or a gate's connection fields. Output: a checked
``RedisConnection`` (``redis.conn.connect`` builds the client from it), and the slot rules
cluster mode checks at startup (``hash_tag``, ``slot``, ``cluster_problem``). Kept apart
from the client modules so that loading the config never imports redis-py (which pulls in
OpenTelemetry when it is installed) for a deployment that does not use Redis.

Fields (docs/transports.md): ``mode`` (``standalone`` | ``sentinel`` | ``cluster``),
``addrs`` (upstream's, llm-d-async #491: more cluster seeds or sentinels beside the url's
host) and ``master_name`` (sentinel), ``sentinels`` and ``sentinel_master`` (ours before:
deprecated aliases, every sentinel listed and the url's host ignored), ``tls_ca_cert`` /
``tls_cert`` / ``tls_key`` / ``tls_insecure_skip_verify`` (with a ``rediss://`` url only).
"""

from __future__ import annotations

from binascii import crc_hqx
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, BeforeValidator

CLUSTER_SLOTS = 16384

DEFAULT_URL = "redis://localhost:6379/0"
SCHEMES = ("redis://", "rediss://", "unix://")

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

    addrs: HostPorts = ()
    master_name: str = ""
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
    addrs: tuple[str, ...] = ()
    master_name: str = ""
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
        if self.addrs and self.mode == "standalone":
            raise ValueError("addrs needs mode cluster or sentinel")
        if self.master_name and self.mode != "sentinel":
            raise ValueError(f"master_name needs mode sentinel, not {self.mode}")
        if self.mode == "sentinel":
            self._check_sentinel()
        elif self.mode == "cluster":
            self._check_cluster()
        elif self.sentinels or self.sentinel_master:
            raise ValueError(f"sentinels and sentinel_master need mode sentinel, not {self.mode}")
        for address in self.addrs:
            host_port(address)
        return self

    def _check_sentinel(self) -> None:
        if self.master_name and self.sentinel_master:
            raise ValueError("give master_name or sentinel_master (its deprecated alias), not both")
        if self.addrs and self.sentinels:
            raise ValueError(
                "give addrs (sentinels beside the url's host) or sentinels (deprecated: every "
                "sentinel, the url's host ignored), not both"
            )
        if not self.master_name and not self.sentinel_master:
            raise ValueError("mode sentinel needs master_name")
        if self.sentinel_master and not self.sentinels:
            raise ValueError("mode sentinel needs sentinels (host:port list) with sentinel_master")
        if self.url.startswith("unix://"):
            raise ValueError("mode sentinel needs a redis:// or rediss:// url")
        for address in self.sentinels:
            host_port(address)

    def _check_cluster(self) -> None:
        if self.url.startswith("unix://"):
            raise ValueError("mode cluster needs a redis:// or rediss:// url")
        if self.sentinels or self.sentinel_master:
            raise ValueError("sentinels and sentinel_master need mode sentinel, not cluster")
        if url_db(self.url):
            raise ValueError("mode cluster needs database 0 (a cluster has no other)")

    def seeds(self) -> tuple[str, ...]:
        """The ``host:port`` a cluster or the sentinels are first asked: the deprecated
        ``sentinels`` as given, else the url's host and the ``addrs`` (upstream's)."""
        if self.sentinels:
            return self.sentinels
        return (url_host_port(self.url), *self.addrs)

    @property
    def deprecated(self) -> tuple[str, ...]:
        """The deprecated fields this connection uses (a warning names them)."""
        return tuple(name for name in ("sentinels", "sentinel_master") if getattr(self, name))

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


def url_host_port(url: str) -> str:
    """``host:port`` of a redis:// or rediss:// url (port 6379 when left out)."""
    parsed = urlsplit(url)
    host = parsed.hostname or "localhost"
    return f"{host}:{parsed.port or 6379}"


def url_db(url: str) -> int:
    """The database a redis:// url names (its path, else ``?db=``; 0 when none)."""
    parsed = urlsplit(url)
    path = parsed.path.strip("/")
    if path.isdigit():
        return int(path)
    query = dict(part.partition("=")[::2] for part in parsed.query.split("&") if part)
    return int(query["db"]) if query.get("db", "").isdigit() else 0


def host_port(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"sentinel {address!r} is not host:port")
    return host, int(port)


def hash_tag(queue: str) -> str:
    """The part of ``queue`` Redis Cluster hashes: its own ``{tag}``, else the whole name."""
    start = queue.find("{")
    end = queue.find("}", start + 1) if start >= 0 else -1
    return queue[start + 1 : end] if start >= 0 and end > start + 1 else queue


def slot(key: str) -> int:
    """The cluster hash slot of ``key`` (CRC16 of its hash tag, as Redis computes it)."""
    return crc_hqx(hash_tag(key).encode(), 0) % CLUSTER_SLOTS


def result_side_key(result_list: str, suffix: str) -> str:
    """A key kept beside a result list, in its cluster hash slot (its tag, or its name as
    the tag): ``{R}:pushed`` and ``{R}:marks`` (retention), ``{R}:processing:<consumer>``.
    A name with a ``{`` but no hash tag keeps its name here, so these land in another slot
    (``shares_slot`` refuses it in cluster mode)."""
    tagged = result_list if "{" in result_list else f"{{{result_list}}}"
    return f"{tagged}:{suffix}"


def shares_slot(queue: str, result_list: str) -> bool:
    """Whether ``result_list`` and the keys kept beside it are in ``queue``'s slot, so one
    script can write a result and ack the queue (cluster mode)."""
    home = slot(queue)
    return slot(result_list) == home and slot(result_side_key(result_list, "")) == home


def cluster_problem(queue: str, result_list: str) -> str | None:
    """Cluster mode: why ``queue``'s keys or its ``result_list`` would not share one slot."""
    if slot(f"{{{hash_tag(queue)}}}:inflight") != slot(queue):
        return f"queue {queue!r}: braces in the name must hold a hash tag, e.g. '{{t}}{queue}'"
    if shares_slot(queue, result_list):
        return None
    return (
        f"queue {queue!r}: result list {result_list!r} (or the keys kept beside it) is in "
        f"another hash slot, so the "
        f"result+ack step could not be atomic; use a name in the queue's slot, "
        f"e.g. '{{{hash_tag(queue)}}}:results'"
    )
