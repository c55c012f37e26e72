"""Single async requests through ``async-processor api``: the real ``openai`` SDK's
``chat.completions.create`` answered through the queue, ``X-AP-Mode: enqueue`` with
``GET``/``DELETE /v1/requests/{id}``, one request per ``X-Request-Id``."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from typing import Any

import openai
import pytest

from tests.fixtures.api import KEYS, BatchStack

pytestmark = [pytest.mark.slow]

MESSAGES = [{"role": "user", "content": "hello"}]


def call(
    stack: BatchStack,
    method: str,
    path: str,
    body: Any = None,
    tenant: str = "acme",
    **headers: str,
) -> tuple[int, Any]:
    request = urllib.request.Request(
        stack.apis[-1].base_url + path,
        data=None if body is None else json.dumps(body).encode(),
        method=method,
        headers={"Authorization": f"Bearer {KEYS[tenant]}", "Content-Type": "application/json",
                 **headers},
    )  # fmt: skip
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_the_sdk_gets_its_answer_through_the_queue_once_per_id(batch_stack: BatchStack) -> None:
    client = batch_stack.client()
    first = client.chat.completions.create(
        model="sim-model", messages=MESSAGES, max_tokens=4, extra_headers={"X-Request-Id": "q-1"}
    )
    assert first.choices and first.usage.completion_tokens == 4
    again = client.chat.completions.create(
        model="sim-model", messages=MESSAGES, max_tokens=4, extra_headers={"X-Request-Id": "q-1"}
    )
    assert again.id == first.id  # the same request, not a second one
    assert batch_stack.simulator.stats()["total"] == 1
    status, record = call(batch_stack, "GET", "/requests/q-1")
    assert status == 200 and record["status"] == "completed"
    assert record["response"]["status_code"] == 200
    assert call(batch_stack, "GET", "/requests/q-1", tenant="globex")[0] == 404


def test_enqueue_then_read_and_a_gateway_error_is_its_answer(batch_stack: BatchStack) -> None:
    body = {"model": "sim-model", "prompt": "p", "max_tokens": "not a number"}  # sim: 400
    status, queued = call(batch_stack, "POST", "/completions", body, **{"X-AP-Mode": "enqueue"})
    assert status == 202 and queued["status"] == "queued" and queued["id"].startswith("req_")
    end = time.monotonic() + 30
    while (record := call(batch_stack, "GET", f"/requests/{queued['id']}")[1])[
        "status"
    ] == "queued":
        assert time.monotonic() < end
        time.sleep(0.05)
    assert record["status"] == "failed" and record["response"]["status_code"] == 400


def test_a_wait_that_times_out_is_202_and_cancel_ends_it(batch_stack: BatchStack) -> None:
    batch_stack.simulator.configure(latency=3)
    body = {"model": "sim-model", "messages": MESSAGES}
    status, queued = call(
        batch_stack, "POST", "/chat/completions", body,
        **{"X-Request-Id": "slow", "X-Request-Timeout-Seconds": "0.3"},
    )  # fmt: skip
    assert status == 202 and queued["status"] == "queued"
    status, cancelled = call(batch_stack, "DELETE", "/requests/slow")
    assert status == 200 and cancelled["status"] == "cancelled"
    time.sleep(1.5)  # the daemon's own CANCELLED result arrives: it changes nothing
    assert call(batch_stack, "GET", "/requests/slow")[1]["status"] == "cancelled"


def test_bad_requests_are_400(batch_stack: BatchStack) -> None:
    client = batch_stack.client(max_retries=0)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="sim-model", messages=MESSAGES, stream=True)
    assert call(batch_stack, "POST", "/chat/completions", [1])[0] == 400
    assert (
        call(batch_stack, "POST", "/chat/completions", {"model": "m"}, **{"X-AP-Mode": "x"})[0]
        == 400
    )
    assert (
        call(batch_stack, "POST", "/chat/completions", {"model": "m"}, **{"X-Request-Id": "a:b"})[0]
        == 400
    )
    assert batch_stack.simulator.stats()["total"] == 0
