"""Redis key names and Lua scripts shared by the Redis transports and the client library.

Input: queue names, request ids and deliveries. Output: the key names both sides agree
on, a submission's dedup ``fingerprint``, a delivery's envelope with its routing filled
from its queue (``decode_delivery``) and its ``dead_letter_entry``, the Lua sources in
``transports/lua/`` registered on a ``redis.asyncio`` client, and Redis errors mapped to
``TransportError`` (clients come from ``redis_conn.connect``).

Keys (the reference's names where it has them):

    <queue>                   sorted set of envelopes, score = deadline (producer's ZADD)
    <queue>:inflight          sorted set: claim id -> lease expiry (Redis clock)
    <queue>:inflight:meta     hash: claim id -> "<original score>|<envelope>"
    <queue>:dead-letter       list of JSON entries for messages with no usable id
    retry-sortedset           sorted set of envelopes, score = due time (shared, configurable)
    result-list               list of result JSON (LPUSH by us, BRPOP by the producer)
    <queue>:seq:<deadline>    submissions so far with that deadline (the client's order
                              tie-breaker in the score), expires 10 min after its last
                              use or 60 s after the deadline, whichever is first
    <queue>:live:<id>         the id's live submission on that queue (client library;
                              deleted with its result, else expires LIVE_GRACE after
                              the deadline): a second submission of the id is refused
    {result-list}:pushed      results ever pushed to the list (retention bookkeeping)
    {result-list}:marks       zset: pushed count -> the first time it was seen
    request-active:<id>       the live submission's token, TTL until its deadline
    request-cancel:<id>       the token being cancelled, TTL 7 days
    request-done:<id>:<digest>  dedup marker: a terminal result was written for this
                              submission; digest = hash of (id, fingerprint), so two
                              different (id, token) pairs never share a marker

Every script's keys sit in its KEYS array, and every script checks their types before its
first write (``lua/lib.lua``). Like the reference, this targets a standalone Redis.

A message is untrusted input (docs/architecture.md G10): the result list it names is used only if
``OwnKeys.rejection`` finds no reason against it (not a key the daemon owns or reads,
and inside the optional ``result_queue_pattern``).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import traceback
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from fnmatch import fnmatchcase
from importlib import resources
from typing import Any

from redis.asyncio import Redis
from redis.commands.core import AsyncScript

from async_processor.config.redis import result_side_key as result_side_key
from async_processor.errors import TransportError
from async_processor.messages import CLASSIFICATION_LABEL, Envelope, decode_envelope
from async_processor.redis.conn import REDIS_AWAY
from async_processor.transports.base import Delivery

DEFAULT_REQUEST_QUEUE = "request-sortedset"
DEFAULT_RESULT_LIST = "result-list"
DEFAULT_RETRY_QUEUE = "retry-sortedset"
CANCEL_TTL_SECONDS = 7 * 24 * 3600
# A live marker outlives its deadline by this much: the deadline sweep answers (and frees
# the id) within a second, so the grace only matters for a member deleted by hand.
LIVE_GRACE_SECONDS = 300
# Result-list marks are kept at least this long, so ``status`` can date older results.
MARKS_HORIZON_SECONDS = 24 * 3600
DEAD_LETTER_RAW_BYTES = 4096  # of a dead-lettered message's text kept in its entry

SCRIPT_NAMES = (
    "claim",
    "ready",
    "extend",
    "reap",
    "complete",
    "defer",
    "dead_letter",
    "drop_returned",
    "move_due",
    "move_due_own",
    "cancel",
    "expired",
    "expired_many",
    "submit",
    "retain",
)


def active_key(request_id: str) -> str:
    return f"request-active:{request_id}"


def cancel_key(request_id: str) -> str:
    return f"request-cancel:{request_id}"


def done_key(request_id: str, fingerprint: str = "") -> str:
    """Dedup marker of one submission: by request token (or another fingerprint) when known.

    Both parts come from the message and may contain ``:``; the suffix is a digest of the
    pair (length-prefixed), so ("a:b", "c") and ("a", "b:c") get different markers. The id
    stays readable in front for operators.
    """
    pair = f"{len(request_id)}:{request_id}{fingerprint}".encode()
    return f"request-done:{request_id}:{hashlib.blake2b(pair, digest_size=16).hexdigest()}"


def fingerprint(delivery: Delivery) -> str:
    """What tells this submission apart from a later one with the same id: its request
    token, else a digest of the request, else (undecodable) nothing."""
    envelope = delivery.envelope
    if envelope is None:
        return ""
    if envelope.routing.request_token:
        return envelope.routing.request_token
    return "sha-" + hashlib.blake2b(envelope.request.encode(), digest_size=8).hexdigest()


def decode_delivery(delivery: Delivery, max_bytes: int) -> Envelope:
    """The delivery's envelope, kept on it, with routing filled from its queue.

    Queue labels win over the message's; the queue id fills in when the message has
    none. ``request_queue_name`` is always the queue it was claimed from: the message's
    own value is informational only, so a retry can only ever go back to that queue.
    A ``classification`` label is a gate's verdict, never the message's: the queue gate
    stamps it again at every fetch (else the message would choose its own lane).
    """
    envelope = decode_envelope(delivery.raw, max_bytes=max_bytes)
    routing = envelope.routing
    queue = delivery.queue
    routing.request_queue_name = queue.name
    routing.queue_id = routing.queue_id or queue.id
    routing.labels.pop(CLASSIFICATION_LABEL, None)
    routing.labels = {**routing.labels, **queue.labels}
    delivery.envelope = envelope
    return envelope


def dead_letter_entry(
    delivery: Delivery, reason: str, detail: str, *, size: int = 0, digest: str = ""
) -> str:
    """The JSON parked on ``<queue>:dead-letter``: {reason, detail, raw, time, queue, size,
    sha1, truncated}. ``raw`` keeps at most ``DEAD_LETTER_RAW_BYTES`` of the message;
    ``size`` and ``sha1`` describe all of it (given when only a prefix was fetched)."""
    raw = delivery.raw
    entry = {
        "reason": reason,
        "detail": detail,
        "raw": raw[:DEAD_LETTER_RAW_BYTES].decode("utf-8", errors="replace"),
        "time": time.time(),
        "queue": delivery.queue.name,
        "size": size or len(raw),
        "sha1": digest or hashlib.sha1(raw, usedforsecurity=False).hexdigest(),
        "truncated": (size or len(raw)) > DEAD_LETTER_RAW_BYTES,
    }
    return json.dumps(entry, ensure_ascii=False)


OWN_PREFIXES = ("request-active:", "request-cancel:", "request-done:")
# The discovered queues removed while they still held claims or retries: kept in Redis so
# a restarted daemon (or one with discovery turned off) still reaps and moves them home.
REMOVED_QUEUES_KEY = "async-processor:removed-queues"
# Removed queue -> when it was first seen empty (Redis time): forgotten a grace period later.
EMPTY_SINCE_KEY = "async-processor:removed-queues:empty-since"


@dataclass(frozen=True, slots=True)
class OwnKeys:
    """The keys a daemon owns or reads, which no message may name as its result list."""

    exact: frozenset[str]
    prefixes: tuple[str, ...]
    pattern: str = ""  # ``result_queue_pattern``: a glob a routed name must match ("" = any)

    def rejection(self, name: str) -> str | None:
        """Why a message may not route its result to ``name`` (None: it may)."""
        if name in self.exact or name.startswith(self.prefixes):
            return "reserved_key"
        if self.pattern and not fnmatchcase(name, self.pattern):
            return "pattern_mismatch"
        return None


def own_keys(
    queues: Iterable[str],
    retry_queue: str,
    gate_params: Iterable[Mapping[str, Any]],
    pattern: str = "",
) -> OwnKeys:
    """Request queues with their in-flight and dead-letter keys, the retry set, the
    markers, and every gate key: a gate parameter named ``*_key`` (that key and the keys
    under ``<key>:``, e.g. a rate gate's ``<control_key>:state``) or ``prefix`` (quotas)."""
    exact = {retry_queue, REMOVED_QUEUES_KEY, EMPTY_SINCE_KEY, *queue_keys(queues)}
    prefixes = list(OWN_PREFIXES)
    for params in gate_params:
        for name, value in params.items():
            if not isinstance(value, str) or not value:
                continue
            if name.endswith("_key"):
                exact.add(value)
                prefixes.append(f"{value}:")
            elif name == "prefix":
                prefixes.append(value)
    return OwnKeys(frozenset(exact), tuple(prefixes), pattern)


def queue_keys(queues: Iterable[str]) -> set[str]:
    """Request queues with their in-flight and dead-letter keys."""
    exact: set[str] = set()
    for queue in queues:
        exact |= {queue, inflight_key(queue), inflight_meta_key(queue), dead_letter_key(queue)}
    return exact


async def marked_cancelled(redis: Redis, markers: Sequence[tuple[str, str]]) -> list[bool]:
    """Per (cancel marker key, request token): whether the marker holds that token (the
    producer cancelled this submission; no token: never). One MGET, keys in one slot."""
    asked = [(i, key, token) for i, (key, token) in enumerate(markers) if token]
    flags = [False] * len(markers)
    if asked:
        with redis_errors("cancel check"):
            values = await redis.mget([key for _, key, _ in asked])
        for (i, _, token), value in zip(asked, values, strict=True):
            flags[i] = value == token.encode()
    return flags


def sequence_key(queue: str, deadline: int) -> str:
    return f"{queue}:seq:{deadline}"


def live_key(queue: str, request_id: str) -> str:
    return f"{queue}:live:{request_id}"


def inflight_key(queue: str) -> str:
    return f"{queue}:inflight"


def inflight_meta_key(queue: str) -> str:
    return f"{queue}:inflight:meta"


def dead_letter_key(queue: str) -> str:
    return f"{queue}:dead-letter"


def script_source(name: str) -> str:
    """The Lua source of ``transports/lua/<name>.lua`` (packaged as data), after the
    shared helpers of ``lua/lib.lua``."""
    if name not in SCRIPT_NAMES:
        raise KeyError(f"unknown Lua script {name!r} (known: {', '.join(SCRIPT_NAMES)})")
    return lua_source("lib") + lua_source(name)


def lua_source(name: str, package: str = "async_processor.transports") -> str:
    """The text of ``<package>/lua/<name>.lua`` (packaged as data); scripts live in files,
    not in Python strings, so they read, diff and lint as Lua."""
    return (resources.files(package) / "lua" / f"{name}.lua").read_text(encoding="utf-8")


def register_scripts(client: Redis) -> dict[str, AsyncScript]:
    """Every script registered on ``client`` (EVALSHA, loaded on first use)."""
    return {name: client.register_script(script_source(name)) for name in SCRIPT_NAMES}


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
        raise TransportError(f"redis {action} failed: connection closed: {exc}") from exc


def transport_error(action: str, exc: BaseException) -> TransportError:
    """``exc`` (a Redis or socket failure) as the ``TransportError`` callers retry; also
    for one command's error in a pipeline run with ``raise_on_error=False``."""
    return TransportError(f"redis {action} failed: {type(exc).__name__}: {exc}")


def _raised_in_redis_connection(exc: BaseException) -> bool:
    frames = traceback.extract_tb(exc.__traceback__)
    return any(frame.filename.endswith(_REDIS_CONNECTION) for frame in frames)


_REDIS_CONNECTION = os.path.join("redis", "asyncio", "connection.py")
