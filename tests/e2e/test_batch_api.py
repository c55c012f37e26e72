"""The Batch API end to end: the real ``openai`` SDK against ``async-processor api``, the
daemon and the simulator over real HTTP, on a real redis-server (docs/batch-api.md).
"""

from __future__ import annotations

import json
import time
from typing import Any

import openai
import pytest
import redis

from tests.fixtures.api import KEYS, BatchStack
from tests.fixtures.lossy_proxy import lossy_proxy

pytestmark = [pytest.mark.slow]

TERMINAL = ("completed", "failed", "cancelled", "expired")
ENDPOINT = "/v1/chat/completions"


def line(custom_id: str, **body: Any) -> dict[str, Any]:
    payload = {"model": "sim-model", "messages": [{"role": "user", "content": custom_id}]}
    return {"custom_id": custom_id, "method": "POST", "url": ENDPOINT, "body": {**payload, **body}}


def jsonl(lines: list[Any]) -> bytes:
    return b"".join(
        (item if isinstance(item, bytes) else json.dumps(item).encode()) + b"\n" for item in lines
    )


def run_batch(client: Any, lines: list[Any], window: str = "24h", **create: Any) -> Any:
    upload = client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
    return client.batches.create(
        input_file_id=upload.id, endpoint=ENDPOINT, completion_window=window, **create
    )


def wait_for(
    client: Any, batch_id: str, statuses: tuple[str, ...] = TERMINAL, timeout: float = 60
) -> Any:
    end = time.monotonic() + timeout
    while (batch := client.batches.retrieve(batch_id)).status not in statuses:
        assert time.monotonic() < end, f"batch still {batch.status}: {batch}"
        time.sleep(0.1)
    return batch


def wait_completed(client: Any, batch_id: str, at_least: int, timeout: float = 60) -> None:
    """Until ``at_least`` lines of the batch are answered with success."""
    end = time.monotonic() + timeout
    while client.batches.retrieve(batch_id).request_counts.completed < at_least:
        assert time.monotonic() < end, f"fewer than {at_least} lines done after {timeout}s"
        time.sleep(0.05)


def file_lines(client: Any, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(x) for x in client.files.content(file_id).text.splitlines()]


def test_batch_completes_with_output_and_error_files(batch_stack: BatchStack) -> None:
    client = batch_stack.client()
    good = [line(f"req-{i}", max_tokens=5) for i in range(30)]
    failing = line("fails-at-gateway", max_tokens="not a number")  # the simulator answers 400
    batch = run_batch(client, [*good, failing], metadata={"job": "nightly"})
    assert batch.status == "validating" and batch.metadata == {"job": "nightly"}

    done = wait_for(client, batch.id)
    assert done.status == "completed", done
    assert done.request_counts.total == 31
    assert done.request_counts.completed == 30 and done.request_counts.failed == 1
    assert done.in_progress_at and done.finalizing_at and done.completed_at
    assert done.model == "sim-model"
    assert done.usage.output_tokens == 30 * 5
    assert done.usage.total_tokens == done.usage.input_tokens + done.usage.output_tokens
    output = file_lines(client, done.output_file_id)
    assert sorted(x["custom_id"] for x in output) == sorted(x["custom_id"] for x in good)
    assert {x["response"]["status_code"] for x in output} == {200}
    assert all(x["error"] is None and x["response"]["body"]["choices"] for x in output)
    errors = file_lines(client, done.error_file_id)
    assert [x["custom_id"] for x in errors] == ["fails-at-gateway"]
    assert errors[0]["response"]["status_code"] == 400
    # Every line went to the gateway exactly once.
    assert batch_stack.simulator.stats()["total"] == 31
    assert client.files.retrieve(done.output_file_id).purpose == "batch_output"
    metrics = batch_stack.apis[-1].metrics()
    assert 'async_processor_api_batch_status_changes_total{status="completed"} 1.0' in metrics
    assert 'async_processor_api_results_total{outcome="recorded"} 31.0' in metrics
    assert 'route="/v1/batches/{batch_id}",status="200"' in metrics


def test_bad_lines_fail_the_batch_naming_every_line(batch_stack: BatchStack) -> None:
    client = batch_stack.client()
    lines: list[Any] = [
        line("ok-1"),
        b"{not json",
        line("ok-1"),  # duplicate custom_id
        {**line("wrong-url"), "url": "/v1/embeddings"},
        {**line("get"), "method": "GET"},
        {"custom_id": "no-model", "method": "POST", "url": ENDPOINT, "body": {"messages": []}},
        line("streams", stream=True),
        b"",  # a blank line is skipped, and still counted in the numbering
        [1, 2],
        line("ok-2"),
    ]
    batch = wait_for(client, run_batch(client, lines).id)
    assert batch.status == "failed" and batch.failed_at
    assert [(e.line, e.code) for e in batch.errors.data] == [
        (2, "invalid_json_line"),
        (3, "duplicate_custom_id"),
        (4, "mismatched_endpoint"),
        (5, "invalid_method"),
        (6, "missing_model"),
        (7, "stream_unsupported"),
        (9, "invalid_json_line"),
    ]
    assert batch.output_file_id is None and batch.error_file_id is None
    assert batch_stack.simulator.stats()["total"] == 0  # nothing of it was dispatched


def test_unknown_endpoint_and_window_are_400_naming_param(batch_stack: BatchStack) -> None:
    client = batch_stack.client()
    upload = client.files.create(file=("in.jsonl", jsonl([line("a")])), purpose="batch")
    for create, param in (
        ({"endpoint": "/v1/images/generations", "completion_window": "24h"}, "endpoint"),
        ({"endpoint": ENDPOINT, "completion_window": "forever"}, "completion_window"),
    ):
        with pytest.raises(openai.BadRequestError) as caught:
            client.batches.create(input_file_id=upload.id, **create)
        assert caught.value.param == param
    with pytest.raises(openai.NotFoundError):
        client.batches.create(input_file_id="file-nope", endpoint=ENDPOINT, completion_window="24h")


def test_lists_auto_page_with_id_cursors(batch_stack: BatchStack) -> None:
    client = batch_stack.client()
    uploads = [
        client.files.create(file=(f"f{i}.jsonl", jsonl([line(f"x{i}")])), purpose="batch")
        for i in range(5)
    ]
    batches = [
        client.batches.create(input_file_id=u.id, endpoint=ENDPOINT, completion_window="24h")
        for u in uploads[:3]
    ]
    # Newest first, two a page: the SDK follows `after` = the last id of each page.
    listed = client.files.list(limit=2, purpose="batch")  # the batches' outputs left out
    assert [f.id for f in listed] == [u.id for u in reversed(uploads)]
    assert [b.id for b in client.batches.list(limit=2)] == [b.id for b in reversed(batches)]
    first = client.batches.list(limit=2)
    assert first.has_more is True and len(first.data) == 2
    # A deleted cursor still pages on (an id cursor, not an offset).
    client.files.delete(uploads[3].id)
    after_deleted = client.files.list(limit=10, after=uploads[3].id, purpose="batch")
    assert [f.id for f in after_deleted.data] == [u.id for u in reversed(uploads[:3])]
    asc = client.files.list(limit=10, order="asc", purpose="batch")
    assert [f.id for f in asc.data] == [uploads[i].id for i in (0, 1, 2, 4)]


def test_cancel_mid_run_keeps_finished_lines(batch_stack: BatchStack) -> None:
    batch_stack.simulator.configure(latency=0.3)
    client = batch_stack.client()
    batch = run_batch(client, [line(f"c{i}") for i in range(200)])
    wait_completed(client, batch.id, 5)
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled")
    started = time.monotonic()
    done = wait_for(client, batch.id, timeout=10)
    assert done.status == "cancelled" and done.cancelled_at and done.cancelling_at
    assert time.monotonic() - started < 5
    output = file_lines(client, done.output_file_id)
    errors = file_lines(client, done.error_file_id)
    assert len(output) == done.request_counts.completed >= 5
    assert len(output) + len(errors) == done.request_counts.total == 200
    assert len({x["custom_id"] for x in output + errors}) == 200
    assert {x["error"]["code"] for x in errors} <= {"batch_cancelled", "CANCELLED"}
    # The queue is not drained line by line: well under all 200 reached the gateway.
    time.sleep(1)
    assert batch_stack.simulator.stats()["total"] < 150
    with pytest.raises(openai.ConflictError):
        client.batches.cancel(run_and_finish(client, batch_stack).id)


def run_and_finish(client: Any, batch_stack: BatchStack) -> Any:
    batch_stack.simulator.configure(latency=0)
    return wait_for(client, run_batch(client, [line("quick")]).id)


def test_another_tenant_sees_nothing(batch_stack: BatchStack) -> None:
    acme, globex = batch_stack.client("acme"), batch_stack.client("globex")
    batch = wait_for(acme, run_batch(acme, [line("mine")]).id)
    for call in (
        lambda: globex.batches.retrieve(batch.id),
        lambda: globex.batches.cancel(batch.id),
        lambda: globex.files.retrieve(batch.input_file_id),
        lambda: globex.files.content(batch.output_file_id),
        lambda: globex.files.delete(batch.input_file_id),
        lambda: globex.batches.create(
            input_file_id=batch.input_file_id, endpoint=ENDPOINT, completion_window="24h"
        ),
    ):
        with pytest.raises(openai.NotFoundError):
            call()
    assert list(globex.batches.list()) == [] and list(globex.files.list()) == []
    assert acme.files.retrieve(batch.input_file_id).id == batch.input_file_id
    stranger = openai.OpenAI(base_url=batch_stack.apis[-1].base_url, api_key="sk-wrong")
    with pytest.raises(openai.AuthenticationError):
        stranger.batches.list()


def test_idempotency_key_returns_the_same_batch(batch_stack: BatchStack) -> None:
    client = batch_stack.client()
    upload = client.files.create(file=("in.jsonl", jsonl([line("once")])), purpose="batch")
    made = [
        client.batches.create(
            input_file_id=upload.id,
            endpoint=ENDPOINT,
            completion_window="24h",
            extra_headers={"Idempotency-Key": "nightly-2026-12-06"},
        )
        for _ in range(3)
    ]
    assert len({b.id for b in made}) == 1
    assert [b.id for b in client.batches.list()] == [made[0].id]
    # Without the key, the same body again (not a retry) is a new batch, as OpenAI does.
    again = client.batches.create(
        input_file_id=upload.id, endpoint=ENDPOINT, completion_window="24h"
    )
    assert again.id != made[0].id


def test_upload_over_a_limit_is_refused(batch_stack: BatchStack) -> None:
    small = batch_stack.start_api("--max-file-lines", "5", "--max-file-bytes", "2000", replica="r2")
    client = batch_stack.client(api=small, max_retries=0)
    with pytest.raises(openai.APIStatusError) as caught:
        client.files.create(
            file=("in.jsonl", jsonl([line(f"l{i}") for i in range(6)])), purpose="batch"
        )
    assert caught.value.status_code == 413
    with pytest.raises(openai.APIStatusError) as caught:
        client.files.create(file=("in.jsonl", b"x" * 5000), purpose="batch")
    assert caught.value.status_code == 413
    assert list(client.files.list()) == []
    assert [p.name for p in (batch_stack.tmp / "storage").iterdir()] == []
    ok = client.files.create(
        file=("in.jsonl", jsonl([line(f"l{i}") for i in range(5)])), purpose="batch"
    )
    assert ok.bytes > 0


@pytest.mark.anyio
async def test_an_sdk_retry_after_a_lost_reply_is_one_batch(batch_stack: BatchStack) -> None:
    """The create ran but its answer never arrived: the SDK sends it again (with
    ``x-stainless-retry-count: 1``) and gets the batch already made."""
    async with lossy_proxy(batch_stack.apis[-1].port) as proxy:
        port = proxy.url.rsplit(":", 1)[1].split("/")[0]
        client = openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key=KEYS["acme"], max_retries=2
        )
        upload = await client.files.create(file=("in.jsonl", jsonl([line("r")])), purpose="batch")
        proxy.lose_next_reply()
        batch = await client.batches.create(
            input_file_id=upload.id, endpoint=ENDPOINT, completion_window="24h"
        )
        assert proxy.replies_lost == 1
        listed = [b.id async for b in client.batches.list()]
        await client.close()
    assert listed == [batch.id]


def test_expired_files_and_batches_are_deleted(batch_stack: BatchStack) -> None:
    api = batch_stack.start_api("--retention-interval", "0.2", replica="r2")
    client = batch_stack.client(api=api)
    upload = client.files.create(
        file=("in.jsonl", jsonl([line("kept")])),
        purpose="batch",
        expires_after={"anchor": "created_at", "seconds": 7200},
    )
    assert upload.expires_at == upload.created_at + 7200
    batch = wait_for(
        client,
        client.batches.create(
            input_file_id=upload.id,
            endpoint=ENDPOINT,
            completion_window="24h",
            output_expires_after={"anchor": "created_at", "seconds": 3600},
        ).id,
    )
    output = client.files.retrieve(batch.output_file_id)
    assert output.expires_at == batch.created_at + 3600
    # The clock moved on: their expiries are now due (the schedule is the sweep's only input).
    r = redis.Redis.from_url(batch_stack.redis_url)
    for member in (f"file:{upload.id}", f"file:{output.id}", f"batch:{batch.id}"):
        assert r.zscore("async-processor:api:expiries", member) is not None
        r.zadd("async-processor:api:expiries", {member: 1})
    end = time.monotonic() + 10
    while list(client.files.list()) or list(client.batches.list()):
        assert time.monotonic() < end
        time.sleep(0.1)
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve(batch.id)
    with pytest.raises(openai.NotFoundError):
        client.files.content(output.id)
    assert list((batch_stack.tmp / "storage").iterdir()) == []
    assert r.keys(f"async-processor:api:batch:{{{batch.id}}}*") == []
