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

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from async_processor.errors import ConfigError, NoAnswer


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


def too_large(length: int | None, limit: int) -> AnswerTooLarge:
    size = f"of {length} bytes " if length is not None else ""
    return AnswerTooLarge(f"gateway answer {size}is larger than {limit} bytes")
