"""What the client library writes outside a queue's hash slot in cluster mode, as
upstream's producer does there (llm-d-async #491).

Stage: the producer side (``SortedSetClient`` in cluster mode). Input: the requests of one
submission chunk with their tokens, or the tokens a cancel marked. Output: single-key
writes in one pipeline: ``request-active:<id>`` under its standalone name (a Go producer's
``CancelRequests`` reads it), each payload key in its own slot (payload-key mode), and
``request-cancel:<id>`` (a Go daemon on the cluster reads that one). The queue-slot keys
(``{Q}:request-active:<id>``, ``{Q}:live:<id>``, ``{Q}:request-cancel:<id>``) are still
written by the scripts, and the daemon reads both names.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from redis.asyncio import Redis

from async_processor.messages import Request
from async_processor.redis import keys

# A payload key outlives its deadline by this much (upstream's: deadline + 10 minutes).
PAYLOAD_GRACE_MS = 600_000


async def write_apart(
    redis: Redis, chunk: Sequence[tuple[Request, str]], *, payload_keys: bool
) -> None:
    """Before the envelopes of ``chunk`` ((request, token) pairs): the active markers and,
    with ``payload_keys``, the payloads. If the submission then fails, or an id is already
    live, these only outlive it until their TTLs (as upstream's)."""
    now = time.time()
    async with redis.pipeline(transaction=False) as pipe:
        for request, token in chunk:
            ttl_ms = max(1, int((request.deadline - now) * 1000))
            pipe.set(keys.active_key(request.id), token, px=ttl_ms)
            if payload_keys:
                name = keys.payload_key(request.id, token)
                pipe.set(name, bytes(request.payload), px=ttl_ms + PAYLOAD_GRACE_MS)
        await pipe.execute()


async def cancel_apart(redis: Redis, ids: Sequence[str], marked: Sequence[Any]) -> None:
    """After a cancel: each token marked (``lua/cancel.lua``'s reply; 0 = none) in
    upstream's ``request-cancel:<id>`` too, for 7 days."""
    async with redis.pipeline(transaction=False) as pipe:
        for request_id, token in zip(ids, marked, strict=True):
            if token:
                pipe.set(keys.cancel_key(request_id), token, ex=keys.CANCEL_TTL_SECONDS)
        await pipe.execute()
