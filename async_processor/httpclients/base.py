"""The seam between dispatch and an HTTP library: one POST, with its limits, as an ``Answer``.

Input: URL, body, headers, the attempt's timeout and the largest answer accepted. Output:
an ``Answer`` (status, body, the headers the retry rules read), or a ``NoAnswer`` error
saying why there is none and whether sending again could help. Every client keeps the
same contract (``tests/unit/test_http_clients.py`` runs it against each): no redirect is
followed (a 3xx is the answer), an answer over the limit is refused while it is read, the
timeout covers connect to last body byte, a cancelled call closes its connection (the
gateway stops the work; pyreqwest 0.15 does not), TLS and mTLS come from ``TLSConfig``.
"""

from __future__ import annotations

import re
import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from async_processor.config import TLSConfig
from async_processor.errors import ConfigError, NoAnswer

# A header block as HTTP/1.1 lines: each a token name and a value without control characters
# (HTAB allowed); the framing headers are the client's to write.
_FIELDS = re.compile(
    r"(?:(?!(?:content-length|transfer-encoding):)[!#$%&'*+\-.^_`|~0-9a-z]+: "
    r"[^\x00-\x08\x0a-\x1f\x7f]*\r\n)*",
    re.IGNORECASE,
)


@dataclass(frozen=True, slots=True)
class Answer:
    status: int
    body: bytes
    retry_after: str | None = None  # the raw ``Retry-After`` header
    dropped_reason: str = ""  # llm-d's dropped-reason header


class AttemptTimeout(NoAnswer):
    """No complete answer within the attempt's timeout."""


class AnswerTooLarge(NoAnswer):
    """The answer is larger than the limit: sending again would get the same."""

    fatal = True


class Unsendable(NoAnswer):
    """The request can never be sent as it is (an invalid URL)."""

    fatal = True


class HttpClient(Protocol):
    """One per process, shared by every worker."""

    async def post(
        self,
        url: str,
        body: bytes | memoryview,
        headers: Mapping[str, str],
        *,
        timeout: float,
        limit: int,
    ) -> Answer:
        """POST ``body``; raises ``NoAnswer`` (or a subclass) when there is no usable answer."""
        ...

    async def aclose(self) -> None: ...


def read_pem(path: str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"--tls-{what}: cannot read {path}: {exc}") from exc


def header_lines(headers: Mapping[str, str]) -> str:
    """``headers`` as HTTP/1.1 lines, refusing (``Unsendable``) any field that could start a
    line of its own (CR, LF or another control character, a name that is not a token) or
    reframe the request (``Content-Length``, ``Transfer-Encoding``). Dispatch refuses these
    from messages already; this keeps every client safe whatever reaches it."""
    fields = "".join([f"{name}: {value}\r\n" for name, value in headers.items()])
    # One line per field: a CRLF inside a value would otherwise pass as a line of its own.
    if fields.count("\n") != len(headers) or not _FIELDS.fullmatch(fields):
        raise Unsendable("a header name or value is not legal (control characters, framing)")
    return fields


def too_large(length: int | None, limit: int) -> AnswerTooLarge:
    size = f"of {length} bytes " if length is not None else ""
    return AnswerTooLarge(f"gateway answer {size}is larger than {limit} bytes")


def ssl_context(tls: TLSConfig) -> ssl.SSLContext | None:
    """The context ``tls`` asks for; None when it asks for nothing (the system's defaults)."""
    if not (tls.ca_cert or tls.cert or tls.insecure_skip_verify):
        return None
    ctx = ssl.create_default_context()
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        if tls.ca_cert:
            ctx.load_verify_locations(cafile=tls.ca_cert)
        if tls.cert:
            ctx.load_cert_chain(tls.cert, tls.key or None)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"--tls-*: cannot load certificates: {exc}") from exc
    if tls.insecure_skip_verify:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    return ctx
