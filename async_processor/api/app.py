"""``async-processor api``: the OpenAI Files and Batches API over our queues.

Stage: the command and its wiring. Input: flags (and ``ASYNC_PROCESSOR_<FLAG>`` env), the
transport config file (its Redis and its queue), the keys file. Output: an aiohttp server
on ``--listen`` and, in the same task group, the runner that drives batches and collects
their results (docs/batch-api.md).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from pathlib import Path

import aiohttp
import anyio
import structlog
from aiohttp import web
from redis.exceptions import RedisError

from async_processor.api import batches, files, requests, rerun, results
from async_processor.api.auth import auth_middleware, load_keys
from async_processor.api.caps import (
    MAX_OPEN_BATCHES,
    MAX_QUEUED_LINES,
    MAX_STORED_BYTES,
    Caps,
    load_caps,
)
from async_processor.api.context import (
    CONTEXT,
    DEFAULT_ENDPOINTS,
    MAX_FILE_BYTES,
    MAX_FILE_LINES,
    MAX_OPEN_LINES,
    Context,
    Limits,
)
from async_processor.api.errors import errors_middleware
from async_processor.api.keys import result_list
from async_processor.api.metrics import ApiMetrics
from async_processor.api.runner import Runner
from async_processor.api.storage import DirStorage
from async_processor.api.store import BATCH_RETENTION, Store
from async_processor.cli.args import duration, parse, subcommand_parser
from async_processor.client import SortedSetClient
from async_processor.config import redis_connection_file
from async_processor.errors import ConfigError
from async_processor.health import listening
from async_processor.logs import configure_logging
from async_processor.redis.conn import connect

log = structlog.get_logger(__name__)


def build_app(ctx: Context, digests: dict[str, str] | None) -> web.Application:
    middlewares = [ctx.metrics.middleware(), errors_middleware, auth_middleware(digests)]
    app = web.Application(middlewares=middlewares)
    app[CONTEXT] = ctx
    files.add_routes(app)
    batches.add_routes(app)
    results.add_routes(app)
    rerun.add_routes(app)
    requests.add_routes(app, ctx.endpoints)
    ctx.metrics.add_route(app)
    app.router.add_get("/healthz", _ok)
    app.router.add_get("/readyz", _ready)
    return app


async def _ok(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def _ready(request: web.Request) -> web.Response:
    """Ready while Redis answers (every call needs it)."""
    try:
        with anyio.fail_after(2):
            await request.app[CONTEXT].store.redis.ping()
    except (TimeoutError, RedisError, OSError) as exc:
        return web.json_response({"status": "unready", "reason": type(exc).__name__}, status=503)
    return web.json_response({"status": "ok"})


def _parser() -> argparse.ArgumentParser:
    p = subcommand_parser("async-processor api", "Serve the OpenAI Files and Batches API.")
    p.add_argument(
        "--transport-config-file", required=True, help="the daemon's redis-sortedset config"
    )
    p.add_argument("--listen", default="127.0.0.1:8000", help="host:port to serve on")
    p.add_argument(
        "--api-keys-file", default="", help='JSON {"<tenant>": ["<key>" or "sha256:<hex>"]}'
    )
    p.add_argument("--no-auth", action="store_true", help="serve without keys (tenant 'default')")
    p.add_argument("--storage-dir", default="api-storage", help="where file bytes are kept")
    p.add_argument(
        "--queue", default="", help="the queue batch lines go to (default: the config's one queue)"
    )
    p.add_argument("--replica", default=socket.gethostname(), help="this replica's name")
    p.add_argument(
        "--endpoints", default=",".join(DEFAULT_ENDPOINTS), help="allowed batch endpoints"
    )
    p.add_argument(
        "--gateway-url",
        default="",
        help="where X-AP-Mode: direct proxies to (default: the queue's igw_base_url)",
    )
    p.add_argument("--max-open-batches", type=int, default=MAX_OPEN_BATCHES, help="per tenant")
    p.add_argument("--max-queued-lines", type=int, default=MAX_QUEUED_LINES, help="per tenant")
    p.add_argument("--max-stored-bytes", type=int, default=MAX_STORED_BYTES, help="per tenant")
    p.add_argument(
        "--tenant-caps-file",
        default="",
        help='JSON {"<tenant>": {"open_batches": N, "queued_lines": N, "stored_bytes": N}}',
    )
    p.add_argument(
        "--output-order",
        choices=("arrival", "input"),
        default="arrival",
        help="output and error files' line order unless a batch names one",
    )
    p.add_argument("--max-file-bytes", type=int, default=MAX_FILE_BYTES)
    p.add_argument("--max-file-lines", type=int, default=MAX_FILE_LINES)
    p.add_argument(
        "--max-open-lines",
        type=int,
        default=MAX_OPEN_LINES,
        help="a batch's lines queued and unanswered at most",
    )
    p.add_argument(
        "--retention-interval",
        type=duration,
        default=60.0,
        help="how often expired files and batches are looked for",
    )
    p.add_argument(
        "--batch-retention",
        type=duration,
        default=BATCH_RETENTION,
        help="how long a finished batch is kept",
    )
    p.add_argument(
        "--replica-timeout",
        type=duration,
        default=60.0,
        help="silence after which a replica's taken results go back to the list",
    )
    p.add_argument("--log-level", default="info")
    p.add_argument("--log-format", default="auto")
    return p


def _queues(args: argparse.Namespace) -> list[dict[str, object]]:
    try:
        queues = json.loads(Path(args.transport_config_file).read_text()).get("queues") or []
    except (OSError, ValueError, AttributeError) as exc:
        raise ConfigError(f"--transport-config-file: {exc}") from None
    return [q for q in queues if isinstance(q, dict)]


def _queue(args: argparse.Namespace) -> str:
    if args.queue:
        return str(args.queue)
    names = [q.get("queue_name") for q in _queues(args)]
    if len(names) != 1 or not isinstance(names[0], str):
        raise ConfigError("--queue is required unless the transport config names one queue")
    return names[0]


def _gateway(args: argparse.Namespace, queue: str) -> str:
    """``--gateway-url``, else the queue's ``igw_base_url`` (where the daemon sends it)."""
    if args.gateway_url:
        return str(args.gateway_url)
    found = [q.get("igw_base_url") for q in _queues(args) if q.get("queue_name") == queue]
    return found[0] if found and isinstance(found[0], str) else ""


def _listen(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isascii() or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ConfigError(f"--listen {text!r} is not host:port")
    return host.strip("[]"), int(port)


def _digests(args: argparse.Namespace) -> dict[str, str] | None:
    if args.no_auth:
        return None
    if not args.api_keys_file:
        raise ConfigError("--api-keys-file is required (or --no-auth to serve without keys)")
    return load_keys(Path(args.api_keys_file))


async def serve(args: argparse.Namespace) -> None:
    digests = _digests(args)
    default = Caps(args.max_open_batches, args.max_queued_lines, args.max_stored_bytes)
    caps = load_caps(args.tenant_caps_file, default)
    # REDIS_URL fills an empty url, as for the daemon (the chart's Secret sets it).
    conn = redis_connection_file(args.transport_config_file, os.environ.get("REDIS_URL", ""))
    queue = _queue(args)
    host, port = _listen(args.listen)
    metrics = ApiMetrics()
    store = Store(
        connect(conn),
        moved=lambda status: metrics.batches.labels(status).inc(),
        batch_retention=int(args.batch_retention),
    )
    ctx = Context(
        store=store,
        metrics=metrics,
        storage=DirStorage(Path(args.storage_dir)),
        queue=queue,
        limits=Limits(args.max_file_bytes, args.max_file_lines, args.max_open_lines),
        endpoints=tuple(e for e in args.endpoints.split(",") if e),
        retention_every=max(0.05, args.retention_interval),
        replica_timeout=max(0.3, args.replica_timeout),
        gateway=_gateway(args, queue),
        caps=caps,
        output_order=args.output_order,
    )
    client = SortedSetClient(conn, queue, result_list(queue), consumer=f"api-{args.replica}")
    ctx.client = client
    app = build_app(ctx, digests)
    # No pool limit of its own: a direct request holds a caller's connection anyway.
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
    ctx.session = session
    async with (
        session,
        client,
        anyio.create_task_group() as tg,
        listening(app, host, port) as bound,
    ):
        log.info("api_listening", host=host, port=bound, queue=queue, replica=args.replica)
        tg.start_soon(Runner(ctx, client, args.replica).run)
        await anyio.sleep_forever()


def main(argv: list[str]) -> int:
    args = parse(_parser(), argv)
    configure_logging(args.log_level, args.log_format)
    try:
        anyio.run(serve, args, backend_options={"use_uvloop": True})
    except KeyboardInterrupt:
        print("async-processor api: stopped", file=sys.stderr)
    return 0
