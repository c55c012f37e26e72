"""Token accounting per tenant: the gateway's ``usage`` counts, by the message's tenant.

Stage: after an HTTP attempt, beside dispatch. Input: a successful answer's body (the
OpenAI format: ``"usage": {"prompt_tokens": …, "completion_tokens": …, "total_tokens":
…}``) and the message's metadata. Output: ``llm_d_async_async_tokens_total{queue_id,
queue_name, pool_name, direction, tenant, kind}``: upstream's ``direction`` (``input`` =
prompt tokens, ``output`` = completion tokens) on every series, and ours, ``tenant`` and
``kind`` (``prompt`` / ``completion``, the same split). ``kind="total"`` (prompt +
completion, no ``direction``) is deprecated: a ``sum`` over the family counted every
token twice; it is written while ``--tokens-kind-total`` is on (this release's default)
and goes in the next. The body itself is not changed: the result carries the gateway's
bytes as they came, as every result does.

Cheap and bounded: the body is never parsed as a whole. ``usage`` comes after the choices
in OpenAI answers, so only the last ``USAGE_WINDOW`` bytes are searched for the key, and
only the object after it (at most ``USAGE_OBJECT_BYTES``) is decoded. The tenant is the
metadata attribute the merge policy uses as the fairness id (``fairness_attribute``,
default ``userid``); past ``--tenant-label-limit`` distinct tenants per process, new
ones are counted as ``other``, so a flood of ids cannot blow up the series.

The gateway is not trusted with the counters: a count that is not an int in
``[0, MAX_TOKENS]`` is not added (it counts in ``token_usage_invalid_total``), and
nothing here can raise into the result path: a 2xx answer stays a success whatever its
``usage`` holds.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import NamedTuple

import structlog
from prometheus_client import Counter

from async_processor.headers import fairness_id
from async_processor.metrics import NO_TENANT, TOKEN_DIRECTIONS

log = structlog.get_logger(__name__)

USAGE_WINDOW = 64 * 1024  # bytes at the end of an answer searched for "usage"
USAGE_OBJECT_BYTES = 4096  # the usage object itself is a few dozen bytes
USAGE_KEY = b'"usage"'
# One answer's count, at most. The largest context windows are ~10**7 tokens, so 2**32
# leaves 400x headroom. Lower than 2**53 on purpose: the counter is a float64, exact up to
# 2**53; a single answer of 2**53 would make every later one-token increment vanish, while
# 2**32 per answer takes 2**21 maximal answers to get there.
MAX_TOKENS = 2**32
FIELDS = {"prompt": "prompt_tokens", "completion": "completion_tokens", "total": "total_tokens"}
OTHER_TENANT = "other"  # past the cap on distinct tenants, or a tenant named like a label
# A tenant whose id is a reserved label value is counted as "other": "none" must mean
# "no tenant attribute" only, and a named series must be that tenant's alone.
RESERVED_TENANTS = frozenset({NO_TENANT, OTHER_TENANT})
INVALID_LOG_SECONDS = 60.0  # at most one warning a minute: a bad gateway answers often
_DECODER = json.JSONDecoder()


Labels = tuple[str, str, str]  # queue_id, queue_name, pool_name


class Usage(NamedTuple):
    counts: dict[str, int]  # kind -> tokens, only the fields present and valid
    invalid: bool  # a field (or the object) was there but malformed or out of range


def parse_usage(body: bytes) -> Usage | None:
    """The answer's top-level-looking ``"usage"`` object near its end; None when there is
    none (or it is null: streaming-style answers without usage)."""
    start = max(0, len(body) - USAGE_WINDOW)
    at = body.rfind(USAGE_KEY, start)
    malformed = False
    while at >= 0:
        # Inside a JSON string the key's quotes are escaped (\"usage\"): not the field.
        if at == 0 or body[at - 1] != ord("\\"):
            found = _object_after(body, at + len(USAGE_KEY))
            if isinstance(found, dict):
                return _counts(found)
            malformed = malformed or found is not None
        at = body.rfind(USAGE_KEY, start, at)
    return Usage({}, invalid=True) if malformed else None


_NOT_JSON = object()  # the bytes after a "usage" key are no JSON value (or no ":")


def _object_after(body: bytes, pos: int) -> object:
    """The JSON value after a ``"usage"`` key, None for null, ``_NOT_JSON`` if unreadable."""
    text = body[pos : pos + USAGE_OBJECT_BYTES].decode("utf-8", errors="replace").lstrip()
    if not text.startswith(":"):
        return None  # a "usage" string value, not a key
    text = text[1:].lstrip()
    try:
        value, _ = _DECODER.raw_decode(text)
    except (ValueError, RecursionError):  # RecursionError: deeply nested junk
        return _NOT_JSON
    return value


def _counts(usage: dict[str, object]) -> Usage:
    counts: dict[str, int] = {}
    invalid = False
    for kind, field in FIELDS.items():
        n = usage.get(field)
        if n is None:
            continue
        if type(n) is int and 0 <= n <= MAX_TOKENS:  # not bool, float, str, nested junk
            counts[kind] = n
        else:
            invalid = True
    # Embeddings answers carry prompt and total only; older servers may lack total.
    if usage.get("total_tokens") is None and "prompt" in counts and "completion" in counts:
        counts["total"] = counts["prompt"] + counts["completion"]
    return Usage(counts, invalid)


class TokenAccounting:
    """Counts each answer's tokens under its tenant, with at most ``limit`` tenants."""

    def __init__(
        self, family: Counter, invalid: Counter, attribute: str, limit: int, *, total: bool = True
    ) -> None:
        self._family = family
        self._total = total  # kind="total" written (deprecated)
        self._invalid = invalid
        self._attribute = attribute
        self._limit = limit
        self._tenants: set[str] = set()
        # Labelled children, looked up once: ``labels()`` costs ~2 µs a call, twice a message.
        self._children: dict[tuple[str, ...], Counter] = {}
        self._warned_at = -INVALID_LOG_SECONDS

    def tenant(self, metadata: Mapping[str, str]) -> str:
        """The tenant label for a message: its attribute, ``none`` or ``other``."""
        value = fairness_id(metadata, self._attribute)
        if value is None:
            return NO_TENANT
        if value in self._tenants:
            return value
        if value in RESERVED_TENANTS or len(self._tenants) >= self._limit:
            return OTHER_TENANT
        self._tenants.add(value)
        return value

    def count(self, queue: Labels, metadata: Mapping[str, str], body: bytes) -> None:
        """Adds the answer's usage under ``queue``'s (queue_id, queue_name, pool_name), as
        ``QueueMetrics.labels``; never raises (the answer is a success whatever it says)."""
        try:
            usage = parse_usage(body)
            if usage is None:
                return
            if usage.invalid:
                self._invalid_usage(queue, "out_of_range")
            if not usage.counts:
                return
            tenant = self.tenant(metadata)
            for kind, n in usage.counts.items():
                if kind == "total" and not self._total:
                    continue
                key = (*queue, TOKEN_DIRECTIONS[kind], tenant, kind)
                child = self._children.get(key)
                if child is None:
                    child = self._children[key] = self._family.labels(*key)
                child.inc(n)
        except Exception as exc:  # a bug here must not turn a 200 into an error result
            self._invalid_usage(queue, type(exc).__name__)

    def _invalid_usage(self, labels: Labels, reason: str) -> None:
        _, queue, pool = labels
        self._invalid.labels(queue, pool).inc()
        now = time.monotonic()
        if now - self._warned_at >= INVALID_LOG_SECONDS:
            self._warned_at = now
            # No body, no value: the answer is the tenant's data, and the number is junk.
            log.warning("token_usage_invalid", queue=queue, pool=pool, reason=reason)
