"""The pyreqwest implementation of ``HttpClient`` (Rust reqwest + tokio; the ``pyreqwest``
extra). Chosen with ``--http-client pyreqwest``.

The answer is read in Rust: in one call when its length is known and within the limit,
else chunk by chunk against the limit. The attempt's timeout is reqwest's per-request total
(connect to last body byte). Known gap (0.15.1): a cancelled call (producer cancel, drain
timeout) is not aborted in Rust; it runs on until that timeout, holding its connection and
the gateway's work (strict xfails in the tests), which is one reason it is not the default.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from datetime import timedelta

import anyio.lowlevel
from pyreqwest.client import Client, ClientBuilder
from pyreqwest.exceptions import BuilderError, PyreqwestError, RequestTimeoutError
from pyreqwest.response import Response

from async_processor.config import TLSConfig
from async_processor.errors import ConfigError, NoAnswer
from async_processor.headers import DROPPED_REASON_HEADER
from async_processor.httpclients.base import (
    Answer,
    AttemptTimeout,
    Unsendable,
    header_lines,
    read_pem,
    too_large,
)


class PyreqwestClient:
    def __init__(self, tls: TLSConfig, connections: int) -> None:
        builder = (
            ClientBuilder()
            .follow_redirects(False)  # a 3xx is the result; never resend body and headers
            .referer(False)
            .max_connections(None)  # the workers bound it
            .pool_idle_timeout(timedelta(seconds=90))
            .min_tls_version("TLSv1.2")
        )
        if tls.ca_cert:
            builder = builder.add_root_certificate_pem(read_pem(tls.ca_cert, "ca-cert"))
        if tls.insecure_skip_verify:
            builder = builder.danger_accept_invalid_certs(True)
        try:
            if tls.cert:
                identity = read_pem(tls.cert, "cert") + b"\n" + read_pem(tls.key, "key")
                builder = builder.identity_pem(identity)
            self.client: Client = builder.build()
        except (PyreqwestError, ValueError) as exc:
            raise ConfigError(f"--tls-*: cannot load certificates: {exc}") from exc
        del connections  # no pool cap: see max_connections

    async def post(
        self, url: str, body: bytes | memoryview, headers: Mapping[str, str], *,
        timeout: float, limit: int,
    ) -> Answer:  # fmt: skip
        header_lines(headers)  # the same refusals as every client
        try:
            request = (
                self.client.post(url)
                .headers(headers)
                .body_bytes(body)
                .timeout(timedelta(seconds=max(0.001, timeout)))
                .build_streamed()
            )
        except (BuilderError, ValueError) as exc:
            raise Unsendable(f"invalid URL {url}: {exc}") from None
        try:
            async with request as response:
                content = await _read_capped(response, limit)
                return Answer(
                    response.status,
                    content,
                    response.get_header("Retry-After"),
                    response.get_header(DROPPED_REASON_HEADER) or "",
                )
        except asyncio.CancelledError:
            # pyreqwest raises a CancelledError of its own, which anyio's cancel scopes
            # (deadline, producer cancel, drain timeout) would not recognise as theirs and
            # would let through: the scope's own cancellation is delivered here instead.
            await anyio.lowlevel.checkpoint()
            raise
        except RequestTimeoutError:
            raise AttemptTimeout() from None
        except BuilderError as exc:
            raise Unsendable(f"invalid URL {url}: {_describe(exc)}") from None
        except PyreqwestError as exc:
            raise NoAnswer(_describe(exc), reason=_reason(exc)) from None

    async def aclose(self) -> None:
        await self.client.close()


def _describe(exc: PyreqwestError) -> str:
    """``ConnectError: connection error: Connection refused (os error 111)``: the message
    and its innermost cause (reqwest's chain repeats the URL at each level)."""
    details = getattr(exc, "details", None) or {}
    causes = details.get("causes") or []
    cause = f": {causes[-1]['message']}" if causes else ""
    return f"{type(exc).__name__}: {exc.message}{cause}"


def _reason(exc: PyreqwestError) -> str:
    name = type(exc).__name__
    if name == "ConnectError":
        return "refused"
    if name == "DecodeError":  # hyper refused the head
        return "malformed"
    return "cut_short" if name in ("ReadError", "BodyDecodeError") else "no_answer"


def _declared_length(response: Response) -> int | None:
    """The Content-Length, refusing framing hyper accepts and llhttp does not (the other
    clients): a length beside chunking (RFC 9112 §6.3: ought to be an error), a list or
    a repeated header, even of one value."""
    declared = response.get_header_all("Content-Length")
    if not declared:
        return None
    if (
        len(declared) > 1
        or not declared[0].isdigit()
        or response.get_header("Transfer-Encoding") is not None
    ):
        raise NoAnswer(f"conflicting framing: Content-Length {declared}", reason="malformed")
    return int(declared[0])


async def _read_capped(response: Response, limit: int) -> bytes:
    """The body, refusing one larger than ``limit`` as soon as it is known to be."""
    length = _declared_length(response)
    reader = response.body_reader
    if length is not None and length <= limit:
        return (await reader.bytes()).to_bytes()
    if length is not None:
        raise too_large(length, limit)
    chunks: list[bytes] = []
    size = 0
    while (chunk := await reader.read_chunk()) is not None:
        size += len(chunk)
        if size > limit:
            raise too_large(None, limit)
        chunks.append(chunk.to_bytes())
    return b"".join(chunks)
