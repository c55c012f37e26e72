"""The Go side's own bytes, pinned: if ``go_side`` drifted from what Go's
``encoding/json`` writes, every conformance test would prove the wrong thing."""

from __future__ import annotations

import json

import pytest

from tests.conformance.go_side import (
    GoRequest,
    GoRouting,
    UnparsableResult,
    go_compact,
    go_envelope,
    go_parse_result,
    go_score,
    go_string,
    slot_key,
)


def test_strings_escape_as_go_does() -> None:
    # HTML-safe escapes, the line separators, control characters as \u00XX except the
    # short ones (\b and \f since Go 1.22).
    text = 'a<b>&"\\\n\t\b\x01\u2028\u2029é'
    assert go_string(text) == (
        b'"a\\u003cb\\u003e\\u0026\\"\\\\\\n\\t\\b\\u0001\\u2028\\u2029\xc3\xa9"'
    )
    assert json.loads(go_string(text)) == text


def test_an_inline_payload_is_compacted_with_its_texts_kept() -> None:
    raw = b'{ "a" : [1.10, 1E2 , "x \\" <y>"],\n "u": "\xe2\x80\xa8" }'
    assert go_compact(raw) == b'{"a":[1.10,1E2,"x \\" \\u003cy\\u003e"],"u":"\\u2028"}'


def test_the_envelope_is_laid_out_in_struct_order() -> None:
    routing = GoRouting(
        request_token="t", request_queue_name="q", result_queue_name="r",
        enqueue_seq=-1, payload_ref="request-payload:i:t", labels={"z": "1", "a": "2"},
    )  # fmt: skip
    request = GoRequest("i", 7, None, metadata={"k": "v"}, model="m")
    assert go_envelope(routing, request, with_payload=False) == (
        b'{"internal":{"request_token":"t","request_queue_name":"q","result_queue_name":"r",'
        b'"enqueue_seq":-1,"payload_ref":"request-payload:i:t","labels":{"a":"2","z":"1"}},'
        b'"request_kind":"redis","data":{"id":"i","created":0,"deadline":7,'
        b'"metadata":{"k":"v"},"model":"m"}}'
    )
    assert b'"payload":null' in go_envelope(routing, request)


def test_scores_and_slot_keys() -> None:
    assert go_score(100, 0) == 100.0
    assert go_score(100, 1) == 100 + 1 / 2**21
    assert go_score(100, 2**22) == 100 + (2**21 - 1) / 2**21  # capped
    assert slot_key("q", True) == "{q}" and slot_key("{t}q", True) == "{t}q"
    assert slot_key("q", False) == "q" and slot_key("{}q", True) == "{{}q}"


@pytest.mark.parametrize(
    "raw",
    [b'{"id":""}', b'{"id":"a","payload":{}}', b'{"id":"a","status_code":"200"}', b"[1]",
     b'{"id":"a","request_token":1}'],
)  # fmt: skip
def test_a_result_go_cannot_unmarshal_is_refused(raw: bytes) -> None:
    with pytest.raises(UnparsableResult):
        go_parse_result(raw)


def test_a_result_go_reads_gets_its_zero_values() -> None:
    assert go_parse_result(b'{"id":"a","payload":"x","extra":[1]}') == {
        "id": "a", "status_code": 0, "payload": "x", "error_code": "",
        "error_message": "", "request_token": "",
    }  # fmt: skip
