"""Who is calling: bearer API keys, each mapped to a tenant.

Stage: the API's HTTP edge. Input: the keys file (``{"<tenant>": ["<key>" or
"sha256:<hex>", ...]}``) and each request's ``Authorization`` header. Output: the
request's tenant (``request["tenant"]``), or a 401. Keys are kept only as SHA-256
digests in memory; the tenant becomes each line's ``metadata.userid``.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

from aiohttp import web
from aiohttp.typedefs import Middleware

from async_processor.api.errors import ApiError, Handler
from async_processor.errors import ConfigError

OPEN_PATHS = ("/healthz", "/readyz", "/metrics")
NO_AUTH_TENANT = "default"
_DIGEST = re.compile(r"^sha256:([0-9a-f]{64})$")
_TENANT = re.compile(r"^[A-Za-z0-9._-]{1,64}$")


def load_keys(path: Path) -> dict[str, str]:
    """Key digest (hex) -> tenant, from the keys file; ``ConfigError`` says what is wrong."""
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--api-keys-file {path}: {exc}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"--api-keys-file {path}: not a JSON object of tenant -> keys")
    digests: dict[str, str] = {}
    for tenant, entries in raw.items():
        if not _TENANT.match(tenant):
            raise ConfigError(f"--api-keys-file {path}: tenant {tenant!r}: [A-Za-z0-9._-]{{1,64}}")
        if not isinstance(entries, list) or not all(isinstance(e, str) and e for e in entries):
            raise ConfigError(f"--api-keys-file {path}: {tenant}: a list of keys")
        for entry in entries:
            digest = _digest_of(entry)
            if digests.setdefault(digest, tenant) != tenant:
                raise ConfigError(f"--api-keys-file {path}: one key for two tenants")
    if not digests:
        raise ConfigError(f"--api-keys-file {path}: no keys")
    return digests


def _digest_of(entry: str) -> str:
    hashed = _DIGEST.match(entry)
    return hashed.group(1) if hashed else hashlib.sha256(entry.encode()).hexdigest()


def auth_middleware(digests: dict[str, str] | None) -> Middleware:
    """``digests`` None: no auth, every caller is ``NO_AUTH_TENANT``."""

    @web.middleware
    async def authenticate(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path in OPEN_PATHS:
            return await handler(request)
        if digests is None:
            request["tenant"] = NO_AUTH_TENANT
            return await handler(request)
        scheme, _, key = request.headers.get("Authorization", "").partition(" ")
        tenant = digests.get(hashlib.sha256(key.strip().encode()).hexdigest())
        if scheme.lower() != "bearer" or not key.strip() or tenant is None:
            raise ApiError(401, "Incorrect API key provided.", code="invalid_api_key")
        request["tenant"] = tenant
        return await handler(request)

    return authenticate
