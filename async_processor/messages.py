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
from async_processor.routing import Routing as Routing
from async_processor.routing import dumps as _dumps
from async_processor.routing import str_map as _str_map

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


def _exact_fields(raw: bytes | str, keys: tuple[str, ...]) -> dict[str, bytes]:
    """The exact JSON text of the ``internal`` fields ``keys`` of an envelope."""
    internal = decode_object(raw, "message", ("internal",))[1]["internal"]
    exact = decode_object(internal, "internal", keys)[1]
    return {k: bytes(exact[k]) for k in keys}


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

    def encode(self, *, with_payload: bool = True) -> bytes:
        """The request's JSON; ``with_payload=False`` leaves the payload out (it is stored
        apart, under the envelope's ``payload_ref``)."""
        if with_payload and self.payload is LET_GO:
            raise RuntimeError(f"request {self.id}: its payload was let go, get it back first")
        parts: list[Payload] = [b'{"id":', _dumps(self.id)]
        if self.created:
            parts += [b',"created":', str(self.created).encode()]
        parts += [b',"deadline":', str(self.deadline).encode()]
        if with_payload:
            parts += [b',"payload":', self.payload]
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
                self.routing.encode(),
                b',"request_kind":',
                _dumps(self.kind),
                b',"data":',
                # A payload stored apart stays there: a retry re-writes the envelope only.
                self.request.encode(with_payload=not self.routing.payload_ref),
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
    # The submission this answers (redis-sortedset, as upstream since v0.10: its result
    # readers key claims and duplicates by id and token). Left out when empty.
    request_token: str = ""
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
        if self.request_token:
            out["request_token"] = self.request_token
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
            request_token=str(obj.get("request_token", "") or ""),
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
        if routing.extra:  # rare: read again for the unknown fields' exact text
            routing.extra = _exact_fields(raw, tuple(routing.extra))
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


# The label a classifying ``redis-quota`` stamps on each message it judges; read by the
# ``tier-priority`` merge and admission, and by the gate-decision metric of a refusal.
CLASSIFICATION_LABEL = "classification"
RESERVED, OVERFLOW = "reserved", "overflow"


def classification(message: Envelope) -> str | None:
    """``reserved`` (within its quota), ``overflow`` (over it) or None (not classified)."""
    return message.routing.labels.get(CLASSIFICATION_LABEL)


def classify(message: Envelope, *, reserved: bool) -> None:
    message.routing.labels[CLASSIFICATION_LABEL] = RESERVED if reserved else OVERFLOW
