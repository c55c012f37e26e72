"""The simulator's control routes: ``/healthz``, ``/metrics`` and ``/admin/*`` (read and
change the config live, counters, recorded requests, reset). Tests and benchmarks drive
the simulator through these; the completion routes are in ``simulator``.
"""

from __future__ import annotations

import json

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from async_processor.sim.config import SimView

JSON = "application/json"


def error_response(status: int, message: str, kind: str) -> web.Response:
    """An OpenAI-style error answer."""
    body = json.dumps({"error": {"message": message, "type": kind, "code": status}})
    return web.Response(status=status, text=body, content_type=JSON)


def add_admin_routes(app: web.Application, sim: SimView) -> None:
    """Everything but the completions."""

    async def metrics(_: web.Request) -> web.Response:
        body = generate_latest(sim.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def healthz(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def get_config(_: web.Request) -> web.Response:
        return web.json_response(sim.config.model_dump())

    async def post_config(request: web.Request) -> web.Response:
        try:
            changes = await request.json()
            if not isinstance(changes, dict):
                raise ValueError("expected a JSON object")
            config = sim.set_config(**changes)
        except ValueError as exc:  # pydantic's ValidationError is a ValueError
            return error_response(400, str(exc), "invalid_request_error")
        return web.json_response(config.model_dump())

    async def get_stats(_: web.Request) -> web.Response:
        return web.json_response(sim.stats)

    async def get_requests(_: web.Request) -> web.Response:
        return web.json_response(sim.recorded())

    async def post_reset(_: web.Request) -> web.Response:
        sim.reset()
        return web.json_response(sim.stats)

    app.router.add_get("/metrics", metrics)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/admin/config", get_config)
    app.router.add_post("/admin/config", post_config)
    app.router.add_get("/admin/stats", get_stats)
    app.router.add_get("/admin/requests", get_requests)
    app.router.add_post("/admin/reset", post_reset)
