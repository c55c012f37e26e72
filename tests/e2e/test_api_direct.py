"""``X-AP-Mode: direct`` through ``async-processor api``: the real ``openai`` SDK proxied to
the gateway now (no queue, no daemon), a streamed answer passed on chunk by chunk, the
tenant in the fairness header, a gateway that does not answer as OpenAI's error shape."""

from __future__ import annotations

import time

import anyio
import openai
import pytest

from tests.e2e.test_api_requests import MESSAGES, call
from tests.fixtures.api import KEYS, BatchStack
from tests.fixtures.scripted_gateway import Script, scripted_gateway
from tests.fixtures.servers import free_port

pytestmark = [pytest.mark.slow]

DIRECT = {"X-AP-Mode": "direct"}


def test_direct_answers_from_the_gateway_without_the_queue(batch_stack: BatchStack) -> None:
    batch_stack.daemon.kill9()  # nothing reads the queue: only a proxied call can answer
    client = batch_stack.client(max_retries=0)
    answer = client.chat.completions.create(
        model="sim-model", messages=MESSAGES, max_tokens=3, extra_headers=DIRECT
    )
    assert answer.choices and answer.usage.completion_tokens == 3
    seen = batch_stack.simulator.requests()
    assert len(seen) == 1 and seen[0]["path"] == "/v1/chat/completions"
    fairness = {k.lower(): v for k, v in seen[0]["headers"].items()}
    assert fairness["x-llm-d-inference-fairness-id"] == batch_stack.tenant("acme")
    # The gateway's own error answer comes back as it gave it.
    status, body = call(
        batch_stack, "POST", "/completions",
        {"model": "sim-model", "prompt": "p", "max_tokens": "x"}, **DIRECT,
    )  # fmt: skip
    assert status == 400 and "error" in body
    # Keys still hold: no key, no proxy.
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(
            base_url=batch_stack.apis[-1].base_url, api_key="sk-wrong", max_retries=0
        ).chat.completions.create(model="sim-model", messages=MESSAGES, extra_headers=DIRECT)
    assert len(batch_stack.simulator.requests()) == 2


def test_an_unreachable_gateway_is_a_502_in_openai_shape(batch_stack: BatchStack) -> None:
    batch_stack.start_api("--gateway-url", f"http://127.0.0.1:{free_port()}", replica="r2")
    status, body = call(batch_stack, "POST", "/chat/completions",
                        {"model": "m", "messages": MESSAGES}, **DIRECT)  # fmt: skip
    assert status == 502
    assert body["error"]["code"] == "gateway_error" and body["error"]["type"] == "server_error"
    assert set(body["error"]) == {"message", "type", "param", "code"}


@pytest.mark.anyio
async def test_a_gateway_redirect_is_never_followed(batch_stack: BatchStack) -> None:
    # The redirect names a gateway that would answer (the simulator): followed, the
    # tenant's body would go there and its 200 come back.
    async with scripted_gateway() as gateway:
        base = gateway.url.removesuffix("/v1/completions")
        batch_stack.start_api("--gateway-url", base, replica="r2")
        elsewhere = f"{batch_stack.simulator.url}/v1/chat/completions"
        redirect = f"HTTP/1.1 307 Temporary Redirect\r\nLocation: {elsewhere}\r\n"
        gateway.play(Script(((redirect + "Content-Length: 0\r\n\r\n").encode(),)))
        status, body = await anyio.to_thread.run_sync(
            lambda: call(
                batch_stack,
                "POST",
                "/chat/completions",
                {"model": "m", "messages": MESSAGES},
                **DIRECT,
            )
        )
    assert status == 502 and body["error"]["code"] == "gateway_error"
    assert "redirect" in body["error"]["message"]
    assert batch_stack.simulator.requests() == []


SSE = [
    b'data: {"id":"c1","object":"chat.completion.chunk","created":1,"model":"m",'
    b'"choices":[{"index":0,"delta":{"role":"assistant","content":"he"}}]}\n\n',
    b'data: {"id":"c1","object":"chat.completion.chunk","created":1,"model":"m",'
    b'"choices":[{"index":0,"delta":{"content":"llo"},"finish_reason":"stop"}]}\n\n',
    b"data: [DONE]\n\n",
]
PAUSE = 5.0  # the gateway holds its second chunk this long


def _chunked(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


@pytest.mark.anyio
async def test_a_streamed_answer_reaches_the_sdk_chunk_by_chunk(batch_stack: BatchStack) -> None:
    async with scripted_gateway() as gateway:
        base = gateway.url.removesuffix("/v1/completions")
        api = batch_stack.start_api("--gateway-url", base, replica="r2")
        head = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                b"Transfer-Encoding: chunked\r\n\r\n")  # fmt: skip
        gateway.play(
            Script(
                (head, _chunked(SSE[0]), PAUSE, _chunked(SSE[1]), _chunked(SSE[2]), b"0\r\n\r\n")
            )
        )
        client = openai.AsyncOpenAI(base_url=api.base_url, api_key=KEYS["acme"], max_retries=0)
        started = time.monotonic()
        arrivals: list[tuple[float, str]] = []
        stream = await client.chat.completions.create(
            model="m",
            messages=MESSAGES,
            stream=True,
            extra_headers=DIRECT,  # type: ignore[arg-type]
        )
        async for chunk in stream:
            arrivals.append((time.monotonic() - started, chunk.choices[0].delta.content or ""))
        await client.close()
        with anyio.fail_after(5):
            while not gateway.heads:
                await anyio.sleep(0.05)
    assert "".join(text for _, text in arrivals) == "hello"
    # The first chunk came while the gateway still held the second: passed on, not buffered.
    assert arrivals[0][0] < PAUSE <= arrivals[-1][0]
    sent = gateway.heads[0].decode().lower()
    assert f"x-llm-d-inference-fairness-id: {batch_stack.tenant('acme')}" in sent
    assert "x-ap-mode" not in sent
