"""A gateway answer too large for the result transport ends as a result naming its size.

Pub/Sub refuses publish requests over 10 MB: a 10 MiB answer used to make every result
publish fail, so the message came back and was sent again until its deadline
(docs/architecture.md G10).
Against the real Pub/Sub emulator and a real HTTP gateway, with the daemon in-process.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from async_processor.health import listening
from tests.contract.harness import Submission, open_harness
from tests.fixtures.inprocess import running
from tests.fixtures.pubsub import PubSubEmulator

pytestmark = [pytest.mark.anyio, pytest.mark.xdist_group("pubsub")]

TEN_MIB = b'{"text":"' + b"a" * (10 * 1024 * 1024) + b'"}'
# Under the limit as bytes, over it once JSON-escaped into the result's payload string.
ESCAPED = b'"' * 6_000_000
ANSWERS = {"big": TEN_MIB, "escaped": ESCAPED, "small": b'{"ok":true}'}


@pytest.fixture
async def gateway() -> AsyncIterator[tuple[str, list[str]]]:
    asked: list[str] = []

    async def answer(request: web.Request) -> web.Response:
        name = request.headers["x-answer"]
        asked.append(name)
        return web.Response(body=ANSWERS[name], content_type="application/json")

    app = web.Application()
    app.router.add_post("/v1/completions", answer)
    async with listening(app, "127.0.0.1", 0) as port:
        yield f"http://127.0.0.1:{port}", asked


async def test_an_answer_pubsub_cannot_carry_is_an_inference_error_naming_its_size(
    pubsub_env: PubSubEmulator, unique: str, gateway: tuple[str, list[str]]
) -> None:
    url, asked = gateway
    deadline = int(time.time() + 120)
    submissions = [Submission(n, deadline, headers={"x-answer": n}) for n in ANSWERS]
    async with open_harness("gcp-pubsub", unique, project=pubsub_env.project) as harness:
        await harness.submit(submissions)
        async with running(harness.config(url)):
            results = {r["id"]: r for r in await harness.results(3, timeout=60)}
    assert results["small"]["status_code"] == 200
    big, escaped = results["big"], results["escaped"]
    assert big["error_code"] == "INFERENCE_ERROR"
    assert f"gateway answer of {len(TEN_MIB)} bytes is larger than" in big["error_message"]
    assert escaped["error_code"] == "INFERENCE_ERROR"
    assert escaped["error_message"].startswith("result of 12000")
    assert "a gcp-pubsub result can carry" in escaped["error_message"]
    assert sorted(asked) == sorted(ANSWERS)  # each sent once: no retry loop
