"""Shared bench plumbing: processes on free ports, /proc CPU and RSS readings, load, tables.

Input: what a bench asks to start or measure. Output: running processes (stopped by the
caller's ``ExitStack``) and plain numbers. Servers come from the test fixtures, so a
bench and a test start them the same way.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import anyio

from tests.fixtures.servers import RedisServer, stop_process, wait_for_port
from tests.fixtures.simulator import SimulatorProcess, start_simulator

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of one process, from /proc (no psutil)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def rss_bytes(pid: int) -> int:
    return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE


def peak_rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def verdict(value: str, ok: bool, target: str) -> str:
    """A figure with its issue-13 target beside it: pass or fall-short."""
    return f"{value}  [{'pass' if ok else 'FALL-SHORT'}: target {target}]"


def simulator(stack: ExitStack, *args: str) -> SimulatorProcess:
    sim = start_simulator(*args)
    stack.callback(stop_process, sim.proc)
    return sim


def redis(stack: ExitStack) -> RedisServer:
    """A private redis-server (no persistence) in a temp dir, stopped with the stack."""
    server = RedisServer(dir=Path(stack.enter_context(tempfile.TemporaryDirectory()))).start()
    stack.callback(server.stop)
    return server


def python_process(
    stack: ExitStack,
    args: Sequence[str],
    *,
    port: int | None = None,
    log: Path | None = None,
    env: Mapping[str, str] | None = None,
) -> subprocess.Popen[bytes]:
    """``python <args>`` with its output in ``log``, ``env`` added to ours; waits for
    ``port`` when given."""
    out = subprocess.DEVNULL
    if log:
        log.parent.mkdir(parents=True, exist_ok=True)
        handle = stack.enter_context(log.open("wb"))
        out = handle.fileno()
    proc = subprocess.Popen(
        [sys.executable, *args],
        stdout=out,
        stderr=subprocess.STDOUT,
        env={**os.environ, **(env or {})},
    )
    stack.callback(stop_process, proc, 30.0)
    if port is not None:
        wait_for_port(port, timeout=30, proc=proc)
    return proc


@dataclass
class LoadResult:
    requests: int
    seconds: float
    statuses: dict[int, int]

    @property
    def rate(self) -> float:
        return self.requests / self.seconds


async def hammer(url: str, total: int, concurrency: int, body: bytes) -> LoadResult:
    """POST ``body`` ``total`` times from ``concurrency`` aiohttp workers."""
    statuses: dict[int, int] = {}
    remaining = total
    connector = aiohttp.TCPConnector(limit=concurrency)

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            async with session.post(url, data=body) as response:
                await response.read()
                statuses[response.status] = statuses.get(response.status, 0) + 1

    started = time.perf_counter()
    async with (
        aiohttp.ClientSession(connector=connector) as session,
        anyio.create_task_group() as tg,
    ):
        for _ in range(concurrency):
            tg.start_soon(worker, session)
    return LoadResult(total, time.perf_counter() - started, statuses)


# Every table printed in this process, in order: ``python -m bench --docs`` writes them
# into docs/performance.md (bench/docs.py).
TABLES: list[tuple[str, list[tuple[str, str]]]] = []


def table(title: str, rows: Sequence[tuple[str, str]]) -> None:
    """Print a bench's figures, with the load it ran under (others' work skews rates)."""
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    rows = [*rows, ("machine", f"{os.cpu_count()} CPUs, load average now {load}")]
    TABLES.append((title, rows))
    width = max(len(name) for name, _ in rows)
    print(f"\n== {title}")
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")
    sys.stdout.flush()


Measure = Callable[[int, int], Awaitable[list[tuple[str, str]]]]


def messages_workers_main(prog: str, title: str, measure: Measure, argv: list[str] | None) -> int:
    """The command line of a bench that runs ``measure(messages, workers)`` once and prints
    its rows: ``--messages`` (20,000), ``--workers`` (256), ``--quick`` (5,000 messages)."""
    p = argparse.ArgumentParser(prog=prog)
    p.add_argument("--messages", type=int, default=20000)
    p.add_argument("--workers", type=int, default=256)
    p.add_argument("--quick", action="store_true", help="5,000 messages")
    args = p.parse_args(argv)
    messages = 5000 if args.quick else args.messages
    table(title, anyio.run(measure, messages, args.workers))
    return 0
