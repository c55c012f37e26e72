"""The aiohttp implementation of ``HttpClient`` (``--http-client aiohttp``; the default until
httptools measured a third less CPU per message: docs/performance.md).

One ``ClientSession`` for all workers: keep-alive connections, no cap beyond the workers.

Its connections use ``_Handler``, aiohttp's protocol with two changes for an answer that is
untrusted input (``tests/unit/test_http_clients_corpus.py`` holds every client to them):
llhttp parses strictly (aiohttp's production default is lenient: ``Content-Length : 5``
was a header it did not frame by, so a truncated body passed as whole), and a reset before
the body's end is an error even when the close would have delimited the body.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Mapping
from typing import Any

import aiohttp
from aiohttp.client_proto import ResponseHandler

from async_processor.config import TLSConfig
from async_processor.errors import NoAnswer
from async_processor.headers import DROPPED_REASON_HEADER
from async_processor.httpclients.base import (
    Answer,
    AttemptTimeout,
    Unsendable,
    framing_allowance,
    framing_too_large,
    header_lines,
    ssl_context,
    too_large,
)

_c_parser: Any
try:  # the C parser; its leniency is read when a parser is made
    _c_parser = importlib.import_module("aiohttp._http_parser")
except ImportError:  # pragma: no cover (AIOHTTP_NO_EXTENSIONS: the Python parser, as it is)
    _c_parser = None

CHUNK = 1 << 16


class _FramingTooLarge(aiohttp.ClientPayloadError):
    pass


class _Malformed(aiohttp.ClientPayloadError):
    pass


class _Handler(ResponseHandler):
    fed = 0  # bytes read since the request went out (interim answers too)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self.fed += len(data)
        payload = self._payload
        body = payload.total_bytes if payload is not None else 0
        if payload is not None and not payload.is_eof() and self.exception() is not None:
            # The parser refused a later part of the body (a chunk's framing): aiohttp sets
            # the error on the connection, not on the body read, which waited out the timeout.
            payload.set_exception(_Malformed(f"malformed answer: {self.exception()}"))
        # aiohttp bounds head lines and trailers, not chunk extensions or interim answers
        # (endless ones held the attempt to its timeout). Its parser counts no chunks: a
        # body byte stands for one (a chunk carries at least one).
        elif self.fed - body > framing_allowance(body):
            error = _FramingTooLarge(str(framing_too_large()))
            if payload is not None and not payload.is_eof():
                payload.set_exception(error)
            else:
                self.set_exception(error)
            if self.transport is not None:
                self.transport.close()

    def set_response_params(self, **kwargs: Any) -> None:
        """Per request. A strict parser: aiohttp's is lenient unless ``DEBUG`` (dev mode) is
        on when it is made. The flag is read in the constructor only, so it is on for that
        call alone."""
        self.fed = 0
        if _c_parser is None:  # pragma: no cover
            super().set_response_params(**kwargs)
            return
        lenient = _c_parser.DEBUG
        _c_parser.DEBUG = True
        try:
            super().set_response_params(**kwargs)
        finally:
            _c_parser.DEBUG = lenient

    def connection_lost(self, exc: BaseException | None) -> None:
        """aiohttp ends a body the close delimits at any close, a reset too."""
        payload = self._payload
        if exc is not None and payload is not None and not payload.is_eof():
            payload.set_exception(aiohttp.ClientPayloadError(f"connection reset: {exc}"))
        super().connection_lost(exc)


class AiohttpClient:
    def __init__(self, tls: TLSConfig, connections: int) -> None:
        connector = aiohttp.TCPConnector(
            limit=max(100, connections),
            limit_per_host=0,
            ssl=ssl_context(tls) or True,  # True: the system's trust store
            keepalive_timeout=90,
            enable_cleanup_closed=True,
        )
        # No public hook makes the connections' protocol; a subclass's is still one.
        connector._factory = functools.partial(_Handler, loop=connector._loop)  # type: ignore[assignment]
        self.session = aiohttp.ClientSession(
            connector=connector,
            timeout=aiohttp.ClientTimeout(total=None),
            skip_auto_headers=("User-Agent",),
        )

    async def post(
        self, url: str, body: bytes | memoryview, headers: Mapping[str, str], *,
        timeout: float, limit: int,
    ) -> Answer:  # fmt: skip
        header_lines(headers)  # aiohttp checks values only, and raises a ValueError
        try:
            async with self.session.post(
                url,
                data=body,
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=max(0.001, timeout)),
                allow_redirects=False,  # a 3xx is the result; never resend body and headers
            ) as response:
                content = await _read_capped(response, limit)
                return Answer(
                    response.status,
                    content,
                    response.headers.get("Retry-After"),
                    response.headers.get(DROPPED_REASON_HEADER, ""),
                )
        except TimeoutError:
            raise AttemptTimeout() from None
        except aiohttp.InvalidURL as exc:
            raise Unsendable(f"invalid URL {exc}") from None
        except (aiohttp.ClientError, OSError) as exc:
            raise NoAnswer(f"{type(exc).__name__}: {exc}", reason=_reason(exc)) from None

    async def aclose(self) -> None:
        await self.session.close()


def _reason(exc: BaseException) -> str:
    if isinstance(exc, aiohttp.ClientConnectorError):
        return "refused"
    if isinstance(exc, _FramingTooLarge):
        return "framing_too_large"
    if isinstance(exc, _Malformed):
        return "malformed"
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return "closed"
    if isinstance(exc, aiohttp.ClientPayloadError | OSError):
        return "cut_short"
    if isinstance(exc, aiohttp.ClientResponseError):  # the parser refused the answer
        return "malformed"
    return "no_answer"


async def _read_capped(response: aiohttp.ClientResponse, limit: int) -> bytes:
    """The body, refusing one larger than ``limit`` (the reference read without a bound)."""
    length = response.content_length
    if length is not None and length <= limit:
        return await response.read()
    if length is not None:
        raise too_large(length, limit)
    chunks: list[bytes] = []
    size = 0
    async for chunk in response.content.iter_chunked(CHUNK):
        size += len(chunk)
        if size > limit:
            raise too_large(None, limit)
        chunks.append(chunk)
    return b"".join(chunks)
