"""JSON scanning for messages: parse an object keeping chosen members as their exact bytes,
and read a request's id from a message that is oversized, cut short or malformed.

msgspec takes the common case; the pure-Python scanner takes whatever msgspec refuses,
so odd input is accepted, refused and explained one way. Used by ``messages``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import msgspec

from async_processor.errors import InvalidMessage

# The payload's JSON text, verbatim. Decoded from a message, a view into the message's own
# bytes (kept anyway for its acknowledgement), so a request in flight holds no second copy.
Payload = bytes | memoryview

_WS = re.compile(r"[ \t\n\r]*")
_DECODER = json.JSONDecoder()
_MEMBERS = msgspec.json.Decoder(dict[str, msgspec.Raw])
_ANY = msgspec.json.Decoder()


def id_from_prefix(prefix: bytes | str) -> str | None:
    """The id of a message known by its first bytes only: ``data.id`` of an envelope, else
    a top-level ``id`` seen before any ``request_kind``/``data`` key. Read by the JSON
    structure, never by pattern (an ``"id"`` inside another field is not it); None when
    the prefix does not reach it."""
    text = prefix.decode("utf-8", "ignore") if isinstance(prefix, bytes) else prefix
    top_id: str | None = None
    envelope = False
    try:
        for key, pos in _members(text, _WS.match(text).end()):  # type: ignore[union-attr]
            if key == "data":
                return _id_member(text, pos)
            envelope = envelope or key == "request_kind"
            if key == "id":
                top_id = usable_id(_DECODER.raw_decode(text, pos)[0])
    except (ValueError, RecursionError):  # the prefix ends (or was never JSON)
        pass
    return None if envelope else top_id


def _id_member(text: str, pos: int) -> str | None:
    for key, at in _members(text, pos):
        if key == "id":
            return usable_id(_DECODER.raw_decode(text, at)[0])
    return None


def _members(text: str, pos: int) -> Iterator[tuple[str, int]]:
    """(key, offset of its value) of the object at ``text[pos]``, in order; raises
    ValueError where the text stops being a well-formed object (e.g. cut short)."""
    if not text.startswith("{", pos):
        raise ValueError("not an object")
    pos = _WS.match(text, pos + 1).end()  # type: ignore[union-attr]
    while not text.startswith("}", pos):
        key, pos = _DECODER.raw_decode(text, pos)
        pos = _WS.match(text, pos).end()  # type: ignore[union-attr]
        if not isinstance(key, str) or not text.startswith(":", pos):
            raise ValueError("not a key")
        pos = _WS.match(text, pos + 1).end()  # type: ignore[union-attr]
        yield key, pos
        _, pos = _DECODER.raw_decode(text, pos)
        pos = _WS.match(text, pos).end()  # type: ignore[union-attr]
        if text.startswith(",", pos):
            pos = _WS.match(text, pos + 1).end()  # type: ignore[union-attr]
        elif not text.startswith("}", pos):
            raise ValueError("expected ',' or '}'")


def peek_id(raw: bytes | str) -> str | None:
    """Best-effort id of a message that failed to decode (for its error result)."""
    try:
        obj = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    if isinstance(obj, dict):
        data = obj.get("data")
        return usable_id(data.get("id") if isinstance(data, dict) else obj.get("id"))
    return None


def decode_object(
    raw: Payload | str, what: str, raw_keys: tuple[str, ...]
) -> tuple[dict[str, Any], dict[str, Payload]]:
    """Parse one JSON object; the values of ``raw_keys`` are kept as their exact bytes.

    msgspec (C) takes what it can: members as ``Raw`` (views of ``raw``, not parsed yet),
    then each member but the raw ones decoded; the raw ones stay views, not copies.
    Whatever it refuses (malformed JSON, lone surrogates, numbers beyond a double, invalid
    UTF-8) goes through ``_scan_object``, so odd input is accepted, refused and explained
    exactly as before.
    """
    # msgspec does not validate the UTF-8 of members it keeps raw; a member (a view) is
    # part of a message checked already.
    if isinstance(raw, bytes) and not raw.isascii():
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidMessage("message is not UTF-8", reason="malformed") from exc
    try:
        members = _MEMBERS.decode(raw)
        values = {k: _ANY.decode(v) for k, v in members.items() if k not in raw_keys}
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return _scan_object(raw, what, raw_keys)
    raws: dict[str, Payload] = {k: memoryview(v) for k, v in members.items() if k in raw_keys}
    return values, raws


def _scan_object(
    raw: Payload | str, what: str, raw_keys: tuple[str, ...]
) -> tuple[dict[str, Any], dict[str, Payload]]:
    """The pure-Python path of ``decode_object``: spans of the text, then their bytes."""
    text = _as_text(raw)
    try:
        values, spans = _scan_object_unchecked(text, raw_keys)
    except (ValueError, IndexError, RecursionError) as exc:  # deep nesting: RecursionError
        raise InvalidMessage(
            f"{what} is not a JSON object: {exc}", reason="malformed", request_id=peek_id(text)
        ) from exc
    return values, {k: text[a:b].encode() for k, (a, b) in spans.items()}


def _scan_object_unchecked(
    text: str, raw_keys: tuple[str, ...]
) -> tuple[dict[str, Any], dict[str, tuple[int, int]]]:
    values: dict[str, Any] = {}
    spans: dict[str, tuple[int, int]] = {}
    pos = _WS.match(text).end()  # type: ignore[union-attr]
    if text[pos] != "{":
        raise ValueError("expected '{'")
    pos = _WS.match(text, pos + 1).end()  # type: ignore[union-attr]
    if text[pos] == "}":
        return values, spans
    while True:
        if text[pos] != '"':
            raise ValueError(f"expected a key at offset {pos}")
        key, pos = json.decoder.scanstring(text, pos + 1)  # type: ignore[attr-defined]
        pos = _WS.match(text, pos).end()  # type: ignore[union-attr]
        if text[pos] != ":":
            raise ValueError(f"expected ':' at offset {pos}")
        pos = _WS.match(text, pos + 1).end()  # type: ignore[union-attr]
        value, end = _DECODER.raw_decode(text, pos)
        if key in raw_keys:
            spans[key] = (pos, end)
        else:
            values[key] = value
        pos = _WS.match(text, end).end()  # type: ignore[union-attr]
        if text[pos] == "}":
            break
        if text[pos] != ",":
            raise ValueError(f"expected ',' or '}}' at offset {pos}")
        pos = _WS.match(text, pos + 1).end()  # type: ignore[union-attr]
    if _WS.match(text, pos + 1).end() != len(text):  # type: ignore[union-attr]
        raise ValueError("trailing data after the object")
    return values, spans


def peek_data_id(data: Payload | None) -> str | None:
    """The id in an envelope's ``data`` (parsed again: only for an error's result)."""
    if data is None:
        return None
    try:
        obj = json.loads(bytes(data))
    except (ValueError, RecursionError):
        return None
    return usable_id(obj.get("id") if isinstance(obj, dict) else None)


def usable_id(candidate: object) -> str | None:
    """A non-empty string id that can name Redis keys (``request-done:<id>``, ...).

    A lone surrogate (JSON "\\ud800") has no UTF-8 form, and redis-py encodes keys as
    strict UTF-8: such an id counts as none, so the message is dead-lettered.
    """
    if not isinstance(candidate, str) or not candidate:
        return None
    if not candidate.isascii():
        try:
            candidate.encode()
        except UnicodeEncodeError:
            return None
    return candidate


def _as_text(raw: Payload | str) -> str:
    if isinstance(raw, str):
        return raw
    try:
        return str(raw, "utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidMessage("message is not UTF-8", reason="malformed") from exc
