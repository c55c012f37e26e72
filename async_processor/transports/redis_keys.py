"""Redis key names and Lua scripts shared by the Redis transports and the client library.

Input: queue names, request ids and deliveries. Output: the key names both sides agree
on, a submission's dedup ``fingerprint``, a delivery's envelope with its routing filled
from its queue (``decode_delivery``) and its ``dead_letter_entry``, the Lua sources in
``transports/lua/`` registered on a ``redis.asyncio`` client, and the client itself
(``connect``) with its errors mapped to ``TransportError``.

Keys (the reference's names where it has them, DESIGN.md §4):

    <queue>                   sorted set of envelopes, score = deadline (producer's ZADD)
    <queue>:inflight          sorted set: claim id -> lease expiry (Redis clock)
    <queue>:inflight:meta     hash: claim id -> "<original score>|<envelope>"
    <queue>:dead-letter       list of JSON entries for messages with no usable id
    retry-sortedset           sorted set of envelopes, score = due time (shared, configurable)
    result-list               list of result JSON (LPUSH by us, BRPOP by the producer)
    request-active:<id>       the live submission's token, TTL until its deadline
    request-cancel:<id>       the token being cancelled, TTL 7 days
    request-done:<id>:<fp>    dedup marker: a terminal result was written for this submission

Every script's keys sit in its KEYS array except the retry mover's origin queues, which it
reads from each envelope; like the reference, this targets a standalone Redis.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from importlib import resources

from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.commands.core import AsyncScript
from redis.exceptions import RedisError

from async_processor.errors import TransportError
from async_processor.messages import Envelope, decode_envelope
from async_processor.transports.base import Delivery

DEFAULT_URL = "redis://localhost:6379/0"
DEFAULT_REQUEST_QUEUE = "request-sortedset"
DEFAULT_RESULT_LIST = "result-list"
DEFAULT_RETRY_QUEUE = "retry-sortedset"
CANCEL_TTL_SECONDS = 7 * 24 * 3600

SCRIPT_NAMES = (
    "claim",
    "extend",
    "reap",
    "complete",
    "defer",
    "dead_letter",
    "move_due",
    "cancel",
)


def active_key(request_id: str) -> str:
    return f"request-active:{request_id}"


def cancel_key(request_id: str) -> str:
    return f"request-cancel:{request_id}"


def done_key(request_id: str, fingerprint: str = "") -> str:
    """Dedup marker of one submission: by request token (or another fingerprint) when known."""
    return (
        f"request-done:{request_id}:{fingerprint}" if fingerprint else f"request-done:{request_id}"
    )


def fingerprint(delivery: Delivery) -> str:
    """What tells this submission apart from a later one with the same id: its request
    token, else a digest of the request, else (undecodable) nothing."""
    envelope = delivery.envelope
    if envelope is None:
        return ""
    if envelope.routing.request_token:
        return envelope.routing.request_token
    return "sha-" + hashlib.blake2b(envelope.request.encode(), digest_size=8).hexdigest()


def decode_delivery(delivery: Delivery, max_bytes: int, *, own_queue_name: bool) -> Envelope:
    """The delivery's envelope, kept on it, with routing filled from its queue.

    Queue labels win over the message's; the queue id fills in when the message has
    none. ``own_queue_name`` keeps a request queue name the message names itself.
    """
    envelope = decode_envelope(delivery.raw, max_bytes=max_bytes)
    routing = envelope.routing
    queue = delivery.queue
    kept = routing.request_queue_name if own_queue_name else ""
    routing.request_queue_name = kept or queue.name
    routing.queue_id = routing.queue_id or queue.id
    routing.labels = {**routing.labels, **queue.labels}
    delivery.envelope = envelope
    return envelope


def dead_letter_entry(delivery: Delivery, reason: str, detail: str) -> str:
    """The JSON parked on ``<queue>:dead-letter``: {reason, detail, raw, time, queue}."""
    entry = {
        "reason": reason,
        "detail": detail,
        "raw": delivery.raw.decode("utf-8", errors="replace"),
        "time": time.time(),
        "queue": delivery.queue.name,
    }
    return json.dumps(entry, ensure_ascii=False)


def inflight_key(queue: str) -> str:
    return f"{queue}:inflight"


def inflight_meta_key(queue: str) -> str:
    return f"{queue}:inflight:meta"


def dead_letter_key(queue: str) -> str:
    return f"{queue}:dead-letter"


def script_source(name: str) -> str:
    """The Lua source of ``transports/lua/<name>.lua`` (packaged as data)."""
    if name not in SCRIPT_NAMES:
        raise KeyError(f"unknown Lua script {name!r} (known: {', '.join(SCRIPT_NAMES)})")
    package = resources.files("async_processor.transports") / "lua" / f"{name}.lua"
    return package.read_text(encoding="utf-8")


def register_scripts(client: Redis) -> dict[str, AsyncScript]:
    """Every script registered on ``client`` (EVALSHA, loaded on first use)."""
    return {name: client.register_script(script_source(name)) for name in SCRIPT_NAMES}


def connect(url: str, *, socket_timeout: float | None = 30.0) -> Redis:
    """One ``redis.asyncio`` client (and pool) for a redis://, rediss:// or unix:// URL.

    Retries once quickly on a dropped connection; longer outages surface as errors so
    the pipeline's own backoff applies.
    """
    return Redis.from_url(
        url or DEFAULT_URL,
        socket_connect_timeout=5.0,
        socket_timeout=socket_timeout,
        health_check_interval=30,
        retry=Retry(ExponentialBackoff(cap=0.5, base=0.05), retries=1),
    )


@contextmanager
def redis_errors(action: str) -> Iterator[None]:
    """Turn a Redis or socket failure into ``TransportError`` (retryable by callers)."""
    try:
        yield
    except (RedisError, OSError) as exc:
        raise TransportError(f"redis {action} failed: {type(exc).__name__}: {exc}") from exc
