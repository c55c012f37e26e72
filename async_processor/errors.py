"""One exception tree for the daemon.

AsyncProcessorError
├── ConfigError                 startup: bad flag, file or field (exit code 2)
│   └── UsageError              a command used wrongly (exit 2, not called a config error)
├── MessageError                a message that cannot be processed as sent
│   ├── InvalidMessage          undecodable / invalid -> INVALID_REQUEST or dead-letter
│   └── PayloadUnavailable      a referenced payload could not be fetched
├── GateError                   a gate could not decide (its backend failed)
├── TransportError              the broker failed (retried with backoff by callers)
│   └── PartialWrite            a batched write failed for some of its items only
└── NoAnswer                    an HTTP client got no usable answer (``httpclients.base``)

An HTTP attempt that fails does not leave dispatch as an exception: ``dispatch.send``
returns it as a ``retry.Attempt``, and ``retry.decide`` classifies it (retry, shed, final).
"""

from __future__ import annotations

import os
import re

_REDIS_CONNECT = re.compile(r"Error (\d+) connecting to (\S+?)\.( |$)")


class AsyncProcessorError(Exception):
    """Root of every error the daemon raises on purpose."""


class ConfigError(AsyncProcessorError):
    """A configuration problem; the message names the field and the problem."""


class UsageError(ConfigError):
    """An operator command used wrongly: a missing argument, an unknown entry id or queue.
    Exit code 2 like a config error, but the message does not call it one."""


class MessageError(AsyncProcessorError):
    """A message that cannot be processed as sent."""


class InvalidMessage(MessageError):
    """Undecodable or invalid message.

    ``request_id`` is set when an id could be read, so the caller can answer with an
    ``INVALID_REQUEST`` result; otherwise the message goes to the dead-letter list.
    ``reason`` is a short snake_case tag used as a metric label.
    """

    def __init__(self, message: str, *, reason: str, request_id: str | None = None) -> None:
        super().__init__(message)
        self.reason = reason
        self.request_id = request_id


class PayloadUnavailable(MessageError):
    """A payload referenced by URL could not be fetched before the deadline."""


class GateError(AsyncProcessorError):
    """A gate's backend failed while deciding."""


class TransportError(AsyncProcessorError):
    """The broker failed; callers retry with backoff."""


class PartialWrite(TransportError):
    """A batched write landed except for the items at ``failed`` (indexes into the batch):
    the caller retries those only, since the others are done (written again, they would
    be taken for duplicates)."""

    def __init__(self, message: str, failed: list[int]) -> None:
        super().__init__(message)
        self.failed = failed


class NoAnswer(AsyncProcessorError):
    """No usable answer from the gateway: refused, reset, timed out, too large.

    ``fatal``: sending again cannot help (``retry.Attempt.fatal``). ``reason``: a short
    snake_case tag from a fixed set (``httpclients.base.NO_ANSWER_REASONS``), a metric label."""

    fatal = False
    reason = "no_answer"

    def __init__(self, message: str = "", *, reason: str | None = None) -> None:
        super().__init__(message)
        if reason is not None:
            self.reason = reason


def plain(exc: BaseException) -> str:
    """A failure in plain words, for operators: ``cannot connect to h:1: connection
    refused``, ``timed out``; never a library's class names or reprs."""
    if isinstance(exc, TimeoutError):
        return "timed out"
    host, port = getattr(exc, "host", None), getattr(exc, "port", None)
    where = f" to {host}:{port}" if host else ""
    cause = getattr(exc, "os_error", None) or exc
    while not isinstance(cause, OSError) and cause.__cause__ is not None:
        cause = cause.__cause__
    if isinstance(cause, TimeoutError):
        return f"timed out connecting{where}"
    if isinstance(cause, OSError):
        errno = cause.errno if isinstance(cause.errno, int) else 0
        reason = _strerror(errno) if errno > 0 else cause.strerror or str(cause)
        return f"cannot connect{where}: {reason[:1].lower()}{reason[1:]}"
    text = str(exc)
    # redis-py words a refused connection "Error 111 connecting to h:1. Connect call ...".
    redis_style = _REDIS_CONNECT.match(text)
    if redis_style:
        return f"cannot connect to {redis_style[2]}: {_strerror(int(redis_style[1])).lower()}"
    return text or exc.__class__.__name__


def _strerror(errno: int) -> str:
    return os.strerror(errno)
