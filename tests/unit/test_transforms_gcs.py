"""gcs_uri_multipart: ownership, signed-URL expiry preflight, multipart shape parsed back."""

from __future__ import annotations

import email.parser
import email.policy
import json
import time
from datetime import UTC, datetime

import pytest

from async_processor.errors import ConfigError, InvalidMessage
from async_processor.messages import Envelope, Request
from async_processor.transforms.base import TRANSFORMS, Outgoing, TransformContext
from async_processor.transforms.gcs_multipart import GcsMultipart, multipart_form, signed_url_expiry

pytestmark = pytest.mark.anyio


DEADLINE = 1_800_000_000  # 2027-01-15T08:00:00Z


def v4(date: str, expires: str) -> str:
    return f"https://storage.googleapis.com/b/o.wav?X-Goog-Date={date}&X-Goog-Expires={expires}&X-Goog-Signature=s"


def envelope(payload: object, provider: str = "openai", deadline: int = DEADLINE) -> Envelope:
    raw = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    return Envelope(
        request=Request(id="r1", deadline=deadline, payload=raw, metadata={"provider": provider})
    )


def plugin() -> GcsMultipart:
    return GcsMultipart("audio", ["openai", "vertex"])


def parse_form(body: bytes, content_type: str) -> list[tuple[str, str]]:
    message = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(
        b"Content-Type: " + content_type.encode() + b"\r\n\r\n" + body
    )
    return [
        (str(part.get_param("name", header="content-disposition")), part.get_content())
        for part in message.iter_parts()
    ]


# ----------------------------------------------------------------------------- expiry


def test_v4_expiry_is_date_plus_seconds() -> None:
    expected = datetime(2027, 1, 15, 8, 0, tzinfo=UTC).timestamp() + 3600
    assert signed_url_expiry(v4("20270115T080000Z", "3600")) == expected


def test_v2_expiry_is_absolute_seconds() -> None:
    assert signed_url_expiry("https://h/o?Expires=1800000123&Signature=x") == 1800000123


@pytest.mark.parametrize(
    "uri",
    [
        v4("2027-01-15", "3600"),  # bad date: no expiry, and no fall-back to V2
        v4("20270115T080000Z", "1h") + "&Expires=1",
        "https://h/o?x-goog-date=20270115T080000Z&x-goog-expires=1",  # names are case-sensitive
        "https://h/o?Expires=soon",
        "https://h/o",
        "not a url at all",
        v4("20270115T080000Z", "9" * 30),
    ],
)
def test_unparsable_or_absent_expiry_is_none(uri: str) -> None:
    assert signed_url_expiry(uri) is None


def test_expiry_at_the_deadline_is_fatal_before_dispatch() -> None:
    at_deadline = f"https://h/o?Expires={DEADLINE}"
    with pytest.raises(InvalidMessage, match="at or before the request deadline") as info:
        plugin().validate(envelope({"gcs_uri": at_deadline}))
    assert "2027-01-15T08:00:00Z" in str(info.value)
    assert info.value.request_id == "r1"


def test_expiry_after_the_deadline_passes() -> None:
    plugin().validate(envelope({"gcs_uri": f"https://h/o?Expires={DEADLINE + 1}"}))
    plugin().validate(envelope({"gcs_uri": v4("20270115T080000Z", "1")}))


def test_v4_expiry_before_deadline_is_fatal() -> None:
    with pytest.raises(InvalidMessage, match="signed URL expires at 2027-01-15T07:59:59Z"):
        plugin().validate(envelope({"gcs_uri": v4("20270115T075958Z", "1")}))


# ----------------------------------------------------------------------------- ownership


def test_other_providers_and_missing_gcs_uri_are_left_alone() -> None:
    plugin().validate(envelope(b"null", provider="other"))
    plugin().validate(envelope({"gcs_uri": ""}))
    plugin().validate(envelope({"gcs_uri": 5}))


async def test_not_owned_means_body_unchanged() -> None:
    out = Outgoing(url="u", body=b'{"gcs_uri": "https://h/o"}')
    await plugin().apply(envelope({}, provider="other"), out)
    assert (out.body, out.content_type, out.body_claimed) == (
        b'{"gcs_uri": "https://h/o"}',
        "application/json",
        False,
    )


async def test_owned_body_that_is_not_an_object_is_fatal() -> None:
    plugin().validate(envelope(b"null"))  # no payload yet: it may come by reference
    with pytest.raises(InvalidMessage, match="failed to parse request body"):
        await plugin().apply(envelope(b"null"), Outgoing(url="u", body=b"null"))


async def test_expiry_is_checked_again_on_the_body_it_rewrites() -> None:
    out = Outgoing(
        url="u", body=json.dumps({"gcs_uri": f"https://h/o?Expires={DEADLINE}"}).encode()
    )
    with pytest.raises(InvalidMessage, match="at or before the request deadline"):
        await plugin().apply(envelope(b"null"), out)
    assert not out.body_claimed


async def test_inline_file_with_gcs_uri_is_fatal_when_applied() -> None:
    env = envelope({"gcs_uri": "https://h/o", "file_base64": "AAAA"})
    out = Outgoing(url="u", body=env.request.payload)
    with pytest.raises(InvalidMessage, match='"file_base64" is not supported'):
        await plugin().apply(env, out)
    assert not out.body_claimed


# ----------------------------------------------------------------------------- body


async def test_multipart_has_url_first_then_payload_fields_in_order() -> None:
    body = (
        b'{"model": "whisper", "gcs_uri": "https://h/o.wav?X-Goog-Signature=a%2Fb",'
        b' "temperature": 0.0, "stream": false, "opts": {"a": [1, 2]}, "note": null,'
        b' "lang": "en\\nx"}'
    )
    out = Outgoing(url="u", body=body, deadline=time.time() + 60)
    await plugin().apply(envelope({}), out)
    assert out.body_claimed
    assert out.content_type.startswith("multipart/form-data; boundary=")
    assert parse_form(out.body, out.content_type) == [
        ("url", "https://h/o.wav?X-Goog-Signature=a%2Fb"),
        ("model", "whisper"),
        ("temperature", "0.0"),
        ("stream", "false"),
        ("opts", '{"a": [1, 2]}'),
        ("note", "null"),
        ("lang", "en\nx"),
    ]


async def test_a_claimed_body_is_not_rewritten_again() -> None:
    out = Outgoing(url="u", body=b"--x--", content_type="multipart/x", body_claimed=True)
    await plugin().apply(envelope({"gcs_uri": "https://h/o"}), out)
    assert out.body == b"--x--"


def test_field_names_are_escaped_and_boundary_avoids_values() -> None:
    body, content_type = multipart_form([('a"b\\c', "v"), ("n\r\nx", "w")])
    assert b'name="a\\"b\\\\c"' in body
    assert b'name="n%0D%0Ax"' in body
    boundary = content_type.split("boundary=")[1]
    assert body.count(boundary.encode()) == 3


# ----------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({}, "providers"),
        ({"providers": []}, "providers"),
        ({"providers": ["a", ""]}, "entries must be non-empty"),
        ({"providers": ["a"], "provider": "b"}, "provider"),
    ],
)
def test_bad_params_fail_at_startup(params: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        TRANSFORMS.build("gcs_uri_multipart", params, TransformContext())


@pytest.mark.parametrize(
    "uri",
    [
        "https://h/o?Expires=" + "9" * 5000,  # int() refuses > 4300 digits with ValueError
        v4("20270115T080000Z", "9" * 5000),
    ],
)
def test_absurdly_long_expiry_numbers_mean_no_expiry(uri: str) -> None:
    assert signed_url_expiry(uri) is None
    plugin().validate(envelope({"gcs_uri": uri}))


@pytest.mark.parametrize("expires", ["-99999999999999999", "-1"])
def test_expiry_outside_the_calendar_is_still_reported_as_fatal(expires: str) -> None:
    # datetime.fromtimestamp raised on the message text, so the worker crashed instead of
    # answering INVALID_REQUEST.
    with pytest.raises(InvalidMessage, match="at or before the request deadline"):
        plugin().validate(envelope({"gcs_uri": f"https://h/o?Expires={expires}"}))
