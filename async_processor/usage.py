"""Token accounting per tenant: the gateway's ``usage`` counts, by the message's tenant.

Stage: after an HTTP attempt, beside dispatch. Input: a successful answer's body (the
OpenAI format: ``"usage": {"prompt_tokens": …, "completion_tokens": …}``) and the
message's metadata. Output: ``llm_d_async_async_tokens_total{queue_name, pool_name,
tenant, kind}`` (kind ``prompt`` or ``completion``). The body itself is not changed: the
result carries the gateway's bytes as they came, as every result does.

Cheap and bounded: the body is never parsed as a whole. ``usage`` comes after the choices
in OpenAI answers, so only the last ``USAGE_WINDOW`` bytes are searched for the key, and
only the object after it (at most ``USAGE_OBJECT_BYTES``) is decoded. The tenant is the
metadata attribute the merge policy uses as the fairness id (``fairness_attribute``,
default ``userid``); past ``--tenant-label-limit`` distinct tenants per process, new
ones are counted as ``other``, so a flood of ids cannot blow up the series.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from prometheus_client import Counter

from async_processor.merge.headers import fairness_id

USAGE_WINDOW = 64 * 1024  # bytes at the end of an answer searched for "usage"
USAGE_OBJECT_BYTES = 4096  # the usage object itself is a few dozen bytes
USAGE_KEY = b'"usage"'
KINDS = ("prompt", "completion")
NO_TENANT = "none"  # the message has no usable tenant attribute
OTHER_TENANT = "other"  # past the cap on distinct tenants
_DECODER = json.JSONDecoder()


def parse_usage(body: bytes) -> dict[str, int] | None:
    """{"prompt": n, "completion": m} from the answer's top-level-looking ``"usage"``
    object near its end; None when there is none (or it is malformed)."""
    start = max(0, len(body) - USAGE_WINDOW)
    at = body.rfind(USAGE_KEY, start)
    while at >= 0:
        # Inside a JSON string the key's quotes are escaped (\"usage\"): not the field.
        if at == 0 or body[at - 1] != ord("\\"):
            found = _object_after(body, at + len(USAGE_KEY))
            if found is not None:
                return found
        at = body.rfind(USAGE_KEY, start, at)
    return None


def _object_after(body: bytes, pos: int) -> dict[str, int] | None:
    text = body[pos : pos + USAGE_OBJECT_BYTES].decode("utf-8", errors="replace").lstrip()
    if not text.startswith(":"):
        return None
    text = text[1:].lstrip()
    try:
        value, _ = _DECODER.raw_decode(text)
    except ValueError:
        return None
    if not isinstance(value, dict):
        return None
    counts = {kind: value.get(f"{kind}_tokens") for kind in KINDS}
    if not all(type(n) is int and n >= 0 for n in counts.values()):
        return None
    return {kind: int(n) for kind, n in counts.items() if n is not None}


class TokenAccounting:
    """Counts each answer's tokens under its tenant, with at most ``limit`` tenants."""

    def __init__(self, family: Counter, attribute: str, limit: int) -> None:
        self._family = family
        self._attribute = attribute
        self._limit = limit
        self._tenants: set[str] = set()
        # Labelled children, looked up once: ``labels()`` costs ~2 µs a call, twice a message.
        self._children: dict[tuple[str, str, str, str], Counter] = {}

    def tenant(self, metadata: Mapping[str, str]) -> str:
        """The tenant label for a message: its attribute, ``none`` or ``other``."""
        value = fairness_id(metadata, self._attribute)
        if value is None:
            return NO_TENANT
        if value in self._tenants:
            return value
        if len(self._tenants) >= self._limit:
            return OTHER_TENANT
        self._tenants.add(value)
        return value

    def count(self, queue: str, pool: str, metadata: Mapping[str, str], body: bytes) -> None:
        usage = parse_usage(body)
        if usage is None:
            return
        tenant = self.tenant(metadata)
        for kind, n in usage.items():
            key = (queue, pool, tenant, kind)
            child = self._children.get(key)
            if child is None:
                child = self._children[key] = self._family.labels(*key)
            child.inc(n)
