"""Inference simulator: an OpenAI-compatible server standing in for the llm-d router.

Stage: outside the daemon (demo, integration tests, benchmarks). Input: POSTs to
``/v1/completions`` and ``/v1/chat/completions``. Output: OpenAI-shaped JSON after a
configurable latency, 429s when its capacity is full, injected faults (5xx, connection
resets, hangs), and the Prometheus series the prometheus/endpoint-scrape gates read
(``/metrics``). ``/admin/config``, ``/admin/stats`` and ``/admin/requests`` let tests and
benchmarks drive load and look at what arrived. It must never be a benchmark's
bottleneck: zero latency means no sleep at all, gauges are computed at scrape time.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import time
from collections import deque
from typing import Any

import anyio
from aiohttp import web
from anyio.abc import TaskStatus
from prometheus_client import CollectorRegistry

from async_processor.cli.args import duration, parse, subcommand_parser
from async_processor.durations import format_duration
from async_processor.headers import DROPPED_REASON_HEADER
from async_processor.health import listening
from async_processor.sim.admin import JSON, add_admin_routes, error_response
from async_processor.sim.capacity import Occupancy, Slots
from async_processor.sim.config import SimConfig, SimStats
from async_processor.sim.pool import PoolConfig
from async_processor.sim.series import SimCollector
from async_processor.sim.serving import (
    TIMING_HEADER,
    Load,
    PoolCollector,
    PoolRuntime,
    add_arguments,
    config_from_args,
    request_class,
)

COMPLETION_PATHS = ("/v1/completions", "/v1/chat/completions")
RECORDED_REQUESTS = 1000
DEFAULT_MAX_TOKENS = 16


class Simulator:
    """The server; ``serve`` runs it until cancelled, ``set_config`` changes it live."""

    def __init__(self, config: SimConfig | None = None, pool: PoolConfig | None = None) -> None:
        self.config = config or SimConfig()
        # With a pool model, latency follows load (sim/pool.py) instead of the fixed delay.
        self.pool = PoolRuntime(pool) if pool else None
        self._rng = random.Random(self.config.seed)
        self._stats = SimStats()
        self._slots = Slots()
        self.occupancy = Occupancy()
        self._recorded: deque[tuple[str, dict[str, str], bytes]] = deque(maxlen=RECORDED_REQUESTS)
        self.registry = CollectorRegistry()
        self.registry.register(SimCollector(self))
        if self.pool:
            self.registry.register(PoolCollector(self.pool, self.vllm_labels))

    # -- run-time control -------------------------------------------------------------

    def set_config(self, **changes: Any) -> SimConfig:
        """Validate and apply changes; a new seed restarts the fault sequence."""
        self.config = SimConfig.model_validate({**self.config.model_dump(), **changes})
        if "seed" in changes:
            self._rng = random.Random(self.config.seed)
        self._slots.admit(self.config.max_concurrent)
        return self.config

    @property
    def stats(self) -> dict[str, Any]:
        return self._stats.as_dict(self._slots, self.occupancy)

    def load(self) -> Load:
        """Running and waiting requests per pod, and the pool's saturation (0..1)."""
        if self.pool:
            return self.pool.load()
        c, s = self.config, self.stats
        saturation = min(1.0, s["running"] / c.max_concurrent) if c.max_concurrent else 0.0
        return Load([("", s["running"], s["waiting"])], saturation)

    def vllm_labels(self) -> dict[str, str]:
        c = self.config
        return {"model_name": c.model, "inference_pool": c.pool, "namespace": c.namespace}

    def recorded(self) -> list[dict[str, Any]]:
        return [
            {"path": path, "headers": headers, "body": body.decode("utf-8", "replace")}
            for path, headers, body in self._recorded
        ]

    def reset(self) -> None:
        """Forget counters and recorded requests (running/waiting stay what they are)."""
        self._stats = SimStats()
        self._slots.max_running_seen = self._slots.running
        self.occupancy.reset()
        self._recorded.clear()

    # -- handlers -----------------------------------------------------------------------

    async def _completion(self, request: web.Request) -> web.StreamResponse:
        self.occupancy.enter()
        try:
            return await self._handle(request)
        finally:
            self.occupancy.leave()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        self._stats.total += 1
        self._recorded.append((request.path, dict(request.headers), body))
        if self.pool:
            return self._answer(await self._pooled(request, body, self.pool))
        if not await self._slots.acquire(self.config.max_concurrent, self.config.max_waiting):
            return self._answer(_capacity_response(self.config.retry_after))
        try:
            return self._answer(await self._respond(request, body))
        finally:
            self._slots.release(self.config.max_concurrent)

    def _answer(self, response: web.Response) -> web.Response:
        self._stats.by_status[str(response.status)] += 1
        return response

    async def _respond(self, request: web.Request, body: bytes) -> web.Response:
        config = self.config
        fault = self._draw_fault(config)
        if fault == "reset":
            self._stats.by_status["reset"] += 1
            if request.transport is not None:
                request.transport.abort()
            await anyio.sleep_forever()  # cancelled as soon as aiohttp sees the lost connection
        if fault == "hang":
            self._stats.by_status["hang"] += 1
            await anyio.sleep_forever()  # cancelled when the client goes away
        if fault == "error":
            return error_response(config.error_status, "simulated server error", "server_error")
        parsed = _parse(body)
        if isinstance(parsed, web.Response):
            return parsed
        max_tokens = _max_tokens(parsed)
        delay = config.delay(max_tokens)
        if delay > 0:  # zero latency must not even enter the event loop's timer heap
            await anyio.sleep(delay)
        chat = request.path.endswith("/chat/completions")
        body = _completion_body(parsed, chat, max_tokens, config.usage_json)
        return web.Response(body=body, content_type=JSON)

    async def _pooled(self, request: web.Request, body: bytes, pool: PoolRuntime) -> web.Response:
        """Through the load-dependent pool: shed (429) or answered when its job finishes."""
        parsed = _parse(body)
        if isinstance(parsed, web.Response):
            return parsed
        chat = request.path.endswith("/chat/completions")
        max_tokens = _max_tokens(parsed)
        job = await pool.run(
            request_class(request.headers), _prompt_tokens(parsed, chat), max_tokens
        )
        if job is None:
            return _capacity_response(self.config.retry_after, "pool-saturated")
        body = _completion_body(parsed, chat, max_tokens, self.config.usage_json)
        response = web.Response(body=body, content_type=JSON)
        response.headers[TIMING_HEADER] = f"{job.ttft or 0.0:.6f}"
        return response

    def _draw_fault(self, config: SimConfig) -> str:
        if not (config.reset_rate or config.hang_rate or config.error_rate):
            return ""
        draw = self._rng.random()
        for name, rate in (
            ("reset", config.reset_rate),
            ("hang", config.hang_rate),
            ("error", config.error_rate),
        ):
            if draw < rate:
                return name
            draw -= rate
        return ""

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        for path in COMPLETION_PATHS:
            app.router.add_post(path, self._completion)
        add_admin_routes(app, self)
        if self.pool:
            self.pool.add_routes(app)
        return app

    async def serve(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        task_status: TaskStatus[int] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Listen until cancelled; reports the bound port (useful with ``port=0``)."""
        # handler_cancellation: a hung or queued request ends when its client goes away.
        async with listening(
            self.app(), host, port, backlog=4096, handler_cancellation=True
        ) as bound:
            task_status.started(bound)
            await (self.pool.drive() if self.pool else anyio.sleep_forever())


def _parse(body: bytes) -> dict[str, Any] | web.Response:
    """The request object, or the 400 answer for a body that is not one."""
    try:
        parsed = json.loads(body)
        if not isinstance(parsed, dict):
            raise ValueError("the body is not a JSON object")
        _max_tokens(parsed)
    except (ValueError, TypeError) as exc:
        return error_response(400, f"invalid request body: {exc}", "invalid_request_error")
    return parsed


def _max_tokens(request: dict[str, Any]) -> int:
    return int(request.get("max_tokens") or DEFAULT_MAX_TOKENS)


def _prompt_tokens(request: dict[str, Any], chat: bool) -> int:
    """Estimated as a quarter of the prompt's characters (no tokenizer)."""
    prompt = json.dumps(request.get("messages", "")) if chat else str(request.get("prompt", ""))
    return max(1, len(prompt) // 4)


def _completion_body(
    request: dict[str, Any], chat: bool, max_tokens: int, usage_json: str | None = None
) -> bytes:
    text = " ".join(["tok"] * min(max_tokens, 4096))
    if chat:
        choice: dict[str, Any] = {"message": {"role": "assistant", "content": text}}
    else:
        choice = {"text": text}
    prompt_tokens = _prompt_tokens(request, chat)
    body = json.dumps(
        {
            "id": f"cmpl-sim-{time.monotonic_ns():x}",
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": request.get("model", ""),
            "choices": [{"index": 0, "finish_reason": "length", "logprobs": None, **choice}],
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": max_tokens,
                "total_tokens": prompt_tokens + max_tokens,
            },
        }
    )
    if usage_json is not None:  # usage stays last, as OpenAI servers put it
        body = body[: body.rindex('"usage": ')] + f'"usage": {usage_json}}}'
    return body.encode()


def _capacity_response(retry_after: float, reason: str = "capacity") -> web.Response:
    response = error_response(429, "simulator capacity is full", "rate_limit_error")
    response.headers["Retry-After"] = f"{retry_after:g}"
    response.headers[DROPPED_REASON_HEADER] = reason
    return response


# -- command line ---------------------------------------------------------------------


# (flag, type, metavar, help) of the SimConfig fields settable at start-up.
_SIM_FLAGS: tuple[tuple[str, Any, str, str], ...] = (
    ("latency", duration, "DURATION", "fixed latency per request"),
    ("ttft", duration, "DURATION", "added time to first token"),
    ("per-token", duration, "DURATION", "added time per requested token (max_tokens)"),
    ("max-concurrent", int, "N", "running slots; beyond them requests wait (0: unlimited)"),
    ("max-waiting", int, "N", "waiting requests beyond which a 429 is returned"),
    ("retry-after", duration, "DURATION", "Retry-After of a capacity 429"),
    ("error-rate", float, "FRACTION", "share of requests answered with --error-status"),
    ("error-status", int, "STATUS", "HTTP status of an injected error"),
    ("reset-rate", float, "FRACTION", "share of connections reset without an answer"),
    ("hang-rate", float, "FRACTION", "share of requests never answered"),
    ("seed", int, "N", "random seed for the injected faults"),
    ("model", str, "NAME", "model_name label of the exported series"),
    ("pool", str, "NAME", "inference_pool label of the exported series"),
    ("namespace", str, "NAME", "namespace label of the exported series"),
    ("ready-pods", int, "N", "ready pods the exported pool series report"),
)


def _parser() -> argparse.ArgumentParser:
    p = subcommand_parser("async-processor sim", __doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1", metavar="ADDRESS", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, metavar="PORT", help="port to listen on")
    add_arguments(p)
    for name, kind, metavar, help_text in _SIM_FLAGS:
        default = SimConfig.model_fields[name.replace("-", "_")].get_default()
        if kind is duration:
            default = format_duration(default)  # --help shows "50ms", not 0.05
        p.add_argument(f"--{name}", type=kind, default=default, metavar=metavar, help=help_text)
    p.add_argument(
        "--epp-metrics",
        choices=("current", "legacy", "both"),
        default="current",
        help="EPP series names: llm_d_epp_* (llm-d-router v0.9+), the deprecated ones, or both",
    )
    return p


def main(argv: list[str]) -> int:
    """``async-processor sim``: serve until SIGINT/SIGTERM."""
    args = vars(parse(_parser(), argv))
    host, port = args.pop("host"), args.pop("port")
    try:
        pool = config_from_args(args)
        config = SimConfig(**{k: v for k, v in args.items() if v is not None})
    except ValueError as exc:
        print(f"invalid simulator settings: {exc}")
        return 2
    anyio.run(_serve_until_signal, Simulator(config, pool), host, port)
    return 0


async def _serve_until_signal(sim: Simulator, host: str, port: int) -> None:
    async with anyio.create_task_group() as tg:
        bound = await tg.start(sim.serve, host, port)
        print(f"simulator listening on http://{host}:{bound}", flush=True)
        with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for _ in signals:
                break
        tg.cancel_scope.cancel()
