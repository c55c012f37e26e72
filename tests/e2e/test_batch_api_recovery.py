"""The Batch API when things go wrong: the API killed mid-upload or mid-batch, the daemon
killed mid-batch, two replicas, a batch's window ending, no keys at start."""

from __future__ import annotations

import socket
import subprocess
import time
from collections import Counter

import pytest

from tests.e2e.test_batch_api import (
    file_lines,
    jsonl,
    line,
    run_batch,
    wait_completed,
    wait_for,
)
from tests.fixtures.api import KEYS, BatchStack, api_command

pytestmark = [pytest.mark.slow]


def test_api_killed_mid_batch_resumes_with_one_line_per_request(batch_stack: BatchStack) -> None:
    batch_stack.simulator.configure(latency=0.05)
    batch_stack.apis[-1].kill9()  # for one that queues at most 200 lines of a batch at once
    client = batch_stack.client(api=batch_stack.start_api("--max-open-lines", "200"))
    batch = run_batch(client, [line(f"k{i}", max_tokens=3) for i in range(1500)])
    for at_least in (100, 600):  # mid-submission and mid-collection both
        wait_completed(client, batch.id, at_least)
        batch_stack.apis[-1].kill9()
        restarted = batch_stack.start_api("--max-open-lines", "200")  # the same replica name
        client = batch_stack.client(api=restarted)
    done = wait_for(client, batch.id, timeout=120)
    assert done.status == "completed", done
    assert done.request_counts.completed == done.request_counts.total == 1500
    output = file_lines(client, done.output_file_id)
    assert Counter(x["custom_id"] for x in output) == Counter(f"k{i}" for i in range(1500))
    assert done.error_file_id is None
    assert done.usage.output_tokens == 1500 * 3


def test_window_end_expires_the_unfinished_lines(batch_stack: BatchStack) -> None:
    """Fast lines (10 ms) first, slow ones (20 s, past the 10 s window) after: the fast
    ones finish whatever the machine's load, the slow ones cannot."""
    batch_stack.simulator.configure(per_token=0.01)  # a line's time is its max_tokens
    client = batch_stack.client()
    fast = [line(f"f{i}", max_tokens=1) for i in range(10)]
    slow = [line(f"s{i}", max_tokens=2000) for i in range(30)]
    batch = run_batch(client, fast + slow, window="10s")
    done = wait_for(client, batch.id, timeout=60)
    assert done.status == "expired" and done.expired_at
    output = file_lines(client, done.output_file_id)
    errors = file_lines(client, done.error_file_id)
    assert len(output) == done.request_counts.completed > 0
    assert {x["custom_id"] for x in output} <= {f"f{i}" for i in range(10)}
    assert len(output) + len(errors) == done.request_counts.total == 40
    assert len({x["custom_id"] for x in output + errors}) == 40
    assert {x["error"]["code"] for x in errors} <= {"batch_expired", "DEADLINE_EXCEEDED"}


def test_refuses_to_start_without_keys(tmp_path: pytest.TempPathFactory) -> None:
    config = tmp_path / "transport.json"  # type: ignore[operator]
    config.write_text('{"url": "redis://127.0.0.1:1/0", "queues": [{"queue_name": "q"}]}')
    done = subprocess.run(api_command(config), capture_output=True, timeout=60)
    assert done.returncode == 2
    assert b"--api-keys-file is required (or --no-auth" in done.stderr


def test_daemon_killed_mid_batch_loses_and_repeats_no_line(batch_stack: BatchStack) -> None:
    batch_stack.simulator.configure(latency=0.1)
    client = batch_stack.client()
    batch = run_batch(client, [line(f"d{i}") for i in range(400)])
    wait_completed(client, batch.id, 50)
    batch_stack.restart_daemon()  # its claims come back when their 2 s leases run out
    done = wait_for(client, batch.id, timeout=120)
    assert done.status == "completed", done
    assert done.request_counts.completed == done.request_counts.total == 400
    output = file_lines(client, done.output_file_id)
    assert Counter(x["custom_id"] for x in output) == Counter(f"d{i}" for i in range(400))


def test_two_replicas_share_the_work_and_the_state(batch_stack: BatchStack) -> None:
    first, second = batch_stack.apis[-1], batch_stack.start_api(replica="r2")
    one, two = batch_stack.client(api=first), batch_stack.client(api=second)
    batches = [
        run_batch(c, [line(f"{n}-{i}") for i in range(100)]) for n, c in (("a", one), ("b", two))
    ]
    for made in batches:  # each replica answers for the other's batch
        done = wait_for(two if made in batches[:1] else one, made.id)
        assert done.status == "completed" and done.request_counts.completed == 100
        output = file_lines(one, done.output_file_id)
        assert len(output) == len({x["custom_id"] for x in output}) == 100
    assert {b.id for b in two.batches.list()} == {b.id for b in batches}


def test_api_killed_mid_upload_leaves_no_file(batch_stack: BatchStack) -> None:
    api, storage = batch_stack.apis[-1], batch_stack.tmp / "storage"
    part = (
        b'--b\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        b'--b\r\nContent-Disposition: form-data; name="file"; filename="in.jsonl"\r\n\r\n'
    )
    head = (
        f"POST /v1/files HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEYS['acme']}\r\n"
        f"Content-Type: multipart/form-data; boundary=b\r\nContent-Length: 10000000\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", api.port)) as upload:
        upload.sendall(head.encode() + part + jsonl([line(f"u{i}") for i in range(3000)]))
        end = time.monotonic() + 10
        while not list(storage.glob(".tmp-*")):  # streamed to a temporary, not yet a file
            assert time.monotonic() < end
            time.sleep(0.05)
        api.kill9()
    client = batch_stack.client(api=batch_stack.start_api())
    assert list(storage.iterdir()) == []  # the temporary was swept at start
    assert list(client.files.list()) == []


def test_a_replica_back_under_another_name_strands_no_result(batch_stack: BatchStack) -> None:
    batch_stack.simulator.configure(latency=0.02)
    client = batch_stack.client()
    batch = run_batch(client, [line(f"n{i}") for i in range(1000)])
    wait_completed(client, batch.id, 300)
    batch_stack.apis[-1].kill9()  # whatever it had taken and not recorded is in its list
    other = batch_stack.start_api("--replica-timeout", "1", replica="r-new")
    client = batch_stack.client(api=other)
    done = wait_for(client, batch.id, timeout=120)
    assert done.status == "completed" and done.request_counts.completed == 1000
    output = file_lines(client, done.output_file_id)
    assert Counter(x["custom_id"] for x in output) == Counter(f"n{i}" for i in range(1000))
