"""``X-AP-Mode: direct``: one request proxied to the gateway now, its answer (streamed when
the caller asked for ``stream: true``) passed back as the gateway gave it.

Stage: the API's HTTP edge, beside the queue. Input: the caller's OpenAI request body
(checked as for the queue, but ``stream: true`` is allowed), its tenant and endpoint.
Output: the gateway's status, body and content type; the tenant rides in the fairness
header the daemon would stamp, so the gateway's per-tenant fairness holds here too. A
gateway that does not answer is a 502, one too slow a 504, in OpenAI's error shape.
Nothing is queued and nothing is kept: a direct request is as durable as its connection.
"""

from __future__ import annotations

import aiohttp
from aiohttp import web

from async_processor.api.errors import ApiError
from async_processor.headers import DEFAULT_FAIRNESS_HEADER
from async_processor.pipeline.dispatch import join_url

CHUNK = 64 * 1024
# Passed to the gateway from the caller (the rest are the caller's business with us).
FORWARDED = ("Accept", "Accept-Encoding")
# Passed back from the gateway's answer.
RETURNED = ("Content-Type", "Cache-Control", "x-request-id", "openai-processing-ms")


async def proxy(
    request: web.Request,
    session: aiohttp.ClientSession,
    gateway: str,
    body: bytes,
    tenant: str,
    idle_seconds: float,
) -> web.StreamResponse:
    """POST ``body`` to ``gateway`` + the request's path; stream the answer back as it
    comes (``idle_seconds``: the longest wait for the gateway's next bytes)."""
    headers = {"Content-Type": "application/json", DEFAULT_FAIRNESS_HEADER: tenant}
    headers |= {h: request.headers[h] for h in FORWARDED if h in request.headers}
    timeout = aiohttp.ClientTimeout(total=None, connect=10, sock_read=idle_seconds or None)
    url = join_url(gateway, request.path)
    try:
        # Never followed (as the daemon's dispatch): a redirect would carry the tenant's
        # body to wherever the gateway's answer names.
        post = session.post(url, data=body, headers=headers, timeout=timeout, allow_redirects=False)
        async with post as answer:
            if 300 <= answer.status < 400:
                raise ApiError(
                    502,
                    f"The gateway answered with a redirect (HTTP {answer.status}), never followed.",
                    code="gateway_error",
                )
            response = web.StreamResponse(status=answer.status)
            for name in RETURNED:
                if name in answer.headers:
                    response.headers[name] = answer.headers[name]
            await response.prepare(request)
            return await _pass_on(answer, response)
    except TimeoutError:
        raise ApiError(504, "The gateway did not answer in time.", code="gateway_timeout") from None
    except aiohttp.ClientError as exc:
        raise ApiError(
            502, f"The gateway could not be reached: {type(exc).__name__}", code="gateway_error"
        ) from None


async def _pass_on(
    answer: aiohttp.ClientResponse, response: web.StreamResponse
) -> web.StreamResponse:
    """Each chunk as the gateway sends it (server-sent events reach the caller at once).
    A gateway failing mid-answer ends the caller's answer early: its status is sent."""
    try:
        async for chunk in answer.content.iter_any():
            await response.write(chunk)
    except (TimeoutError, aiohttp.ClientError):
        return response  # the caller sees a cut answer, as it would from the gateway
    await response.write_eof()
    return response
