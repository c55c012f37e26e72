"""Batch lines in and out: input lines checked and made into requests, results made into
output or error file lines.

Stage: between the API's files and the queue. Input: the input file's bytes (streamed),
the batch's endpoint; later the daemon's ``Result`` of each line. Output: ``Checked``
(every good line's custom_id and body bytes, or every bad line by 1-based number), the
``Request`` for a line, and the ``store.Line`` for a result (with the usage it adds).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import msgspec

from async_processor.api import keys
from async_processor.api.store import Line
from async_processor.errors import InvalidMessage
from async_processor.json_scan import decode_object
from async_processor.messages import Request, Result

MAX_REPORTED_ERRORS = 1000
MAX_USAGE = 2**40  # a count beyond this is a gateway's junk, not tokens


@dataclass(frozen=True, slots=True)
class BadLine:
    line: int  # 1-based
    code: str
    message: str
    param: str | None = None

    def as_obj(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, "param": self.param, "line": self.line}


@dataclass(slots=True)
class Checked:
    """What validation found: every good line's custom_id, or the bad lines."""

    custom_ids: list[str] = field(default_factory=list)
    bad: list[BadLine] = field(default_factory=list)
    bad_count: int = 0
    model: str = ""

    def refuse(self, bad: BadLine) -> None:
        self.bad_count += 1
        if len(self.bad) < MAX_REPORTED_ERRORS:
            self.bad.append(bad)


async def split_lines(chunks: AsyncIterator[bytes]) -> AsyncIterator[tuple[int, bytes]]:
    """(1-based line number, line) of each non-blank line of a stream of chunks."""
    pending, number = b"", 0
    async for chunk in chunks:
        pending += chunk
        *complete, pending = pending.split(b"\n")
        for line in complete:
            number += 1
            if line.strip():
                yield number, line
    if pending.strip():
        yield number + 1, pending


async def check_lines(chunks: AsyncIterator[bytes], endpoint: str) -> Checked:
    checked = Checked()
    seen: set[str] = set()
    async for number, raw in split_lines(chunks):
        try:
            custom_id, model = _check(raw, endpoint, number)
        except _Bad as exc:
            checked.refuse(exc.bad)
            continue
        if custom_id in seen:
            checked.refuse(BadLine(number, "duplicate_custom_id", _dup(custom_id), "custom_id"))
            continue
        seen.add(custom_id)
        checked.custom_ids.append(custom_id)
        checked.model = checked.model or model
    if not checked.custom_ids and not checked.bad_count:
        checked.refuse(BadLine(1, "empty_file", "The input file has no request lines."))
    return checked


class _Bad(Exception):
    def __init__(self, bad: BadLine) -> None:
        self.bad = bad


def _check(raw: bytes, endpoint: str, number: int) -> tuple[str, str]:
    """(custom_id, model) of a good line; ``_Bad`` says what is wrong."""
    try:
        top, raws = decode_object(raw, "line", ("body",))
        body = msgspec.json.decode(bytes(raws.get("body", b"null")))
    except (InvalidMessage, msgspec.DecodeError, RecursionError) as exc:
        raise _Bad(
            BadLine(number, "invalid_json_line", f"Line is not a JSON object: {exc}")
        ) from None
    custom_id = top.get("custom_id")
    problem = (
        ("missing_custom_id", "custom_id must be a non-empty string", "custom_id")
        if not isinstance(custom_id, str) or not custom_id
        else ("invalid_method", "method must be POST", "method")
        if top.get("method") != "POST"
        else ("mismatched_endpoint", f"url must be the batch's endpoint {endpoint}", "url")
        if top.get("url") != endpoint
        else _body_problem(body)
    )
    if problem:
        raise _Bad(BadLine(number, *problem))
    return str(custom_id), str(body["model"])


def _body_problem(body: object) -> tuple[str, str, str] | None:
    if not isinstance(body, dict):
        return ("invalid_body", "body must be a JSON object", "body")
    if not isinstance(body.get("model"), str) or not body["model"]:
        return ("missing_model", "body.model must be a non-empty string", "body.model")
    if body.get("stream") is True:
        return ("stream_unsupported", "stream: true is not supported in a batch", "body.stream")
    return None


def _dup(custom_id: str) -> str:
    return f"custom_id {custom_id[:100]!r} appears more than once"


async def bodies(chunks: AsyncIterator[bytes], start: int) -> AsyncIterator[tuple[int, bytes]]:
    """(0-based index, body bytes) of each line of a checked file, from ``start`` on."""
    index = -1
    async for _, raw in split_lines(chunks):
        index += 1
        if index >= start:
            yield index, bytes(decode_object(raw, "line", ("body",))[1]["body"])


def line_request(batch: dict[str, str], index: int, body: bytes, custom_id: str) -> Request:
    """The queue message of a checked line of ``batch`` (its record in the store)."""
    metadata = {"userid": batch["tenant"], "batch_id": batch["id"], "custom_id": custom_id}
    return Request(
        id=keys.line_id(batch["id"], index),
        deadline=int(batch["deadline"]),
        payload=body,
        created=int(time.time()),
        metadata=metadata,
        endpoint=batch["endpoint"],
    )


@dataclass(frozen=True, slots=True)
class Outcome:
    """A result as OpenAI's files show it: ``response`` (an HTTP answer) or ``error``."""

    ok: bool
    response: dict[str, Any] | None
    error: dict[str, str] | None
    usage: tuple[int, int, int, int, int]


def outcome(result: Result) -> Outcome:
    body = _json_or_text(result.payload)
    ok = not result.error_code and 200 <= result.status_code < 300
    if result.status_code <= 0:
        error = {"code": result.error_code or "UNKNOWN", "message": result.error_message}
        return Outcome(False, None, error, _NONE)
    response = {"status_code": result.status_code, "request_id": result.id, "body": body}
    return Outcome(ok, response, None, _usage(body) if ok else _NONE)


def result_line(result: Result, index: int, custom_id: str) -> Line:
    """The output line (an HTTP 2xx) or error line of a line's result."""
    found = outcome(result)
    line = {
        "id": "batch_req_" + hashlib.sha1(result.id.encode(), usedforsecurity=False).hexdigest(),
        "custom_id": custom_id,
        "response": found.response,
        "error": found.error,
    }
    return Line(index, found.ok, json.dumps(line, ensure_ascii=False), found.usage)


def failed_line(index: int, custom_id: str, request_id: str, code: str, message: str) -> Line:
    """An error line for a line that got no result (cancelled or expired batch)."""
    digest = hashlib.sha1(request_id.encode(), usedforsecurity=False).hexdigest()
    line = {
        "id": "batch_req_" + digest,
        "custom_id": custom_id,
        "response": None,
        "error": {"code": code, "message": message},
    }
    return Line(index, False, json.dumps(line, ensure_ascii=False))


_NONE = (0, 0, 0, 0, 0)


def _json_or_text(payload: str) -> Any:
    try:
        return json.loads(payload)
    except (ValueError, RecursionError):
        return payload


def _usage(body: Any) -> tuple[int, int, int, int, int]:
    """(input, output, total, cached, reasoning) tokens of an answer's ``usage``."""
    usage = body.get("usage") if isinstance(body, dict) else None
    if not isinstance(usage, dict):
        return _NONE
    given = _count(usage, "prompt_tokens") or _count(usage, "input_tokens")
    made = _count(usage, "completion_tokens") or _count(usage, "output_tokens")
    prompt_details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details")
    made_details = usage.get("completion_tokens_details") or usage.get("output_tokens_details")
    return (
        given,
        made,
        _count(usage, "total_tokens") or given + made,
        _count(prompt_details, "cached_tokens"),
        _count(made_details, "reasoning_tokens"),
    )


def _count(obj: object, name: str) -> int:
    value = obj.get(name) if isinstance(obj, dict) else None
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_USAGE:
        return value
    return 0
