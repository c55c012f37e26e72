"""``payload_url``: fetch the JSON payload from an http(s) URL named in the message.

Stage: transforms (payload source; it never claims the body). Input: a message whose
``metadata[metadata_key]`` (default ``payload_url``) is an http(s) URL; the message's own
``payload`` is ignored (send ``null`` or leave it out). Output: ``out.body`` = the fetched
bytes, verbatim, so later transforms (``set_params``, ``gcs_uri_multipart``) see them.

Producers use it when a body is too large for the broker. Failures (connection errors,
timeouts, any non-200 status, e.g. a 404 before the upload lands) are retried with
exponential backoff and jitter until ``out.deadline``; then ``PayloadUnavailable``
(-> ``PAYLOAD_UNAVAILABLE``). A body over ``max_message_bytes`` or one that is not a JSON
object is ``InvalidMessage`` (-> ``INVALID_REQUEST``) at once. URLs are logged without
their query string (signed URLs carry credentials there).

The URL is the message's, so it is untrusted (docs/architecture.md G10): only URLs on the ``allow``
list are fetched (an empty list refuses to start); a redirect is an error, never
followed; the fetch has its own session (no gateway client certificate, no cookies, no
proxy from the environment), opened with the chain and reused by every message so its
connections are kept alive between fetches; and addresses that are not globally routable (loopback,
private, link-local such as the cloud metadata server) are refused unless
``allow_private_addresses``. Host names are checked as they are resolved, on the
addresses the connection then uses, so a name cannot pass the check and then rebind.
"""

from __future__ import annotations

import ipaddress
import random
import socket
import time
from urllib.parse import SplitResult, unquote, urlsplit

import aiohttp
import anyio
import structlog
from aiohttp.abc import AbstractResolver, ResolveResult
from pydantic import BaseModel, ConfigDict, Field

from async_processor.errors import ConfigError, InvalidMessage, PayloadUnavailable
from async_processor.messages import Envelope
from async_processor.transforms.base import TRANSFORMS, Outgoing, Transform, TransformContext
from async_processor.transforms.json_fields import scan

log = structlog.get_logger(__name__)

CHUNK = 64 * 1024


class PayloadUrlParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    metadata_key: str = Field(default="payload_url", min_length=1)
    attempt_timeout: float = Field(default=30.0, gt=0)  # seconds per GET
    backoff_initial: float = Field(default=0.5, gt=0)
    backoff_max: float = Field(default=10.0, gt=0)
    # Host names ("store.example.com", "*.example.com") or http(s) URL prefixes
    # ("https://store.example.com/uploads/"); a URL must match one. Empty: no start.
    allow: list[str] = Field(default_factory=list)
    allow_private_addresses: bool = False


class _Retryable(Exception):
    """One fetch attempt failed in a way that may pass (status, connection, timeout)."""


class _BlockedAddress(OSError):
    """A host resolved to an address the transform may not reach."""


class PayloadUrl:
    def __init__(self, name: str, params: PayloadUrlParams, ctx: TransformContext) -> None:
        if not params.allow:
            raise ConfigError(
                '"allow" must list the hosts or URL prefixes payloads may be fetched from'
            )
        self.name = name
        self._params = params
        self._allow = [_AllowEntry.parse(entry) for entry in params.allow]
        self._limit = ctx.max_message_bytes
        self._client: aiohttp.ClientSession | None = None

    async def open(self) -> None:
        """One session for every message (the chain opens it: ``TransformChain.opened``)."""
        if self._client is None:
            self._client = self._session()

    async def aclose(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await client.close()

    def validate(self, envelope: Envelope) -> None:
        url = self._url(envelope)
        if url is not None:
            self._check(url, envelope)

    async def apply(self, envelope: Envelope, out: Outgoing) -> None:
        url = self._url(envelope)
        if url is None or out.body_claimed:
            return
        self._check(url, envelope)
        body = await self._fetch_until(url, out.deadline, envelope)
        try:
            scan(body)
        except ValueError as exc:
            raise InvalidMessage(
                f"payload at {redact(url)} is not a JSON object: {exc}",
                reason="malformed",
                request_id=envelope.id,
            ) from exc
        out.body = body

    def _url(self, envelope: Envelope) -> str | None:
        return envelope.request.metadata.get(self._params.metadata_key) or None

    def _check(self, url: str, envelope: Envelope) -> None:
        """http(s), on the allow-list, no dot segments, no literal non-public address."""
        parts = _http_url(url)
        if parts is None:
            raise self._refused("is not an http(s) URL", envelope)
        if ".." in unquote(parts.path).split("/"):
            raise self._refused("has '..' in its path", envelope)
        if not any(entry.matches(parts) for entry in self._allow):
            raise self._refused(f"({redact(url)}) is not on the allow-list", envelope)
        if not self._params.allow_private_addresses and _not_public(parts.hostname or ""):
            raise self._refused(f"({redact(url)}) is not a public address", envelope)

    def _refused(self, why: str, envelope: Envelope) -> InvalidMessage:
        return InvalidMessage(
            f"metadata {self._params.metadata_key!r} {why}",
            reason="bad_payload_url",
            request_id=envelope.id,
        )

    async def _fetch_until(self, url: str, deadline: float, envelope: Envelope) -> bytes:
        delay = self._params.backoff_initial
        attempts = 0
        if self._client is None:
            raise RuntimeError(f"transform {self.name}: apply before open")
        while (remaining := deadline - time.time()) > 0:
            attempts += 1
            try:
                with anyio.fail_after(min(self._params.attempt_timeout, remaining)):
                    return await self._fetch_once(self._client, url, envelope)
            except (_Retryable, aiohttp.ClientError, OSError, TimeoutError) as exc:
                self._fatal_or_log(exc, url, envelope, attempts)
            # Full jitter keeps many messages that wait for one upload from moving in step.
            await anyio.sleep(min(random.uniform(0, delay), max(0.0, deadline - time.time())))
            delay = min(delay * 2, self._params.backoff_max)
        raise PayloadUnavailable(
            f"payload at {redact(url)} not available before the deadline ({attempts} attempts)"
        )

    def _fatal_or_log(self, exc: Exception, url: str, envelope: Envelope, attempt: int) -> None:
        """A refused address ends the request; anything else is logged and retried."""
        if isinstance(exc, aiohttp.ClientConnectorError) and isinstance(
            exc.os_error, _BlockedAddress
        ):
            raise self._refused(f"({redact(url)}): {exc.os_error}", envelope) from exc
        cause = str(exc) or type(exc).__name__
        log.info("payload_fetch_failed", request_id=envelope.id, url=redact(url),
                 attempt=attempt, cause=cause)  # fmt: skip

    async def _fetch_once(
        self, session: aiohttp.ClientSession, url: str, envelope: Envelope
    ) -> bytes:
        async with session.get(url, allow_redirects=False) as response:
            if 300 <= response.status < 400:
                why = f"({redact(url)}) answered HTTP {response.status}: redirects are not followed"
                raise self._refused(why, envelope)
            if response.status != 200:
                raise _Retryable(f"HTTP {response.status}")
            if (response.content_length or 0) > self._limit:
                raise self._too_large(url, envelope)
            body = bytearray()
            async for chunk in response.content.iter_chunked(CHUNK):
                body += chunk
                if len(body) > self._limit:
                    raise self._too_large(url, envelope)
            return bytes(body)

    def _too_large(self, url: str, envelope: Envelope) -> InvalidMessage:
        return InvalidMessage(
            f"payload at {redact(url)} exceeds the {self._limit}-byte limit",
            reason="too_large",
            request_id=envelope.id,
        )

    def _session(self) -> aiohttp.ClientSession:
        """A session of its own, never the gateway's (its client certificate, its pool).

        No connection limit: fetches are bounded by the workers, and a shared cap would
        make one message's fetch wait for another's inside its attempt timeout."""
        resolver = _GuardedResolver(allow_private=self._params.allow_private_addresses)
        return aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(resolver=resolver, limit=0),
            cookie_jar=aiohttp.DummyCookieJar(),
            trust_env=False,
        )


class _AllowEntry:
    """One ``allow`` entry: a host (``*.`` for its subdomains) or an http(s) URL prefix."""

    def __init__(self, host: str, prefix: SplitResult | None) -> None:
        self.host = host
        self.prefix = prefix

    @classmethod
    def parse(cls, entry: str) -> _AllowEntry:
        if "://" not in entry:
            if not entry or "/" in entry:
                raise ConfigError(f"allow entry {entry!r} is neither a host nor an http(s) URL")
            return cls(entry.lower(), None)
        parts = _http_url(entry)
        if parts is None:
            raise ConfigError(f"allow entry {entry!r} is not an http(s) URL")
        return cls(parts.hostname or "", parts)

    def matches(self, url: SplitResult) -> bool:
        host = url.hostname or ""
        if self.prefix is None:
            if self.host.startswith("*."):
                return host.endswith(self.host[1:])
            return host == self.host
        p = self.prefix
        if (url.scheme, host, url.port) != (p.scheme, self.host, p.port):
            return False
        # "/uploads" allows "/uploads" and "/uploads/...", never "/uploads-other".
        base = p.path.rstrip("/")
        return not base or url.path == base or url.path.startswith(base + "/")


class _GuardedResolver(AbstractResolver):
    """The default resolver, refusing a name with any address that is not public."""

    def __init__(self, *, allow_private: bool) -> None:
        self._inner = aiohttp.DefaultResolver()
        self._allow_private = allow_private

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        found = await self._inner.resolve(host, port, family)
        if not self._allow_private and any(_not_public(r["host"]) for r in found):
            raise _BlockedAddress(f"{host} resolves to an address that is not public")
        return found

    async def close(self) -> None:
        await self._inner.close()


def _not_public(host: str) -> bool:
    """True for an IP address that is not globally routable (loopback, private,
    link-local, unspecified, ...); False for a name (checked when it resolves)."""
    try:
        address = ipaddress.ip_address(host.strip("[]").partition("%")[0])
    except ValueError:
        return False
    return not address.is_global


def _http_url(url: str) -> SplitResult | None:
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - parsed lazily: raises ValueError for a bad port
    except ValueError:  # e.g. an unclosed IPv6 literal
        return None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return None
    return parts


def redact(url: str) -> str:
    """The URL without query and fragment (signatures and tokens live there)."""
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc.rpartition('@')[2]}{parts.path}"


@TRANSFORMS.register("payload_url", PayloadUrlParams)
def _payload_url(params: PayloadUrlParams, ctx: TransformContext) -> Transform:
    return PayloadUrl(ctx.name, params, ctx)
