"""Top-level fields of a JSON object body, located in the text rather than re-encoded.

Stage: transforms (helper). Input: a JSON object body as bytes. Output: each top-level
field's exact JSON text, and an edited body in which only the changed fields differ
(docs/architecture.md G9: numbers, key order and escapes elsewhere pass through unchanged).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from async_processor.messages import Payload

_WS = re.compile(r"[ \t\n\r]*")
_DECODER = json.JSONDecoder()


@dataclass(frozen=True, slots=True)
class Fields:
    """A JSON object's text with the (start, end) span of each top-level value, in order."""

    text: str
    spans: dict[str, tuple[int, int]]
    close: int  # offset of the closing brace

    def raw(self, key: str) -> str:
        start, end = self.spans[key]
        return self.text[start:end]

    def value(self, key: str) -> Any:
        return json.loads(self.raw(key))

    def edited(self, changes: Mapping[str, Any]) -> bytes:
        """The body with ``changes`` applied: present keys replaced in place, others appended."""
        replaced = sorted(
            ((self.spans[k], v) for k, v in changes.items() if k in self.spans),
            key=lambda item: item[0],
        )
        parts: list[str] = []
        pos = 0
        for (start, end), value in replaced:
            parts += [self.text[pos:start], _dumps(value)]
            pos = end
        parts.append(self.text[pos : self.close])
        separator = "," if self.spans else ""
        for key, value in changes.items():
            if key not in self.spans:
                parts += [separator, _dumps(key), ":", _dumps(value)]
                separator = ","
        parts.append(self.text[self.close :])
        return "".join(parts).encode()


def scan(body: Payload) -> Fields:
    """Locate the top-level fields; ValueError when ``body`` is not one JSON object."""
    try:
        text = str(body, "utf-8")
        return _scan(text)
    except (UnicodeDecodeError, IndexError, RecursionError) as exc:  # deep nesting
        raise ValueError(f"not a JSON object: {exc}") from exc


def _scan(text: str) -> Fields:
    spans: dict[str, tuple[int, int]] = {}
    pos = _skip(text, 0)
    if text[pos] != "{":
        raise ValueError("not a JSON object")
    pos = _skip(text, pos + 1)
    while text[pos] != "}":
        if spans:
            if text[pos] != ",":
                raise ValueError(f"expected ',' at offset {pos}")
            pos = _skip(text, pos + 1)
        key, pos = _DECODER.raw_decode(text, pos)
        if not isinstance(key, str):
            raise ValueError(f"expected a key at offset {pos}")
        pos = _skip(text, pos)
        if text[pos] != ":":
            raise ValueError(f"expected ':' at offset {pos}")
        start = _skip(text, pos + 1)
        _, end = _DECODER.raw_decode(text, start)
        spans.pop(key, None)  # a repeated key: the last one counts, in its own position
        spans[key] = (start, end)
        pos = _skip(text, end)
    if _skip(text, pos + 1) != len(text):
        raise ValueError("trailing data after the object")
    return Fields(text, spans, pos)


def _skip(text: str, pos: int) -> int:
    match = _WS.match(text, pos)
    assert match is not None  # the pattern matches the empty string
    return match.end()


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))
