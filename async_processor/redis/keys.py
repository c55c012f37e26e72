"""Redis key names shared by the Redis transports, the Redis gates, the client library
and the operator tools, and the result-list refusal rules.

Input: queue names and request ids. Output: the key names every side agrees on, and
``OwnKeys``, the keys no message may name as its result list. The scripts are in
``redis/lua/`` (loaded by ``redis.scripts``); a queued message's Redis envelope and the
dead-letter entry are ``redis.entries``.

Keys (the reference's names where it has them):

    <queue>                   sorted set of envelopes, score = deadline (producer's ZADD)
    <queue>:claimed           hash: claim key -> the member claimed (upstream's claim
                              layout, #412, shared with Go daemons v0.9.1+); claim key =
                              id NUL request_token (id alone without a token)
    <queue>:claim-owners      hash: claim key -> owner token (16 hex, one per process)
    <queue>:claims-idx        sorted set: claim key -> lease expiry (Unix seconds)
    <queue>:inflight          the current release's claims (sorted set: claim id -> lease
    <queue>:inflight:meta     expiry; hash: claim id -> "<score>|<envelope>"), no longer
                              written: still reaped, so a rolling upgrade loses nothing
    <queue>:dead-letter       list of JSON entries for messages with no usable id
    retry-sortedset           sorted set of envelopes, score = due time (shared, configurable)
    result-list               list of result JSON (LPUSH by us, BRPOP by the producer)
    request-seq:<queue>:<deadline>  submissions so far with that deadline (upstream's
                              order counter, #463: Go and Python producers share it),
                              expires an hour after the deadline. The current release's
                              ``<queue>:seq:<deadline>`` is no longer written; the scores
                              it gave still sort (same integer part, a finer fraction)
    request-payload:<id>:<token>  a request's body stored apart (upstream's payload keys,
                              ``payload_ref``), deleted with its result
    <queue>:live:<id>         the id's live submission on that queue (client library;
                              deleted with its result, else expires LIVE_GRACE after
                              the deadline): a second submission of the id is refused
    {result-list}:pushed      results ever pushed to the list (retention bookkeeping)
    {result-list}:marks       zset: pushed count -> the first time it was seen
    request-active:<id>       the live submission's token, TTL until its deadline
    request-cancel:<id>       the token being cancelled, TTL 7 days
    claim-batch:<owner>:<n>   one claim call's claim keys and scores, for a retry of the
                              call whose reply was lost; expires after a lease
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
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any

from async_processor.config.redis import result_side_key as result_side_key

DEFAULT_REQUEST_QUEUE = "request-sortedset"
DEFAULT_RESULT_LIST = "result-list"
DEFAULT_RETRY_QUEUE = "retry-sortedset"
CANCEL_TTL_SECONDS = 7 * 24 * 3600
# A live marker outlives its deadline by this much: the deadline sweep answers (and frees
# the id) within a second, so the grace only matters for a member deleted by hand.
LIVE_GRACE_SECONDS = 300
# Result-list marks are kept at least this long, so ``status`` can date older results.
MARKS_HORIZON_SECONDS = 24 * 3600


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


SEQUENCE_PREFIX = "request-seq:"
# A claim call's record (claim-batch:<owner>:<n>, JSON [[claim key, score], ...], expires
# after a lease): a retried call whose reply was lost answers with what it claimed.
CLAIM_RECORD_PREFIX = "claim-batch:"
PAYLOAD_PREFIX = "request-payload:"
# Upstream's counter outlives its deadline by this much (EXPIREAT deadline + 3600).
SEQUENCE_GRACE_SECONDS = 3600
OWN_PREFIXES = (
    "request-active:",
    "request-cancel:",
    "request-done:",
    SEQUENCE_PREFIX,
    PAYLOAD_PREFIX,
    CLAIM_RECORD_PREFIX,
)
# The discovered queues removed while they still held claims or retries: kept in Redis so
# a restarted daemon (or one with discovery turned off) still reaps and moves them home.
REMOVED_QUEUES_KEY = "async-processor:removed-queues"
# Removed queue -> when it was first seen empty (Redis time): forgotten a grace period later.
EMPTY_SINCE_KEY = "async-processor:removed-queues:empty-since"
# A token no process ever deletes: another one read back means the data set was replaced
# (transports/redis_sortedset/dataset.py).
DATASET_KEY = "async-processor:dataset"
# In cluster mode one token per primary: this prefix, then a hash tag in one of its slots.
DATASET_NODE_PREFIX = DATASET_KEY + ":"


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
    exact = {retry_queue, REMOVED_QUEUES_KEY, EMPTY_SINCE_KEY, DATASET_KEY, *queue_keys(queues)}
    prefixes = [*OWN_PREFIXES, DATASET_NODE_PREFIX]
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
    """Request queues with their claim, in-flight and dead-letter keys."""
    exact: set[str] = set()
    for queue in queues:
        exact |= {queue, inflight_key(queue), inflight_meta_key(queue), dead_letter_key(queue)}
        exact |= {claimed_key(queue), claim_owners_key(queue), claims_idx_key(queue)}
    return exact


def sequence_key(queue: str, deadline: int) -> str:
    return f"{SEQUENCE_PREFIX}{queue}:{deadline}"


def payload_key(request_id: str, token: str) -> str:
    """Upstream's payload key: the body of a request stored apart from its envelope."""
    return f"{PAYLOAD_PREFIX}{request_id}:{token}"


def live_key(queue: str, request_id: str) -> str:
    return f"{queue}:live:{request_id}"


def claimed_key(queue: str) -> str:
    return f"{queue}:claimed"


def claim_owners_key(queue: str) -> str:
    return f"{queue}:claim-owners"


def claims_idx_key(queue: str) -> str:
    return f"{queue}:claims-idx"


def inflight_key(queue: str) -> str:
    return f"{queue}:inflight"


def inflight_meta_key(queue: str) -> str:
    return f"{queue}:inflight:meta"


def dead_letter_key(queue: str) -> str:
    return f"{queue}:dead-letter"


def retry_key(queue: str) -> str:
    """A queue's own retry set (cluster mode, or discovered queues)."""
    return f"{queue}:retry"
