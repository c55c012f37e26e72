"""The aiohttp implementation of ``HttpClient`` (``--http-client aiohttp``; the default until
httptools measured a third less CPU per message: README, Benchmarks).

One ``ClientSession`` for all workers: keep-alive connections, no cap beyond the workers.
"""

from __future__ import annotations

from collections.abc import Mapping

import aiohttp

from async_processor.config import TLSConfig
from async_processor.errors import NoAnswer
from async_processor.headers import DROPPED_REASON_HEADER
from async_processor.httpclients.base import (
    Answer,
    AttemptTimeout,
    Unsendable,
    header_lines,
    ssl_context,
    too_large,
)

CHUNK = 1 << 16


class AiohttpClient:
    def __init__(self, tls: TLSConfig, connections: int) -> None:
        connector = aiohttp.TCPConnector(
            limit=max(100, connections),
            limit_per_host=0,
            ssl=ssl_context(tls) or True,  # True: the system's trust store
            keepalive_timeout=90,
            enable_cleanup_closed=True,
        )
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
            raise NoAnswer(f"{type(exc).__name__}: {exc}") from None

    async def aclose(self) -> None:
        await self.session.close()


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
