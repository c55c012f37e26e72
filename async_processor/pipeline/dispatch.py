"""HTTP dispatch: build the gateway request for one message and send one attempt.

Input: a ``Work`` item (admitted) and the settings that shape requests. Output: an
``Outgoing`` request (URL, headers, verbatim body) and, after sending, a ``retry.Attempt``.
The attempt is cut at min(deadline, now + request timeout); the deadline also reaches
the gateway as a header (docs/architecture.md G7), and so does the trace context when tracing is on;
with ``--inference-ttl-header`` each attempt also carries the time left to it.
The HTTP library is behind ``httpclients.base.HttpClient`` (``--http-client``).
"""

from __future__ import annotations

import math
import posixpath
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from urllib.parse import unquote, urlsplit, urlunsplit

from async_processor.durations import go_duration_string
from async_processor.errors import InvalidMessage, NoAnswer
from async_processor.headers import (
    DEFAULT_DEADLINE_HEADER,
    INFERENCE_TTL_HEADER,
    OBJECTIVE_HEADER,
    RESERVED_HEADERS,
    apply_stamped,
    is_valid_header_name,
    is_valid_header_value,
    split_content_type,
)
from async_processor.httpclients.base import AttemptTimeout, HttpClient
from async_processor.messages import Payload
from async_processor.retry import (
    Attempt,
    parse_retry_after,
)
from async_processor.transforms.base import Outgoing
from async_processor.work import Work

MAX_RESPONSE_BYTES = 64 * 1024 * 1024
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")  # C0 and DEL


@dataclass(frozen=True, slots=True)
class DispatchSettings:
    request_timeout: float = 300.0
    deadline_header: str = DEFAULT_DEADLINE_HEADER
    # Header names the merge policy is configured to stamp (its ``*_header`` parameters),
    # refused from messages like the default names even when not stamped on one.
    stamped_names: frozenset[str] = frozenset()
    # Send the time left to the deadline at each attempt (INFERENCE_TTL_HEADER); off as
    # upstream, which sends nothing.
    inference_ttl: bool = False


def stamped_header_names(merge_parameters: Mapping[str, object]) -> frozenset[str]:
    """The lower-cased names of a merge policy's ``*_header`` parameters."""
    return frozenset(
        value.lower()
        for key, value in merge_parameters.items()
        if key.endswith("_header") and isinstance(value, str) and value
    )


def build_request(work: Work, settings: DispatchSettings) -> Outgoing:
    """URL + headers in the reference's order + the payload bytes as sent by the producer.

    Raises ``InvalidMessage`` for an endpoint that is not a path or an illegal header.
    """
    request = work.envelope.request
    queue = work.queue
    url = join_url(queue.igw_base_url, request.endpoint or queue.request_path_url)
    _check_caller_headers(work, settings)
    # Caller headers may override Content-Type (as in the reference), in any letter case;
    # one canonical header goes out (#494).
    content_type, caller = split_content_type(request.headers, "application/json")
    headers = {"Content-Type": content_type}
    if queue.inference_objective:
        headers[OBJECTIVE_HEADER] = queue.inference_objective
    apply_stamped(headers, caller)
    apply_stamped(headers, work.stamped_headers)
    if settings.deadline_header:
        apply_stamped(headers, [(settings.deadline_header, str(request.deadline))])
    return Outgoing(
        url=url,
        body=request.payload,
        headers=headers,
        content_type=content_type,
        deadline=request.deadline,
    )


def _check_caller_headers(work: Work, settings: DispatchSettings) -> None:
    """The message's headers are legal and leave framing, routing and ours alone.

    Framing headers would desynchronise the connection (``Content-Length: 2`` made every
    attempt fail until the deadline), ``Host`` would reach another virtual host, and the
    deadline, objective, priority and fairness headers are the daemon's to set.
    """
    request = work.envelope.request
    if not request.headers:  # the common case: nothing to check
        return
    reserved = RESERVED_HEADERS | settings.stamped_names
    reserved |= {name.lower() for name, _ in work.stamped_headers}
    if settings.deadline_header:
        reserved |= {settings.deadline_header.lower()}
    if settings.inference_ttl:
        reserved |= {INFERENCE_TTL_HEADER}
    for name, value in request.headers.items():
        if not is_valid_header_name(name) or not is_valid_header_value(value):
            raise InvalidMessage(
                f"header {name!r} is not a legal HTTP header",
                reason="bad_header",
                request_id=request.id,
            )
        folded = name.lower()
        if folded in reserved or folded.startswith("proxy-"):
            raise InvalidMessage(
                f"header {name!r} is set by the daemon, not by the message",
                reason="reserved_header",
                request_id=request.id,
            )


@lru_cache(maxsize=1024)
def join_url(base: str, path: str) -> str:
    """``base`` + ``path`` like Go's url.JoinPath; ``path`` must not change the host, nor
    climb out of the base URL's path (``..``, also percent-encoded)."""
    parts = urlsplit(base)
    if "://" in path or path.startswith("//") or "?" in path or "#" in path:
        raise InvalidMessage(f"endpoint {path!r} must be a path, not a URL", reason="bad_endpoint")
    decoded = _fully_unquoted(path)
    # Clients drop tabs and line ends from a URL (``.\t.`` went out as ``..``): none is sent.
    if _CONTROL.search(decoded):
        raise InvalidMessage(f"endpoint {path!r} holds a control character", reason="bad_endpoint")
    root = "/" + parts.path.strip("/") if parts.path.strip("/") else ""
    joined = _normalized(root, path)
    # Checked as the strictest reader resolves it: the gateway (or a proxy before it) may
    # decode %2e%2e and %2f before resolving dots, and a WHATWG parser (pyreqwest's) reads
    # a backslash as a slash.
    if not _within(root, _normalized(root, decoded.replace("\\", "/"))):
        raise InvalidMessage(
            f"endpoint {path!r} leaves the base path {root or '/'!r}", reason="bad_endpoint"
        )
    return urlunsplit((parts.scheme, parts.netloc, joined, parts.query, ""))


def _normalized(root: str, path: str) -> str:
    segments = "/".join(s for s in (root.strip("/"), path.strip("/")) if s)
    joined = posixpath.normpath("/" + segments) if segments else "/"
    if path.endswith("/") and not joined.endswith("/"):
        joined += "/"
    return joined.replace("//", "/")  # normpath keeps a leading "//"


def _within(root: str, joined: str) -> bool:
    return not root or joined == root or joined.startswith(root + "/")


def _fully_unquoted(path: str) -> str:
    """``path`` percent-decoded until it stops changing (``%252e`` is ``.`` decoded twice)."""
    for _ in range(4):
        decoded = unquote(path)
        if decoded == path:
            break
        path = decoded
    return path


async def send(
    client: HttpClient, out: Outgoing, *, timeout: float, limit: int | None = None
) -> Attempt:
    """One POST; any failure to get a complete answer becomes a no-response ``Attempt``.

    An answer over ``limit`` bytes (default ``MAX_RESPONSE_BYTES``) is a fatal attempt."""
    headers = out.headers
    if out.body_claimed:  # a transform rewrote the body, and its content type goes with it
        headers = dict(headers)
        apply_stamped(headers, [("Content-Type", out.content_type)])  # every variant replaced
    try:
        answer = await client.post(
            out.url, _taken(out), headers, timeout=timeout, limit=limit or MAX_RESPONSE_BYTES
        )
    except AttemptTimeout as exc:
        return Attempt(error=f"attempt timed out after {timeout:.3g}s", reason=exc.reason)
    except NoAnswer as exc:
        return Attempt(error=str(exc), fatal=exc.fatal, reason=exc.reason)
    return Attempt(
        status=answer.status,
        body=answer.body,
        retry_after=parse_retry_after(answer.retry_after),
        dropped_reason=answer.dropped_reason,
    )


def _taken(out: Outgoing) -> Payload:
    """The body, no longer held by ``out``: the client lets it go once it is written, and
    ``out`` lives as long as the answer takes (with a message's bytes let go, nothing else
    holds them: ``transports.base.LetsGo``)."""
    body, out.body = out.body, b""
    return body


def stamp_inference_ttl(out: Outgoing, now: float) -> None:
    """The time left to the deadline as Go writes a duration (``1m27.5s``), whole
    milliseconds rounded down (never more time than is left), at least ``1ms`` (an attempt
    is not sent once none is left; ``0s`` could read as "no bound")."""
    left_ms = max(1, math.floor((out.deadline - now) * 1000))
    apply_stamped(out.headers, [(INFERENCE_TTL_HEADER, go_duration_string(left_ms * 1_000_000))])


def attempt_timeout(deadline: float, request_timeout: float) -> float:
    """Seconds this attempt may take: min(deadline, now + request timeout)."""
    return min(deadline - time.time(), request_timeout)
