"""A queued message's Redis side: its envelope as claimed, its dedup fingerprint, its
dead-letter entry, and its cancel markers.

Input: a claimed message's bytes and queue, markers' keys and tokens. Output: the decoded
``Envelope`` with routing filled from its queue, the ``fingerprint`` that tells two
submissions of one id apart, the JSON parked on ``<queue>:dead-letter``, and which
submissions a producer cancelled. Shared by both Redis transports and the tools.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Sequence

from redis.asyncio import Redis

from async_processor.config.queues import QueueSpec
from async_processor.messages import CLASSIFICATION_LABEL, Envelope, decode_envelope
from async_processor.redis.conn import redis_errors

DEAD_LETTER_RAW_BYTES = 4096  # of a dead-lettered message's text kept in its entry


def fingerprint(envelope: Envelope | None) -> str:
    """What tells this submission apart from a later one with the same id: its request
    token, else a digest of the request, else (undecodable) nothing."""
    if envelope is None:
        return ""
    if envelope.routing.request_token:
        return envelope.routing.request_token
    # A payload stored apart is not in the digest: read or not, the submission is the same.
    request = envelope.request.encode(with_payload=not envelope.routing.payload_ref)
    return "sha-" + hashlib.blake2b(request, digest_size=8).hexdigest()


def decode_queued(raw: bytes, queue: QueueSpec, max_bytes: int) -> Envelope:
    """The envelope of a message claimed from ``queue``, with routing filled from it.

    Queue labels win over the message's; the queue id fills in when the message has
    none. ``request_queue_name`` is always the queue it was claimed from: the message's
    own value is informational only, so a retry can only ever go back to that queue.
    A ``classification`` label is a gate's verdict, never the message's: the queue gate
    stamps it again at every fetch (else the message would choose its own lane).
    The result route is frozen at the first fetch (``result_routing_resolved``).
    """
    envelope = decode_envelope(raw, max_bytes=max_bytes)
    routing = envelope.routing
    routing.request_queue_name = queue.name
    routing.queue_id = routing.queue_id or queue.id
    routing.labels.pop(CLASSIFICATION_LABEL, None)
    routing.labels = {**routing.labels, **queue.labels}
    if not routing.result_routing_resolved:
        # Upstream's frozen result route (v0.9.1): the queue's result list, if it names
        # one, and its result TTL are written into the routing at the first fetch, so a
        # retry re-written by us, or fetched by a Go daemon after a config change, answers
        # where and as it was bound.
        if queue.result_queue_name:
            routing.result_queue_name = queue.result_queue_name
        routing.result_ttl_seconds = queue.result_ttl_seconds
        routing.result_routing_resolved = True
    return envelope


def dead_letter_entry(
    raw: bytes, queue: str, reason: str, detail: str, *, size: int = 0, digest: str = ""
) -> str:
    """The JSON parked on ``<queue>:dead-letter``: {reason, detail, raw, time, queue, size,
    sha1, truncated}. ``raw`` keeps at most ``DEAD_LETTER_RAW_BYTES`` of the message;
    ``size`` and ``sha1`` describe all of it (given when only a prefix was fetched)."""
    entry = {
        "reason": reason,
        "detail": detail,
        "raw": raw[:DEAD_LETTER_RAW_BYTES].decode("utf-8", errors="replace"),
        "time": time.time(),
        "queue": queue,
        "size": size or len(raw),
        "sha1": digest or hashlib.sha1(raw, usedforsecurity=False).hexdigest(),
        "truncated": (size or len(raw)) > DEAD_LETTER_RAW_BYTES,
    }
    return json.dumps(entry, ensure_ascii=False)


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
