"""Redis key names and Lua scripts shared by the Redis transports and the client library.

Input: queue names and request ids. Output: the key names both sides agree on, and the
Lua sources in ``transports/lua/`` registered on a ``redis.asyncio`` client.

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

from importlib import resources

from redis.asyncio import Redis
from redis.commands.core import AsyncScript

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
