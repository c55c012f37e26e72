"""Retry policy (pure): one attempt's outcome -> a final result or a retry with backoff.

Input: an ``Attempt`` (HTTP status/body/headers, or no response) and the message's
deadline and retry count. Output: ``Final`` (result + which counter it bumps) or
``Retry`` (delay in seconds). No I/O here, so every rule is unit-testable.

Rules (the Go reference's, with our changes; docs/architecture.md G7, G8):
- 2xx/3xx -> HTTP result; 429 -> shed + retry; 5xx (and >= 600) -> retry; other 4xx -> final.
- No response (refused, reset, attempt timeout) -> retry until the deadline (the reference
  made these fatal ``INFERENCE_ERROR``s). Only a request that can never be sent
  (``fatal=True``, e.g. a bad URL) is ``INFERENCE_ERROR`` at once.
- Deadline reached when a retry is due -> the last HTTP result if any, else DEADLINE_EXCEEDED.
- Backoff: base 2 s, cap 60 s, equal jitter, never past the deadline; ``Retry-After``
  honoured on 429/5xx, clamped to half the remaining time (with up to +25 % jitter).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
from enum import Enum

from async_processor.messages import DEADLINE_EXCEEDED_TEXT, ErrorCode, Result, Routing

BACKOFF_BASE = 2.0
BACKOFF_CAP = 60.0
LAST_BODY_LIMIT = 64 * 1024
# A message a gate refused comes back after this long (never a hot re-pop loop,
# docs/architecture.md G5).
REFUSE_DELAY = 1.0
_RNG = random.Random()  # one per process: a fresh Random() per retry reseeds from urandom


class Counter(Enum):
    """Which outcome counter a final result bumps."""

    SUCCESS = "success"
    FAILED = "failed"
    DEADLINE = "deadline"


@dataclass(frozen=True, slots=True)
class Attempt:
    """What one HTTP attempt produced. ``status`` 0 = no response at all."""

    status: int = 0
    body: bytes = b""
    retry_after: float | None = None
    dropped_reason: str = ""
    error: str = ""  # why no (usable) response: refused, reset, timeout, ...
    fatal: bool = False  # the request can never be sent as is (bad URL, ...)
    reason: str = ""  # the error's metric label (``NoAnswer.reason``)

    @property
    def shed(self) -> bool:
        return self.status == 429

    @property
    def retryable(self) -> bool:
        if self.status == 0:
            return not self.fatal
        return self.status == 429 or self.status >= 500

    def describe(self) -> str:
        text = f"HTTP {self.status}" if self.status else self.error or "no response"
        if self.dropped_reason:
            text += f" (dropped: {self.dropped_reason})"
        return text


@dataclass(frozen=True, slots=True)
class Final:
    result: Result
    counter: Counter | None  # None: ends without bumping an outcome counter (cancel, gate)


@dataclass(frozen=True, slots=True)
class Retry:
    delay: float


@dataclass(frozen=True, slots=True)
class HandBack:
    """Back to the broker without counting a retry, due after ``delay`` seconds."""

    delay: float


# What one message's trip through a worker ends in: settled by ``pipeline.settle``.
Outcome = Final | Retry | HandBack


def decide(
    request_id: str,
    attempt: Attempt,
    *,
    deadline: float,
    retry_count: int,
    last_http: Attempt | None = None,
    now: float | None = None,
    rng: random.Random | None = None,
) -> Final | Retry:
    """Final result or retry for one attempt (``last_http``: an earlier HTTP answer)."""
    if not attempt.retryable:
        return _final(request_id, attempt)
    now = time.time() if now is None else now
    remaining = deadline - now
    if remaining <= 0:
        return expired(request_id, attempt if attempt.status else last_http)
    rng = rng or _RNG
    return Retry(backoff(retry_count + 1, remaining, attempt.retry_after, rng))


def expired(request_id: str, last_http: Attempt | None) -> Final:
    """The result of a request whose deadline passed: its last HTTP answer, if it had one."""
    if last_http is not None and last_http.status:
        return Final(Result.http(request_id, last_http.status, last_http.body), Counter.DEADLINE)
    return Final(
        Result.failure(request_id, ErrorCode.DEADLINE_EXCEEDED, DEADLINE_EXCEEDED_TEXT),
        Counter.DEADLINE,
    )


def last_answer(routing: Routing) -> Attempt | None:
    """The last HTTP answer a retried message carries in its routing block."""
    if not routing.last_status:
        return None
    return Attempt(status=routing.last_status, body=routing.last_body.encode())


def remember_answer(routing: Routing, attempt: Attempt) -> None:
    """Keep a retryable HTTP answer with the message (body capped) for ``expired``."""
    if attempt.status:
        routing.last_status = attempt.status
        routing.last_body = attempt.body[:LAST_BODY_LIMIT].decode("utf-8", errors="replace")


def backoff(
    attempt_no: int, remaining: float, retry_after: float | None, rng: random.Random
) -> float:
    """Equal-jitter exponential backoff for retry number ``attempt_no`` (1-based)."""
    cap = min(BACKOFF_CAP, remaining)
    top = min(cap, BACKOFF_BASE * 2.0 ** min(attempt_no, 30))
    delay = top / 2 + rng.random() * top / 2
    if retry_after is not None and retry_after > delay:
        clamped = min(retry_after, remaining / 2)
        delay = max(delay, clamped * (1 + rng.random() / 4))
    # Land strictly before the deadline so the retry still gets its chance.
    return max(0.0, min(delay, remaining * 0.95))


def parse_retry_after(value: str | None, *, now: float | None = None) -> float | None:
    """Seconds from a Retry-After header: integer seconds or an HTTP date; else None."""
    if not value:
        return None
    text = value.strip()
    if text.isascii() and text.isdigit():  # isdigit alone takes "²", which float() rejects
        return float(text)
    try:
        when = parsedate_to_datetime(text)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:
        return None
    now = time.time() if now is None else now
    return max(0.0, when.timestamp() - now)


def _final(request_id: str, attempt: Attempt) -> Final:
    if attempt.status == 0:
        message = f"Failed to send request to inference: {attempt.describe()}"
        return Final(Result.failure(request_id, ErrorCode.INFERENCE_ERROR, message), Counter.FAILED)
    counter = Counter.SUCCESS if attempt.status < 400 else Counter.FAILED
    return Final(Result.http(request_id, attempt.status, attempt.body), counter)
