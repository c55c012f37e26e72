"""The ``httptools`` implementation of ``HttpClient``, the default: HTTP/1.1 on asyncio
Protocols, parsed by llhttp (the C parser Node.js and uvicorn use).

It does what the seam needs and nothing else: a POST with headers and a body, keep-alive
connections pooled per origin, TLS and mTLS from ``TLSConfig``, no redirects, no
compression, no proxies, no cookies. Why it is the default: the daemon spends about a third
less CPU per message on it than on aiohttp (docs/performance.md has the figures). Host
names are resolved at each new connection (aiohttp caches them for 10 s). No cap on open
connections: one is opened only when no idle one to its origin is free, so an origin
has at most as many as the calls in flight at once, which the workers bound.

Retry semantics of a pooled connection: one the gateway closed while it was idle is
dropped before anything is written on it, and the request goes out on another (it was
never sent). Once the request is written, a connection lost before the answer is a
``NoAnswer`` like any other: a POST is not resent behind the retry rules' back, since the
gateway may have started the work (RFC 9112 §9.3.1).
"""

from __future__ import annotations

import asyncio
import base64
import re
import ssl
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import quote, unquote, urlsplit

import anyio

from async_processor.config import TLSConfig
from async_processor.errors import NoAnswer
from async_processor.httpclients.base import (
    Answer,
    AttemptTimeout,
    Unsendable,
    header_lines,
    ssl_context,
)
from async_processor.httpclients.h1_connection import Connection, Origin

KEEPALIVE = 90.0  # seconds an idle connection is kept (aiohttp's setting here too)
RECEIVE_BUFFER = 1 << 16
TARGETS_KEPT = 1024  # parsed URLs remembered; a daemon posts to a handful
_PATH_SAFE = "!$%&'()*+,/:;=?@[]~"  # with letters, digits and "_.-": left as they are
_HOST = re.compile(r"(?:^|\n)host:", re.IGNORECASE)
_AUTHORIZATION = re.compile(r"(?:^|\n)authorization:", re.IGNORECASE)


@dataclass(frozen=True, slots=True)
class Target:
    """A URL as this client sends to it."""

    origin: Origin
    request_line: str  # "POST /path?query HTTP/1.1\r\n"
    host_line: str  # "Host: host[:port]\r\n"
    auth_line: str  # "Authorization: Basic ...\r\n" from the URL's user:password, or ""


class HttptoolsClient:
    def __init__(self, tls: TLSConfig, connections: int) -> None:
        del connections  # no pool cap: the workers bound the connections
        self._tls = ssl_context(tls)  # the system's, when first needed: loading it takes ~50 ms
        self._idle: dict[Origin, deque[Connection]] = {}
        self._targets: dict[str, Target] = {}
        self._buffer = memoryview(bytearray(RECEIVE_BUFFER))

    async def post(
        self, url: str, body: bytes | memoryview, headers: Mapping[str, str], *,
        timeout: float, limit: int,
    ) -> Answer:  # fmt: skip
        target = self._targets.get(url) or self._target(url)
        head = _head(target, headers, len(body))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(0.001, timeout)
        conn = self._take(target.origin) or await self._connect(target.origin, deadline)
        exchange = conn.exchange(head, body, deadline, limit, loop)
        del head, body  # the exchange lets them go once written, not when the answer comes
        answer = await exchange
        if conn.reusable():
            self._give_back(conn, loop.time())
        else:
            conn.close()
        return answer

    async def aclose(self) -> None:
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()

    def _target(self, url: str) -> Target:
        try:
            parts = urlsplit(url)
            port = parts.port or (443 if parts.scheme == "https" else 80)
        except ValueError as exc:
            raise Unsendable(f"invalid URL {url}: {exc}") from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise Unsendable(f"invalid URL {url}: not an http(s) URL with a host")
        path = parts.path or "/"
        if parts.query:
            path = f"{path}?{parts.query}"
        path = quote(path, safe=_PATH_SAFE)  # spaces, controls, non-ASCII: percent-encoded
        target = Target(
            (parts.scheme, parts.hostname, port),
            f"POST {path} HTTP/1.1\r\n",
            f"Host: {parts.netloc.rpartition('@')[2]}\r\n",
            _basic_auth(parts.username, parts.password),
        )
        if len(self._targets) >= TARGETS_KEPT:
            self._targets.clear()
        self._targets[url] = target
        return target

    def _take(self, origin: Origin) -> Connection | None:
        """The most recently used idle connection still open (closed ones are dropped)."""
        idle = self._idle.get(origin)
        while idle:
            conn = idle.pop()
            if conn.usable:
                return conn
        return None

    def _give_back(self, conn: Connection, now: float) -> None:
        idle = self._idle.get(conn.origin)
        if idle is None:
            idle = self._idle[conn.origin] = deque()
        conn.idle_since = now
        idle.append(conn)
        while idle[0].idle_since < now - KEEPALIVE:  # the oldest wait at the left end
            idle.popleft().close()

    async def _connect(self, origin: Origin, deadline: float) -> Connection:
        scheme, host, port = origin
        loop = asyncio.get_running_loop()
        conn = Connection(origin, self._buffer)
        tls = None
        if scheme == "https":
            tls = self._tls = self._tls or ssl.create_default_context()
        with anyio.CancelScope(deadline=deadline) as scope:
            try:
                await loop.create_connection(lambda: conn, host, port, ssl=tls)
            except OSError as exc:  # refused, unreachable, a certificate refused
                raise NoAnswer(f"{type(exc).__name__}: {exc}") from None
            except ValueError as exc:  # a host name that cannot be encoded
                raise Unsendable(f"invalid host {host!r}: {exc}") from None
        if scope.cancelled_caught:
            raise AttemptTimeout()
        return conn


def _head(target: Target, headers: Mapping[str, str], length: int) -> bytes:
    """The request's head, refusing header fields that could break out of their line."""
    fields = header_lines(headers)
    host = "" if _HOST.search(fields) else target.host_line
    auth = target.auth_line
    if auth and _AUTHORIZATION.search(fields):  # the message's own wins, as its Host does
        auth = ""
    head = f"{target.request_line}{host}{auth}Content-Length: {length}\r\n{fields}\r\n"
    try:
        return head.encode()
    except UnicodeEncodeError as exc:
        raise Unsendable(f"a header cannot be encoded: {exc}") from None


def _basic_auth(user: str | None, password: str | None) -> str:
    """A URL's ``user:password@`` as Basic credentials, as aiohttp and pyreqwest send them
    (a gateway URL written for them keeps working on the default client)."""
    if user is None:
        return ""
    pair = f"{unquote(user)}:{unquote(password or '')}".encode()
    return f"Authorization: Basic {base64.b64encode(pair).decode()}\r\n"
