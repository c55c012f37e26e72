"""The health and metrics servers over real HTTP on free ports."""

from __future__ import annotations

import contextlib
import functools
import gzip
import logging
import os
import socket
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import anyio
import pytest
from prometheus_client import CollectorRegistry, Counter

from async_processor import health
from async_processor.errors import ConfigError

pytestmark = pytest.mark.anyio


@asynccontextmanager
async def running(
    serve: Callable[..., Coroutine[Any, Any, None]], *args: object, **kwargs: object
) -> AsyncIterator[str]:
    """Start ``serve`` on a free port in a task group; yield its base URL; stop it."""
    async with anyio.create_task_group() as tg:
        port = await tg.start(functools.partial(serve, *args, **kwargs))
        assert port > 0
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            tg.cancel_scope.cancel()


async def get(url: str, headers: dict[str, str] | None = None) -> tuple[int, str, str]:
    async with aiohttp.ClientSession() as session, session.get(url, headers=headers) as resp:
        return resp.status, resp.headers.get("Content-Type", ""), await resp.text()


async def test_healthz_ok_and_readiness_toggles() -> None:
    state: dict[str, str | None] = {"reason": "starting"}

    async def readiness() -> str | None:
        return state["reason"]

    async with running(health.serve_health, "127.0.0.1", 0, readiness) as base:
        status, ctype, body = await get(f"{base}/healthz")
        assert (status, body) == (200, '{"status": "ok"}')
        assert ctype.startswith("application/json")

        status, ctype, body = await get(f"{base}/readyz")
        assert status == 503
        assert ctype.startswith("application/json")
        assert body == '{"status": "not ready", "error": "starting"}'

        state["reason"] = None
        status, _, body = await get(f"{base}/readyz")
        assert (status, body) == (200, '{"status": "ready"}')

        state["reason"] = "draining"
        status, _, body = await get(f"{base}/readyz")
        assert status == 503 and '"draining"' in body


async def test_readiness_that_raises_or_hangs_is_not_ready(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(health, "READINESS_TIMEOUT", 0.2)
    mode = {"value": "raise"}

    async def readiness() -> str | None:
        if mode["value"] == "raise":
            raise RuntimeError("redis down")
        await anyio.sleep(5)
        return None

    async with running(health.serve_health, "127.0.0.1", 0, readiness) as base:
        status, _, body = await get(f"{base}/readyz")
        assert status == 503 and "redis down" in body
        mode["value"] = "hang"
        with anyio.fail_after(3):
            status, _, body = await get(f"{base}/readyz")
        assert status == 503 and "timed out" in body


async def test_readiness_reasons_never_show_credentials() -> None:
    async def readiness() -> str | None:
        # What a driver's error may quote: the URL it was given, credentials and all.
        raise RuntimeError(
            "cannot reach rediss://app:hunter2@redis:6380/0?password=hunter2&db=0 "
            "or https://gw/v1?token=tok-1&sig=s1&x-api-key=k1"
        )

    async with running(health.serve_health, "127.0.0.1", 0, readiness) as base:
        status, _, body = await get(f"{base}/readyz")
    assert status == 503
    for secret in ("hunter2", "tok-1", "s1", "k1"):
        assert secret not in body
    assert "rediss://app:***@redis:6380/0?password=***&db=0" in body
    assert "https://gw/v1?token=***&sig=***&x-api-key=***" in body


def _registry() -> CollectorRegistry:
    registry = CollectorRegistry()
    Counter("llm_d_async_async_request", "doc", registry=registry).inc(3)
    return registry


async def test_metrics_exposition_without_token() -> None:
    async with running(health.serve_metrics, "127.0.0.1", 0, _registry()) as base:
        status, ctype, body = await get(f"{base}/metrics")
    assert status == 200
    assert ctype.startswith("text/plain") and "version=" in ctype
    assert "llm_d_async_async_request_total 3.0" in body


async def test_metrics_bearer_token() -> None:
    async with running(
        health.serve_metrics, "127.0.0.1", 0, _registry(), bearer_token="s3cret"
    ) as base:
        status, _, body = await get(f"{base}/metrics")
        assert status == 401 and "llm_d_async" not in body
        status, _, _ = await get(f"{base}/metrics", {"Authorization": "Bearer wrong"})
        assert status == 401
        status, _, _ = await get(f"{base}/metrics", {"Authorization": "s3cret"})
        assert status == 401
        status, _, body = await get(f"{base}/metrics", {"Authorization": "Bearer s3cret"})
        assert status == 200 and "llm_d_async_async_request_total 3.0" in body


async def test_metrics_negotiates_openmetrics_and_gzip_behind_the_token() -> None:
    """prometheus-client's handler: OpenMetrics on request, gzip on request; token first."""
    openmetrics = "application/openmetrics-text; version=1.0.0"
    auth = {"Authorization": "Bearer s3cret"}
    async with (
        running(health.serve_metrics, "127.0.0.1", 0, _registry(), bearer_token="s3cret") as base,
        aiohttp.ClientSession(auto_decompress=False) as session,
    ):
        async with session.get(f"{base}/metrics", headers={"Accept": openmetrics}) as r:
            assert r.status == 401  # negotiation does not get around the token
        headers = {**auth, "Accept": openmetrics, "Accept-Encoding": "gzip"}
        async with session.get(f"{base}/metrics", headers=headers) as r:
            assert r.status == 200
            assert r.headers["Content-Type"].startswith("application/openmetrics-text")
            assert r.headers["Content-Encoding"] == "gzip"
            body = gzip.decompress(await r.read()).decode()
    assert "llm_d_async_async_request_total 3.0" in body and body.endswith("# EOF\n")


async def test_a_non_utf8_authorization_header_is_401_not_500() -> None:
    # aiohttp keeps undecodable header bytes as surrogates; str.encode() raised on them.
    async with running(
        health.serve_metrics, "127.0.0.1", 0, _registry(), bearer_token="s3cret"
    ) as base:
        port = int(base.rsplit(":", 1)[1])

        def raw_get() -> bytes:
            with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
                sock.sendall(
                    b"GET /metrics HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xff\r\n"
                    b"Connection: close\r\n\r\n"
                )
                return sock.recv(100).split(b"\r\n")[0]

        assert await anyio.to_thread.run_sync(raw_get) == b"HTTP/1.1 401 Unauthorized"


async def test_taken_port_is_a_config_error_naming_it() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]

        async def ready() -> None:
            return None

        with pytest.raises(ExceptionGroup) as caught:
            async with anyio.create_task_group() as tg:
                await tg.start(health.serve_health, "127.0.0.1", port, ready)
    assert caught.group_contains(
        ConfigError, match=f"127.0.0.1:{port} .*(?i:address already in use)"
    )


async def test_cancel_stops_the_server() -> None:
    async def ready() -> None:
        return None

    async with running(health.serve_health, "127.0.0.1", 0, ready) as base:
        assert (await get(f"{base}/healthz"))[0] == 200
    with pytest.raises(aiohttp.ClientConnectionError):
        await get(f"{base}/healthz")


async def _ready() -> None:
    return None


def _server(name: str) -> tuple[Callable[..., Coroutine[Any, Any, None]], str, int, object]:
    if name == "health":
        return health.serve_health, "127.0.0.1", 0, _ready
    return health.serve_metrics, "127.0.0.1", 0, _registry()


@pytest.mark.parametrize("name", ["health", "metrics"])
async def test_a_half_sent_request_is_closed_after_the_header_timeout(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # aiohttp waited its keep-alive default (an hour) for the rest of the request line, so
    # a few slow clients could hold the probe and scrape ports' connections indefinitely.
    monkeypatch.setattr(health, "HEADER_TIMEOUT", 0.5)
    async with running(*_server(name)) as base:
        port = int(base.rsplit(":", 1)[1])
        async with await anyio.connect_tcp("127.0.0.1", port) as stream:
            await stream.send(b"GET /healthz HT")
            with anyio.fail_after(10), pytest.raises(anyio.EndOfStream):
                await stream.receive()


@pytest.mark.parametrize("name", ["health", "metrics"])
async def test_a_malformed_request_is_one_debug_line_without_traceback(
    name: str, caplog: pytest.LogCaptureFixture
) -> None:
    # aiohttp logged every unparsable request at error level with its traceback.
    caplog.set_level(logging.DEBUG, logger="aiohttp.server")
    async with running(*_server(name)) as base:
        port = int(base.rsplit(":", 1)[1])
        for raw in (b"GET / HTTP/1.1\r\nBad Header\r\n\r\n", b"\x16\x03\x01 TLS\r\n\r\n"):
            async with await anyio.connect_tcp("127.0.0.1", port) as stream:
                await stream.send(raw)
                assert (await stream.receive()).startswith(b"HTTP/1.0 400 ")
    records = [r for r in caplog.records if r.name == "aiohttp.server"]
    assert [(r.levelno, r.exc_info, "\n" in r.getMessage()) for r in records] == [
        (logging.DEBUG, None, False)
    ] * 2


def _server_sockets(port: int) -> int:
    """This process's open sockets whose local port is ``port``: the server's listener and
    its connections (a client's socket has the port as its remote end)."""
    ours = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith("socket:["):
                ours.add(target[8:-1])
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as lines:
            for line in lines.readlines()[1:]:
                fields = line.split()
                local_port = int(fields[1].rsplit(":", 1)[1], 16)
                count += local_port == port and fields[9] in ours
    return count


@pytest.mark.parametrize("name", ["health", "metrics"])
async def test_a_flood_of_idle_and_slow_connections_leaves_probes_answered_and_fds_bounded(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each connection held a file descriptor for up to the header timeout, without a cap:
    # a client opening them faster than they time out could run the daemon out of fds.
    monkeypatch.setattr(health, "MAX_CONNECTIONS", 8)
    monkeypatch.setattr(health, "HEADER_TIMEOUT", 600)  # only the cap may close them
    path = "/healthz" if name == "health" else "/metrics"
    async with running(*_server(name)) as base, contextlib.AsyncExitStack() as flood:
        port = int(base.rsplit(":", 1)[1])
        for n in range(200):
            stream = await flood.enter_async_context(await anyio.connect_tcp("127.0.0.1", port))
            if n % 2:  # a slow sender: its headers never finish
                await stream.send(b"GET / HTTP/1.1\r\nX-Slow: ")
        for _ in range(3):
            status, _, _ = await get(f"{base}{path}")
            assert status == 200
            # The flood's connections were all accepted before the probe's (one queue).
            assert _server_sockets(port) <= 1 + 8


async def test_at_the_cap_requests_in_progress_are_answered_and_a_newcomer_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(health, "MAX_CONNECTIONS", 3)
    release = anyio.Event()
    waiting = 0

    async def readiness() -> str | None:
        nonlocal waiting
        waiting += 1
        await release.wait()
        return None

    async with running(health.serve_health, "127.0.0.1", 0, readiness) as base:
        port = int(base.rsplit(":", 1)[1])
        results: list[int] = []

        async def probe() -> None:
            results.append((await get(f"{base}/readyz"))[0])

        async with anyio.create_task_group() as tg:
            for _ in range(3):
                tg.start_soon(probe)
            while waiting < 3:  # all three in their handler
                await anyio.sleep(0.01)
            # Closed unanswered (sending nothing, so it is a clean close, never a reset).
            async with await anyio.connect_tcp("127.0.0.1", port) as stream:
                with anyio.fail_after(10), pytest.raises(anyio.EndOfStream):
                    await stream.receive()
            release.set()
        assert results == [200] * 3
        assert (await get(f"{base}/healthz"))[0] == 200
