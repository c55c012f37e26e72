"""set_headers and set_params: sources, label conditions, verbatim bytes when not applying."""

from __future__ import annotations

import json
from typing import Any

import pytest

from async_processor.errors import ConfigError, InvalidMessage
from async_processor.messages import Envelope, Request, Routing
from async_processor.transforms.base import TRANSFORMS, Outgoing, Transform, TransformContext

pytestmark = pytest.mark.anyio


def build(type_name: str, params: dict[str, Any]) -> Transform:
    return TRANSFORMS.build(type_name, params, TransformContext(name="t"))


def envelope(
    metadata: dict[str, str] | None = None, labels: dict[str, str] | None = None
) -> Envelope:
    return Envelope(
        request=Request(id="r", deadline=1, metadata=dict(metadata or {})),
        routing=Routing(labels=dict(labels or {})),
    )


# ----------------------------------------------------------------------------- set_headers

HEADERS = {
    "headers": {
        "x-static": {"value": "v1"},
        "x-tenant": {"from_metadata": "tenant"},
        "x-tier": {"from_label": "tier"},
    }
}


async def test_set_headers_from_value_metadata_and_label_replacing_case_variants() -> None:
    out = Outgoing(url="u", body=b"{}", headers={"X-Static": "caller", "x-keep": "k"})
    await build("set_headers", HEADERS).apply(envelope({"tenant": "t1"}, {"tier": "batch"}), out)
    assert out.headers == {"x-keep": "k", "x-static": "v1", "x-tenant": "t1", "x-tier": "batch"}


async def test_set_headers_skips_missing_and_illegal_values() -> None:
    out = Outgoing(url="u", body=b"{}")
    await build("set_headers", HEADERS).apply(envelope({"tenant": "a\r\nb"}), out)
    assert out.headers == {"x-static": "v1"}


async def test_set_headers_when_labels_do_not_match_does_nothing() -> None:
    transform = build("set_headers", {**HEADERS, "when_labels": {"tier": "interactive"}})
    out = Outgoing(url="u", body=b"{}")
    await transform.apply(envelope({"tenant": "t"}, {"tier": "batch"}), out)
    assert out.headers == {}
    await transform.apply(envelope({"tenant": "t"}, {"tier": "interactive"}), out)
    assert out.headers["x-tenant"] == "t"


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"headers": {}}, "headers"),
        ({"headers": {"bad name": {"value": "v"}}}, "not a legal HTTP header name"),
        ({"headers": {"Content-Type": {"value": "text/plain"}}}, "content-type"),
        ({"headers": {"x-a": {"value": "a\nb"}}}, "not a legal HTTP header value"),
        ({"headers": {"x-a": {}}}, "exactly one"),
        ({"headers": {"x-a": {"value": "v", "from_label": "l"}}}, "exactly one"),
        ({"headers": {"x-a": {"from_env": "HOME"}}}, "from_env"),
    ],
)
def test_set_headers_bad_params_fail_at_startup(params: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        build("set_headers", params)


# ----------------------------------------------------------------------------- set_params

PAYLOAD = b'{"model": "caller",  "prompt": "hi", "n": 12345678901234567890, "t": 1e0}'


async def apply_params(params: dict[str, Any], body: bytes = PAYLOAD, **labels: str) -> bytes:
    out = Outgoing(url="u", body=body)
    await build("set_params", params).apply(envelope(labels=labels), out)
    return out.body


async def test_set_params_overrides_and_defaults_editing_only_those_fields() -> None:
    body = await apply_params({"set": {"model": "llama"}, "default": {"max_tokens": 16, "n": 1}})
    assert body == (
        b'{"model": "llama",  "prompt": "hi", "n": 12345678901234567890, "t": 1e0,"max_tokens":16}'
    )


async def test_set_params_keeps_bytes_when_nothing_changes() -> None:
    assert await apply_params({"set": {"model": "caller"}, "default": {"prompt": "x"}}) == PAYLOAD


async def test_set_params_distinguishes_json_types() -> None:
    body = await apply_params({"set": {"t": 1}})
    assert body.endswith(b'"t": 1}')  # 1e0 is the float 1.0: a different JSON value


async def test_set_params_only_for_matching_labels() -> None:
    params = {"set": {"model": "batch-model"}, "when_labels": {"tier": "batch"}}
    assert await apply_params(params, tier="interactive") == PAYLOAD
    assert json.loads(await apply_params(params, tier="batch"))["model"] == "batch-model"


async def test_set_params_on_non_object_payload_is_invalid() -> None:
    with pytest.raises(InvalidMessage, match="JSON object"):
        await apply_params({"set": {"model": "m"}}, body=b"null")


async def test_set_params_leaves_a_claimed_body_alone() -> None:
    out = Outgoing(url="u", body=b"--multipart--", body_claimed=True)
    await build("set_params", {"set": {"model": "m"}}).apply(envelope(), out)
    assert out.body == b"--multipart--"


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({}, "at least one field"),
        ({"set": {"a": 1}, "default": {"a": 2}}, "both in set and default: a"),
        ({"set": {"a": 1}, "when": {}}, "when"),
    ],
)
def test_set_params_bad_params_fail_at_startup(params: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        build("set_params", params)
