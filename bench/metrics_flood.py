"""The dispatch path under a metrics-port flood (issue 30, item 4).

The daemon (``python -m async_processor run``, zero-latency simulator, 256 workers) drains
the same number of messages twice from a private Redis: once quiet, once while 200 clients
pipeline ``GET /metrics`` on its metrics port and never read an answer. Printed per run:
msg/s and CPU ms per message over the steady window, the time a scrape takes with the
flood still connected, and how many times the page was rendered.

Run: ``python -m bench.metrics_flood [--quick]``. Figures only, never asserted.
"""

from __future__ import annotations

import contextlib
import socket
import time
import urllib.request
from contextlib import ExitStack

from bench.common import messages_workers_main, redis, simulator
from bench.harness import Lane, Run, start_daemon, submit, watch
from tests.fixtures.servers import free_port
from tests.fixtures.simulator import SimulatorProcess

CLIENTS = 200
PIPELINED = 500
RENDERS = "llm_d_async_async_metrics_renders_total"


async def run_once(
    url: str, sim: SimulatorProcess, workers: int, messages: int, *, flood: bool
) -> tuple[Run, str]:
    lane = Lane.fresh(url, f"flood-{int(flood)}")
    await submit(lane, messages)
    port = free_port()
    with ExitStack() as stack:
        proc = start_daemon(stack, lane, sim, workers, metrics_port=port)
        sockets = _flood(stack, port) if flood else 0
        started = time.monotonic()
        run = await watch(lane, proc, messages, timeout=messages / 50 + 60, rounds=workers)
        try:  # the flood still connected
            scrape, page = _timed(port), _get(port)
        except OSError as exc:  # refused, timed out: what the flood did to the scrape
            return run, f"{sockets} flood clients; a scrape after the run failed: {exc!r}"
        renders = _value(page, RENDERS)
        per_second = renders / (time.monotonic() - started)
    note = (
        f"{sockets} flood clients; a scrape after the run {scrape * 1000:.0f} ms;"
        f" {renders:.0f} renders ({per_second:.1f}/s)"
    )
    return run, note


def _flood(stack: ExitStack, port: int) -> int:
    request = b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n" * PIPELINED
    for _ in range(CLIENTS):
        sock = stack.enter_context(socket.create_connection(("127.0.0.1", port), timeout=5))
        sock.setblocking(False)
        with contextlib.suppress(BlockingIOError, ConnectionError):
            sock.send(request)
    return CLIENTS


def _get(port: int, path: str = "/metrics") -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=30) as response:
        return str(response.read().decode())


def _timed(port: int, path: str = "/metrics") -> float:
    started = time.monotonic()
    _get(port, path)
    return time.monotonic() - started


def _value(page: str, name: str) -> float:
    return next((float(x.split()[1]) for x in page.splitlines() if x.startswith(name + " ")), 0)


async def measure(messages: int, workers: int) -> list[tuple[str, str]]:
    rows = [("setup", f"{messages} messages each, {workers} workers, zero-latency gateway")]
    with ExitStack() as stack:
        url, sim = redis(stack).url, simulator(stack)
        for flood in (False, True):
            run, note = await run_once(url, sim, workers, messages, flood=flood)
            label = "flood" if flood else "quiet"
            rows.append((label, f"{run.rate:,.0f} msg/s, {run.cpu_ms:.3f} CPU ms/msg; {note}"))
    return rows


def main(argv: list[str] | None = None) -> int:
    return messages_workers_main(
        "python -m bench.metrics_flood", "metrics port flood: the dispatch path", measure, argv
    )


if __name__ == "__main__":
    raise SystemExit(main())
