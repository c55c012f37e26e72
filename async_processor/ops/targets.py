"""``check-config --probe``, its first half: can this process reach its broker and gateways?

Stage: outside the pipeline (the first check after ``helm install``). Input: a validated
``AppConfig``. Output: one ``Check`` per target: the broker (Redis: a PING; gcp-pubsub:
each subscription and the result topic exist) and each distinct gateway base URL (any
HTTP answer counts: a gateway may answer 404 on its root). A failure is said in plain
words (``cannot connect to h:6379: connection refused``), never a library's repr, and
no target's credentials are printed. Each target gets ``TIMEOUT`` seconds.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import aiohttp
import anyio
from redis.asyncio import Redis

from async_processor.config import AppConfig, GcpPubSubConfig, SortedSetConfig
from async_processor.config.queues import QueueSpec
from async_processor.config.redis import RedisConnection
from async_processor.errors import plain
from async_processor.logs import mask_url
from async_processor.redis.conn import connect

if TYPE_CHECKING:  # the Google libraries load only for the gcp transport (as in the daemon)
    from async_processor.transports.gcp_pubsub.backlog import BacklogReader

TIMEOUT = 5.0


@dataclass(frozen=True, slots=True)
class Check:
    target: str  # e.g. "broker redis at 10.0.0.1:6379", "gateway http://gw:8000"
    problem: str = ""  # "" = reached
    detail: str = ""  # what answered, e.g. "HTTP 404"
    skipped: bool = False  # not looked at (``detail`` says why)

    def line(self) -> str:
        if self.problem:
            return f"probe: {self.target}: FAILED: {self.problem}"
        state = "skipped" if self.skipped else "ok"
        return f"probe: {self.target}: {state}" + (f" ({self.detail})" if self.detail else "")


async def check_targets(config: AppConfig) -> list[Check]:
    transport = config.transport_config
    if isinstance(transport, GcpPubSubConfig):
        checks = await anyio.to_thread.run_sync(_pubsub_checks, transport)
        checks += await backlog_checks(transport, config.runtime.metrics_backlog_poll_interval)
    else:
        checks = [await _redis_check(transport.redis_connection(), config.transport)]
    bases = dict.fromkeys(spec.igw_base_url for spec in _specs(config))
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT)) as session:
        for base in bases:
            checks.append(await _gateway_check(session, base))
    return checks


def _specs(config: AppConfig) -> list[QueueSpec]:
    specs = list(config.queue_specs())
    transport = config.transport_config
    if isinstance(transport, SortedSetConfig):
        specs += transport.template_specs()  # discovered queues' gateway
    return specs


async def _redis_check(conn: RedisConnection, transport: str) -> Check:
    return await redis_check(f"broker {transport} at {redis_where(conn)}", conn, ping)


async def redis_check(
    target: str, conn: RedisConnection, read: Callable[[Redis], Awaitable[str]]
) -> Check:
    """``read`` on a fresh client of ``conn`` within ``TIMEOUT``: ok with what it says, or
    the failure in plain words."""
    client = connect(conn)
    try:
        with anyio.fail_after(TIMEOUT):
            detail = await read(client)
    except Exception as exc:  # whatever the failure, the operator needs its words
        return Check(target, plain(exc))
    finally:
        await client.aclose()
    return Check(target, detail=detail)


async def ping(client: Redis) -> str:
    await client.ping()
    return "PING answered"


def redis_where(conn: RedisConnection) -> str:
    """Host and port (or the sentinels), never the URL's password."""
    if conn.mode == "sentinel":
        return f"sentinels {', '.join(conn.sentinels)} (master {conn.sentinel_master})"
    parts = urlsplit(conn.url)
    return f"{parts.hostname}:{parts.port or 6379}"


def _pubsub_checks(config: GcpPubSubConfig) -> list[Check]:
    # Imported here: the Google libraries load only for the gcp transport (as in the daemon).
    from google.cloud import pubsub_v1

    from async_processor.transports.gcp_pubsub.transport import resource_path

    where = os.environ.get("PUBSUB_EMULATOR_HOST") or "pubsub.googleapis.com"
    subscriber, publisher = pubsub_v1.SubscriberClient(), pubsub_v1.PublisherClient()
    checks = []
    try:
        for topic in config.topics:
            path = resource_path(config.project_id, "subscriptions", topic.subscriber_id)
            checks.append(_rpc(f"broker gcp-pubsub {path} at {where}", subscriber.get_subscription,
                               {"subscription": path}))  # fmt: skip
        path = resource_path(config.project_id, "topics", config.result_topic_id)
        checks.append(_rpc(f"broker gcp-pubsub {path} at {where}", publisher.get_topic,
                           {"topic": path}))  # fmt: skip
    finally:
        subscriber.close()
    return checks


def _rpc(target: str, call: object, request: dict[str, str]) -> Check:
    try:
        call(request=request, timeout=TIMEOUT)  # type: ignore[operator]
    except Exception as exc:  # Google's errors carry a status line; say that, not a repr
        message = getattr(exc, "message", "") or plain(exc)
        return Check(target, message.splitlines()[0] if message else type(exc).__name__)
    return Check(target, detail="exists")


async def backlog_checks(
    config: GcpPubSubConfig, poll_interval: float, reader: BacklogReader | None = None
) -> list[Check]:
    """Each subscription's backlog as the daemon reads it (``broker_backlog``), from
    Cloud Monitoring; skipped where the daemon does not read it."""
    target = "backlog from Cloud Monitoring"
    if poll_interval <= 0:
        return [Check(target, detail="--metrics-backlog-poll-interval 0", skipped=True)]
    if os.environ.get("PUBSUB_EMULATOR_HOST"):
        why = "the emulator has none; broker_backlog stays unknown"
        return [Check(target, detail=why, skipped=True)]
    from async_processor.transports.gcp_pubsub.backlog import BacklogReader
    from async_processor.transports.gcp_pubsub.transport import resource_path

    reader = reader or BacklogReader(config.project_id)
    checks = []
    try:
        for topic in config.topics:
            path = resource_path(config.project_id, "subscriptions", topic.subscriber_id)
            checks.append(await _backlog_check(f"{target} of {path}", reader, path))
    finally:
        await reader.aclose()
    return checks


async def _backlog_check(target: str, reader: BacklogReader, subscription: str) -> Check:
    try:
        with anyio.fail_after(TIMEOUT):
            undelivered = await reader.read(subscription)
    except Exception as exc:  # no credentials, a refused permission, unreachable: in words
        return Check(target, plain(exc).splitlines()[0])
    if undelivered is None:
        return Check(target, detail="no point in the last 5 minutes: the backlog is unknown")
    return Check(target, detail=f"{undelivered} undelivered")


async def _gateway_check(session: aiohttp.ClientSession, base: str) -> Check:
    target = f"gateway {mask_url(base)}"
    try:
        async with session.get(base, allow_redirects=False) as response:
            return Check(target, detail=f"HTTP {response.status}")
    except Exception as exc:  # refused, unknown host, timed out, TLS: all in plain words
        return Check(target, plain(exc))
