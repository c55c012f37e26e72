"""Producer and consumer commands on the client library: ``submit``, ``results``, ``cancel``.

Input: JSONL request lines (our request format, or OpenAI batch-input lines
``{custom_id, method, url, body}``), result lists, request ids. Output: requests on a
Redis sorted set, results as JSONL, cancellation markers. Long work shows progress on
stderr (a ``\\r`` bar on a terminal, periodic lines otherwise).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections.abc import Iterator
from typing import IO

import anyio

from async_processor.cli.args import (
    DAEMON_CMDLINE,
    daemon_flags,
    duration,
    parse,
    subcommand_parser,
)
from async_processor.client.redis_sortedset import SortedSetClient
from async_processor.client.served import Served, served_queues
from async_processor.client.submission import as_request, request_of
from async_processor.config import ENV_PREFIX, redis_connection_file, usable_env
from async_processor.config.redis import RedisConnection
from async_processor.errors import ConfigError, InvalidMessage, TransportError
from async_processor.json_scan import decode_object
from async_processor.messages import Payload, Request
from async_processor.redis.conn import connect, redis_errors
from async_processor.redis.keys import DEFAULT_REQUEST_QUEUE, DEFAULT_RESULT_LIST

CHUNK = 1000
LOCAL_REDIS = "redis://127.0.0.1:6379/0"


class Progress:
    """Progress on stderr (no dependency): a bar redrawn in place on a terminal; elsewhere
    (a log, a pipe) a plain count every 5 s and at the end, no bar."""

    def __init__(self, label: str, total: int | None, stream: IO[str] = sys.stderr) -> None:
        self.label, self.total, self.stream = label, total, stream
        self.done = 0
        self._tty = stream.isatty()
        self._last = 0.0
        self._started = time.monotonic()

    def advance(self, n: int = 1) -> None:
        self.done += n
        now = time.monotonic()
        if now - self._last >= (0.1 if self._tty else 5.0):
            self._last = now
            self._show(end="\r" if self._tty else "\n")

    def finish(self) -> None:
        self._show(end="\n")

    def _show(self, end: str) -> None:
        rate = self.done / max(1e-6, time.monotonic() - self._started)
        if not self._tty:  # a log or a pipe: plain counts, no bar
            of = f"/{self.total}" if self.total else ""
            text = f"{self.label} {self.done}{of} ({rate:.0f}/s)"
        elif self.total:
            width = 30
            filled = int(width * self.done / self.total)
            bar = "#" * filled + "-" * (width - filled)
            text = f"{self.label} [{bar}] {self.done}/{self.total} ({rate:.0f}/s)"
        else:
            text = f"{self.label} {self.done} ({rate:.0f}/s)"
        self.stream.write(text + end)
        self.stream.flush()


def request_from_line(line: str, *, deadline: int, default_endpoint: str = "") -> Request:
    """Our request from a JSONL line; OpenAI batch-input lines are converted. The payload
    (a batch line's ``body``) keeps its text as written: parsed and written again, a
    float lost its digits (``1.10`` became ``1.1``)."""
    try:
        obj, raws = decode_object(line, "line", ("payload", "body"))
    except InvalidMessage as exc:
        raise ValueError(str(exc)) from None
    payload: Payload | None = raws.pop("payload", None)
    if "custom_id" in obj and "body" in raws:
        payload = raws["body"]
        url = obj.get("url")
        obj = {"id": str(obj["custom_id"]), **({"endpoint": url} if url else {})}
    else:
        obj.update((key, json.loads(bytes(raw))) for key, raw in raws.items())  # a "body" field
    obj.setdefault("deadline", deadline)
    # When it was submitted: the daemon's submit-to-result histogram measures from it.
    obj.setdefault("created", int(time.time()))
    if default_endpoint and "endpoint" not in obj:
        obj["endpoint"] = default_endpoint
    return request_of(obj, payload)


def _lines(path: str) -> Iterator[tuple[int, str]]:
    """(line number, line) of the non-blank lines."""
    with sys.stdin if path == "-" else open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if line.strip():
                yield number, line


def _requests(args: argparse.Namespace, deadline: int) -> list[Request]:
    """Every line's request, read and validated (as the client validates) before anything
    is submitted: a bad line, unreadable or invalid, is named (``<file>:<line>: why``) and
    nothing is queued, not even the chunks before it."""
    requests = []
    for number, line in _lines(args.file):
        try:
            request = request_from_line(line, deadline=deadline, default_endpoint=args.endpoint)
            requests.append(as_request(request))
        except (ValueError, RecursionError) as exc:  # RecursionError: nested too deep
            raise ValueError(f"{args.file}:{number}: {exc}") from None
    return requests


async def _submit(args: argparse.Namespace) -> int:
    requests = _requests(args, int(time.time() + args.deadline_in))
    await _require_served(args)
    progress = Progress("submitted", len(requests))
    async with SortedSetClient(
        _connection(args), args.queue, args.result_queue, payload_keys=args.payload_keys
    ) as client:
        for start in range(0, len(requests), CHUNK):
            chunk = requests[start : start + CHUNK]
            await client.submit_many(chunk)
            progress.advance(len(chunk))
    progress.finish()
    return 0


async def _results(args: argparse.Namespace) -> int:
    out: IO[str] = args.out
    progress = Progress("results", args.count or None)
    timeout = None if args.follow else args.timeout
    try:
        async with SortedSetClient(_connection(args), result_queue=args.result_queue) as client:
            async for result in client.results(timeout=timeout):
                out.write(json.dumps(result.to_obj(), ensure_ascii=False) + "\n")
                out.flush()
                progress.advance()
                if args.count and progress.done >= args.count:
                    break
    finally:
        progress.finish()
    return 0


async def _cancel(args: argparse.Namespace) -> int:
    await _require_served(args)
    async with SortedSetClient(_connection(args)) as client:
        marked = await client.cancel(args.ids, queue=args.queue)
    print(f"cancelled {marked} of {len(args.ids)} (others were finished or unknown)")
    return 0


def _connection(args: argparse.Namespace) -> RedisConnection:
    if args.transport_config_file:
        return redis_connection_file(args.transport_config_file, _redis_url(args))
    return RedisConnection(url=_redis_url(args))


def _targets(command: str, args: argparse.Namespace) -> None:
    """Fill ``args.queue`` / ``args.result_queue`` when not given: from the daemon's config
    file when there is one (its one queue, the queue's result list), else the defaults."""
    transport = os.environ.get(f"{ENV_PREFIX}TRANSPORT", "")
    if not args.transport_config_file:  # in the daemon's pod: its config file
        daemon, _ = daemon_flags()
        args.transport_config_file = daemon.get("transport-config-file", "")
        transport = daemon.get("transport", "redis-pubsub") if daemon else transport
        if args.transport_config_file:
            print(f"async-processor {command}: using the daemon's --transport-config-file "
                  f"from {DAEMON_CMDLINE}", file=sys.stderr)  # fmt: skip
    served = served_queues(args.transport_config_file) if args.transport_config_file else None
    if served is not None and not served.lists_queues():
        served = None  # a file with only the connection fields names no queue to check
    args.served = served
    if served is not None:
        _require_sorted_set(transport)
    if command != "results" and not args.queue:
        args.queue = served.default_queue() if served else DEFAULT_REQUEST_QUEUE
    if command == "submit" and not args.result_queue:
        args.result_queue = served.result_list_of(args.queue) if served else DEFAULT_RESULT_LIST
    if command == "results" and not args.result_queue:
        args.result_queue = served.default_result_list() if served else DEFAULT_RESULT_LIST


def _require_sorted_set(transport: str) -> None:
    """The producer commands write sorted-set queues: a daemon of another transport says so."""
    if usable_env(transport) and transport != "redis-sortedset":
        raise ConfigError(
            f"the daemon's transport is {transport}: submit, results and cancel work on "
            "redis-sortedset queues only"
        )


async def _require_served(args: argparse.Namespace) -> None:
    """A ConfigError when the daemon's config (if given) does not serve ``args.queue``:
    requests there would wait forever, and cancels there would match nothing."""
    served: Served | None = args.served
    if served is None or args.force or served.statically_served(args.queue):
        return
    if served.set_key:
        client = connect(_connection(args))
        try:
            with redis_errors("queue_discovery set"):
                if await client.sismember(served.set_key, args.queue):
                    return
        finally:
            await client.aclose()
    raise ConfigError(
        f"queue {args.queue!r} is not served by {served.source} (it serves "
        f"{served.describe()}): pass --force to use it anyway"
    )


def _parser(command: str) -> argparse.ArgumentParser:
    p = subcommand_parser(f"async-processor {command}", DESCRIPTIONS[command])
    p.add_argument(
        "--redis-url",
        default="",
        metavar="URL",
        help=f"the sorted-set transport's Redis (default: REDIS_URL, else {LOCAL_REDIS})",
    )
    p.add_argument(
        "--transport-config-file",
        default="",
        metavar="FILE",
        help="connect as the daemon does: url, mode, sentinels and TLS from its transport config",
    )
    if command == "submit":
        p.add_argument(
            "file",
            metavar="FILE",
            help="JSONL of requests or OpenAI batch-input lines ('-' = stdin); each payload "
            "(a batch line's body) is sent as written, byte for byte",
        )
        p.add_argument(
            "--queue", default="", metavar="NAME", help=f"request sorted set {QUEUE_DEFAULT}"
        )
        p.add_argument(
            "--result-queue",
            default="",
            metavar="NAME",
            help="result list named in each request's routing (default: the queue's in the "
            f"config file, else {DEFAULT_RESULT_LIST})",
        )
        p.add_argument(
            "--deadline-in",
            type=duration,
            default="1h",
            metavar="DURATION",
            help="deadline for lines without one, from now",
        )
        p.add_argument(
            "--endpoint", default="", metavar="PATH", help="endpoint for lines without one"
        )
        p.add_argument(
            "--payload-keys",
            action="store_true",
            help="store each payload in its own key (request-payload:<id>:<token>), as "
            "upstream's WithPayloadKeys(); only once every consumer reads payload_ref",
        )
    elif command == "results":
        p.add_argument(
            "--result-queue",
            default="",
            metavar="NAME",
            help=f"result list to read (default: the config file's, else {DEFAULT_RESULT_LIST})",
        )
        p.add_argument(
            "--output",
            "-o",
            default="-",
            metavar="FILE",
            help="JSONL file to append to ('-' = stdout)",
        )
        p.add_argument("--follow", "-f", action="store_true", help="keep waiting for results")
        p.add_argument(
            "--timeout",
            type=duration,
            default="5s",
            metavar="DURATION",
            help="stop after this long with no result",
        )
        p.add_argument(
            "--count",
            "-n",
            type=int,
            default=0,
            metavar="N",
            help="stop after this many (0: no limit)",
        )
    else:
        p.add_argument("ids", nargs="+", metavar="ID", help="request ids to cancel")
        p.add_argument(
            "--queue",
            default="",
            metavar="NAME",
            help="the queue they were submitted to: only its submissions are cancelled "
            f"{QUEUE_DEFAULT}",
        )
    if command != "results":
        p.add_argument(
            "--force",
            action="store_true",
            help="use --queue even if the config file's daemon does not serve it",
        )
    return p  # fmt: skip


QUEUE_DEFAULT = (
    "(default: the config file's queue when it has one, else "
    f"{DEFAULT_REQUEST_QUEUE}; with a config file, one the daemon serves)"
)


DESCRIPTIONS = {
    "submit": "Put requests from a JSONL file on a Redis sorted-set queue.",
    "results": "Read results from a result list as JSONL.",
    "cancel": "Cancel requests by id (those not yet finished).",
}


def _redis_url(args: argparse.Namespace) -> str:
    # Not the parser's default: --help would print a password from REDIS_URL.
    return str(args.redis_url or os.environ.get("REDIS_URL") or LOCAL_REDIS)


COMMANDS = {"submit": _submit, "results": _results, "cancel": _cancel}


def main(argv: list[str]) -> int:
    """``argv[0]`` names the command (submit, results or cancel), as the CLI passes it."""
    command, rest = argv[0], argv[1:]
    args = parse(_parser(command), rest)
    try:
        _targets(command, args)
        with contextlib.ExitStack() as stack:
            if command == "results":
                args.out = (
                    sys.stdout
                    if args.output == "-"
                    else stack.enter_context(open(args.output, "a", encoding="utf-8"))
                )
            return anyio.run(COMMANDS[command], args)
    except (TransportError, ConfigError, OSError, ValueError) as exc:
        print(f"async-processor {command}: {exc}", file=sys.stderr)
        return 1
