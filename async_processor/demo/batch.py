"""The demo's last step: a small OpenAI batch through ``async-processor api`` with the real
``openai`` SDK, answered by the daemon and the simulator.

Stage: outside the daemon (``async-processor demo``). Input: the demo's Redis and gateway,
how many lines. Output: an ``async-processor api`` process (its own port, a private
storage directory, one demo tenant with a fresh key), a daemon on the batch's queue, the
SDK's ``files.create`` -> ``batches.create`` -> ``retrieve`` until it ends ->
``files.content``, and a ``BatchOutcome`` for the summary. Everything it made in Redis
is deleted afterwards; the daemon and the API stop.
"""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio

from async_processor.client.redis_sortedset import SortedSetClient
from async_processor.config import AppConfig, RuntimeConfig
from async_processor.config.transports import SortedSetConfig, SortedSetQueue
from async_processor.demo.local_servers import free_port, wait_for_port
from async_processor.pipeline.processor import Processor
from async_processor.sim.app import Simulator
from async_processor.sim.config import SimConfig

ENDED = ("completed", "failed", "cancelled", "expired")
API_START_TIMEOUT = 30.0
BATCH_TIMEOUT = 60.0


@dataclass(frozen=True)
class BatchOutcome:
    status: str
    total: int
    completed: int
    failed: int
    output_lines: int
    seconds: float
    first_answer: str
    made: tuple[str, ...] = ()  # the batch's and its files' ids, to tidy


async def run_batch_step(redis_url: str, gateway: str, lines: int) -> BatchOutcome:
    """Start a daemon and the API on ``redis_url`` (and the simulator when ``gateway``
    is empty), run one batch of ``lines`` lines."""
    async with anyio.create_task_group() as services:
        if not gateway:
            port = await services.start(Simulator(SimConfig()).serve, "127.0.0.1", 0)
            gateway = f"http://127.0.0.1:{port}"
        outcome = await _run(redis_url, gateway, lines)
        services.cancel_scope.cancel()
    return outcome


async def _run(redis_url: str, gateway: str, lines: int) -> BatchOutcome:
    run = secrets.token_hex(4)
    tenant, key = f"demo-{run}", f"sk-demo-{secrets.token_hex(16)}"
    config = SortedSetConfig(
        url=redis_url,
        retry_queue_name=f"demo-{run}-batch-retry",
        result_queue_name=f"demo-{run}-batch-results",
        poll_interval_ms=100,
        queues=[SortedSetQueue(queue_name=f"demo-{run}-batch", igw_base_url=gateway)],
    )
    runtime = RuntimeConfig.model_validate(
        {"concurrency": 16, "health_port": 0, "metrics_port": 0, "bind_address": "127.0.0.1"}
    )
    processor = Processor(
        AppConfig(transport="redis-sortedset", transport_config=config, runtime=runtime)
    )
    with tempfile.TemporaryDirectory(prefix="async-processor-demo-api-") as tmp:
        async with anyio.create_task_group() as daemon:
            await daemon.start(processor.run)
            try:
                api, port = _start_api(Path(tmp), config, {tenant: [key]})
                try:
                    outcome = await anyio.to_thread.run_sync(_sdk_batch, port, key, lines)
                finally:
                    api.terminate()
                    await anyio.to_thread.run_sync(api.wait)
            finally:
                processor.request_stop()
    await _tidy(redis_url, run, tenant, outcome.made)
    return outcome


def _start_api(
    tmp: Path, config: SortedSetConfig, keys: dict[str, list[str]]
) -> tuple[subprocess.Popen[bytes], int]:
    (tmp / "transport.json").write_text(config.model_dump_json())
    (tmp / "keys.json").write_text(json.dumps(keys))
    port = free_port()
    command = [
        sys.executable, "-m", "async_processor", "api",
        "--transport-config-file", str(tmp / "transport.json"),
        "--api-keys-file", str(tmp / "keys.json"),
        "--storage-dir", str(tmp / "storage"),
        "--listen", f"127.0.0.1:{port}", "--log-level", "warning",
    ]  # fmt: skip
    log = (tmp / "api.log").open("wb")
    api = subprocess.Popen(  # noqa: S603 - this interpreter, fixed arguments
        command, stdout=subprocess.DEVNULL, stderr=log
    )
    log.close()  # the child holds its own copy
    try:
        wait_for_port(port, API_START_TIMEOUT, api)
    except BaseException:
        api.kill()
        raise RuntimeError(
            f"async-processor api did not start:\n{_tail(tmp / 'api.log')}"
        ) from None
    return api, port


def _tail(path: Path) -> str:
    return path.read_text(errors="replace")[-2000:] if path.exists() else ""


def _sdk_batch(port: int, key: str, lines: int) -> BatchOutcome:
    """What a user writes: the OpenAI SDK, pointed at the API."""
    from openai import OpenAI

    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key)
    started = time.monotonic()
    body = b"".join(json.dumps(_line(i)).encode() + b"\n" for i in range(lines))
    upload = client.files.create(file=("demo.jsonl", body), purpose="batch")
    batch = client.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    end = started + BATCH_TIMEOUT
    while (batch := client.batches.retrieve(batch.id)).status not in ENDED:
        if time.monotonic() > end:
            break
        time.sleep(0.2)
    output: list[Any] = []
    if batch.output_file_id:
        text = client.files.content(batch.output_file_id).text
        output = [json.loads(x) for x in text.splitlines()]
    counts = batch.request_counts
    first = output[0]["response"]["body"]["choices"][0]["message"]["content"] if output else ""
    return BatchOutcome(
        status=batch.status,
        total=counts.total if counts else 0,
        completed=counts.completed if counts else 0,
        failed=counts.failed if counts else 0,
        output_lines=len(output),
        seconds=time.monotonic() - started,
        first_answer=str(first)[:60],
        made=(batch.id, upload.id, *(f for f in (batch.output_file_id, batch.error_file_id) if f)),
    )


def _line(i: int) -> dict[str, Any]:
    return {
        "custom_id": f"demo-{i}",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "model": "demo-model",
            "messages": [{"role": "user", "content": f"Line {i}"}],
            "max_tokens": 8,
        },
    }


async def _tidy(redis_url: str, run: str, tenant: str, made: tuple[str, ...]) -> None:
    """Every key of this step: its queue's, its tenant's and its batch's and files'."""
    client = SortedSetClient(redis_url, result_queue=f"demo-{run}-batch-results")
    async with client:
        await client.clear_matching(
            f"demo-{run}-*",
            f"{{demo-{run}-*",
            f"async-processor:api:*{{{tenant}}}*",
            *(f"async-processor:api:*{{{made_id}}}*" for made_id in made),
        )
