"""Messages: the request, the Redis envelope around it, and the result.

Input: raw bytes as a broker holds them. Output: ``Envelope`` / ``Request`` objects for
the pipeline and encoded bytes for the broker, in the reference's JSON shapes.

The payload is kept as the exact JSON text the producer sent (``Request.payload``): it
is never re-encoded, so key order, big integers and escapes reach the gateway unchanged.
Decoding records where each top-level value sits in the text instead of rebuilding it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from async_processor.errors import InvalidMessage
from async_processor.json_scan import Payload as Payload
from async_processor.json_scan import decode_object, id_from_prefix, peek_data_id, usable_id

DEFAULT_MAX_MESSAGE_BYTES = 4 * 1024 * 1024
# How much of an oversized message is read for its id (the rest is never parsed).
ID_PREFIX_BYTES = 64 * 1024
# The reference's deadline is an int64; anything larger overflows float arithmetic later.
MAX_DEADLINE = 2**63 - 1
ENVELOPE_KINDS = ("plain", "redis", "pubsub")
# Fields of the typed request variants that ride in ``data`` next to the public ones.
VARIANT_FIELDS = ("request_queue_name", "result_queue_name", "pubsub_id")


class ErrorCode(StrEnum):
    INVALID_REQUEST = "INVALID_REQUEST"
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
    CANCELLED = "CANCELLED"
    GATE_DROPPED = "GATE_DROPPED"
    GATE_ERROR = "GATE_ERROR"
    INFERENCE_ERROR = "INFERENCE_ERROR"
    PAYLOAD_UNAVAILABLE = "PAYLOAD_UNAVAILABLE"


INVALID_DEADLINE_TEXT = "Failed: deadline is missing or invalid (Unix seconds)."
DEADLINE_EXCEEDED_TEXT = "deadline exceeded"
CANCELLED_TEXT = "cancelled"
GATE_DROPPED_TEXT = "Pool gating dropped request"


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
    # Ours: the last HTTP answer of a retried request, so that a deadline reached while it
    # waits on the broker still ends with that answer (the Go daemon ignores these fields).
    last_status: int = 0
    last_body: str = ""

    def to_obj(self) -> dict[str, Any]:
        """JSON object with empty/zero fields left out, as the reference writes it."""
        out: dict[str, Any] = {}
        if self.retry_count:
            out["retry_count"] = self.retry_count
        for name in (
            "queue_id",
            "request_token",
            "request_queue_name",
            "result_queue_name",
            "transport_correlation_id",
        ):
            value = getattr(self, name)
            if value:
                out[name] = value
        if self.labels:
            out["labels"] = self.labels
        if self.last_status:
            out["last_status"] = self.last_status
            out["last_body"] = self.last_body
        return out

    @classmethod
    def from_obj(cls, obj: object) -> Routing:
        if obj is None:
            return cls()
        if not isinstance(obj, dict):
            raise ValueError("internal must be an object")
        retry = obj.get("retry_count", 0) or 0
        if not isinstance(retry, int) or isinstance(retry, bool) or retry < 0:
            raise ValueError("internal.retry_count must be a non-negative integer")
        routing = cls(
            retry_count=retry,
            labels=_str_map(obj.get("labels"), "internal.labels"),
            last_status=_opt_int(obj, "last_status"),
        )
        # Only the strings present are checked: most envelopes carry two or three of the
        # six, and each check costs ~0.3 µs per message (issue 13).
        for key in _ROUTING_STRINGS:
            if key in obj:
                setattr(routing, key, _opt_str(obj, key))
        return routing


_ROUTING_STRINGS = (
    "queue_id",
    "request_token",
    "request_queue_name",
    "result_queue_name",
    "transport_correlation_id",
    "last_body",
)


# The payload of a request whose bytes were let go once it was written to the gateway
# (redis-sortedset: the lease in Redis holds them). Got back from the broker before the
# request is encoded again; encoding it as it is raises.
LET_GO: Payload = memoryview(b"")


@dataclass(slots=True)
class Request:
    """The public request message. ``payload`` is the payload's JSON text, verbatim."""

    id: str
    deadline: int
    payload: Payload = b"null"
    created: int = 0
    metadata: dict[str, str] = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)
    endpoint: str = ""
    # Variant and unknown fields, kept so that re-encoding loses nothing.
    extra: dict[str, Any] = field(default_factory=dict)

    def encode(self) -> bytes:
        if self.payload is LET_GO:
            raise RuntimeError(f"request {self.id}: its payload was let go, get it back first")
        parts: list[Payload] = [b'{"id":', _dumps(self.id)]
        if self.created:
            parts += [b',"created":', str(self.created).encode()]
        parts += [b',"deadline":', str(self.deadline).encode(), b',"payload":', self.payload]
        if self.metadata:
            parts += [b',"metadata":', _dumps(self.metadata)]
        if self.headers:
            parts += [b',"headers":', _dumps(self.headers)]
        if self.endpoint:
            parts += [b',"endpoint":', _dumps(self.endpoint)]
        for key, value in self.extra.items():
            parts += [b",", _dumps(key), b":", _dumps(value)]
        parts.append(b"}")
        return b"".join(parts)


@dataclass(slots=True)
class Envelope:
    """A request plus its routing, as carried on the Redis transports."""

    request: Request
    routing: Routing = field(default_factory=Routing)
    kind: str = "plain"

    @property
    def id(self) -> str:
        return self.request.id

    def encode(self) -> bytes:
        return b"".join(
            (
                b'{"internal":',
                _dumps(self.routing.to_obj()),
                b',"request_kind":',
                _dumps(self.kind),
                b',"data":',
                self.request.encode(),
                b"}",
            )
        )


@dataclass(slots=True)
class Result:
    """Exactly one per request, on the result queue. Not changed once made: ``encode``
    keeps its bytes (a result is sized before it is written)."""

    id: str
    status_code: int = 0
    payload: str = ""
    error_code: str = ""
    error_message: str = ""
    _encoded: bytes = field(default=b"", init=False, repr=False, compare=False)

    @classmethod
    def failure(cls, request_id: str, code: ErrorCode, message: str) -> Result:
        """A non-HTTP failure; ``payload`` repeats the message for old consumers."""
        return cls(
            id=request_id,
            payload=json.dumps({"error": message}),
            error_code=code.value,
            error_message=message,
        )

    @classmethod
    def http(cls, request_id: str, status_code: int, body: bytes) -> Result:
        return cls(
            id=request_id,
            status_code=status_code,
            payload=body.decode("utf-8", errors="replace"),
        )

    def to_obj(self) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id}
        if self.status_code > 0:
            out["status_code"] = self.status_code
        out["payload"] = self.payload
        if self.error_code:
            out["error_code"] = self.error_code
        if self.error_message:
            out["error_message"] = self.error_message
        return out

    def encode(self) -> bytes:
        if not self._encoded:
            self._encoded = _dumps(self.to_obj())
        return self._encoded

    @classmethod
    def decode(cls, raw: bytes | str) -> Result:
        """ValueError (or TypeError) for anything that is not a result, however odd."""
        try:
            obj = json.loads(raw)
            if not isinstance(obj, dict) or not isinstance(obj.get("id"), str):
                raise ValueError("result has no string id")
            status_code = int(obj.get("status_code", 0) or 0)
        except (RecursionError, OverflowError) as exc:  # deep nesting; int(1e999)
            raise ValueError(str(exc)) from exc
        return cls(
            id=obj["id"],
            status_code=status_code,
            payload=str(obj.get("payload", "")),
            error_code=str(obj.get("error_code", "")),
            error_message=str(obj.get("error_message", "")),
        )


# ----------------------------------------------------------------------------- decoding

_PUBLIC_FIELDS = frozenset(
    ("id", "created", "deadline", "payload", "metadata", "headers", "endpoint")
)


def decode_envelope(raw: bytes | str, *, max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> Envelope:
    """Decode a Redis member: an envelope, or a bare request object (taken as ``plain``).

    Raises ``InvalidMessage`` with ``request_id`` set whenever an id could be read.
    """
    check_size(raw, max_bytes)
    top, raws = decode_object(raw, "message", ("data", "payload"))
    if "request_kind" not in top and "data" not in raws:
        return Envelope(request=_request_from(top, raws))
    data = raws.get("data")
    kind = top.get("request_kind")
    if kind not in ENVELOPE_KINDS:
        raise InvalidMessage(
            f"unknown request_kind {kind!r} (known: {', '.join(ENVELOPE_KINDS)})",
            reason="unknown_kind",
            request_id=peek_data_id(data),
        )
    if data is None:
        raise InvalidMessage("envelope has no data", reason="malformed", request_id=None)
    try:
        routing = Routing.from_obj(top.get("internal"))
    except ValueError as exc:
        raise InvalidMessage(str(exc), reason="malformed", request_id=peek_data_id(data)) from exc
    fields, data_raws = decode_object(data, "data", ("payload",))
    return Envelope(request=_request_from(fields, data_raws), routing=routing, kind=str(kind))


def decode_request(raw: bytes | str, *, max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> Request:
    """Decode a bare public request (the Pub/Sub wire format)."""
    check_size(raw, max_bytes)
    return _request_from(*decode_object(raw, "message", ("payload",)))


def check_size(raw: bytes | str, max_bytes: int) -> None:
    """Sizes are bytes, checked before parsing (docs/architecture.md G10): an oversized message is
    refused with the id its first ``ID_PREFIX_BYTES`` give, the rest never parsed."""
    size = len(raw) if isinstance(raw, bytes) else len(raw.encode("utf-8", "surrogatepass"))
    if size > max_bytes:
        raise too_large(size, max_bytes, id_from_prefix(raw[:ID_PREFIX_BYTES]))


def too_large(size: int, max_bytes: int, request_id: str | None) -> InvalidMessage:
    return InvalidMessage(
        f"message of {size} bytes exceeds the {max_bytes}-byte limit",
        reason="too_large",
        request_id=request_id,
    )


def _request_from(obj: dict[str, Any], raws: dict[str, Payload]) -> Request:
    request_id = usable_id(obj.get("id"))
    if request_id is None:
        raise InvalidMessage("request has no usable string id", reason="missing_id")
    deadline = _deadline_of(obj, request_id)
    try:
        created = obj.get("created", 0) or 0
        if not isinstance(created, int | float) or isinstance(created, bool):
            raise ValueError("created must be a number")
        endpoint = obj.get("endpoint", "") or ""
        if not isinstance(endpoint, str):
            raise ValueError("endpoint must be a string")
        request = Request(
            id=request_id,
            deadline=deadline,
            created=int(created),
            metadata=_str_map(obj.get("metadata"), "metadata"),
            headers=_str_map(obj.get("headers"), "headers"),
            endpoint=endpoint,
            extra={k: v for k, v in obj.items() if k not in _PUBLIC_FIELDS},
        )
    except (ValueError, OverflowError) as exc:  # OverflowError: int(inf) for "created"
        raise InvalidMessage(str(exc), reason="malformed", request_id=request_id) from exc
    payload = raws.get("payload")
    if payload is not None:
        request.payload = payload
        if bytes(payload[:1]) not in (b"{", b"n"):
            raise InvalidMessage(
                "payload must be a JSON object", reason="malformed", request_id=request_id
            )
    return request


def _deadline_of(obj: dict[str, Any], request_id: str) -> int:
    """Whole Unix seconds in (0, int64 max]; 1.9e9 is accepted as 1900000000."""
    deadline = obj.get("deadline")
    if isinstance(deadline, float) and deadline.is_integer():
        deadline = int(deadline)
    if (
        isinstance(deadline, int)
        and not isinstance(deadline, bool)
        and 0 < deadline <= MAX_DEADLINE
    ):
        return deadline
    raise InvalidMessage(INVALID_DEADLINE_TEXT, reason="invalid_deadline", request_id=request_id)


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


def _str_map(value: object, what: str) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise ValueError(f"{what} must be an object of strings")
    return dict(value)


def _dumps(value: object) -> bytes:
    # A lone surrogate (legal JSON "\ud800", decoded as such) cannot be UTF-8 encoded;
    # backslashreplace writes it back as that same JSON escape, so the text round-trips.
    text = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    return text.encode("utf-8", "backslashreplace")


# The label a classifying ``redis-quota`` stamps on each message it judges; read by the
# ``tier-priority`` merge and admission, and by the gate-decision metric of a refusal.
CLASSIFICATION_LABEL = "classification"
RESERVED, OVERFLOW = "reserved", "overflow"


def classification(message: Envelope) -> str | None:
    """``reserved`` (within its quota), ``overflow`` (over it) or None (not classified)."""
    return message.routing.labels.get(CLASSIFICATION_LABEL)


def classify(message: Envelope, *, reserved: bool) -> None:
    message.routing.labels[CLASSIFICATION_LABEL] = RESERVED if reserved else OVERFLOW
