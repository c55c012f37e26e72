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
# (HTAB allowed); the headers that frame or change the exchange are the client's to write
# (``Expect: 100-continue`` would hold the body back for an answer a gateway may never send).
_FIELDS = re.compile(
    r"(?:(?!(?:content-length|transfer-encoding|expect|upgrade|connection|te):)"
    r"[!#$%&'*+\-.^_`|~0-9a-z]+: [^\x00-\x08\x0a-\x1f\x7f]*\r\n)*",
    re.IGNORECASE,
)
# ``NoAnswer.reason``: why an attempt got no usable answer (the metric's label values).
NO_ANSWER_REASONS = (
    "timeout",  # nothing complete within the attempt's timeout (a slow drip too)
    "refused",  # no connection: refused, unreachable, a certificate refused
    "closed",  # the connection ended (close or reset) before any byte of an answer
    "cut_short",  # the connection ended (close or reset) before the answer was complete
    "malformed",  # the parser refused the answer (framing conflicts, bad syntax)
    "head_too_large",  # status line and headers over the head limit
    "framing_too_large",  # chunk-size lines or trailers over their limit
    "too_large",  # the body over the answer limit (fatal)
    "bad_status",  # a final status outside 200-599 (000, 099, 101, 600)
    "unsendable",  # the request can never be sent as it is (fatal)
    "no_answer",  # anything else a library reported
)
# Bytes of an answer outside its body, at most. Status line and headers (with any interim
# answers): llhttp sets no bound, and httptools gathers each field by re-copying it; a
# gateway's head is well under 8 KiB. After the head, chunk-size lines (extensions too)
# and trailers get what the head left of HEAD_LIMIT, FRAMING_LIMIT more, and CHUNK_FRAMING
# a chunk ("1f\r\n" and the CRLF after the data are 6). ``framing_allowance`` is the sum.
HEAD_LIMIT = 1 << 16
FIELD_LIMIT = 8190  # one header or trailer field, name and value (aiohttp's line limit)
FRAMING_LIMIT = 1 << 14
CHUNK_FRAMING = 64


def framing_allowance(chunks: int) -> int:
    """Bytes read outside the body an answer of ``chunks`` chunks may take in all."""
    return HEAD_LIMIT + FRAMING_LIMIT + CHUNK_FRAMING * chunks


def framing_too_large() -> NoAnswer:
    return NoAnswer(
        f"the gateway's chunk framing and trailers are over {FRAMING_LIMIT} bytes",
        reason="framing_too_large",
    )


# A final answer's status: 1xx are interim (skipped), so a 1xx taken as final is 101
# Switching Protocols, which a POST without Upgrade cannot use; below 100 and above 599
# is not HTTP. Either is no answer, the retry path, for every client alike.
FINAL_STATUSES = range(200, 600)


@dataclass(frozen=True, slots=True)
class Answer:
    """A whole answer: the clients build one only once the parser framed its end."""

    status: int
    body: bytes
    retry_after: str | None = None  # the raw ``Retry-After`` header
    dropped_reason: str = ""  # llm-d's dropped-reason header

    def __post_init__(self) -> None:
        if self.status not in FINAL_STATUSES:
            raise NoAnswer(
                f"the gateway answered status {self.status}, not a final HTTP status (200-599)",
                reason="bad_status",
            )


class AttemptTimeout(NoAnswer):
    """No complete answer within the attempt's timeout."""

    reason = "timeout"


class AnswerTooLarge(NoAnswer):
    """The answer is larger than the limit: sending again would get the same."""

    fatal = True
    reason = "too_large"


class Unsendable(NoAnswer):
    """The request can never be sent as it is (an invalid URL)."""

    fatal = True
    reason = "unsendable"


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
    reframe or change the exchange (``Content-Length``, ``Transfer-Encoding``, ``Expect``,
    ``Upgrade``, ``Connection``, ``TE``). Dispatch refuses these
    from messages already; this keeps every client safe whatever reaches it."""
    fields = "".join([f"{name}: {value}\r\n" for name, value in headers.items()])
    # One line per field: a CRLF inside a value would otherwise pass as a line of its own.
    if fields.count("\n") != len(headers) or not _FIELDS.fullmatch(fields):
        raise Unsendable("a header name or value is not legal (control characters, framing)")
    return fields


def too_large(length: int | None, limit: int) -> AnswerTooLarge:
    size = f"of {length} bytes " if length is not None else ""
    return AnswerTooLarge(f"gateway answer {size}is larger than {limit} bytes")


def cut_short(exc: BaseException | None) -> NoAnswer:
    """The connection ended (a close, or a reset: ``exc``) before the answer was whole."""
    how = f"was reset ({exc})" if exc else "closed"
    return NoAnswer(f"the connection {how} before the answer was complete", reason="cut_short")


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
