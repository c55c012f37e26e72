"""What every route and the runner share: settings, the store, the file storage.

Stage: the API's wiring. Input: the command's flags. Output: one ``Context`` per process,
on the aiohttp app under ``CONTEXT``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import aiohttp
from aiohttp import web

from async_processor.api.caps import CapsBook, Guard
from async_processor.api.errors import not_found
from async_processor.api.metrics import ApiMetrics
from async_processor.api.storage import Storage
from async_processor.api.store import Store
from async_processor.client import SortedSetClient

DEFAULT_ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")


MAX_FILE_BYTES = 200 * 1024 * 1024
MAX_FILE_LINES = 50_000
MAX_OPEN_LINES = 5000


@dataclass(frozen=True, slots=True)
class Limits:
    max_file_bytes: int = MAX_FILE_BYTES
    max_file_lines: int = MAX_FILE_LINES
    # A batch's lines queued and unanswered at most: a big batch dispatches while it is
    # still being queued, and cannot fill the queue ahead of other batches.
    max_open_lines: int = MAX_OPEN_LINES


@dataclass(slots=True)
class Context:
    store: Store
    storage: Storage
    queue: str
    metrics: ApiMetrics = field(default_factory=ApiMetrics)
    limits: Limits = field(default_factory=Limits)
    endpoints: tuple[str, ...] = DEFAULT_ENDPOINTS
    retention_every: float = 60.0  # seconds between looks for expired files and batches
    replica_timeout: float = 60.0  # seconds without a heartbeat before a replica is gone
    client: SortedSetClient | None = None  # submits single requests (set before serving)
    caps: CapsBook = field(default_factory=CapsBook)
    output_order: str = "arrival"  # a batch's output lines' order unless it names one
    gateway: str = ""  # X-AP-Mode: direct proxies here (the queue's igw_base_url by default)
    session: aiohttp.ClientSession | None = None  # direct's connections (set before serving)

    _guard: Guard | None = None

    @property
    def guard(self) -> Guard:
        """The tenant caps' checks (made on first use: they register scripts)."""
        if self._guard is None:
            self._guard = Guard(self.store, self.caps)
        return self._guard


CONTEXT = web.AppKey("context", Context)


def context(request: web.Request) -> Context:
    return request.app[CONTEXT]


def tenant(request: web.Request) -> str:
    return str(request["tenant"])


async def owned(request: web.Request, kind: Literal["file", "batch", "request"]) -> dict[str, str]:
    """The record of the file, batch or request the path names, if it is the caller's;
    else 404 (another tenant's is answered as absent)."""
    object_id = request.match_info[f"{kind}_id"]
    store = context(request).store
    find = {"file": store.file, "batch": store.batch_for, "request": store.request}[kind]
    record = await find(tenant(request), object_id)
    if record is None:
        raise not_found(kind, object_id)
    return record
