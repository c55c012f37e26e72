"""One submission, checked before it is queued: a validated ``Request`` and its token.

Stage: the producer side (the client library and ``submit``). Input: a request as a dict
or a ``messages.Request``. Output: the ``Request`` to queue (or a ``ValueError`` saying
why it would be refused) and a fresh request token.
"""

from __future__ import annotations

import hashlib
import json
import math
import secrets
import time
from typing import Any, NoReturn

from async_processor.errors import InvalidMessage
from async_processor.messages import Payload, Request, decode_request

# The latest deadline a submission may carry: 9999-12-31T23:59:59Z. Larger ones made the
# marker's SET EX fail inside the MULTI while the ZADD still ran (a half-written submit).
MAX_DEADLINE = 253_402_300_799


def new_token() -> str:
    """A fresh 32-hex request token that ``lua/cancel.lua`` knows for this library's: 16
    random hex, then the first 16 hex of the SHA-1 of ``async-processor:`` and those."""
    head = secrets.token_hex(8)
    return (
        head
        + hashlib.sha1(f"async-processor:{head}".encode(), usedforsecurity=False).hexdigest()[:16]
    )


def request_of(fields: dict[str, Any], payload: Payload | None = None) -> Request:
    """The ``Request`` of ``fields``, with ``payload`` (JSON text, if given) kept verbatim:
    re-encoding a parsed payload changed its text (``1.10`` became ``1.1``).

    ``ValueError`` says why it would be refused."""
    try:
        # allow_nan=False: a number JSON cannot hold (1e999 read as inf, a NaN or
        # Infinity literal) went on as a bare Infinity/NaN token, which is not JSON.
        text = json.dumps(fields, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
        if payload is not None:
            _check_strict(payload)
            text = f'{text[:-1]},"payload":{bytes(payload).decode()}}}'
    except ValueError as exc:  # which value, dumps does not say
        raise ValueError(f"invalid request: a number out of JSON's range: {exc}") from exc
    try:
        return decode_request(text)
    except InvalidMessage as exc:
        raise ValueError(f"invalid request: {exc}") from exc


def _check_strict(payload: Payload) -> None:
    """A payload kept as text holds only numbers JSON can carry: Python's parser (which
    read the line when msgspec would not) lets 1e999, NaN and Infinity through."""

    def number(text: str) -> float:
        if not math.isfinite(value := float(text)):
            raise ValueError(f"{text} is beyond a double")
        return value

    def constant(name: str) -> NoReturn:
        raise ValueError(f"{name} is not a JSON number")

    json.loads(bytes(payload), parse_float=number, parse_constant=constant)


def as_request(request: dict[str, Any] | Request) -> Request:
    """A validated ``Request``; a dict's payload is encoded once, then kept verbatim.

    ``ValueError`` says why it would be refused (``submit`` checks every line with it
    before queueing any)."""
    if isinstance(request, dict):
        request = request_of(request)
    if not request.id:
        raise ValueError("request id must not be empty")
    if not time.time() < request.deadline <= MAX_DEADLINE:
        raise ValueError(
            f"request {request.id!r}: deadline {request.deadline} is not between now and "
            f"{MAX_DEADLINE} (9999-12-31, Unix seconds)"
        )
    return request
