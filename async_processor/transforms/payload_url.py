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
"""

from __future__ import annotations

import random
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from urllib.parse import urlsplit

import aiohttp
import anyio
import structlog
from pydantic import BaseModel, ConfigDict, Field

from async_processor.errors import InvalidMessage, PayloadUnavailable
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


class _Retryable(Exception):
    """One fetch attempt failed in a way that may pass (status, connection, timeout)."""


class PayloadUrl:
    def __init__(self, name: str, params: PayloadUrlParams, ctx: TransformContext) -> None:
        self.name = name
        self._params = params
        self._http: aiohttp.ClientSession | None = ctx.http
        self._limit = ctx.max_message_bytes

    def validate(self, envelope: Envelope) -> None:
        url = self._url(envelope)
        if url is None:
            return
        if not _is_http_url(url):
            raise InvalidMessage(
                f"metadata {self._params.metadata_key!r} is not an http(s) URL",
                reason="bad_payload_url",
                request_id=envelope.id,
            )

    async def apply(self, envelope: Envelope, out: Outgoing) -> None:
        url = self._url(envelope)
        if url is None or out.body_claimed:
            return
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

    async def _fetch_until(self, url: str, deadline: float, envelope: Envelope) -> bytes:
        delay = self._params.backoff_initial
        attempts = 0
        async with self._session() as session:
            while True:
                remaining = deadline - time.time()
                if remaining <= 0:
                    break
                attempts += 1
                try:
                    with anyio.fail_after(min(self._params.attempt_timeout, remaining)):
                        return await self._fetch_once(session, url, envelope)
                except (_Retryable, aiohttp.ClientError, OSError, TimeoutError) as exc:
                    cause = str(exc) or type(exc).__name__
                    log.info("payload_fetch_failed", request_id=envelope.id, url=redact(url),
                             attempt=attempts, cause=cause)  # fmt: skip
                # Full jitter keeps many messages that wait for one upload from moving in step.
                await anyio.sleep(min(random.uniform(0, delay), max(0.0, deadline - time.time())))
                delay = min(delay * 2, self._params.backoff_max)
        raise PayloadUnavailable(
            f"payload at {redact(url)} not available before the deadline ({attempts} attempts)"
        )

    async def _fetch_once(
        self, session: aiohttp.ClientSession, url: str, envelope: Envelope
    ) -> bytes:
        async with session.get(url) as response:
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

    @asynccontextmanager
    async def _session(self) -> AsyncIterator[aiohttp.ClientSession]:
        """The daemon's shared session, or a short-lived one when none was given."""
        if self._http is not None:
            yield self._http
            return
        async with aiohttp.ClientSession() as session:
            yield session


def _is_http_url(url: str) -> bool:
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - parsed lazily: raises ValueError for a bad port
    except ValueError:  # e.g. an unclosed IPv6 literal
        return False
    return parts.scheme in ("http", "https") and bool(parts.hostname)


def redact(url: str) -> str:
    """The URL without query and fragment (signatures and tokens live there)."""
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc.rpartition('@')[2]}{parts.path}"


@TRANSFORMS.register("payload_url", PayloadUrlParams)
def _payload_url(params: PayloadUrlParams, ctx: TransformContext) -> Transform:
    return PayloadUrl(ctx.name, params, ctx)
