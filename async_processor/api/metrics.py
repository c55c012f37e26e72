"""The API's metrics: requests by route, batches by status (open ones, and changes), lines
by outcome, results read, time to a batch's first result.

Stage: the API's observability. Input: the events the middleware, the store and the
collector report. Output: ``async_processor_api_*`` families on the process's registry,
served at ``/metrics`` on the API's port (counts only: no tenant, no id, no payload).
"""

from __future__ import annotations

import time

from aiohttp import web
from aiohttp.typedefs import Middleware
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.aiohttp import make_aiohttp_handler

from async_processor.api.errors import Handler

PREFIX = "async_processor_api_"
OPEN_STATUSES = ("validating", "in_progress", "finalizing", "cancelling")
OUTCOMES = ("completed", "failed", "cancelled", "expired")


class ApiMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.request_seconds = Histogram(
            PREFIX + "request_duration_seconds",
            "API requests by route pattern, method and status",
            ["route", "method", "status"],
            registry=r,
        )
        self.batches = Counter(
            PREFIX + "batch_status_changes",
            "batches moved to a status (by this replica)",
            ["status"],
            registry=r,
        )
        self.lines = Counter(
            PREFIX + "results",
            "results read from the API's result list (by this replica): recorded, or "
            "dropped (read again after a crash, for a finalized batch, or not a batch line)",
            ["outcome"],
            registry=r,
        )
        self.outcomes = Counter(
            PREFIX + "lines",
            "batch lines ended (by this replica): completed (a 2xx answer), failed (an "
            "error answer or none), cancelled or expired (no result before the batch's end)",
            ["outcome"],
            registry=r,
        )
        self.open_batches = Gauge(
            PREFIX + "batches",
            "batches not yet ended, by status, as Redis holds them (every replica reports "
            "the same numbers: take max, not sum)",
            ["status"],
            registry=r,
        )
        for status in OPEN_STATUSES:  # at 0 from the start, so an alert sees the series
            self.open_batches.labels(status).set(0)
        for outcome in OUTCOMES:
            self.outcomes.labels(outcome).inc(0)
        for outcome in ("recorded", "dropped"):
            self.lines.labels(outcome).inc(0)
        self.first_result = Histogram(
            PREFIX + "first_result_seconds",
            "from a batch's creation to its first recorded result",
            buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600),
            registry=r,
        )

    def middleware(self) -> Middleware:
        @web.middleware
        async def timed(request: web.Request, handler: Handler) -> web.StreamResponse:
            started = time.perf_counter()
            status = 500
            try:
                response = await handler(request)
                status = response.status
                return response
            finally:
                resource = request.match_info.route.resource
                route = resource.canonical if resource is not None else "unmatched"
                self.request_seconds.labels(route, request.method, str(status)).observe(
                    time.perf_counter() - started
                )

        return timed

    def add_route(self, app: web.Application) -> None:
        app.router.add_get("/metrics", make_aiohttp_handler(self.registry))
