"""Batch API: a batch end to end through ``async-processor api`` beside ``submit`` +
``results`` of the same lines, at zero gateway latency.

One daemon (256 workers) in front of the simulator (no latency). First the same lines
go through the client library in this process (``submit_many`` while ``drain_results``
reads, as the ``submit`` and ``results`` commands do): lines per second and this
process's CPU per line. Then as a batch through the real ``openai`` SDK against an
``async-processor api`` process: upload, create, poll until ``completed``, download the
output file; lines per second over all of that, the API process's CPU per line and its
peak RSS. Goal: the batch within 1.3x of the library's time.
Run alone: ``python -m bench.batch_api [--quick] [--lines N]``.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import anyio

from async_processor.client import SortedSetClient
from bench.common import (
    cpu_seconds,
    mib,
    peak_rss_bytes,
    python_process,
    redis,
    simulator,
    table,
    verdict,
)
from bench.harness import LOG_DIR, Lane, payload, start_daemon
from tests.fixtures.servers import free_port

GOAL = 1.3
WORKERS = 256
CHUNK = 500
ENDPOINT = "/v1/completions"


async def library(lane: Lane, lines: int) -> tuple[float, float]:
    """(lines per second, CPU ms per line of this process) for submit + results."""
    deadline = int(time.time()) + 3600
    body = payload()
    cpu, started = time.process_time(), time.perf_counter()
    async with SortedSetClient(lane.redis_url, lane.queue, lane.results, consumer="bench") as c:

        async def produce() -> None:
            for start in range(0, lines, CHUNK):
                stop = min(lines, start + CHUNK)
                await c.submit_many(
                    {"id": f"lib-{i}", "deadline": deadline, "payload": body, "endpoint": ENDPOINT}
                    for i in range(start, stop)
                )

        async with anyio.create_task_group() as tg:
            tg.start_soon(produce)
            got = 0
            while got < lines:
                got += len(await c.drain_results(CHUNK, 1.0))
    seconds = time.perf_counter() - started
    return lines / seconds, (time.process_time() - cpu) * 1000 / lines


def batch_file(lines: int) -> bytes:
    body = payload()
    return b"".join(
        json.dumps({"custom_id": f"b{i}", "method": "POST", "url": ENDPOINT, "body": body}).encode()
        + b"\n"
        for i in range(lines)
    )


def through_api(base_url: str, pid: int, lines: int) -> tuple[float, float, Any]:
    """(lines per second, API CPU ms per line, the finished batch) through the SDK."""
    import openai

    client = openai.OpenAI(base_url=base_url, api_key="bench", max_retries=0, timeout=600)
    data = batch_file(lines)
    cpu, started = cpu_seconds(pid), time.perf_counter()
    upload = client.files.create(file=("bench.jsonl", data), purpose="batch")
    batch = client.batches.create(
        input_file_id=upload.id, endpoint=ENDPOINT, completion_window="24h"
    )
    while (batch := client.batches.retrieve(batch.id)).status not in ("completed", "failed"):
        time.sleep(0.1)
    output = client.files.content(batch.output_file_id).text if batch.output_file_id else ""
    seconds = time.perf_counter() - started
    if output.count("\n") != lines:
        raise RuntimeError(f"batch {batch.status}: {output.count(chr(10))} output lines")
    return lines / seconds, (cpu_seconds(pid) - cpu) * 1000 / lines, batch


def measure(lines: int) -> list[tuple[str, str]]:
    with ExitStack() as stack:
        url, sim = redis(stack).url, simulator(stack)
        lane = Lane.fresh(url, "batch-api")
        start_daemon(stack, lane, sim, WORKERS)
        lib_rate, lib_cpu = anyio.run(library, lane, lines)
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        config = tmp / "transport.json"
        config.write_text(json.dumps({"url": url, "queues": [{"queue_name": lane.queue}]}))
        port = free_port()
        api = python_process(
            stack,
            ["-m", "async_processor", "api", "--transport-config-file", str(config),
             "--listen", f"127.0.0.1:{port}", "--no-auth", "--storage-dir", str(tmp / "files"),
             "--log-level", "warning"],
            port=port,
            log=LOG_DIR / "batch-api.log",
        )  # fmt: skip
        api_rate, api_cpu, _ = through_api(f"http://127.0.0.1:{port}/v1", api.pid, lines)
        rss = peak_rss_bytes(api.pid)
    ratio = lib_rate / api_rate
    return [
        ("setup", f"{lines:,} lines, {WORKERS} daemon workers, zero gateway latency"),
        ("submit + results", f"{lib_rate:,.0f} lines/s, {lib_cpu:.3f} CPU ms/line (client)"),
        ("batch via the API", f"{api_rate:,.0f} lines/s, {api_cpu:.3f} CPU ms/line (API)"),
        ("API peak RSS", mib(rss)),
        ("library ÷ API time", verdict(f"× {ratio:.2f}", ratio <= GOAL, f"≤ {GOAL}×")),
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.batch_api")
    p.add_argument("--lines", type=int, default=50_000)
    p.add_argument("--quick", action="store_true", help="5,000 lines")
    args = p.parse_args(argv)
    table("batch API", measure(5000 if args.quick else args.lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
