"""Redis connections: the one factory for the Redis transports, the Redis gates and the client.

Input: a ``RedisConnection`` (``config.redis``: URL, mode, sentinels, TLS files). Output:
a ``redis.asyncio`` client, and ``redis_errors``, which turns its failures into the
``TransportError`` callers retry.

- ``standalone`` (default): the URL names the server, as the Go reference.
- ``sentinel``: the sentinels (the URL's host and ``addrs``, as upstream; or the deprecated
  ``sentinels`` list, the URL's host then ignored) name the master of ``master_name``
  (deprecated alias ``sentinel_master``); the URL carries credentials, db and TLS. The
  pool asks the sentinels again whenever a connection fails, so after a failover the next
  call reaches the new master, and while no master is known every call fails (the
  daemon's /readyz turns 503).
- ``cluster``: the URL names any node (``addrs`` more seeds); redis-py's asyncio cluster
  client finds the rest and follows slot moves (``redis.keyspace`` keeps each queue's
  keys in one slot).
- TLS (``rediss://``) takes a CA file, a client certificate and key, or skips verification;
  the sentinels are spoken to with the same TLS settings. ACL users and passwords come in
  the URL (``redis://user:password@host``) and are masked wherever a URL is logged.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, cast

import anyio
import structlog
from redis.asyncio import Redis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.connection import AbstractConnection, parse_url
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel
from redis.backoff import ExponentialBackoff
from redis.exceptions import RedisClusterException, RedisError
from redis.typing import EncodableT
from redis.utils import HIREDIS_AVAILABLE

from async_processor.broker_errors import broker_error
from async_processor.config.redis import DEFAULT_URL, RedisConnection, host_port
from async_processor.errors import TransportError

# "Redis is away": what a call raises when its server cannot be reached or answer. The
# cluster client raises its own RedisClusterException (not a RedisError) when no node
# answers or a slot is uncovered; catching RedisError alone turned a cluster outage into
# a crash or an error result where a standalone one waits. TimeoutError is an OSError.
REDIS_AWAY: tuple[type[Exception], ...] = (RedisError, RedisClusterException, OSError)
# RuntimeError too: a cluster client's INFO to every node at startup, beside the first
# scripts, met a connection another task had closed ("the handler is closed", uvloop) and
# crashed the daemon about one start in four. A probe only warns.
_PROBE_FAILURES: tuple[type[Exception], ...] = (*REDIS_AWAY, RuntimeError)

log = structlog.get_logger(__name__)

CONNECT_TIMEOUT = 5.0
# redis-py 8 caps a pool at 100 connections and fails the 101st caller ("Too many
# connections"); a daemon with 200 queues has 200 pollers claiming at once. Its callers are
# bounded by its queues and workers, so leave the limit to the server's maxclients.
MAX_CONNECTIONS = 10_000


def _pack_with_hiredis() -> None:
    """Pack commands in C on every asyncio connection, as redis-py's sync ones already do.

    redis-py's sync connections use hiredis's packer when hiredis is installed (it is our
    dependency); its asyncio ones always pack in Python: 266 µs for one result batch's
    complete script (16 results, 213 arguments) against hiredis's 31 µs, the largest single
    cost of ours per message at a zero-latency gateway (issue 13). Same bytes on the wire.
    hiredis is called directly: redis-py's sync wrapper first looks at every argument in a
    Python loop (to copy memoryviews, which hiredis reads as they are): 38 µs against 18 for
    an 11-result batch. What hiredis refuses (a bytearray, a bool, an IntEnum), and the
    connections that encode text other than as strict UTF-8, go to redis-py's own packer,
    so the patch (process-wide: the client library's users too) packs and refuses exactly
    what redis-py does.
    """
    if not HIREDIS_AVAILABLE:
        return
    import hiredis

    python_pack = AbstractConnection.pack_command

    def pack(conn: AbstractConnection, *args: EncodableT) -> list[bytes]:
        encoder = conn.encoder  # hiredis encodes text as UTF-8, strictly
        if encoder.encoding != "utf-8" or encoder.encoding_errors != "strict":
            return python_pack(conn, *args)
        # As redis-py: a command name of several words ("SCRIPT LOAD") is sent as several.
        if isinstance(args[0], str):
            args = (*args[0].encode().split(), *args[1:])
        elif b" " in args[0]:  # type: ignore[operator]
            args = (*args[0].split(), *args[1:])  # type: ignore[union-attr]
        try:
            return [hiredis.pack_command(args)]  # type: ignore[arg-type]  # its stub: a 1-tuple
        except TypeError:
            return python_pack(conn, *args)

    setattr(AbstractConnection, "pack_command", pack)  # noqa: B010


_pack_with_hiredis()


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
        "max_connections": MAX_CONNECTIONS,
        "retry": Retry(ExponentialBackoff(cap=retry_cap, base=0.05), retries=1),
        **conn.tls_options(),
    }
    _warn_deprecated(conn)
    if conn.mode == "sentinel":
        return _sentinel_master(conn, options)
    if conn.mode == "cluster":
        if conn.addrs:
            options["startup_nodes"] = [ClusterNode(*host_port(a)) for a in conn.addrs]
        # Typed as Redis: callers use only commands both clients have (keys, scripts,
        # pipelines); the cluster tests run the transport and the client on a real cluster.
        return cast(Redis, RedisCluster.from_url(conn.url, **options))
    return Redis.from_url(conn.url or DEFAULT_URL, **options)


async def warn_if_evicting(client: Redis) -> None:
    """Log an error when Redis may evict keys at its ``maxmemory``: past a set limit (0 is
    none), any policy but ``noeviction`` (managed Redis often defaults to ``volatile-lru``)
    deletes keys with a TTL (dedup markers: duplicate results; result lists under
    retention: every result in them), ``allkeys-*`` also queues and in-flight sets, so
    messages vanish unanswered. Asked once at start (``INFO memory``); not knowing (an ACL
    without INFO, Redis away) is only a debug line."""
    try:
        with anyio.fail_after(CONNECT_TIMEOUT):
            info = await client.info("memory")
    except _PROBE_FAILURES as exc:
        log.debug("eviction_policy_unknown", error=str(exc))
        return
    # A cluster client answers per node: {node: {field: value}}.
    nodes = (
        [info] if "maxmemory_policy" in info else [v for v in info.values() if isinstance(v, dict)]
    )
    # maxmemory 0 is no limit: nothing is ever evicted, whatever the policy says.
    limited = [n for n in nodes if _int(n.get("maxmemory")) > 0]
    evicting = sorted({str(n.get("maxmemory_policy")) for n in limited} - {"noeviction"})
    if evicting:
        log.error(
            "redis_may_evict",
            maxmemory_policy=",".join(evicting),
            advice="set maxmemory-policy noeviction: evicted keys are lost messages and results",
        )


def _int(value: object) -> int:
    try:
        return int(str(value))
    except ValueError:  # absent or unreadable: assume a limit, so the policy is reported
        return 1


class _SentinelMaster(Redis):
    """The master's client; closing it also closes the sentinel clients it asks."""

    sentinel_manager: Sentinel | None = None

    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        await super().aclose(close_connection_pool)
        if self.sentinel_manager is not None:
            for client in self.sentinel_manager.sentinels:
                await client.aclose()


_warned: set[tuple[str, ...]] = set()


def _warn_deprecated(conn: RedisConnection) -> None:
    """Once per process and set of fields: ``sentinels`` / ``sentinel_master`` still work,
    upstream's ``addrs`` / ``master_name`` replace them (docs/transports.md)."""
    if conn.deprecated and conn.deprecated not in _warned:
        _warned.add(conn.deprecated)
        log.warning(
            "redis_config_deprecated",
            fields=list(conn.deprecated),
            use="url (first sentinel), addrs (the others), master_name",
        )


def _sentinel_master(conn: RedisConnection, options: dict[str, Any]) -> Redis:
    parsed = parse_url(conn.url)
    credentials = {k: v for k, v in parsed.items() if k in ("username", "password", "db")}
    sentinel_options = {k: v for k, v in options.items() if k != "health_check_interval"}
    if conn.tls:
        sentinel_options["ssl"] = True
    sentinel = Sentinel(  # type: ignore[no-untyped-call]
        [host_port(address) for address in conn.seeds()],
        sentinel_kwargs=sentinel_options,
        **options,
        **credentials,
        ssl=conn.tls,
    )
    master = conn.master_name or conn.sentinel_master
    client: _SentinelMaster = sentinel.master_for(master, redis_class=_SentinelMaster)
    client.sentinel_manager = sentinel
    return client


@contextmanager
def redis_errors(action: str) -> Iterator[None]:
    """Turn a Redis or socket failure into ``TransportError`` (retryable by callers)."""
    try:
        yield
    except REDIS_AWAY as exc:
        raise transport_error(action, exc) from exc
    except (AttributeError, TypeError) as exc:
        # redis-py 8.1 lets these escape when a connection is closed under a write (its
        # writer gone; redis/redis-py#4287), e.g. the cluster client dropping connections
        # while it refreshes its slot map. They are a lost connection, nothing more.
        if not _raised_in_redis_connection(exc):
            raise
        broker_error(action)
        raise TransportError(f"redis {action} failed: connection closed: {exc}") from exc


def transport_error(action: str, exc: BaseException) -> TransportError:
    """``exc`` (a Redis or socket failure) as the ``TransportError`` callers retry; also
    for one command's error in a pipeline run with ``raise_on_error=False``. Counted in
    ``broker_errors_total``."""
    broker_error(action)
    return TransportError(f"redis {action} failed: {type(exc).__name__}: {exc}")


def _raised_in_redis_connection(exc: BaseException) -> bool:
    frames = traceback.extract_tb(exc.__traceback__)
    return any(frame.filename.endswith(_REDIS_CONNECTION) for frame in frames)


_REDIS_CONNECTION = os.path.join("redis", "asyncio", "connection.py")
