"""OpenAI-shaped errors and the middleware that answers with them.

Stage: the API's HTTP edge. Input: an ``ApiError`` raised by a route (or any other
failure). Output: ``{"error": {"message", "type", "param", "code"}}`` with the status,
and an ``x-request-id`` on every answer.
"""

from __future__ import annotations

import secrets
from collections.abc import Awaitable, Callable
from typing import Any

import structlog
from aiohttp import web

log = structlog.get_logger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
}


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers  # e.g. a 429's Retry-After

    def body(self) -> dict[str, Any]:
        kind = TYPES.get(self.status, "server_error")
        return {
            "error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}
        }


def not_found(what: str, object_id: str) -> ApiError:
    return ApiError(404, f"No {what} found with id '{object_id}'.", code="not_found")


@web.middleware
async def errors_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    request_id = request.headers.get("x-request-id") or f"req_{secrets.token_hex(12)}"
    try:
        response = await handler(request)
    except ApiError as exc:
        response = web.json_response(exc.body(), status=exc.status, headers=exc.headers)
    except web.HTTPException as exc:  # aiohttp's own (unknown route, wrong method)
        allow = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
        response = web.json_response(
            ApiError(exc.status, exc.reason).body(), status=exc.status, headers=allow
        )
    except Exception:
        log.exception("api_request_failed", path=request.path, request_id=request_id)
        response = web.json_response(ApiError(500, "internal error").body(), status=500)
    if not response.prepared:
        response.headers["x-request-id"] = request_id[:200]
    return response
