"""Health and metrics HTTP servers: /healthz, /readyz and /metrics (no Kubernetes API).

Input: a readiness callback (None = ready, else the reason) and a Prometheus registry.
Output: two aiohttp servers, each run inside the caller's task group: ``task_status``
receives the bound port once listening, and cancelling the task stops the server.
A port already taken is a ``ConfigError`` naming it (fail fast at startup).
``listening`` (an aiohttp app served for the length of a block) is shared with the
inference simulator.

Both ports are open to anything that can reach the pod, so a client gets
``HEADER_TIMEOUT`` to send its request's headers (from connecting, or from the previous
response) before the connection is closed: a half-sent request cannot hold one for
aiohttp's default hour; and each server holds at most ``MAX_CONNECTIONS`` connections
(aiohttp has no such cap): at the cap a new connection takes the place of the oldest one
waiting for a request, or is closed at once if every one is in the middle of a request,
so a flood of idle or half-sent connections costs neither file descriptors nor the
probes' and scrapers' answers. A client that asks and never reads its answers counts as
idle there: past the cap its connection gives way to a new one. The /metrics page is
rendered at most once per ``RENDER_EVERY`` for each form asked (text or OpenMetrics,
gzip or not, a ``name[]`` filter), and served from that render meanwhile, so 200 clients
that pipeline requests cost one render a second, not one per request (issue 30, item 4).
A malformed request is one debug line, not an error traceback.
"""

from __future__ import annotations

import asyncio
import gzip
import hmac
import logging
import math
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from typing import Any

import anyio
import structlog
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.typedefs import Handler
from aiohttp.web_protocol import RequestHandler
from anyio.abc import TaskStatus
from prometheus_client import CollectorRegistry, Counter, disable_created_metrics
from prometheus_client.exposition import choose_encoder, gzip_accepted
from prometheus_client.metrics_core import Metric

from async_processor.errors import ConfigError
from async_processor.logs import mask_url

READINESS_TIMEOUT = 3.0
SHUTDOWN_TIMEOUT = 5.0
# Probes and scrapers send a request in milliseconds; an idle keep-alive reconnects.
HEADER_TIMEOUT = 10.0
# Probes and scrapers hold a connection or two each; far below the fd limit.
MAX_CONNECTIONS = 64
# The /metrics page is rendered at most this often (per form): below any scrape interval,
# so every scrape still sees a fresh page, while a flood of requests costs one render.
RENDER_EVERY = 1.0
# Distinct page forms (format, gzip, name[] filter) rendered per RENDER_EVERY; past it, a
# new form is answered 429: varying the filter must not buy a render per request.
MAX_FORMS = 8

Readiness = Callable[[], Awaitable[str | None]]
log = structlog.get_logger(__name__)


async def serve_health(
    host: str,
    port: int,
    readiness: Readiness,
    *,
    task_status: TaskStatus[int] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """GET /healthz (always ok) and GET /readyz (asks ``readiness``, 3 s at most)."""

    async def healthz(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def readyz(_: web.Request) -> web.Response:
        reason = await _check(readiness)
        if reason is None:
            return web.json_response({"status": "ready"})
        # The reason may quote a driver's error, and with it a URL's credentials.
        return web.json_response({"status": "not ready", "error": mask_url(reason)}, status=503)

    app = web.Application()
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    await _serve(app, host, port, "health", task_status)


async def serve_metrics(
    host: str,
    port: int,
    registry: CollectorRegistry,
    *,
    bearer_token: str = "",
    routes: Mapping[str, Handler] | None = None,
    renders: Counter | None = None,
    task_status: TaskStatus[int] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """GET /metrics (and any extra GET ``routes``), ``Bearer <token>`` required if set.

    As prometheus-client's handler: the text format, or OpenMetrics when the scraper asks
    for it (``Accept``), gzip when it accepts that, ``name[]`` filters; rendered by
    ``MetricsPage`` (``renders`` counts its renders).
    """
    expected = f"Bearer {bearer_token}".encode()
    # No ``<counter>_created`` series: they doubled every counter's and histogram's series
    # (the Go daemon's client exports none), and nothing here reads them.
    disable_created_metrics()  # type: ignore[no-untyped-call]

    def guarded(handler: Handler) -> Handler:
        async def check(request: web.Request) -> web.StreamResponse:
            if bearer_token and not _authorized(request, expected):
                return web.Response(
                    status=401, text="unauthorized\n", headers={"WWW-Authenticate": "Bearer"}
                )
            return await handler(request)

        return check

    app = web.Application()
    page = MetricsPage(registry, renders)
    for path, handler in {"/metrics": page.handle, **(routes or {})}.items():
        app.router.add_get(path, guarded(handler))
    await _serve(app, host, port, "metrics", task_status)


class MetricsPage:
    """The /metrics page: the registry collected at most once per ``RENDER_EVERY``, each
    form encoded once per collection (at most ``MAX_FORMS``), and served from there."""

    def __init__(
        self,
        registry: CollectorRegistry,
        renders: Counter | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._registry = registry
        self._renders = renders
        self._clock = clock
        self._collected_at = -math.inf
        self._families: list[Metric] = []
        # Each form's body and headers, for the current collection.
        self._forms: dict[tuple[str, bool, frozenset[str]], tuple[bytes, dict[str, str]]] = {}

    async def handle(self, request: web.Request) -> web.Response:
        encoder, content_type = choose_encoder(",".join(request.headers.getall("Accept", [])))
        names = frozenset(request.query.getall("name[]", []))
        gzipped = gzip_accepted(request.headers.get("Accept-Encoding", ""))
        if self._clock() - self._collected_at >= RENDER_EVERY:
            self._collect()
        form = (content_type, gzipped, names)
        if (cached := self._forms.get(form)) is None:
            if len(self._forms) >= MAX_FORMS:
                return web.Response(status=429, text="too many page forms\n", headers=_AGAIN)
            body = encoder(_Families(self._families, names))
            headers = {"Content-Type": content_type}
            if gzipped:
                body, headers["Content-Encoding"] = gzip.compress(body, 6), "gzip"
            cached = self._forms[form] = (body, headers)
        return web.Response(body=cached[0], headers=cached[1])

    def _collect(self) -> None:
        if self._renders is not None:
            self._renders.inc()  # before collecting, so the page counts itself
        self._families = list(self._registry.collect())
        self._collected_at = self._clock()
        self._forms = {}


_AGAIN = {"Retry-After": f"{RENDER_EVERY:g}"}


class _Families:
    """Collected families as a registry for prometheus-client's encoders, with only the
    samples named ``names`` when any are (as its ``restricted_registry``)."""

    def __init__(self, families: list[Metric], names: frozenset[str]) -> None:
        self._families = families
        self._names = names

    def collect(self) -> list[Metric]:
        if not self._names:
            return self._families
        kept = []
        for family in self._families:
            samples = [s for s in family.samples if s.name in self._names]
            if samples:
                copy = Metric(family.name, family.documentation, family.type, family.unit)
                copy.samples = samples
                kept.append(copy)
        return kept


async def _check(readiness: Readiness) -> str | None:
    """The readiness reason; a timeout or an exception is a reason too."""
    try:
        with anyio.fail_after(READINESS_TIMEOUT):
            return await readiness()
    except TimeoutError:
        return f"readiness check timed out after {READINESS_TIMEOUT:g}s"
    except Exception as exc:  # a broken check means "not ready", never a 500
        log.warning("readiness_check_failed", error=repr(exc))
        return str(exc) or type(exc).__name__


def _authorized(request: web.Request, expected: bytes) -> bool:
    # Undecodable header bytes arrive as surrogates: turn them back into the same bytes.
    given = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
    return hmac.compare_digest(given, expected)


class _BadRequests(logging.LoggerAdapter[logging.Logger]):
    """aiohttp's server logger, where a client's unparsable request is one debug line.

    aiohttp logs each one at error level with a traceback, so anyone who can reach the
    port could fill the logs; an error in our own handlers keeps its traceback."""

    def log(self, level: int, msg: object, *args: object, exc_info: Any = None, **kw: Any) -> None:
        if isinstance(exc_info, HttpProcessingError):
            reason = (exc_info.message or "").partition("\n")[0]
            super().log(logging.DEBUG, f"{msg}: %s %s", *args, exc_info.code, reason, **kw)
        else:
            super().log(level, msg, *args, exc_info=exc_info, **kw)


async def _serve(
    app: web.Application, host: str, port: int, name: str, task_status: TaskStatus[int]
) -> None:
    server_log = _BadRequests(logging.getLogger("aiohttp.server"))
    try:
        async with listening(
            app, host, port, shutdown_timeout=SHUTDOWN_TIMEOUT,
            keepalive_timeout=HEADER_TIMEOUT, logger=server_log,
            max_connections=MAX_CONNECTIONS,
        ) as bound:  # fmt: skip
            log.info("server_listening", server=name, host=host, port=bound)
            task_status.started(bound)
            await anyio.sleep_forever()
    except OSError as exc:  # only listening raises it: the body just logs and sleeps
        reason = os.strerror(exc.errno) if exc.errno else str(exc)
        raise ConfigError(
            f"cannot listen on {host}:{port} for the {name} server: {reason}"
        ) from None


@asynccontextmanager
async def listening(
    app: web.Application,
    host: str,
    port: int,
    *,
    backlog: int = 128,
    max_connections: int | None = None,
    handler_cancellation: bool = False,
    shutdown_timeout: float = 60.0,
    **handler: Any,
) -> AsyncIterator[int]:
    """``app`` served on ``host:port`` for the block; yields the bound port (``port=0``
    picks one). ``OSError`` when it cannot listen; the runner is cleaned up even when
    the block is cancelled. ``max_connections``: see ``_Doorman`` (None: no cap).
    ``handler``: more of aiohttp's request-handler options."""
    runner = web.AppRunner(
        app,
        access_log=None,
        handle_signals=False,
        handler_cancellation=handler_cancellation,
        shutdown_timeout=shutdown_timeout,
        **handler,
    )
    await runner.setup()
    assert runner.server is not None  # setup made it
    factory: Callable[[], asyncio.BaseProtocol] = runner.server
    if max_connections is not None:
        factory = _Doorman(runner.server, max_connections)
    try:
        # What web.TCPSite does, with the connection factory in front of aiohttp's.
        loop = asyncio.get_running_loop()
        server = await loop.create_server(factory, host, port, backlog=backlog)
        try:
            yield int(server.sockets[0].getsockname()[1])
        finally:
            server.close()  # stop accepting before the runner closes the connections
    finally:
        with anyio.CancelScope(shield=True):
            await runner.cleanup()


class _Doorman:
    """aiohttp's connection factory with at most ``limit`` connections open.

    At the cap, a new connection closes the oldest one waiting for a request (idle
    between requests, or still sending its headers), else the one whose client leaves
    the most of its answers unread (``_not_reading``), or, when every one is in the
    middle of a request, is itself closed unanswered. So an abusive client's idle or
    never-reading connections give way to a probe's, whose request arrives with its
    connection; a request being answered to a client that reads is never cut."""

    def __init__(self, server: web.Server, limit: int) -> None:
        self._server = server
        self._limit = limit
        self._warned = False

    def __call__(self) -> asyncio.BaseProtocol:
        # Closed ones stay listed until their handler task ends; their transport is gone.
        live = [c for c in self._server.connections if c.transport is not None]
        if len(live) < self._limit:
            return self._server()
        # aiohttp keeps no public "busy" flag; this one spans handler and response write.
        idle = next((c for c in live if not c._request_in_progress), None)
        victim = idle or _not_reading(live)
        self._note_full(evicted=victim is not None)
        if victim is None:
            return _Refused()
        victim.force_close()
        return self._server()

    def _note_full(self, *, evicted: bool) -> None:
        # Once at warning level: a flood must not fill the logs it is reported in.
        level = logging.DEBUG if self._warned else logging.WARNING
        self._warned = True
        log.log(level, "server_connections_full", limit=self._limit, evicted_idle=evicted)


def _not_reading(live: list[RequestHandler]) -> RequestHandler | None:
    """The connection with the most answer bytes its client has not read, if any: one
    that pipelines requests and never reads is stuck writing, not being answered (its
    writes wait for a reader that never comes), and must not hold its place."""
    unread = max(live, key=_unread)
    return unread if _unread(unread) > 0 else None


def _unread(connection: RequestHandler) -> int:
    transport = connection.transport
    return 0 if transport is None else transport.get_write_buffer_size()


class _Refused(asyncio.Protocol):
    """A connection over the cap with none to give way: closed before any byte is read."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.close()
