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
from collections import Counter, deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import anyio
from aiohttp import web
from anyio.abc import TaskStatus
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from pydantic import BaseModel, ConfigDict, Field

from async_processor.cliargs import duration, parse, subcommand_parser
from async_processor.durations import format_duration
from async_processor.gates import epp
from async_processor.health import listening
from async_processor.sim_pool import PoolConfig
from async_processor.sim_serving import (
    TIMING_HEADER,
    Load,
    PoolCollector,
    PoolRuntime,
    add_arguments,
    config_from_args,
    request_class,
)

COMPLETION_PATHS = ("/v1/completions", "/v1/chat/completions")
DROPPED_REASON_HEADER = "x-llm-d-request-dropped-reason"
RECORDED_REQUESTS = 1000
DEFAULT_MAX_TOKENS = 16
JSON = "application/json"


class SimConfig(BaseModel):
    """What the simulator does; every field can change at run time (``POST /admin/config``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    latency: float = Field(0.0, ge=0)  # fixed seconds per request
    ttft: float = Field(0.0, ge=0)  # added: time to first token
    per_token: float = Field(0.0, ge=0)  # added: seconds per requested token (max_tokens)
    max_concurrent: int = Field(0, ge=0)  # running slots; 0 = unlimited
    max_waiting: int = Field(0, ge=0)  # FIFO queue for a running slot
    retry_after: float = Field(1.0, ge=0)  # Retry-After header of a capacity 429
    error_rate: float = Field(0.0, ge=0, le=1)
    error_status: int = Field(500, ge=400, le=599)
    reset_rate: float = Field(0.0, ge=0, le=1)  # abort the connection, no response
    hang_rate: float = Field(0.0, ge=0, le=1)  # never answer until the client goes away
    seed: int | None = None
    # Labels of the exported series, as a real llm-d deployment would carry them.
    model: str = "sim-model"
    pool: str = "sim-pool"
    namespace: str = "default"
    ready_pods: int = Field(1, ge=0)
    # EPP series names: llm-d-router v0.9+ (current), older EPPs (legacy), or both.
    epp_metrics: Literal["current", "legacy", "both"] = "current"

    def delay(self, max_tokens: int) -> float:
        return self.latency + self.ttft + self.per_token * max_tokens


@dataclass
class _Waiter:
    """One request queued for a running slot; ``granted`` means the slot is now its own."""

    event: anyio.Event = field(default_factory=anyio.Event)
    granted: bool = False


@dataclass
class SimStats:
    total: int = 0
    by_status: Counter[str] = field(default_factory=Counter)
    max_running_seen: int = 0
    running: int = 0
    waiting: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "total": self.total,
            "by_status": dict(self.by_status),
            "max_concurrent_seen": self.max_running_seen,
            "running": self.running,
            "waiting": self.waiting,
        }


class Simulator:
    """The server; ``serve`` runs it until cancelled, ``set_config`` changes it live."""

    def __init__(self, config: SimConfig | None = None, pool: PoolConfig | None = None) -> None:
        self.config = config or SimConfig()
        # With a pool model, latency follows load (sim_pool.py) instead of the fixed delay.
        self.pool = PoolRuntime(pool) if pool else None
        self._rng = random.Random(self.config.seed)
        self._stats = SimStats()
        self._queue: deque[_Waiter] = deque()
        self._recorded: deque[tuple[str, dict[str, str], bytes]] = deque(maxlen=RECORDED_REQUESTS)
        self.registry = CollectorRegistry()
        self.registry.register(_SimCollector(self))
        if self.pool:
            self.registry.register(PoolCollector(self.pool, self._vllm_labels))

    # -- run-time control -------------------------------------------------------------

    def set_config(self, **changes: Any) -> SimConfig:
        """Validate and apply changes; a new seed restarts the fault sequence."""
        self.config = SimConfig.model_validate({**self.config.model_dump(), **changes})
        if "seed" in changes:
            self._rng = random.Random(self.config.seed)
        self._admit_waiters()
        return self.config

    @property
    def stats(self) -> dict[str, Any]:
        self._stats.waiting = len(self._queue)
        return self._stats.as_dict()

    def load(self) -> Load:
        """Running and waiting requests per pod, and the pool's saturation (0..1)."""
        if self.pool:
            return self.pool.load()
        c, s = self.config, self.stats
        saturation = min(1.0, s["running"] / c.max_concurrent) if c.max_concurrent else 0.0
        return Load([("", s["running"], s["waiting"])], saturation)

    def _vllm_labels(self) -> dict[str, str]:
        c = self.config
        return {"model_name": c.model, "inference_pool": c.pool, "namespace": c.namespace}

    def recorded(self) -> list[dict[str, Any]]:
        return [
            {"path": path, "headers": headers, "body": body.decode("utf-8", "replace")}
            for path, headers, body in self._recorded
        ]

    def reset(self) -> None:
        """Forget counters and recorded requests (running/waiting stay what they are)."""
        running = self._stats.running
        self._stats = SimStats(running=running, max_running_seen=running)
        self._recorded.clear()

    # -- capacity -----------------------------------------------------------------------

    def _has_free_slot(self) -> bool:
        limit = self.config.max_concurrent
        return limit == 0 or self._stats.running < limit

    def _take_slot(self) -> None:
        s = self._stats
        s.running += 1
        s.max_running_seen = max(s.max_running_seen, s.running)

    def _release_slot(self) -> None:
        self._stats.running -= 1
        self._admit_waiters()

    def _admit_waiters(self) -> None:
        while self._queue and self._has_free_slot():
            waiter = self._queue.popleft()
            waiter.granted = True
            self._take_slot()
            waiter.event.set()

    async def _acquire(self) -> bool:
        """Take a running slot, queueing FIFO; False when the queue is full too."""
        if self._has_free_slot() and not self._queue:
            self._take_slot()
            return True
        if len(self._queue) >= self.config.max_waiting:
            return False
        waiter = _Waiter()
        self._queue.append(waiter)
        try:
            await waiter.event.wait()
        except BaseException:
            # The client left: give up the place, or the slot if it was handed over.
            if waiter.granted:
                self._release_slot()
            else:
                self._queue.remove(waiter)
            raise
        return True

    # -- handlers -----------------------------------------------------------------------

    async def _completion(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        self._stats.total += 1
        self._recorded.append((request.path, dict(request.headers), body))
        if self.pool:
            return self._answer(await self._pooled(request, body, self.pool))
        if not await self._acquire():
            return self._answer(_capacity_response(self.config.retry_after))
        try:
            return self._answer(await self._respond(request, body))
        finally:
            self._release_slot()

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
            return _error_response(config.error_status, "simulated server error", "server_error")
        parsed = _parse(body)
        if isinstance(parsed, web.Response):
            return parsed
        max_tokens = _max_tokens(parsed)
        delay = config.delay(max_tokens)
        if delay > 0:  # zero latency must not even enter the event loop's timer heap
            await anyio.sleep(delay)
        chat = request.path.endswith("/chat/completions")
        return web.Response(body=_completion_body(parsed, chat, max_tokens), content_type=JSON)

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
        response = web.Response(body=_completion_body(parsed, chat, max_tokens), content_type=JSON)
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

    async def _metrics(self, _: web.Request) -> web.Response:
        body = generate_latest(self.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _healthz(self, _: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def _get_config(self, _: web.Request) -> web.Response:
        return web.json_response(self.config.model_dump())

    async def _post_config(self, request: web.Request) -> web.Response:
        try:
            changes = await request.json()
            if not isinstance(changes, dict):
                raise ValueError("expected a JSON object")
            config = self.set_config(**changes)
        except ValueError as exc:  # pydantic's ValidationError is a ValueError
            return _error_response(400, str(exc), "invalid_request_error")
        return web.json_response(config.model_dump())

    async def _get_stats(self, _: web.Request) -> web.Response:
        return web.json_response(self.stats)

    async def _get_requests(self, _: web.Request) -> web.Response:
        return web.json_response(self.recorded())

    async def _post_reset(self, _: web.Request) -> web.Response:
        self.reset()
        return web.json_response(self.stats)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        for path in COMPLETION_PATHS:
            app.router.add_post(path, self._completion)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/admin/config", self._get_config)
        app.router.add_post("/admin/config", self._post_config)
        app.router.add_get("/admin/stats", self._get_stats)
        app.router.add_get("/admin/requests", self._get_requests)
        app.router.add_post("/admin/reset", self._post_reset)
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
        return _error_response(400, f"invalid request body: {exc}", "invalid_request_error")
    return parsed


def _max_tokens(request: dict[str, Any]) -> int:
    return int(request.get("max_tokens") or DEFAULT_MAX_TOKENS)


def _prompt_tokens(request: dict[str, Any], chat: bool) -> int:
    """Estimated as a quarter of the prompt's characters (no tokenizer)."""
    prompt = json.dumps(request.get("messages", "")) if chat else str(request.get("prompt", ""))
    return max(1, len(prompt) // 4)


def _completion_body(request: dict[str, Any], chat: bool, max_tokens: int) -> bytes:
    text = " ".join(["tok"] * min(max_tokens, 4096))
    if chat:
        choice: dict[str, Any] = {"message": {"role": "assistant", "content": text}}
    else:
        choice = {"text": text}
    prompt_tokens = _prompt_tokens(request, chat)
    return json.dumps(
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
    ).encode()


def _error_response(status: int, message: str, kind: str) -> web.Response:
    body = json.dumps({"error": {"message": message, "type": kind, "code": status}})
    return web.Response(status=status, text=body, content_type=JSON)


def _capacity_response(retry_after: float, reason: str = "capacity") -> web.Response:
    response = _error_response(429, "simulator capacity is full", "rate_limit_error")
    response.headers["Retry-After"] = f"{retry_after:g}"
    response.headers[DROPPED_REASON_HEADER] = reason
    return response


class _SimCollector(Collector):
    """Gauges computed at scrape time from the live counts (nothing to update per request).

    Names and labels are what the prometheus-budget / -saturation PromQL and the
    endpoint-scrape gate read: vLLM series carry ``model_name`` and a relabelled
    ``inference_pool``; EPP pool series carry ``name``; flow-control series carry
    ``inference_pool``. The queue sizes are the waiting requests, split over the pods.
    EPP series use the current ``llm_d_epp_*`` names, the legacy ones or both
    (``epp_metrics``), as llm-d-router v0.9+, older EPPs or dual-emitting ones do.
    """

    def __init__(self, sim: Simulator) -> None:
        self._sim = sim

    def collect(self) -> Iterator[GaugeMetricFamily]:
        c, load = self._sim.config, self._sim.load()
        vllm = self._sim._vllm_labels()
        # A pool model reports each pod (label ``pod``); the fixed model one pool-wide series.
        pods_vllm = [({**vllm, "pod": pod} if pod else vllm, r, w) for pod, r, w in load.per_pod]
        yield _gauge(
            "vllm:num_requests_running", "Requests running.", [(v, r) for v, r, _ in pods_vllm]
        )
        yield _gauge(
            "vllm:num_requests_waiting", "Requests waiting.", [(v, w) for v, _, w in pods_vllm]
        )
        pods = len(load.per_pod) if self._sim.pool else c.ready_pods
        for legacy in _EPP_NAMES[c.epp_metrics]:
            yield from _epp_series(c, legacy, pods, load.waiting, load.saturation)


_EPP_NAMES = {"current": (False,), "legacy": (True,), "both": (False, True)}


def _epp_series(
    c: SimConfig, legacy: bool, pods: int, waiting: float, saturation: float
) -> Iterator[GaugeMetricFamily]:
    """The EPP's pool and flow-control gauges under the current or the legacy names."""

    def name(metric: epp.EppMetric) -> str:
        return metric.legacy if legacy else metric.current

    pool = {"name": c.pool, "namespace": c.namespace}
    flow = {"inference_pool": c.pool, "model_name": c.model, "namespace": c.namespace}
    endpoint = "model_server_pod" if legacy else "model_server_endpoint"
    per_pod = [({**pool, endpoint: f"sim-{i}"}, waiting / pods) for i in range(pods)]
    yield _gauge(name(epp.READY_ENDPOINTS), "Ready endpoints in the pool.", [(pool, pods)])
    yield _gauge(name(epp.PER_ENDPOINT_QUEUE_SIZE), "Queued requests per endpoint.", per_pod)
    yield _gauge(name(epp.FLOW_CONTROL_QUEUE_SIZE), "Flow-control queue.", [(flow, waiting)])
    yield _gauge(
        name(epp.POOL_SATURATION),
        "Running / capacity, 0..1.",
        [({"inference_pool": c.pool, "namespace": c.namespace}, saturation)],
    )


def _gauge(
    name: str, doc: str, series: Iterable[tuple[dict[str, str], float]]
) -> GaugeMetricFamily:
    series = list(series)
    labels = list(series[0][0]) if series else []
    family = GaugeMetricFamily(name, doc, labels=labels)
    for values, value in series:
        family.add_metric([values[k] for k in labels], value)
    return family


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
