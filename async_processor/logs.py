"""Logging setup: structlog events and stdlib records through one redacting renderer.

Input: ``log = structlog.get_logger(__name__)`` events from every stage, and records
from libraries using stdlib ``logging``. Output: one line per event on stderr, JSON in
production (or when stderr is not a TTY) and a readable console line on a terminal.

Redaction happens at render time, so no stage has to remember it: values under secret
keys (password, token, authorization, ...) become ``***``, and so do static header values
whose names look secret (under a ``headers`` key: also ``*key*``, e.g. ``x-access-key``);
passwords inside URLs become ``scheme://user:***@host`` and secret-looking query
parameters ``?password=***`` (also ``token``, ``*key*``, ``*sig*``, ...), wherever a URL
appears in text; ``payload`` / ``body`` fields are dropped unless
``ASYNC_PROCESSOR_LOG_PAYLOADS=1``. ``redact`` and ``mask_url`` are reused by
``check-config``, config errors and ``/readyz``.

Message-derived fields (``request_id``, ``queue``, ``tenant``, ...) are untrusted and of
any size: a line carries their first 128 characters and ``…(+N)`` for the N left out
(any other text field: 4096), so a multi-MB id is not copied into every event. Only the
log line is cut: results and Redis keys keep the full value.
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
# Header names and URL query parameters are secret by these fragments too: ``x-access-key``,
# ``?sig=``, ``?pwd=``. (Not config keys in general: ``metadata_key`` names no secret.)
_SECRET_NAME_EXTRA = ("key", "sig", "pwd", "auth")
_PAYLOAD_KEYS = frozenset(("payload", "body"))
# userinfo password in any URL, also inside free text: scheme://user:PASSWORD@host
_URL_PASSWORD = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://[^\s/:@]*:)(\S*)@")
# a query parameter (after ? & or ;) and its value, also inside free text
_QUERY_PARAM = re.compile(r"([?&;]([^=&;#\s?]+)=)([^&;#\s\"']*)")
_MAX_DEPTH = 8
# Fields that carry a message's own strings (ids, result queues named in its routing).
_MESSAGE_FIELDS = frozenset(
    ("request_id", "message_id", "id", "tenant", "queue", "result_queue", "result_list",
     "endpoint", "channel", "key", "item")
)  # fmt: skip
MESSAGE_FIELD_CHARS = 128
FIELD_CHARS = 4096
# A traceback is cut nowhere: its last line is the one that matters.
_UNCUT = frozenset(("exception", "stack"))


def mask_url(text: str) -> str:
    """``redis://user:pw@host/?password=pw`` -> ``redis://user:***@host/?password=***``
    (anywhere in ``text``: also error messages and readiness reasons)."""
    if "@" in text:
        text = _URL_PASSWORD.sub(_masked_password, text)
    if "=" in text:
        text = _QUERY_PARAM.sub(_masked_param, text)
    return text


def _masked_password(match: re.Match[str]) -> str:
    return f"{match.group(1)}{MASK}@" if match.group(2) else match.group(0)


def _masked_param(match: re.Match[str]) -> str:
    secret = match.group(3) and is_secret_name(match.group(2))
    return match.group(1) + MASK if secret else match.group(0)


def is_secret_key(key: object) -> bool:
    lowered = str(key).lower()
    return any(fragment in lowered for fragment in _SECRET_KEYS)


def is_secret_name(name: object) -> bool:
    """A header or query-parameter name that looks secret (wider than a config key)."""
    lowered = str(name).lower()
    return is_secret_key(lowered) or any(f in lowered for f in _SECRET_NAME_EXTRA)


def redact(
    value: Any, *, drop_payloads: bool = False, _depth: int = 0, _headers: bool = False
) -> Any:
    """A copy of ``value`` with secrets masked (and payload fields dropped if asked).

    Under a key ending in ``headers`` the keys are header names, judged by
    ``is_secret_name`` (a static ``x-access-key`` value is a credential)."""
    if isinstance(value, str):
        return mask_url(value)
    if _depth >= _MAX_DEPTH:
        return value
    if isinstance(value, Mapping):
        out: dict[Any, Any] = {}
        for key, item in value.items():
            if drop_payloads and str(key).lower() in _PAYLOAD_KEYS:
                continue
            secret = is_secret_name(key) if _headers else is_secret_key(key)
            if secret and item not in ("", None):
                out[key] = MASK
            else:
                out[key] = redact(item, drop_payloads=drop_payloads, _depth=_depth + 1,
                                  _headers=str(key).lower().endswith("headers"))  # fmt: skip
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


def shorten(text: str, limit: int) -> str:
    """``text`` up to ``limit`` characters, then ``…(+N)`` for the N left out."""
    extra = len(text) - limit
    return text if extra <= 0 else f"{text[:limit]}…(+{extra})"


def _cut_long_fields(_: WrappedLogger, __: str, event_dict: EventDict) -> EventDict:
    # After redaction: cutting first could split a URL before its password's "@" and so
    # hide it from the masking.
    for key, value in event_dict.items():
        if isinstance(value, str) and key not in _UNCUT:
            limit = MESSAGE_FIELD_CHARS if key in _MESSAGE_FIELDS else FIELD_CHARS
            event_dict[key] = shorten(value, limit)
    return event_dict


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
            _cut_long_fields,
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            _renderer(fmt, out),
        ],
    )
    handler = logging.StreamHandler(out)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # Only the call-time work stays in the logger chain. Loggers are not cached on first
    # use: a cached module logger ignores any later configuration (tests' capture_logs saw
    # nothing, depending on which test ran first); resolving costs ~2 us per call.
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.stdlib.filter_by_level,
            structlog.stdlib.PositionalArgumentsFormatter(),
            structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
        ],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=False,
    )
