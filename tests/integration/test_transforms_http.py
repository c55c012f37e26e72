"""Transforms over real HTTP: payload_url against a local server, multipart parsed by aiohttp."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import anyio
import pytest
from aiohttp import web

from async_processor.config import TransformConfig
from async_processor.errors import ConfigError, InvalidMessage, PayloadUnavailable
from async_processor.messages import Envelope, Request
from async_processor.transforms import TransformChain, build_transform_chain
from async_processor.transforms.base import Outgoing, TransformContext
from async_processor.transforms.payload_url import PayloadUrl
from tests.doubles.daemon import QUEUE, daemon, message
from tests.fixtures.servers import free_port

pytestmark = pytest.mark.anyio

LIMIT = 1024
PAYLOAD = b'{"model": "m", "prompt": "from the store", "n": 12345678901234567890}'


@dataclass
class Server:
    url: str
    hits: Counter[str] = field(default_factory=Counter)
    forms: list[list[tuple[str, str]]] = field(default_factory=list)
    # The client's address of each connection a fetch came on, with the server's end of it.
    connections: dict[Any, asyncio.BaseTransport] = field(default_factory=dict)

    async def wait_all_closed(self) -> None:
        with anyio.fail_after(5):
            while not all(t.is_closing() for t in self.connections.values()):
                await anyio.sleep(0.01)


async def _payload(state: Server, request: web.Request) -> web.StreamResponse:
    """The payload server: ``/payload/<name>`` answers as its name says."""
    name = request.match_info["name"]
    state.hits[name] += 1
    if request.transport is not None:
        state.connections[request.transport.get_extra_info("peername")] = request.transport
    if name == "flaky" and state.hits[name] <= 2:
        return web.Response(status=(404, 500)[state.hits[name] - 1])
    if name == "never":
        return web.Response(status=503)
    if name == "big":
        return web.Response(body=b"{" + b" " * LIMIT + b"}")
    if name == "big-chunked":
        response = web.StreamResponse()
        response.enable_chunked_encoding()
        await response.prepare(request)
        for _ in range(4):
            await response.write(b" " * (LIMIT // 2))
        return response
    if name == "redirect":
        raise web.HTTPFound("/payload/ok")
    if name == "text":
        return web.Response(text="not json")
    return web.Response(body=PAYLOAD, content_type="application/json")


@pytest.fixture
async def server() -> AsyncIterator[Server]:
    state = Server(url="")

    async def payload(request: web.Request) -> web.StreamResponse:
        return await _payload(state, request)

    async def gateway(request: web.Request) -> web.Response:
        reader = await request.multipart()
        fields = []
        while (part := await reader.next()) is not None:
            assert isinstance(part, aiohttp.BodyPartReader)
            assert part.filename is None  # plain fields, never file parts
            fields.append((str(part.name), await part.text()))
        state.forms.append(fields)
        return web.json_response({"ok": True})

    app = web.Application()
    app.router.add_get("/payload/{name}", payload)
    app.router.add_post("/v1/audio", gateway)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    state.url = f"http://127.0.0.1:{port}"
    try:
        yield state
    finally:
        await runner.cleanup()


def chain(*entries: dict[str, Any]) -> TransformChain:
    config = TransformConfig.model_validate({"requestTransforms": list(entries)})
    return build_transform_chain(config, TransformContext(max_message_bytes=LIMIT))


# The test server is on loopback: these tests allow it explicitly.
LOCAL = {"allow": ["127.0.0.1"], "allow_private_addresses": True}
FETCH = {
    "name": "fetch",
    "type": "payload_url",
    "parameters": {"backoff_initial": 0.02, "backoff_max": 0.1, "attempt_timeout": 1, **LOCAL},
}


def fetching(**params: Any) -> TransformChain:
    return chain({**FETCH, "parameters": {**FETCH["parameters"], **params}})


async def fetch(c: TransformChain, url: str, budget: float = 5.0, **meta: str) -> Outgoing:
    metadata = {"payload_url": url, **meta}
    env = Envelope(request=Request(id="r", deadline=int(time.time() + 60), metadata=metadata))
    c.validate(env)
    out = Outgoing(url="u", body=env.request.payload, deadline=time.time() + budget)
    async with c.opened():
        await c.apply(env, out)
    return out


async def test_payload_is_fetched_verbatim(server: Server) -> None:
    out = await fetch(chain(FETCH), f"{server.url}/payload/ok?sig=secret")
    assert out.body == PAYLOAD and not out.body_claimed


async def test_messages_share_one_session_and_its_connection_until_the_chain_closes(
    server: Server,
) -> None:
    c = chain(FETCH)
    async with c.opened():
        for i in range(20):
            env = Envelope(
                request=Request(id=f"r{i}", deadline=int(time.time() + 60),
                                metadata={"payload_url": f"{server.url}/payload/ok"})
            )  # fmt: skip
            out = Outgoing(url="u", body=env.request.payload, deadline=time.time() + 5)
            await c.apply(env, out)
            assert out.body == PAYLOAD
        assert server.hits["ok"] == 20
        assert len(server.connections) == 1  # one keep-alive connection, not one per message
        assert not any(t.is_closing() for t in server.connections.values())
    await server.wait_all_closed()


async def test_apply_outside_the_open_chain_is_a_bug_not_a_fetch(server: Server) -> None:
    with pytest.raises(RuntimeError, match="apply before open"):
        await chain(FETCH).apply(
            Envelope(request=Request(id="r", deadline=int(time.time() + 60),
                                     metadata={"payload_url": f"{server.url}/payload/ok"})),
            Outgoing(url="u", body=b"null", deadline=time.time() + 5),
        )  # fmt: skip
    assert not server.hits


async def test_the_daemon_reuses_the_session_and_closes_it_at_shutdown(
    server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Hold the transform, so that only the daemon's shutdown, not the garbage collector,
    # can close its session.
    opened: list[PayloadUrl] = []
    open_session = PayloadUrl.open

    async def record(self: PayloadUrl) -> None:
        opened.append(self)
        await open_session(self)

    monkeypatch.setattr(PayloadUrl, "open", record)
    config = TransformConfig.model_validate({"requestTransforms": [FETCH]})
    meta = {"metadata": {"payload_url": f"{server.url}/payload/ok"}}
    async with daemon(workers=1, transforms=config) as (_, transport, simulator):
        transport.put(QUEUE, *(message(f"r{i}", time.time() + 60, **meta) for i in range(10)))
        results = await transport.wait_results(10)
        assert {r.status_code for r in results.values()} == {200}
        assert server.hits["ok"] == 10 and simulator.stats["total"] == 10
        assert len(server.connections) == 1
        assert not any(t.is_closing() for t in server.connections.values())
    assert len(opened) == 1
    await server.wait_all_closed()  # the daemon's shutdown closed the transform's session


async def test_404_then_500_then_success_is_retried(server: Server) -> None:
    out = await fetch(chain(FETCH), f"{server.url}/payload/flaky")
    assert out.body == PAYLOAD
    assert server.hits["flaky"] == 3


async def test_never_available_until_the_deadline_is_payload_unavailable(server: Server) -> None:
    started = time.monotonic()
    with pytest.raises(PayloadUnavailable) as info:
        await fetch(chain(FETCH), f"{server.url}/payload/never?X-Goog-Signature=secret", 0.5)
    elapsed = time.monotonic() - started
    assert 0.45 <= elapsed < 3
    assert server.hits["never"] >= 3  # retried, with backoff
    assert str(info.value).startswith("transform fetch/payload_url: payload at http://127.0.0.1:")
    assert "secret" not in str(info.value)


async def test_unreachable_host_is_retried_until_the_deadline() -> None:
    with pytest.raises(PayloadUnavailable):
        await fetch(chain(FETCH), f"http://127.0.0.1:{free_port()}/payload", 0.3)


@pytest.mark.parametrize("name", ["big", "big-chunked"])
async def test_oversize_payload_is_invalid_at_once(server: Server, name: str) -> None:
    with pytest.raises(InvalidMessage, match=f"exceeds the {LIMIT}-byte limit") as info:
        await fetch(chain(FETCH), f"{server.url}/payload/{name}")
    assert info.value.reason == "too_large"
    assert server.hits[name] == 1


async def test_fetched_body_that_is_not_json_is_invalid(server: Server) -> None:
    with pytest.raises(InvalidMessage, match="not a JSON object"):
        await fetch(chain(FETCH), f"{server.url}/payload/text")


async def test_payload_url_must_be_http() -> None:
    with pytest.raises(InvalidMessage, match="not an http"):
        await fetch(chain(FETCH), "file:///etc/passwd")


async def test_fetched_payload_flows_into_set_params_and_multipart(server: Server) -> None:
    """payload_url -> set_params -> gcs_uri_multipart, posted to a gateway that parses it."""
    signed = "https://storage.googleapis.com/b/a.wav?X-Goog-Date=20990101T000000Z&X-Goog-Expires=60"
    store = {"name": "fetch", "type": "payload_url", "parameters": LOCAL}
    edit = {"name": "gcs-uri", "type": "set_params", "parameters": {"default": {"gcs_uri": signed}}}
    audio = {"name": "audio", "type": "gcs_uri_multipart", "parameters": {"providers": ["openai"]}}
    async with aiohttp.ClientSession() as session:
        out = await fetch(chain(store, edit, audio), f"{server.url}/payload/ok", provider="openai")
        async with session.post(
            f"{server.url}/v1/audio", data=out.body, headers={"Content-Type": out.content_type}
        ) as response:
            assert response.status == 200
    assert server.forms == [
        [
            ("url", signed),
            ("model", "m"),
            ("prompt", "from the store"),
            ("n", "12345678901234567890"),
        ]
    ]


# ------------------------------------------------------------ the URL is the message's


@pytest.mark.parametrize("allow", [[], ["127.0.0.1/path"], ["ftp://127.0.0.1/"]])
def test_payload_url_without_a_usable_allow_list_refuses_to_start(allow: list[str]) -> None:
    with pytest.raises(ConfigError, match="allow"):
        chain({**FETCH, "parameters": {"allow": allow}})


@pytest.mark.parametrize(
    ("allow", "path"),
    [
        (["{url}/payload/"], "/other"),
        (["{url}/payload"], "/payload-other/ok"),
        (["{url}/payload/"], "/payload/../other"),
        (["{url}/payload/"], "/payload/%2e%2e/other"),
        (["store.example.com"], "/payload/ok"),
        (["*.example.com"], "/payload/ok"),
        (["http://127.0.0.1:1/payload/"], "/payload/ok"),  # another port
    ],
)
async def test_urls_off_the_allow_list_are_refused_before_any_fetch(
    server: Server, allow: list[str], path: str
) -> None:
    c = fetching(allow=[a.format(url=server.url) for a in allow])
    with pytest.raises(InvalidMessage, match="Failed to validate request") as info:
        await fetch(c, f"{server.url}{path}")
    assert info.value.reason == "bad_payload_url"
    assert not server.hits


async def test_a_prefix_on_the_allow_list_is_fetched(server: Server) -> None:
    out = await fetch(fetching(allow=[f"{server.url}/payload/"]), f"{server.url}/payload/ok")
    assert out.body == PAYLOAD


async def test_redirects_are_not_followed(server: Server) -> None:
    with pytest.raises(InvalidMessage, match="HTTP 302: redirects are not followed"):
        await fetch(chain(FETCH), f"{server.url}/payload/redirect")
    assert server.hits == {"redirect": 1}  # the target was never asked


@pytest.mark.parametrize(
    ("host", "why"),
    [
        ("127.0.0.1", "is not a public address"),
        ("localhost", "resolves to an address that is not public"),
        ("169.254.169.254", "is not a public address"),  # the cloud metadata server
        ("[::1]", "is not a public address"),
    ],
)
async def test_non_public_addresses_are_refused_unless_allowed(
    server: Server, host: str, why: str
) -> None:
    port = server.url.rpartition(":")[2]
    c = fetching(allow=["127.0.0.1", "localhost", "169.254.169.254", "::1"],
                 allow_private_addresses=False)  # fmt: skip
    with pytest.raises(InvalidMessage, match=why) as info:
        await fetch(c, f"http://{host}:{port}/payload/ok")
    assert info.value.reason == "bad_payload_url"
    assert not server.hits
