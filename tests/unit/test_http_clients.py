"""The ``HttpClient`` contract, against every implementation (``httpclients.HTTP_CLIENTS``).

A local aiohttp gateway (plain, TLS, mTLS) and a raw socket server that reports when the
client hangs up. Each test runs once per client: what dispatch and the retry rules rely
on must not depend on the library chosen with ``--http-client``.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import get_args

import anyio
import pytest
from aiohttp import web
from httptools import HttpResponseParser
from multidict import CIMultiDict

from async_processor.config import RuntimeConfig, TLSConfig, load_config
from async_processor.errors import ConfigError, NoAnswer
from async_processor.httpclients import HTTP_CLIENTS, build_http_client, h1_connection
from async_processor.httpclients.base import (
    Answer,
    AnswerTooLarge,
    AttemptTimeout,
    HttpClient,
    Unsendable,
)
from async_processor.httpclients.h1_connection import Connection
from async_processor.httpclients.httptools_client import HttptoolsClient
from tests.fixtures.httpclients import client_for, each_loop  # noqa: F401 (each loop)
from tests.fixtures.redis_modes import Certs
from tests.unit.test_config import sortedset_args

pytestmark = pytest.mark.anyio
TEN_MB = 10 * 10**6
BIG = b"y" * TEN_MB
Seen = list[tuple[str, bytes, CIMultiDict[str]]]
SEEN = web.AppKey("seen", Seen)


async def _handle(request: web.Request) -> web.StreamResponse:
    body = await request.read()
    request.app[SEEN].append((request.path, body, CIMultiDict(request.headers)))
    if request.path == "/redirect":
        raise web.HTTPTemporaryRedirect("/stolen")
    if request.path == "/hang":
        await asyncio.sleep(30)
    if request.path in ("/stall", "/chunked", "/big-chunked"):
        response = web.StreamResponse()
        response.enable_chunked_encoding()
        await response.prepare(request)
        if request.path == "/stall":
            await response.write(b"x")
            await asyncio.sleep(30)
        for _ in range(5 if request.path == "/chunked" else 10):
            await response.write(b"c" * 1000 if request.path == "/chunked" else BIG[: 10**6])
        return response
    if request.path == "/big":
        return web.Response(body=BIG)
    headers = {"Retry-After": "3", "x-llm-d-request-dropped-reason": "queue-full"}
    return web.Response(status=503 if request.path == "/busy" else 200, body=body, headers=headers)


@asynccontextmanager
async def gateway(tls: ssl.SSLContext | None = None) -> AsyncIterator[tuple[str, Seen]]:
    app = web.Application(client_max_size=TEN_MB * 2)
    seen: Seen = []
    app[SEEN] = seen
    app.router.add_route("*", "/{tail:.*}", _handle)
    runner = web.AppRunner(app, shutdown_timeout=0.1)  # hung handlers are cut
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=tls)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"{'https' if tls else 'http'}://127.0.0.1:{port}", seen
    finally:
        await runner.cleanup()


async def _post(client: HttpClient, url: str, *, timeout: float = 5, limit: int = TEN_MB) -> Answer:
    headers = {"Content-Type": "application/json", "x-test": "1"}
    return await client.post(url, memoryview(b'{"p":1}'), headers, timeout=timeout, limit=limit)


async def test_answer_carries_status_body_and_the_retry_headers(client: HttpClient) -> None:
    async with gateway() as (url, seen):
        answer = await _post(client, url + "/v1/completions")
        busy = await _post(client, url + "/busy")
    assert answer == Answer(200, b'{"p":1}', "3", "queue-full")
    assert busy.status == 503
    path, body, headers = seen[0]
    assert (path, body, headers["x-test"]) == ("/v1/completions", b'{"p":1}', "1")


async def test_a_redirect_is_the_answer_and_never_followed(client: HttpClient) -> None:
    async with gateway() as (url, seen):
        answer = await _post(client, url + "/redirect")
    assert answer.status == 307
    assert [s[0] for s in seen] == ["/redirect"]


@pytest.mark.parametrize("path", ["/hang", "/stall"])
async def test_the_timeout_covers_headers_and_body(client: HttpClient, path: str) -> None:
    async with gateway() as (url, _):
        started = time.monotonic()
        with pytest.raises(AttemptTimeout) as caught:
            await _post(client, url + path, timeout=0.3)
        assert time.monotonic() - started < 5
    assert not caught.value.fatal


@pytest.mark.parametrize("path", ["/big", "/big-chunked"])
async def test_an_answer_over_the_limit_is_refused_and_fatal(client: HttpClient, path: str) -> None:
    async with gateway() as (url, _):
        with pytest.raises(AnswerTooLarge, match="larger than 4096 bytes") as caught:
            await _post(client, url + path, limit=4096)
        whole = await _post(client, url + path)  # 10 MB within the default 64 MB cap
        small = await _post(client, url + "/chunked", limit=5000)  # exactly at the limit
    assert caught.value.fatal
    assert len(whole.body) == TEN_MB
    assert small.body == b"c" * 5000


async def test_no_listener_is_a_retryable_no_answer(client: HttpClient) -> None:
    with pytest.raises(NoAnswer) as caught:
        await _post(client, "http://127.0.0.1:1/v1/completions")
    assert not caught.value.fatal
    assert not isinstance(caught.value, AttemptTimeout)


async def test_an_invalid_url_can_never_be_sent(client: HttpClient) -> None:
    with pytest.raises(Unsendable) as caught:
        await _post(client, "http://[::1/v1/completions")
    assert caught.value.fatal


async def test_a_cancel_scope_ends_a_call_quietly(client: HttpClient) -> None:
    """The deadline, a producer's cancel and the drain timeout are anyio cancel scopes: the
    call ends where the scope is, and nothing escapes past it."""
    async with gateway() as (url, _):
        with anyio.move_on_after(0.2) as scope:
            await _post(client, url + "/hang")
        assert scope.cancelled_caught
        assert (await _post(client, url + "/ok")).status == 200  # the client still works


async def test_a_cancelled_call_hangs_up_on_the_gateway(
    client: HttpClient, client_name: str, request: pytest.FixtureRequest
) -> None:
    """How a producer's cancel and the drain timeout stop the work at the gateway."""
    if client_name == "pyreqwest":  # strict: a pyreqwest that aborts on cancel is news
        reason = (
            "pyreqwest 0.15 drops the tokio JoinHandle on cancel without aborting the task: "
            "the request runs on until its own timeout"
        )
        request.applymarker(pytest.mark.xfail(strict=True, reason=reason))
    hung_up = anyio.Event()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        while await reader.read(65536):  # the body, then nothing until the client closes
            pass
        hung_up.set()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        with anyio.move_on_after(0.3):
            await _post(client, f"http://127.0.0.1:{port}/v1/completions")
        with anyio.fail_after(3):  # the call's own timeout is 5 s
            await hung_up.wait()


async def test_connections_to_a_gateway_never_outnumber_the_calls_in_flight(
    client: HttpClient,
) -> None:
    """No client needs a cap of its own on open connections (httptools sets none): a
    connection is opened only when no idle one is free, so a gateway sees at most as many
    as the calls in flight at once, which the workers bound."""
    accepted = 0

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal accepted
        accepted += 1
        try:
            while head := await reader.readuntil(b"\r\n\r\n"):
                length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                await reader.readexactly(length)
                await asyncio.sleep(0.05)  # the wave's calls are all in flight at once
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1/completions"
    async with server:
        for _ in range(4):  # waves of 8 calls at once
            async with anyio.create_task_group() as tg:
                for _ in range(8):
                    tg.start_soon(_post, client, url)
    assert 0 < accepted <= 8


@pytest.fixture(scope="module")
def server_tls(certs: Certs) -> Iterator[tuple[ssl.SSLContext, ssl.SSLContext]]:
    """(TLS, mTLS) server contexts: the second requires a client certificate."""
    plain = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    plain.load_cert_chain(certs.server_cert, certs.server_key)
    mutual = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    mutual.load_cert_chain(certs.server_cert, certs.server_key)
    mutual.load_verify_locations(certs.ca)
    mutual.verify_mode = ssl.CERT_REQUIRED
    yield plain, mutual


async def test_tls_trusts_the_configured_ca_only(
    client_name: str, certs: Certs, server_tls: tuple[ssl.SSLContext, ssl.SSLContext]
) -> None:
    async with gateway(server_tls[0]) as (url, _):
        async with client_for(client_name, TLSConfig(ca_cert=str(certs.ca))) as client:
            assert (await _post(client, url + "/ok")).status == 200
        async with client_for(client_name, TLSConfig(ca_cert=str(certs.other_ca))) as client:
            with pytest.raises(NoAnswer):
                await _post(client, url + "/ok")
        async with client_for(client_name, TLSConfig(insecure_skip_verify=True)) as client:
            assert (await _post(client, url + "/ok")).status == 200


async def test_mtls_presents_the_client_certificate(
    client_name: str, certs: Certs, server_tls: tuple[ssl.SSLContext, ssl.SSLContext]
) -> None:
    mutual = TLSConfig(
        ca_cert=str(certs.ca), cert=str(certs.client_cert), key=str(certs.client_key)
    )
    async with gateway(server_tls[1]) as (url, _):
        async with client_for(client_name, mutual) as client:
            assert (await _post(client, url + "/ok")).status == 200
        async with client_for(client_name, TLSConfig(ca_cert=str(certs.ca))) as client:
            with pytest.raises(NoAnswer):
                await _post(client, url + "/ok")


def test_unreadable_certificates_are_a_config_error(client_name: str, certs: Certs) -> None:
    bad = TLSConfig(cert=str(certs.ca), key=str(certs.ca))  # a certificate is not a key
    with pytest.raises(ConfigError, match="--tls"):
        build_http_client(client_name, bad, 16)


def test_the_flag_names_every_client_and_defaults_to_httptools(tmp_path: Path) -> None:
    args = sortedset_args(tmp_path)
    assert load_config(args, {}).runtime.http_client == "httptools"
    env = {"ASYNC_PROCESSOR_HTTP_CLIENT": "pyreqwest"}
    assert load_config(args, env).runtime.http_client == "pyreqwest"
    choices = get_args(RuntimeConfig.model_fields["http_client"].annotation)
    assert set(choices) == set(HTTP_CLIENTS)
    with pytest.raises(ConfigError, match="--http-client"):
        load_config([*args, "--http-client", "httpx"], {})


async def test_httptools_makes_a_parser_only_for_an_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    """A request in flight mostly waits for its answer: its connection holds no parser
    (~0.85 KB each, issue 13's 10,000 in flight) until the answer's first bytes, and lets
    it go once the answer is complete; the connection is still reused."""
    made: list[HttpResponseParser] = []

    def parser(protocol: Connection) -> HttpResponseParser:
        made.append(HttpResponseParser(protocol))
        return made[-1]

    monkeypatch.setattr(h1_connection, "HttpResponseParser", parser)
    client = HttptoolsClient(TLSConfig(), 1)
    try:
        async with gateway() as (url, _):
            with anyio.move_on_after(0.3):
                await _post(client, url + "/hang")
            assert made == []  # sent, and waited without one
            for _ in range(2):
                assert (await _post(client, url + "/ok")).status == 200
            (conn,) = (c for idle in client._idle.values() for c in idle)  # one, reused
            assert conn.parser is None
            assert len(made) == 2  # one per answer
    finally:
        await client.aclose()
