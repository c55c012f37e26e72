"""The envelope's routing block (``internal``): where a message came from and goes to,
the fields upstream added, and the ones nobody here knows, kept as their exact text.

Input: the decoded ``internal`` object. Output: ``Routing``, and its JSON text for a
re-written envelope. Used by ``messages`` (the envelope around it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from async_processor.json_scan import usable_id

# Upstream's submission order (llm-d-async #463): the n-th request of one queue and one
# deadline is scored deadline + min(n, SEQ_MAX) / SEQ_SCALE. Exact in a double for
# deadlines below 2^32 (2106); from there on the score is the bare deadline.
SEQ_SCALE = 2097152  # 2^21
SEQ_MAX = SEQ_SCALE - 1
SEQ_DEADLINE_LIMIT = 2**32


def queue_score(deadline: int, enqueue_seq: int) -> float:
    """A request's score in its queue: the deadline, plus its submission order's fraction
    (``enqueue_seq`` <= 0, unstamped: the bare deadline, which sorts first)."""
    if enqueue_seq <= 0 or deadline >= SEQ_DEADLINE_LIMIT:
        return float(deadline)
    return deadline + min(enqueue_seq, SEQ_MAX) / SEQ_SCALE


@dataclass(slots=True)
class Routing:
    """The envelope's ``internal`` block: where a message came from and goes to."""

    retry_count: int = 0
    queue_id: str = ""
    request_token: str = ""
    request_queue_name: str = ""
    result_queue_name: str = ""
    transport_correlation_id: str = ""
    labels: dict[str, str] = field(default_factory=dict)
    # Upstream's (llm-d-async v0.9.1+): the result route frozen at the first fetch, so a
    # config change cannot reroute a message in flight; its result list's TTL; the
    # producer's 1-based order among its queue's requests of one deadline (the score's
    # fraction); and the key holding the body when it is stored apart (``payload_ref``).
    result_ttl_seconds: int = 0
    result_routing_resolved: bool = False
    enqueue_seq: int = 0
    payload_ref: str = ""
    # Ours: the last HTTP answer of a retried request, so that a deadline reached while it
    # waits on the broker still ends with that answer (the Go daemon ignores these fields).
    last_status: int = 0
    last_body: str = ""
    # Fields we do not know (upstream's ``dispatch_epoch``, a later release's), as their
    # exact JSON text: written back unchanged when the envelope is re-written, so a
    # message retried by us still carries what another consumer wrote into it.
    extra: dict[str, bytes] = field(default_factory=dict)

    def to_obj(self) -> dict[str, Any]:
        """JSON object with empty/zero fields left out, as the reference writes it (the
        unknown fields are not in it: ``encode`` writes them)."""
        out: dict[str, Any] = {}
        if self.retry_count:
            out["retry_count"] = self.retry_count
        for name in _ROUTING_OUT:
            value = getattr(self, name)
            if value:
                out[name] = value
        if self.labels:
            out["labels"] = self.labels
        if self.last_status:
            out["last_status"] = self.last_status
            out["last_body"] = self.last_body
        return out

    def encode(self) -> bytes:
        """The ``internal`` object's JSON text, unknown fields byte for byte."""
        known = dumps(self.to_obj())
        if not self.extra:
            return known
        parts = [b",".join(dumps(k) + b":" + v for k, v in self.extra.items())]
        return known[:-1] + (b"," if len(known) > 2 else b"") + parts[0] + b"}"

    @classmethod
    def from_obj(cls, obj: object) -> Routing:
        """From the decoded ``internal`` object (unknown fields re-encoded: see
        ``decode_envelope`` for their exact text)."""
        if obj is None:
            return cls()
        if not isinstance(obj, dict):
            raise ValueError("internal must be an object")
        retry = obj.get("retry_count", 0) or 0
        if not isinstance(retry, int) or isinstance(retry, bool) or retry < 0:
            raise ValueError("internal.retry_count must be a non-negative integer")
        routing = cls(
            retry_count=retry,
            labels=str_map(obj.get("labels"), "internal.labels"),
            last_status=_opt_int(obj, "last_status"),
        )
        # Only the strings present are checked: most envelopes carry two or three of the
        # six, and each check costs ~0.3 µs per message (issue 13).
        for key in _ROUTING_STRINGS:
            if key in obj:
                setattr(routing, key, _opt_str(obj, key))
        if len(obj) > len(_ROUTING_COMMON.intersection(obj)):
            _upstream_fields(routing, obj)
        return routing


_ROUTING_OUT = (
    "queue_id",
    "request_token",
    "request_queue_name",
    "result_queue_name",
    "transport_correlation_id",
    "result_ttl_seconds",
    "result_routing_resolved",
    "enqueue_seq",
    "payload_ref",
)
_ROUTING_STRINGS = (
    "queue_id",
    "request_token",
    "request_queue_name",
    "result_queue_name",
    "transport_correlation_id",
    "last_body",
    "payload_ref",
)
_ROUTING_INTS = ("result_ttl_seconds", "enqueue_seq")
_ROUTING_KNOWN = frozenset(
    (*_ROUTING_STRINGS, *_ROUTING_INTS, "retry_count", "labels", "last_status",
     "result_routing_resolved")
)  # fmt: skip
# The fields of an envelope our own producers and daemons write: the rest is read apart.
_ROUTING_COMMON = frozenset(_ROUTING_KNOWN - {*_ROUTING_INTS, "result_routing_resolved"})


def _upstream_fields(routing: Routing, obj: dict[str, Any]) -> None:
    """The fields only upstream's envelopes carry, and the unknown ones."""
    for key in _ROUTING_INTS:
        if key in obj:
            setattr(routing, key, _opt_int(obj, key))
    resolved = obj.get("result_routing_resolved", False)
    if not isinstance(resolved, bool):
        raise ValueError("internal.result_routing_resolved must be a boolean")
    routing.result_routing_resolved = resolved
    routing.extra = {k: dumps(v) for k, v in obj.items() if k not in _ROUTING_KNOWN}


def _opt_str(obj: dict[str, Any], key: str) -> str:
    value = obj.get(key, "")
    if value is None:
        return ""
    if not isinstance(value, str) or usable_id(value or "-") is None:
        # Routing strings name Redis keys (result list, origin queue, dedup marker).
        raise ValueError(f"internal.{key} must be a UTF-8 string")
    return value


def _opt_int(obj: dict[str, Any], key: str) -> int:
    value = obj.get(key, 0) or 0
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"internal.{key} must be an integer")
    return value


def str_map(value: object, what: str) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise ValueError(f"{what} must be an object of strings")
    return dict(value)


def dumps(value: object) -> bytes:
    # A lone surrogate (legal JSON "\ud800", decoded as such) cannot be UTF-8 encoded;
    # backslashreplace writes it back as that same JSON escape, so the text round-trips.
    text = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    return text.encode("utf-8", "backslashreplace")
