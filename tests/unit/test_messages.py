"""Messages: verbatim payload bytes, envelopes, bare requests, errors, result shapes."""

from __future__ import annotations

import json

import pytest

from async_processor.errors import InvalidMessage
from async_processor.json_scan import id_from_prefix, peek_id
from async_processor.messages import (
    INVALID_DEADLINE_TEXT,
    Envelope,
    ErrorCode,
    Request,
    Result,
    Routing,
    decode_envelope,
    decode_request,
)

# Key order z-before-a, a 20-digit integer (beyond int64 and exact float), escapes.
PAYLOAD = (
    b'{"z": 1, "a": 12345678901234567890, "f": 1.10, '
    b'"s": "caf\\u00e9 \\"quoted\\"\\n\\/", "nested": {"b": [1, 2e3]}}'
)
BARE = b'{"id": "r1", "deadline": 1900000000, "payload": ' + PAYLOAD + b"}"


def envelope_bytes(kind: str = "redis", data: bytes = BARE) -> bytes:
    return (
        b'{"internal": {"retry_count": 2, "queue_id": "q", "labels": {"tier": "batch"}}, '
        b'"request_kind": "' + kind.encode() + b'", "data": ' + data + b"}"
    )


def test_payload_bytes_pass_through_verbatim() -> None:
    request = decode_request(BARE)
    assert request.payload == PAYLOAD
    assert (request.id, request.deadline) == ("r1", 1900000000)
    envelope = decode_envelope(envelope_bytes())
    assert envelope.request.payload == PAYLOAD
    assert PAYLOAD in envelope.encode()
    again = decode_envelope(envelope.encode())
    assert again.request.payload == PAYLOAD
    assert json.loads(bytes(again.request.payload))["a"] == 12345678901234567890


def test_a_decoded_payload_is_a_view_into_the_message_not_a_copy() -> None:
    # A request in flight would otherwise hold its payload twice (the message's bytes are
    # kept for its acknowledgement): 4 KiB more per request at 10,000 in flight.
    raw = envelope_bytes()
    payload = decode_envelope(raw).request.payload
    assert isinstance(payload, memoryview) and payload == PAYLOAD
    assert bytes(payload) == PAYLOAD


def test_invalid_utf8_inside_the_payload_is_refused() -> None:
    # msgspec keeps the payload as raw bytes without validating them: checked separately.
    raw = b'{"id": "u1", "deadline": 1900000000, "payload": {"p": "\xff"}}'
    with pytest.raises(InvalidMessage) as caught:
        decode_envelope(raw)
    assert caught.value.reason == "malformed"


def test_what_msgspec_refuses_is_decoded_as_before() -> None:
    # A lone surrogate escape is legal JSON that msgspec refuses: the pure-Python scanner
    # takes the message, and the payload still passes through verbatim.
    data = b'{"id": "r1", "deadline": 1900000000, "metadata": {"m": "\\ud800"}, "payload": '
    envelope = decode_envelope(envelope_bytes(data=data + PAYLOAD + b"}"))
    assert envelope.request.metadata == {"m": "\ud800"}
    assert envelope.request.payload == PAYLOAD
    assert envelope.routing.labels == {"tier": "batch"}


def test_envelope_routing_and_reencoding() -> None:
    envelope = decode_envelope(envelope_bytes())
    assert envelope.kind == "redis"
    assert envelope.routing.retry_count == 2
    assert envelope.routing.queue_id == "q"
    assert envelope.routing.labels == {"tier": "batch"}
    obj = json.loads(envelope.encode())
    assert list(obj) == ["internal", "request_kind", "data"]
    assert obj["internal"] == {"retry_count": 2, "queue_id": "q", "labels": {"tier": "batch"}}


def test_bare_request_is_a_plain_envelope() -> None:
    envelope = decode_envelope(BARE)
    assert envelope.kind == "plain"
    assert envelope.routing == Routing()
    assert envelope.id == "r1"
    assert envelope.request.payload == PAYLOAD


def test_unknown_fields_survive_a_round_trip() -> None:
    raw = b'{"id":"r2","deadline":1900000000,"payload":{},"result_queue_name":"rq","x":[1]}'
    request = decode_request(raw)
    assert request.extra == {"result_queue_name": "rq", "x": [1]}
    assert json.loads(request.encode()) == json.loads(raw)


def test_request_encode_omits_empty_fields() -> None:
    request = Request(id="r3", deadline=5, payload=b'{"p":1}')
    assert request.encode() == b'{"id":"r3","deadline":5,"payload":{"p":1}}'
    full = Request(
        id="r4", deadline=5, created=4, metadata={"userid": "u"}, headers={"h": "v"}, endpoint="/e"
    )
    assert json.loads(full.encode()) == {
        "id": "r4", "created": 4, "deadline": 5, "payload": None,
        "metadata": {"userid": "u"}, "headers": {"h": "v"}, "endpoint": "/e",
    }  # fmt: skip


def test_unknown_kind_names_the_request() -> None:
    with pytest.raises(InvalidMessage) as caught:
        decode_envelope(envelope_bytes(kind="kafka"))
    assert caught.value.reason == "unknown_kind"
    assert caught.value.request_id == "r1"
    assert "kafka" in str(caught.value)


@pytest.mark.parametrize(
    "deadline", [b"", b', "deadline": "soon"', b', "deadline": 0', b', "deadline": true']
)
def test_missing_or_bad_deadline(deadline: bytes) -> None:
    raw = b'{"id": "r5"' + deadline + b', "payload": {}}'
    with pytest.raises(InvalidMessage) as caught:
        decode_envelope(raw)
    assert (caught.value.reason, caught.value.request_id) == ("invalid_deadline", "r5")
    assert str(caught.value) == INVALID_DEADLINE_TEXT


def test_oversize_message_keeps_its_id() -> None:
    raw = b'{"id": "big", "deadline": 1900000000, "payload": {"p": "' + b"x" * 2000 + b'"}}'
    with pytest.raises(InvalidMessage) as caught:
        decode_envelope(raw, max_bytes=1000)
    assert (caught.value.reason, caught.value.request_id) == ("too_large", "big")
    assert decode_envelope(raw, max_bytes=len(raw)).id == "big"


@pytest.mark.parametrize(
    ("raw", "reason", "request_id"),
    [
        (b'{"deadline": 1900000000, "payload": {}}', "missing_id", None),
        (b'{"id": "r6", "deadline": 1900000000, "payload": [1]}', "malformed", "r6"),
        (b'{"id": "r7", "deadline": 1900000000, "metadata": {"a": 1}}', "malformed", "r7"),
        (b'{"id": "r8", "deadline": 1', "malformed", None),
        (b"not json", "malformed", None),
        (b"\xff\xfe", "malformed", None),
        (b'{"id": "r9", "deadline": 1900000000} trailing', "malformed", None),
    ],
)
def test_invalid_messages(raw: bytes, reason: str, request_id: str | None) -> None:
    with pytest.raises(InvalidMessage) as caught:
        decode_envelope(raw)
    assert (caught.value.reason, caught.value.request_id) == (reason, request_id)


def test_peek_id() -> None:
    assert peek_id(envelope_bytes()) == "r1"
    assert peek_id(BARE) == "r1"
    assert peek_id(b"[]") is None
    assert peek_id(b"{bad") is None


def test_result_shapes() -> None:
    ok = Result.http("r1", 200, b'{"choices":[]}')
    assert json.loads(ok.encode()) == {"id": "r1", "status_code": 200, "payload": '{"choices":[]}'}
    failed = Result.failure("r2", ErrorCode.DEADLINE_EXCEEDED, "deadline exceeded")
    assert json.loads(failed.encode()) == {
        "id": "r2",
        "payload": '{"error": "deadline exceeded"}',
        "error_code": "DEADLINE_EXCEEDED",
        "error_message": "deadline exceeded",
    }
    assert Result("r3").encode() == b'{"id":"r3","payload":""}'
    assert Result.decode(failed.encode()) == failed
    assert Result.decode(ok.encode()) == ok
    with pytest.raises(ValueError, match="no string id"):
        Result.decode(b'{"payload": ""}')


def test_envelope_encode_leaves_out_empty_routing() -> None:
    envelope = Envelope(request=Request(id="r", deadline=9, payload=b"{}"))
    assert envelope.encode() == (
        b'{"internal":{},"request_kind":"plain","data":{"id":"r","deadline":9,"payload":{}}}'
    )


# ----------------------------------------------------------------- hostile input (review)

DEEP = "[" * 100_000 + "]" * 100_000


@pytest.mark.parametrize(
    ("raw", "request_id"),
    [
        ('{"id":"deep","deadline":1900000000,"payload":{"a":' + DEEP + "}}", "deep"),
        ('{"id":"deep","deadline":1900000000,"metadata":' + DEEP + "}", None),
        ('{"internal":' + DEEP + ',"request_kind":"plain","data":{}}', None),
    ],
)
def test_deeply_nested_json_is_an_invalid_message_not_a_crash(
    raw: str, request_id: str | None
) -> None:
    # A RecursionError escaping decode crashed the poller, and the message came back
    # after its lease to crash the next replica too (a poison pill).
    with pytest.raises(InvalidMessage) as caught:
        decode_envelope(raw)
    assert caught.value.reason == "malformed"
    assert caught.value.request_id in (request_id, None)
    assert peek_id(raw) is None


@pytest.mark.parametrize(
    "field", ['"created":1e400', '"created":-1e400', '"deadline":1' + "0" * 400]
)
def test_out_of_range_numbers_are_invalid_not_overflow_errors(field: str) -> None:
    # int(inf) and float(10**400) raise OverflowError (not ValueError) further down.
    raw = '{"id":"big","deadline":1900000000,' + field + "}"
    with pytest.raises(InvalidMessage) as caught:
        decode_request(raw)
    assert caught.value.request_id == "big"


def test_lone_surrogate_escapes_round_trip_through_the_encoders() -> None:
    # JSON allows "\ud800"; Python decodes it to a lone surrogate that str.encode("utf-8")
    # refuses, which crashed the result writer (Result.encode) and defer (Envelope.encode).
    raw = '{"id":"s","deadline":1900000000,"metadata":{"userid":"u\\udfff"}}'
    envelope = decode_envelope(raw)
    again = decode_envelope(envelope.encode())
    assert again.request.metadata == {"userid": "u\udfff"}
    result = Result.failure("r\ud800", ErrorCode.CANCELLED, "cancelled")
    assert Result.decode(result.encode()).id == "r\ud800"


@pytest.mark.parametrize(
    "raw",
    [
        '{"id":"s\\ud800","deadline":1900000000}',
        '{"id":"s\\ud800","deadline":0}',  # the error result would carry the id
        '{"internal":{},"request_kind":"nope","data":{"id":"s\\udfff","deadline":1}}',
    ],
)
def test_an_id_that_cannot_be_a_redis_key_is_no_usable_id(raw: str) -> None:
    # redis-py encodes keys (request-done:<id>, request-cancel:<id>) as strict UTF-8:
    # such an id crashed the fetch (cancel MGET) and the result writer (done marker).
    with pytest.raises(InvalidMessage) as caught:
        decode_envelope(raw)
    assert caught.value.request_id is None
    assert peek_id(raw) is None


@pytest.mark.parametrize("field", ["result_queue_name", "request_queue_name", "request_token"])
def test_routing_names_that_cannot_be_redis_keys_are_invalid(field: str) -> None:
    # These become Redis keys (result list, retry origin, dedup fingerprint): a lone
    # surrogate made redis-py raise UnicodeEncodeError in the result writer.
    internal = '{"' + field + '":"x\\ud800"}'
    raw = '{"internal":' + internal + ',"request_kind":"redis","data":{"id":"r","deadline":5}}'
    with pytest.raises(InvalidMessage) as caught:
        decode_envelope(raw)
    assert caught.value.request_id == "r"


def test_max_bytes_counts_bytes_not_characters() -> None:
    # 600 four-byte characters: ~650 characters, ~2,450 bytes. Counted as characters after
    # a full parse, they passed a 1,000-byte limit.
    raw = json.dumps(
        {"id": "wide", "deadline": 2_000_000_000, "payload": {"p": "\U0001f600" * 600}},
        ensure_ascii=False,
    ).encode()
    assert len(raw.decode()) < 1000 < len(raw)
    for decode in (decode_envelope, decode_request):
        with pytest.raises(InvalidMessage) as caught:
            decode(raw, max_bytes=1000)
        assert (caught.value.reason, caught.value.request_id) == ("too_large", "wide")
        assert f"{len(raw)} bytes" in str(caught.value)


@pytest.mark.parametrize(
    ("prefix", "expected"),
    [
        (b'{"id": "a", "payload": {"x": "yyy', "a"),  # a bare request cut in its payload
        (b'{"internal": {"labels": {"id": "no"}}, "request_kind": "plain", '
         b'"data": {"metadata": {"id": "no"}, "id": "b", "payload": "', "b"),
        (b'{"request_kind": "plain", "id": "no", "dat', None),  # envelope: data.id or none
        (b'{"payload": {"id": "no"}, "dead', None),  # an "id" inside another field
        (b"[" * 50_000, None),
    ],
)  # fmt: skip
def test_id_from_prefix_reads_the_structure(prefix: bytes, expected: str | None) -> None:
    assert id_from_prefix(prefix) == expected


def test_routing_strings_present_are_kept_absent_ones_empty_and_wrong_types_refused() -> None:
    # Only the routing strings a message carries are checked (issue 13): each present one
    # still is, and each absent one still reads as "".
    internal = {"queue_id": "q", "transport_correlation_id": "t", "last_status": 503,
                "last_body": "busy"}  # fmt: skip
    routing = Routing.from_obj(internal)
    assert (routing.queue_id, routing.transport_correlation_id) == ("q", "t")
    assert (routing.last_status, routing.last_body) == (503, "busy")
    assert routing.request_token == routing.result_queue_name == routing.request_queue_name == ""
    assert Routing.from_obj({"queue_id": None}).queue_id == ""
    for field in ("queue_id", "transport_correlation_id", "last_body"):
        with pytest.raises(ValueError, match=f"internal.{field} must be a UTF-8 string"):
            Routing.from_obj({field: 7})


# ------------------------------------------------ upstream's routing fields (issue 27)


def test_upstream_routing_fields_round_trip_and_unknown_ones_keep_their_text() -> None:
    raw = (
        b'{"internal":{"dispatch_epoch":1.0e3,"enqueue_seq":3,"payload_ref":"r",'
        b'"result_routing_resolved":true,"result_ttl_seconds":60},"request_kind":"redis",'
        b'"data":{"id":"a","deadline":1900000000}}'
    )
    envelope = decode_envelope(raw)
    routing = envelope.routing
    assert (routing.enqueue_seq, routing.payload_ref, routing.result_ttl_seconds) == (3, "r", 60)
    assert routing.result_routing_resolved is True
    assert routing.extra == {"dispatch_epoch": b"1.0e3"}
    again = envelope.encode()
    assert b'"dispatch_epoch":1.0e3' in again
    assert b'"payload"' not in again  # stored apart: a re-write carries the envelope only
    assert decode_envelope(again).routing == routing


@pytest.mark.parametrize(
    "field",
    ['"result_routing_resolved":"yes"', '"enqueue_seq":"7"', '"payload_ref":5',
     '"result_ttl_seconds":1.5'],
)  # fmt: skip
def test_upstream_routing_fields_of_the_wrong_type_are_refused(field: str) -> None:
    raw = '{"internal":{' + field + '},"request_kind":"redis","data":{"id":"a","deadline":9}}'
    with pytest.raises(InvalidMessage) as caught:
        decode_envelope(raw)
    assert caught.value.request_id == "a"
