"""Per-tenant caps through the real ``openai`` SDK: open batches, queued lines and bytes
stored, each a 429 with ``Retry-After`` past its cap (per tenant in the caps file, the
flags' defaults for the rest), room again once batches end and files go; and a real
201 MB upload refused while it streams, the API's memory bounded."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

from tests.e2e.test_batch_api import ENDPOINT, jsonl, line, run_batch, wait_for
from tests.fixtures.api import KEYS, BatchStack

pytestmark = [pytest.mark.slow]


def refused(call: Any, what: str) -> None:
    with pytest.raises(openai.RateLimitError) as caught:
        call()
    assert caught.value.response.headers["retry-after"] == "60"
    assert what in caught.value.message
    assert caught.value.body["code"] == "rate_limit_exceeded"


def test_caps_refuse_with_429_and_room_comes_back(batch_stack: BatchStack) -> None:
    caps = batch_stack.tmp / "caps.json"
    caps.write_text(json.dumps({
        batch_stack.tenant("acme"): {"open_batches": 1, "stored_bytes": 6000},
        batch_stack.tenant("globex"): {"queued_lines": 10},
    }))  # fmt: skip
    batch_stack.start_api("--tenant-caps-file", str(caps), replica="r2")
    batch_stack.simulator.configure(latency=30)  # batches stay open until cancelled
    acme = batch_stack.client("acme", max_retries=0)
    globex = batch_stack.client("globex", max_retries=0)

    # Open batches: acme's one place is taken until its batch ends.
    first = run_batch(acme, [line("a0")])
    upload = acme.files.create(file=("in.jsonl", jsonl([line("a1")])), purpose="batch")

    def create() -> Any:
        return acme.batches.create(
            input_file_id=upload.id, endpoint=ENDPOINT, completion_window="24h",
            extra_headers={"Idempotency-Key": "k"},
        )  # fmt: skip

    refused(create, "open batches")
    acme.batches.cancel(first.id)
    assert wait_for(acme, first.id, timeout=20).status == "cancelled"
    second = create()
    # A repeat of a made batch (its Idempotency-Key) is no new batch: no cap applies.
    assert create().id == second.id
    acme.batches.cancel(second.id)
    wait_for(acme, second.id, timeout=20)  # its error file is written: bytes stored settle

    # Queued lines: globex's 10 hold one batch of 8, not two (and its open batches are free).
    eight = [line(f"g{i}") for i in range(8)]
    held = run_batch(globex, eight)
    refused(lambda: run_batch(globex, eight), "queued lines")
    globex.batches.cancel(held.id)
    wait_for(globex, held.id, timeout=20)
    run_batch(globex, eight)

    # Bytes stored: refused while the upload streams, room again once a file is deleted.
    stored = sum(f.bytes for f in acme.files.list())
    big = b"x" * (6000 - stored - 10) + b"\n"
    kept = acme.files.create(file=("big.jsonl", big), purpose="batch")
    refused(lambda: acme.files.create(file=("more.jsonl", b"y" * 100), purpose="batch"), "bytes")
    assert {f.id for f in acme.files.list()} >= {kept.id}
    acme.files.delete(kept.id)
    acme.files.create(file=("more.jsonl", b"y" * 100), purpose="batch")


MB = 1024 * 1024


def peak_and_now(pid: int) -> tuple[int, int]:
    """(VmHWM, VmRSS) of a process, in bytes."""
    status = Path(f"/proc/{pid}/status").read_text()
    kb = {k: int(v.split()[0]) for k, v in re.findall(r"^(VmHWM|VmRSS):\s+(.+)$", status, re.M)}
    return kb["VmHWM"] * 1024, kb["VmRSS"] * 1024


@pytest.mark.anyio
async def test_a_201_mb_upload_is_refused_while_it_streams(batch_stack: BatchStack) -> None:
    """The default 200 MB limit, a real 201 MB body sent in 256 KiB chunks (about 8 KiB
    lines, under the line limit): 413, nothing stored, and the API's memory never holds
    the file (its peak RSS stays within 64 MiB of what it was before)."""
    api = batch_stack.apis[-1]
    before = peak_and_now(api.proc.pid)[1]
    text = json.dumps(line("pad", padding="x" * 8000)).encode() + b"\n"
    block = text * (256 * 1024 // len(text))
    sent = 0

    async def body() -> AsyncIterator[bytes]:
        nonlocal sent
        while sent < 201 * MB:
            sent += len(block)
            yield block

    with aiohttp.MultipartWriter("form-data") as form:
        form.append("batch").set_content_disposition("form-data", name="purpose")
        part = form.append(body(), {"Content-Type": "application/jsonl"})
        part.set_content_disposition("form-data", name="file", filename="big.jsonl")
    headers = {"Authorization": f"Bearer {KEYS['acme']}"}
    timeout = aiohttp.ClientTimeout(total=110)
    url = f"{api.base_url}/files"
    async with (
        aiohttp.ClientSession(timeout=timeout) as session,
        session.post(url, data=form, headers=headers) as answer,
    ):
        status, error = answer.status, (await answer.json())["error"]
    assert status == 413 and error["param"] == "file" and "209715200 bytes" in error["message"]
    assert sent > 200 * MB  # the whole body was offered
    assert list((batch_stack.tmp / "storage").iterdir()) == []
    peak = peak_and_now(api.proc.pid)[0]
    assert peak - before < 64 * MB, f"peak RSS {peak / MB:.0f} MiB, before {before / MB:.0f}"
    assert list(batch_stack.client("acme").files.list()) == []
