"""The transform chain: config order, body claiming, named errors, startup failures."""

from __future__ import annotations

import json
from typing import Any

import pytest

from async_processor.config import TransformConfig
from async_processor.errors import ConfigError, InvalidMessage
from async_processor.messages import Envelope, Request
from async_processor.transforms import TransformChain, build_transform_chain
from async_processor.transforms.base import Outgoing, TransformContext

pytestmark = pytest.mark.anyio


GCS = {"name": "audio", "type": "gcs_uri_multipart", "parameters": {"providers": ["openai"]}}
MODEL = {"name": "model", "type": "set_params", "parameters": {"set": {"model": "whisper-2"}}}
HEADER = {
    "name": "hdr",
    "type": "set_headers",
    "parameters": {"headers": {"x-route": {"value": "audio"}}},
}


def chain(*entries: dict[str, Any]) -> TransformChain:
    config = TransformConfig.model_validate({"requestTransforms": list(entries)})
    return build_transform_chain(config, TransformContext())


def envelope(payload: bytes, provider: str = "openai") -> Envelope:
    request = Request(
        id="r", deadline=2_000_000_000, payload=payload, metadata={"provider": provider}
    )
    return Envelope(request=request)


async def run(c: TransformChain, payload: bytes, provider: str = "openai") -> Outgoing:
    env = envelope(payload, provider)
    c.validate(env)
    out = Outgoing(url="u", body=env.request.payload, headers={"Content-Type": "application/json"})
    await c.apply(env, out)
    return out


async def test_no_transform_applying_sends_the_payload_bytes_exactly() -> None:
    payload = b'{ "b": 1.50, "a": "\\u003c", "big": 123456789012345678901234567890 }'
    for c in (
        chain(),
        chain(GCS, HEADER | {"parameters": {"headers": {"x": {"from_label": "no"}}}}),
    ):
        out = await run(c, payload, provider="other")
        assert (out.body, out.content_type, out.body_claimed) == (
            payload,
            "application/json",
            False,
        )


async def test_runs_in_config_order_and_the_rewriter_sees_edited_payload() -> None:
    out = await run(chain(MODEL, GCS, HEADER), b'{"model": "whisper-1", "gcs_uri": "https://h/o"}')
    assert out.body_claimed and out.content_type.startswith("multipart/form-data")
    assert b"whisper-2" in out.body and b"whisper-1" not in out.body
    assert out.headers["x-route"] == "audio"  # header transforms run after a claim


async def test_first_body_rewriter_claims_and_later_ones_skip() -> None:
    second = GCS | {"name": "audio-2"}
    out = await run(chain(GCS, second, MODEL), b'{"gcs_uri": "https://h/o", "model": "m"}')
    # The second rewriter and set_params would fail on a multipart body if they ran on it.
    assert out.body.count(b"form-data") == 2  # url + model, built once


async def test_validate_errors_name_the_transform_in_the_reference_wording() -> None:
    expired = json.dumps({"gcs_uri": "https://h/o?Expires=1"}).encode()
    with pytest.raises(InvalidMessage) as info:
        chain(MODEL, GCS).validate(envelope(expired))
    assert str(info.value).startswith(
        "Failed to validate request for transform: transform audio/gcs_uri_multipart: "
        "signed URL expires at 1970-01-01T00:00:01Z"
    )
    assert info.value.request_id == "r"


async def test_apply_errors_name_the_transform_in_the_reference_wording() -> None:
    with pytest.raises(InvalidMessage) as info:
        await chain(MODEL).apply(envelope(b"null"), Outgoing(url="u", body=b"null"))
    assert str(info.value).startswith(
        "Failed to transform request body: transform model/set_params: set_params needs"
    )


@pytest.mark.parametrize(
    ("entries", "message"),
    [
        (
            [{"name": "x", "type": "gzip"}],
            r"requestTransforms\[0\] \(x\): unknown transform type 'gzip' "
            r"\(known: gcs_uri_multipart, payload_url, set_headers, set_params\)",
        ),
        (
            [MODEL, GCS | {"parameters": {"providers": []}}],
            r"requestTransforms\[1\] \(audio\): transform 'gcs_uri_multipart': providers",
        ),
        ([GCS | {"parameters": {"providers": ["a"], "extra": 1}}], "extra"),
    ],
)
def test_malformed_configs_fail_at_startup_with_one_line(
    entries: list[dict[str, Any]], message: str
) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        chain(*entries)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("url", ["http://[::1", "http://h:99999/x", "http://h:abc/", "ftp://h/x"])
def test_an_unparsable_payload_url_is_invalid_request_not_a_crash(url: str) -> None:
    # urlsplit raises ValueError for a bad IPv6 literal, and .port for a bad port; the
    # chain only converts MessageErrors, so these escaped and crashed the worker.
    fetch = {"name": "src", "type": "payload_url", "parameters": {"allow": ["h"]}}
    request = Request(id="r", deadline=2_000_000_000, metadata={"payload_url": url})
    with pytest.raises(InvalidMessage, match="is not an http"):
        chain(fetch).validate(Envelope(request=request))


async def test_inline_file_is_a_transform_failure_in_the_reference_wording() -> None:
    # Producers match on the reference's prefix; a validate-time rejection read
    # "Failed to validate request for transform" instead.
    payload = json.dumps({"gcs_uri": "https://h/o", "file_base64": "AAAA"}).encode()
    with pytest.raises(InvalidMessage) as info:
        await run(chain(GCS), payload)
    assert str(info.value).startswith(
        'Failed to transform request body: transform audio/gcs_uri_multipart: "file_base64"'
    )
    assert info.value.reason == "inline_file"
