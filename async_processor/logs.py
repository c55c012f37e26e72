"""Logging setup: structlog events and stdlib records through one redacting renderer.

Input: ``log = structlog.get_logger(__name__)`` events from every stage, and records
from libraries using stdlib ``logging``. Output: one line per event on stderr, JSON in
production (or when stderr is not a TTY) and a readable console line on a terminal.

Redaction happens at render time, so no stage has to remember it: values under secret
keys (password, token, authorization, ...) become ``***``, passwords inside URLs become
``scheme://user:***@host``, and ``payload`` / ``body`` fields are dropped unless
``ASYNC_PROCESSOR_LOG_PAYLOADS=1``. ``redact`` is reused by ``check-config``.
"""

from __future__ import annotations

import logging
import os
import re
import sys
from collections.abc import Mapping
from typing import Any, TextIO

import structlog
from structlog.typing import EventDict, Processor, WrappedLogger

LEVELS = ("debug", "info", "warning", "error", "critical")
FORMATS = ("auto", "json", "console")
MASK = "***"
PAYLOAD_ENV = "ASYNC_PROCESSOR_LOG_PAYLOADS"

# Key fragments whose values are secrets (compared case-insensitively, as substrings).
_SECRET_KEYS = (
    "password",
    "passwd",
    "secret",
    "token",
    "authorization",
    "api_key",
    "apikey",
    "api-key",
    "cookie",
    "credential",
)
_PAYLOAD_KEYS = frozenset(("payload", "body"))
# userinfo password in any URL, also inside free text: scheme://user:PASSWORD@host
_URL_PASSWORD = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://[^\s/:@]*:)(\S*)@")
_MAX_DEPTH = 8


def mask_url(text: str) -> str:
    """``redis://user:pw@host`` -> ``redis://user:***@host`` (anywhere in ``text``)."""
    if "@" not in text:
        return text
    return _URL_PASSWORD.sub(lambda m: f"{m.group(1)}{MASK}@" if m.group(2) else m.group(0), text)


def is_secret_key(key: object) -> bool:
    lowered = str(key).lower()
    return any(fragment in lowered for fragment in _SECRET_KEYS)


def redact(value: Any, *, drop_payloads: bool = False, _depth: int = 0) -> Any:
    """A copy of ``value`` with secrets masked (and payload fields dropped if asked)."""
    if isinstance(value, str):
        return mask_url(value)
    if _depth >= _MAX_DEPTH:
        return value
    if isinstance(value, Mapping):
        out: dict[Any, Any] = {}
        for key, item in value.items():
            if drop_payloads and str(key).lower() in _PAYLOAD_KEYS:
                continue
            if is_secret_key(key) and item not in ("", None):
                out[key] = MASK
            else:
                out[key] = redact(item, drop_payloads=drop_payloads, _depth=_depth + 1)
        return out
    if isinstance(value, list | tuple):
        return [redact(item, drop_payloads=drop_payloads, _depth=_depth + 1) for item in value]
    return value


def _redactor(log_payloads: bool) -> Processor:
    def redact_secrets(_: WrappedLogger, __: str, event_dict: EventDict) -> EventDict:
        # structlog's own keys (record, logger objects) are left alone.
        private = {k: v for k, v in event_dict.items() if k.startswith("_")}
        public = {k: v for k, v in event_dict.items() if not k.startswith("_")}
        cleaned: EventDict = redact(public, drop_payloads=not log_payloads)
        cleaned.update(private)
        return cleaned

    return redact_secrets


def _renderer(fmt: str, stream: TextIO) -> Processor:
    if fmt == "auto":
        fmt = "console" if stream.isatty() else "json"
    if fmt == "json":
        return structlog.processors.JSONRenderer()
    return structlog.dev.ConsoleRenderer(colors=stream.isatty())


def configure_logging(
    level: str = "info", fmt: str = "auto", *, stream: TextIO | None = None
) -> None:
    """Route structlog and stdlib logging to ``stream`` (stderr) at ``level``.

    Safe to call again (tests, ``run`` after flag parsing): the root handler is replaced.
    """
    if level.lower() not in LEVELS:
        raise ValueError(f"log level {level!r} (known: {', '.join(LEVELS)})")
    if fmt not in FORMATS:
        raise ValueError(f"log format {fmt!r} (known: {', '.join(FORMATS)})")
    out = stream if stream is not None else sys.stderr
    formatter = structlog.stdlib.ProcessorFormatter(
        processors=[
            structlog.stdlib.add_log_level,
            structlog.stdlib.add_logger_name,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            _redactor(os.environ.get(PAYLOAD_ENV, "") == "1"),
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            _renderer(fmt, out),
        ],
    )
    handler = logging.StreamHandler(out)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # Only the call-time work stays in the logger chain, so re-configuring takes effect
    # even for loggers cached at import.
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.stdlib.filter_by_level,
            structlog.stdlib.PositionalArgumentsFormatter(),
            structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
        ],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=True,
    )
