"""Request building: URL joining, header order and legality, deadline header, verbatim body."""

from __future__ import annotations

import pytest

from async_processor.config.queues import QueueSpec
from async_processor.errors import InvalidMessage
from async_processor.messages import decode_envelope
from async_processor.metrics import Metrics
from async_processor.pipeline.dispatch import DispatchSettings, build_request, join_url
from async_processor.transports.base import Delivery
from async_processor.work import Work
from tests.fixtures.inprocess import http_client

RAW = b'{"id":"r1","deadline":1900000000,"payload":{"n":12345678901234567890,"b":1,"a":2}}'


def _work(raw: bytes = RAW, **queue_kw: object) -> Work:
    queue = QueueSpec(id="q", name="q", igw_base_url="http://gw:8000/", **queue_kw)  # type: ignore[arg-type]
    delivery = Delivery(queue=queue, raw=raw)
    envelope = decode_envelope(raw)
    return Work(delivery, envelope, Metrics().queue("q", "q", "default"))


@pytest.mark.parametrize(
    ("base", "path", "expected"),
    [
        ("http://h:80/", "/v1/completions", "http://h:80/v1/completions"),
        ("http://h/api", "v1/x", "http://h/api/v1/x"),
        ("http://h/api/", "/v1//x", "http://h/api/v1/x"),
        ("http://h", "/v1/a/../b", "http://h/v1/b"),
        (
            "http://h/base?tenant=1",
            "/v1/chat/completions",
            "http://h/base/v1/chat/completions?tenant=1",
        ),
        ("https://h", "/", "https://h/"),
    ],
)
def test_join_url_like_go_joinpath(base: str, path: str, expected: str) -> None:
    assert join_url(base, path) == expected


@pytest.mark.parametrize("path", ["http://evil/x", "//evil/x", "https://h/v1", "/v1?x=1"])
def test_endpoint_must_be_a_path(path: str) -> None:
    with pytest.raises(InvalidMessage):
        join_url("http://gw", path)


def test_body_is_the_payload_bytes_verbatim() -> None:
    out = build_request(_work(), DispatchSettings())
    assert out.body == b'{"n":12345678901234567890,"b":1,"a":2}'
    assert out.url == "http://gw:8000/v1/completions"


def test_header_order_and_deadline_header() -> None:
    raw = b'{"id":"r1","deadline":1900000000,"payload":{},"headers":{"X-Tenant":"t"}}'
    work = _work(raw, inference_objective="batch-obj")
    work.stamped_headers = [("x-llm-d-inference-fairness-id", "u1")]
    out = build_request(work, DispatchSettings(deadline_header="x-request-deadline"))
    assert list(out.headers)[:2] == ["Content-Type", "x-gateway-inference-objective"]
    assert out.headers["x-gateway-inference-objective"] == "batch-obj"
    assert out.headers["X-Tenant"] == "t"
    assert out.headers["x-llm-d-inference-fairness-id"] == "u1"
    assert out.headers["x-request-deadline"] == "1900000000"


def test_empty_deadline_header_name_disables_it() -> None:
    out = build_request(_work(), DispatchSettings(deadline_header=""))
    assert not any(k.lower() == "x-request-deadline" for k in out.headers)


def test_endpoint_overrides_queue_path() -> None:
    raw = b'{"id":"r1","deadline":1900000000,"payload":{},"endpoint":"/v1/chat/completions"}'
    assert build_request(_work(raw), DispatchSettings()).url == "http://gw:8000/v1/chat/completions"


@pytest.mark.parametrize(
    "headers",
    [
        b'{"X-Bad":"a\\r\\nInjected: 1"}',
        b'{"Bad Name":"v"}',
        b'{"X-Nul":"a\\u0000b"}',
    ],
)
def test_illegal_caller_headers_are_invalid_request(headers: bytes) -> None:
    raw = b'{"id":"r1","deadline":1900000000,"payload":{},"headers":' + headers + b"}"
    with pytest.raises(InvalidMessage) as err:
        build_request(_work(raw), DispatchSettings())
    assert err.value.request_id == "r1"


def test_caller_content_type_overrides_in_any_case() -> None:
    raw = (
        b'{"id":"r1","deadline":1900000000,"payload":{},'
        b'"headers":{"content-type":"application/vnd.x+json"}}'
    )
    out = build_request(_work(raw), DispatchSettings())
    assert [k for k in out.headers if k.lower() == "content-type"] == ["Content-Type"]  # #494
    assert out.content_type == "application/vnd.x+json"


@pytest.mark.anyio
@pytest.mark.parametrize("chunked", [False, True])
async def test_response_body_over_the_cap_is_a_fatal_attempt(
    chunked: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    from aiohttp import web

    from async_processor.pipeline import dispatch
    from async_processor.transforms.base import Outgoing

    async def big(request: web.Request) -> web.StreamResponse:
        if not chunked:
            return web.Response(body=b"x" * 5000)
        response = web.StreamResponse()
        response.enable_chunked_encoding()
        await response.prepare(request)
        for _ in range(5):
            await response.write(b"x" * 1000)
        return response

    app = web.Application()
    app.router.add_post("/v1/completions", big)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    monkeypatch.setattr(dispatch, "MAX_RESPONSE_BYTES", 4096)
    try:
        async with http_client() as client:
            out = Outgoing(url=f"http://127.0.0.1:{port}/v1/completions", body=b"{}")
            attempt = await dispatch.send(client, out, timeout=5)
            monkeypatch.setattr(dispatch, "MAX_RESPONSE_BYTES", 8192)
            fine = await dispatch.send(client, out, timeout=5)
    finally:
        await runner.cleanup()
    assert attempt.fatal and attempt.status == 0
    assert "larger than 4096" in attempt.error
    assert (fine.status, len(fine.body)) == (200, 5000)


def test_deadline_header_help_docs_and_behaviour_agree() -> None:
    """The help said "remaining deadline" while the header carries the absolute deadline."""
    from pathlib import Path

    from async_processor.config import flag_parser

    root = Path(__file__).resolve().parents[2]
    out = build_request(_work(), DispatchSettings(deadline_header="x-request-deadline"))
    assert out.headers["x-request-deadline"] == str(_work().envelope.request.deadline)
    assert "absolute Unix seconds" in " ".join(flag_parser().format_help().split())
    for path in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        for line in path.read_text().splitlines():
            if "--deadline-header" in line:
                assert "remaining" not in line, f"{path.name}: {line}"
