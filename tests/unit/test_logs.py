"""Logging: JSON lines, levels, stdlib routing, and secrets/payloads never rendered."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest
import structlog

from async_processor.logs import configure_logging, mask_url, redact


@pytest.fixture
def stream(monkeypatch: pytest.MonkeyPatch) -> Iterator[io.StringIO]:
    """A captured log stream; the global logging setup is restored afterwards."""
    monkeypatch.delenv("ASYNC_PROCESSOR_LOG_PAYLOADS", raising=False)
    root = logging.getLogger()
    saved = (root.handlers[:], root.level)
    out = io.StringIO()
    yield out
    root.handlers[:] = saved[0]
    root.setLevel(saved[1])
    structlog.reset_defaults()


def lines(out: io.StringIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in out.getvalue().splitlines()]


def test_json_lines_with_timestamp_level_and_logger(stream: io.StringIO) -> None:
    configure_logging("info", "json", stream=stream)
    structlog.get_logger("async_processor.test").info("request_done", request_id="r1", n=2)
    structlog.get_logger("async_processor.test").debug("too_detailed")
    logging.getLogger("aiohttp.access").warning("from %s", "stdlib")
    logging.getLogger("quiet").debug("hidden")
    first, second = lines(stream)
    assert first["event"] == "request_done" and first["request_id"] == "r1" and first["n"] == 2
    assert first["level"] == "info" and first["logger"] == "async_processor.test"
    assert str(first["timestamp"]).endswith("Z") and "T" in str(first["timestamp"])
    assert second == {
        **second,
        "event": "from stdlib",
        "level": "warning",
        "logger": "aiohttp.access",
    }


def test_secrets_and_payloads_never_rendered(stream: io.StringIO) -> None:
    configure_logging("debug", "json", stream=stream)
    log = structlog.get_logger("async_processor.test")
    log.info(
        "connecting",
        url="redis://app:hunter2@redis:6379/0",
        headers={"Authorization": "Bearer sk-live-123", "X-Trace": "t1"},
        payload={"prompt": "TOP-SECRET-PROMPT"},
        body=b"TOP-SECRET-BODY",
        password="pw-plain",
        nested=[{"token": "tok-999"}],
    )
    logging.getLogger("redis").error("cannot reach redis://:hunter2@10.0.0.1:6379")
    try:
        raise RuntimeError("boom at rediss://u:hunter2@cache:6380")
    except RuntimeError:
        log.exception("failed")
    text = stream.getvalue()
    for secret in ("hunter2", "sk-live-123", "TOP-SECRET", "pw-plain", "tok-999"):
        assert secret not in text
    first = lines(stream)[0]
    assert first["url"] == "redis://app:***@redis:6379/0"
    assert first["headers"] == {"Authorization": "***", "X-Trace": "t1"}
    assert "payload" not in first and "body" not in first
    assert "redis://:***@10.0.0.1:6379" in text and "rediss://u:***@cache:6380" in text


def test_query_passwords_and_secret_static_headers_never_rendered(stream: io.StringIO) -> None:
    configure_logging("debug", "json", stream=stream)
    log = structlog.get_logger("async_processor.test")
    log.info(
        "starting",
        url="redis://redis:6379/0?password=hunter2&db=1",
        transforms={"headers": {"x-access-key": {"value": "ak-1"}, "X-Model": {"value": "m"}}},
        gate_params={"headers": {"Cookie": "c-1", "x-session-token": "st-1"}},
    )
    logging.getLogger("aiohttp").error("GET https://store/o?X-Goog-Signature=sig-1&a=b failed")
    text = stream.getvalue()
    for secret in ("hunter2", "ak-1", "c-1", "st-1", "sig-1"):
        assert secret not in text
    first = lines(stream)[0]
    assert first["url"] == "redis://redis:6379/0?password=***&db=1"
    assert first["transforms"] == {"headers": {"x-access-key": "***", "X-Model": {"value": "m"}}}
    assert "X-Goog-Signature=***&a=b" in text


def test_payloads_logged_only_when_asked(
    stream: io.StringIO, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ASYNC_PROCESSOR_LOG_PAYLOADS", "1")
    configure_logging("info", "json", stream=stream)
    structlog.get_logger("t").info("dispatching", payload={"prompt": "hello"}, token="abc")
    (line,) = lines(stream)
    assert line["payload"] == {"prompt": "hello"} and line["token"] == "***"


def test_console_format_and_reconfigure(stream: io.StringIO) -> None:
    configure_logging("info", "console", stream=stream)
    log = structlog.get_logger("async_processor.console")
    log.info("ready", port=8081)
    assert "ready" in stream.getvalue() and "port=8081" in stream.getvalue()
    assert not stream.getvalue().lstrip().startswith("{")
    again = io.StringIO()
    configure_logging("warning", "json", stream=again)
    log.info("hidden_now")
    log.warning("visible", password="x")
    assert [line["event"] for line in lines(again)] == ["visible"]
    assert lines(again)[0]["password"] == "***"


def test_auto_format_is_json_off_a_tty(stream: io.StringIO) -> None:
    configure_logging("info", "auto", stream=stream)
    structlog.get_logger("t").info("hello")
    assert lines(stream)[0]["event"] == "hello"


def test_bad_level_or_format() -> None:
    with pytest.raises(ValueError, match="log level"):
        configure_logging("loud", "json", stream=io.StringIO())
    with pytest.raises(ValueError, match="log format"):
        configure_logging("info", "xml", stream=io.StringIO())


def test_mask_url_and_redact_helpers() -> None:
    assert mask_url("redis://user:pw@h:1/0") == "redis://user:***@h:1/0"
    assert mask_url("redis://h:1/0") == "redis://h:1/0"
    assert mask_url("redis://user@h:1") == "redis://user@h:1"
    assert mask_url("see http://a:b@x and http://c:d@y") == "see http://a:***@x and http://c:***@y"
    data = {"api_key": "k", "budget_key": "dispatch-gate-budget", "token": "", "items": ("a",)}
    assert redact(data) == {
        "api_key": "***", "budget_key": "dispatch-gate-budget", "token": "", "items": ["a"],
    }  # fmt: skip
    assert redact({"payload": 1}, drop_payloads=True) == {}
    assert redact({"payload": 1}) == {"payload": 1}


def test_a_logger_used_before_capture_logs_is_still_captured(stream: io.StringIO) -> None:
    # A module logger used once after configure_logging was cached with that chain; once
    # logging was configured again (another test, another CLI run), structlog's
    # capture_logs saw nothing from it: an order-dependent test under xdist.
    from structlog.testing import capture_logs

    configure_logging("info", "json", stream=stream)
    log = structlog.get_logger("async_processor.test.cached")
    log.info("first")
    configure_logging("info", "json", stream=stream)
    with capture_logs() as captured:
        log.warning("second", detail="d")
    assert [e["event"] for e in captured] == ["second"]


def test_long_fields_are_cut_after_their_secrets_are_masked(stream: io.StringIO) -> None:
    configure_logging("info", "json", stream=stream)
    # A password after the cut point must still be masked, not cut in half and shown.
    error = "x" * 5000 + " redis://app:" + "p" * 10 + "@redis:6379"
    structlog.get_logger("async_processor.test").warning(
        "odd", request_id="r" * 200, tenant="t" * 100, error=error
    )
    (line,) = lines(stream)
    assert line["request_id"] == "r" * 128 + "…(+72)"
    assert line["tenant"] == "t" * 100
    assert line["error"] == "x" * 4096 + f"…(+{len(error) - 4096 - 7})"
