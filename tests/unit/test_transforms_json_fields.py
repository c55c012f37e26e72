"""Top-level JSON fields located in the text; edits touch only the changed fields."""

from __future__ import annotations

import json

import pytest

from async_processor.transforms.json_fields import scan

BODY = (
    b'{ "model" : "a",\n "n": 12345678901234567890, "x": 1e5, "s": "\\u003c", "o": {"k": [1, 2]} }'
)


def test_scan_gives_each_field_exact_text_in_order() -> None:
    fields = scan(BODY)
    assert list(fields.spans) == ["model", "n", "x", "s", "o"]
    assert fields.raw("n") == "12345678901234567890"
    assert fields.raw("x") == "1e5"
    assert fields.raw("s") == '"\\u003c"'
    assert fields.raw("o") == '{"k": [1, 2]}'
    assert fields.value("o") == {"k": [1, 2]}


def test_edit_replaces_in_place_and_appends_new_keys() -> None:
    edited = scan(BODY).edited({"model": "b", "max_tokens": 5})
    assert edited == (
        b'{ "model" : "b",\n "n": 12345678901234567890, "x": 1e5, "s": "\\u003c", '
        b'"o": {"k": [1, 2]} ,"max_tokens":5}'
    )
    assert json.loads(edited)["max_tokens"] == 5


def test_edit_of_empty_object() -> None:
    assert scan(b" {} ").edited({"a": [1]}) == b' {"a":[1]} '


def test_repeated_key_last_wins() -> None:
    fields = scan(b'{"a":1,"a":2}')
    assert fields.value("a") == 2
    assert json.loads(fields.edited({"a": 3})) == {"a": 3}


@pytest.mark.parametrize(
    "body", [b"null", b"[1]", b'"s"', b"{", b'{"a" 1}', b'{"a":1}x', b'{"a":1 "b":2}', b"\xff"]
)
def test_non_objects_are_rejected(body: bytes) -> None:
    with pytest.raises(ValueError):
        scan(body)


def test_deeply_nested_body_is_a_value_error_not_a_recursion_error() -> None:
    # A fetched payload_url body nested 100k deep raised RecursionError, which no caller
    # turns into INVALID_REQUEST: the worker crashed instead.
    with pytest.raises(ValueError):
        scan(b'{"a":' + b"[" * 100_000 + b"]" * 100_000 + b"}")
