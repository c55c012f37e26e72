"""Retry policy: classification, backoff bounds, Retry-After, deadline handling."""

from __future__ import annotations

import random
from email.utils import formatdate

import pytest

from async_processor.retry import Attempt, Counter, Final, Retry, backoff, decide, parse_retry_after

NOW = 1_800_000_000.0


def _decide(attempt: Attempt, *, remaining: float = 3600, retry_count: int = 0, **kw: object):
    return decide(
        "r1",
        attempt,
        deadline=NOW + remaining,
        retry_count=retry_count,
        now=NOW,
        rng=random.Random(7),
        **kw,
    )


@pytest.mark.parametrize("status", [200, 201, 204, 302])
def test_success_is_final_http_result(status: int) -> None:
    out = _decide(Attempt(status=status, body=b'{"ok":1}'))
    assert isinstance(out, Final)
    assert out.counter is Counter.SUCCESS
    assert out.result.status_code == status
    assert out.result.payload == '{"ok":1}'
    assert out.result.error_code == ""


@pytest.mark.parametrize("status", [400, 401, 403, 404, 408, 422])
def test_other_4xx_is_final_failure_with_body(status: int) -> None:
    out = _decide(Attempt(status=status, body=b"bad"))
    assert isinstance(out, Final)
    assert out.counter is Counter.FAILED
    assert (out.result.status_code, out.result.payload) == (status, "bad")


@pytest.mark.parametrize(
    "attempt",
    [
        Attempt(status=429),
        Attempt(status=500),
        Attempt(status=503),
        Attempt(status=600),
        Attempt(error="ConnectionRefusedError"),
        Attempt(error="attempt timed out"),
    ],
)
def test_retryable_outcomes_retry_before_deadline(attempt: Attempt) -> None:
    out = _decide(attempt, remaining=100)
    assert isinstance(out, Retry)
    assert 0 < out.delay < 100


def test_fatal_no_response_is_inference_error() -> None:
    out = _decide(Attempt(error="invalid URL", fatal=True))
    assert isinstance(out, Final)
    assert out.result.error_code == "INFERENCE_ERROR"
    assert "invalid URL" in out.result.error_message
    assert out.counter is Counter.FAILED


def test_deadline_passed_returns_last_http_answer() -> None:
    out = _decide(Attempt(status=503, body=b"busy"), remaining=-1)
    assert isinstance(out, Final)
    assert (out.result.status_code, out.result.payload) == (503, "busy")
    assert out.counter is Counter.DEADLINE


def test_deadline_passed_without_answer_is_deadline_exceeded() -> None:
    out = _decide(Attempt(error="reset"), remaining=0)
    assert isinstance(out, Final)
    assert out.result.error_code == "DEADLINE_EXCEEDED"
    assert out.result.status_code == 0


def test_deadline_passed_uses_earlier_http_answer() -> None:
    out = _decide(Attempt(error="reset"), remaining=-5, last_http=Attempt(status=429, body=b"x"))
    assert isinstance(out, Final)
    assert out.result.status_code == 429


@pytest.mark.parametrize(
    ("n", "low", "high"), [(1, 2, 4), (2, 4, 8), (3, 8, 16), (4, 16, 32), (5, 30, 60), (9, 30, 60)]
)
def test_equal_jitter_ranges(n: int, low: float, high: float) -> None:
    rng = random.Random(1)
    delays = [backoff(n, 10_000, None, rng) for _ in range(500)]
    assert min(delays) >= low
    assert max(delays) < high
    assert max(delays) - min(delays) > (high - low) * 0.5  # really jittered


def test_backoff_never_past_deadline() -> None:
    rng = random.Random(3)
    for n in range(1, 10):
        assert backoff(n, 3.0, None, rng) < 3.0
        assert backoff(n, 3.0, 1000.0, rng) < 3.0


def test_retry_after_honoured_and_clamped_to_half_remaining() -> None:
    rng = random.Random(5)
    assert backoff(1, 1000, 20, rng) >= 20  # larger than the exponential step: honoured
    clamped = [backoff(1, 100, 500, rng) for _ in range(200)]
    assert all(50 <= d <= 62.5 for d in clamped)


def test_parse_retry_after_forms() -> None:
    assert parse_retry_after("7") == 7.0
    assert parse_retry_after(None) is None
    assert parse_retry_after("-3") is None
    assert parse_retry_after("1.5") is None
    assert parse_retry_after("soon") is None
    later = parse_retry_after(formatdate(NOW + 30, usegmt=True), now=NOW)
    assert later is not None and 29 <= later <= 31
    assert parse_retry_after(formatdate(NOW - 30, usegmt=True), now=NOW) == 0.0


@pytest.mark.parametrize("value", ["\u00b2", "1\u00b2", "\u0663", "\uff17"])
def test_retry_after_with_non_ascii_digits_is_ignored_not_a_crash(value: str) -> None:
    # str.isdigit() accepts superscripts, which float() rejects with ValueError: a gateway
    # (or proxy) sending "Retry-After: \u00b2" crashed the worker inside send().
    assert parse_retry_after(value) is None


def test_last_answer_rides_with_the_message_through_the_broker() -> None:
    from async_processor.messages import decode_envelope
    from async_processor.retry import last_answer, remember_answer

    env = decode_envelope(b'{"id":"r","deadline":5,"payload":{}}')
    assert last_answer(env.routing) is None
    remember_answer(env.routing, Attempt(status=429, body=b'{"busy":true}'))
    back = decode_envelope(env.encode())  # as stored in the retry set and fetched again
    out = decide(
        "r",
        Attempt(error="reset"),
        deadline=NOW - 1,
        retry_count=1,
        now=NOW,
        last_http=last_answer(back.routing),
    )
    assert isinstance(out, Final)
    assert (out.result.status_code, out.result.payload) == (429, '{"busy":true}')
