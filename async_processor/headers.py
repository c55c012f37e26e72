"""Every HTTP header the daemon reads, writes or refuses, and the legality rules.

Vocabulary for merge (stamping), transforms, dispatch (applying) and the HTTP clients
(reading the gateway's answer). Input: names and values from config and messages. Output:
the header names, legality checks and ``apply_stamped``.

Header order on the wire (the Go reference's), later wins:

1. ``Content-Type: application/json`` (one header, spelt so, whatever case the caller or
   a transform used: ``split_content_type``, upstream #494)
2. ``x-gateway-inference-objective: <queue inference_objective>`` when configured
3. the caller's ``headers`` from the message (exact keys)
4. the stamped headers, in order: fairness id, priority (tier-priority), lane objective.
5. the deadline header, then at each attempt the inference TTL (``--inference-ttl-header``).

The dispatcher builds 1–3 and then calls ``apply_stamped``, which deletes every letter-case
variant of a stamped name before setting it, so a caller's ``X-LLM-D-Inference-Fairness-Id``
can never ride next to the stamped one.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

# Stamped by the daemon (the Go reference's names); refused from a message.
OBJECTIVE_HEADER = "x-gateway-inference-objective"  # the queue's inference_objective
DEFAULT_FAIRNESS_HEADER = "x-llm-d-inference-fairness-id"
DEFAULT_FAIRNESS_ATTRIBUTE = "userid"
MAX_FAIRNESS_ID_BYTES = 256
DEFAULT_PRIORITY_HEADER = "x-gateway-priority"  # tier-priority's
DEFAULT_OBJECTIVE_HEADER = "x-llm-d-inference-objective"  # tier-priority's lane objective
# The request's deadline sent to the gateway, absolute Unix seconds (--deadline-header;
# empty sends none).
DEFAULT_DEADLINE_HEADER = "x-request-deadline"
# The time left to the deadline, Go duration syntax (--inference-ttl-header): the llm-d
# router's flow control holds a request no longer than this (llm-d-router #2316).
INFERENCE_TTL_HEADER = "x-llm-d-inference-ttl"
# Read from the gateway's answer: why llm-d dropped a request (a shed, retried).
DROPPED_REASON_HEADER = "x-llm-d-request-dropped-reason"

# Never from a message (docs/architecture.md G10): framing and routing headers, those that
# change the exchange (``Expect: 100-continue`` held the body back for an answer a gateway
# may never send), and the daemon's own (objective, fairness, priority; the deadline
# header and stamped names are added per request). ``Proxy-*`` is refused by prefix.
RESERVED_HEADERS = frozenset(
    (
        "host",
        "content-length",
        "transfer-encoding",
        "connection",
        "upgrade",
        "te",
        "trailer",
        "keep-alive",
        "expect",
        OBJECTIVE_HEADER,
        DEFAULT_FAIRNESS_HEADER,
        DEFAULT_PRIORITY_HEADER,
        DEFAULT_OBJECTIVE_HEADER,
    )
)

# RFC 7230 token: tchar = "!" / "#" / "$" / "%" / "&" / "'" / "*" / "+" / "-" / "." /
# "^" / "_" / "`" / "|" / "~" / DIGIT / ALPHA
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
# Field values: any character except CTLs (0x00-0x1F, 0x7F); HTAB is allowed. Characters
# >= 0x80 are allowed (obs-text), as Go's httpguts does, but not lone surrogates (JSON
# "\ud800" decodes to one): they have no UTF-8 encoding to send.
_ILLEGAL_VALUE_CHAR = re.compile(r"[\x00-\x08\x0a-\x1f\x7f\ud800-\udfff]")


def is_valid_header_name(name: str) -> bool:
    """True for a non-empty RFC 7230 token."""
    return _TOKEN.fullmatch(name) is not None


def is_valid_header_value(value: str) -> bool:
    """True when ``value`` has no control character other than HTAB (so no CR/LF)."""
    return _ILLEGAL_VALUE_CHAR.search(value) is None


def check_header_name(name: str) -> str:
    """Pydantic-style check: return ``name`` or raise ValueError naming it."""
    if not is_valid_header_name(name):
        raise ValueError(f"{name!r} is not a legal HTTP header name (RFC 7230 token)")
    return name


def check_header_value(value: str) -> str:
    if not is_valid_header_value(value):
        raise ValueError(f"{value!r} is not a legal HTTP header value (control characters)")
    return value


def apply_stamped(headers: dict[str, str], stamped: list[tuple[str, str]]) -> None:
    """Set each stamped header in order, first deleting every letter-case variant of it."""
    for name, value in stamped:
        folded = name.lower()
        for existing in [k for k in headers if k.lower() == folded]:
            del headers[existing]
        headers[name] = value


def split_content_type(
    headers: Mapping[str, str], default: str
) -> tuple[str, list[tuple[str, str]]]:
    """The content type a message's headers ask for (its last letter-case variant of
    ``Content-Type``, else ``default``) and its other headers, so that one header, spelt
    ``Content-Type``, goes out (upstream #494)."""
    content_type, others = default, []
    for name, value in headers.items():
        if name.lower() == "content-type":
            content_type = value
        else:
            others.append((name, value))
    return content_type, others


def fairness_id(metadata: Mapping[str, str], attribute: str) -> str | None:
    """``metadata[attribute]`` when usable as a header value: non-empty, ≤ 256 bytes, legal."""
    value = metadata.get(attribute, "")
    if not value or not is_valid_header_value(value):
        return None
    return value if len(value.encode()) <= MAX_FAIRNESS_ID_BYTES else None
