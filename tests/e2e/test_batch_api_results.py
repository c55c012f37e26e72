"""A batch's results while it runs and after (``GET /v1/batches/{id}/results?after=``), the
output file in input order as an option, and ``retry_failed``: through the real ``openai``
SDK (and plain HTTP for our extensions) against the API, the daemon and the simulator."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections import Counter
from typing import Any

import openai
import pytest

from tests.e2e.test_batch_api import TERMINAL, file_lines, jsonl, line, run_batch, wait_for
from tests.fixtures.api import KEYS, BatchStack

pytestmark = [pytest.mark.slow]


def results(
    stack: BatchStack, batch_id: str, after: Any = 0, tenant: str = "acme"
) -> tuple[int, str, list[dict[str, Any]]]:
    """(HTTP status, the batch's status header, the lines) of one results read."""
    request = urllib.request.Request(
        f"{stack.apis[-1].base_url}/batches/{batch_id}/results?after={after}",
        headers={"Authorization": f"Bearer {KEYS[tenant]}"},
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            body = answer.read().decode()
            status = answer.headers["X-AP-Batch-Status"]
            return answer.status, status, [json.loads(x) for x in body.splitlines()]
    except urllib.error.HTTPError as exc:
        return exc.code, "", [json.loads(exc.read())]


def failing(custom_id: str) -> dict[str, Any]:
    return line(custom_id, max_tokens="not a number")  # the simulator answers 400


def test_results_stream_while_running_and_the_cursor_goes_on_after_the_end(
    batch_stack: BatchStack,
) -> None:
    batch_stack.simulator.configure(latency=0.4)  # 16 at a time: about 5 s for 200 lines
    client = batch_stack.client()
    lines = [failing(f"r{i}") if i % 10 == 0 else line(f"r{i}") for i in range(200)]
    batch = run_batch(client, lines)
    got: list[dict[str, Any]] = []
    read_while_running = 0
    end = time.monotonic() + 60
    while True:
        code, status, new = results(batch_stack, batch.id, after=len(got))
        assert code == 200
        got += new
        if status not in TERMINAL:
            read_while_running += len(new)
        elif not new:
            break
        assert time.monotonic() < end, f"{len(got)} lines after 60 s"
        time.sleep(0.1)
    assert read_while_running > 0  # lines came while the batch ran
    done = client.batches.retrieve(batch.id)
    files = file_lines(client, done.output_file_id) + file_lines(client, done.error_file_id)
    assert len(got) == len(files) == 200
    assert Counter(json.dumps(x, sort_keys=True) for x in got) == Counter(
        json.dumps(x, sort_keys=True) for x in files
    )
    # The whole stream again from 0 is the same lines in the same order.
    assert results(batch_stack, batch.id)[2] == got
    assert results(batch_stack, batch.id, after=150)[2] == got[150:]
    text = client.get(  # the SDK's own form (docs/batch-api.md)
        f"/batches/{batch.id}/results", cast_to=str, options={"params": {"after": 190}}
    )
    assert [json.loads(x) for x in text.splitlines()] == got[190:]
    assert results(batch_stack, batch.id, after=999)[2] == []
    assert results(batch_stack, batch.id, after="-1")[0] == 400
    assert results(batch_stack, batch.id, after="x")[0] == 400
    assert results(batch_stack, batch.id, tenant="globex")[0] == 404


def test_input_order_and_retry_failed(batch_stack: BatchStack) -> None:
    # A line's time is its max_tokens: the first lines finish last.
    batch_stack.simulator.configure(per_token=0.03)
    client = batch_stack.client(max_retries=0)
    lines = [
        failing(f"o{i}") if i % 4 == 1 else line(f"o{i}", max_tokens=40 - i) for i in range(40)
    ]
    upload = client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
    ordered = client.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h",
        metadata={"output_order": "input"},
    )  # fmt: skip
    arrival = run_batch(client, lines)
    ordered, arrival = wait_for(client, ordered.id), wait_for(client, arrival.id)
    want_ok = [f"o{i}" for i in range(40) if i % 4 != 1]
    want_failed = [f"o{i}" for i in range(40) if i % 4 == 1]
    assert [x["custom_id"] for x in file_lines(client, ordered.output_file_id)] == want_ok
    assert [x["custom_id"] for x in file_lines(client, ordered.error_file_id)] == want_failed
    # Without the option the lines are as they came (the slow first lines last).
    assert [x["custom_id"] for x in file_lines(client, arrival.output_file_id)] != want_ok
    # The results stream keeps the recorded order, its cursor too.
    stream = results(batch_stack, ordered.id)[2]
    assert [x["custom_id"] for x in stream] != want_ok + want_failed
    assert sorted(x["custom_id"] for x in stream) == sorted(want_ok + want_failed)
    assert results(batch_stack, ordered.id, after=7)[2] == stream[7:]

    with pytest.raises(openai.ConflictError):  # nothing failed: nothing to retry
        client.post(f"/batches/{run_batch_ok(client).id}/retry_failed", cast_to=object)
    retry = client.post(f"/batches/{ordered.id}/retry_failed", cast_to=object)
    again = client.post(f"/batches/{ordered.id}/retry_failed", cast_to=object)
    assert again["id"] == retry["id"]  # one retry per batch
    assert retry["request_counts"]["total"] in (0, 10)  # counted once validated
    mine = [json.dumps(x).encode() for x in lines if x["custom_id"] in want_failed]
    assert client.files.content(retry["input_file_id"]).content == b"\n".join(mine) + b"\n"
    retried = wait_for(client, retry["id"])
    assert retried.request_counts.total == retried.request_counts.failed == 10
    assert retried.metadata == {"output_order": "input"}
    assert len([b for b in client.batches.list() if b.id == retry["id"]]) == 1


def run_batch_ok(client: Any) -> Any:
    return wait_for(client, run_batch(client, [line("fine", max_tokens=1)]).id)
