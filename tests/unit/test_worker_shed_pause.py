"""A shed pause delays a request's attempt, never stretches it past its deadline: the
attempt's budget is taken after the pause, so a deadline that passes during the pause is
answered DEADLINE_EXCEEDED without a call to the gateway."""

from __future__ import annotations

import dataclasses
import time

import anyio
import pytest
from aiohttp import web

from async_processor.messages import ErrorCode
from async_processor.pipeline.capacity import ShedPause
from async_processor.transports.base import Completion
from tests.fixtures.inprocess import http_client
from tests.fixtures.servers import free_port
from tests.unit.test_tracing import _work, _worker

pytestmark = pytest.mark.anyio


async def test_a_deadline_that_passes_during_the_pause_is_answered_without_a_call() -> None:
    calls: list[str] = []

    async def answer(request: web.Request) -> web.Response:
        calls.append(request.path)
        return web.json_response({"ok": True})

    app = web.Application()
    app.router.add_post("/v1/completions", answer)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        work = _work(f"http://127.0.0.1:{port}")
        work.envelope.request.deadline = int(time.time()) + 1
        pause = ShedPause(cap=3.0)
        pause.shed(2.5)  # the pool is paused past the request's deadline
        send, receive = anyio.create_memory_object_stream[object](4)
        async with http_client() as http:
            worker = dataclasses.replace(_worker(http, send), shed_pause=pause)  # type: ignore[arg-type]
            await worker.handle(work)
        send.close()
        ops = [op async for op in receive]
    finally:
        await runner.cleanup()
    assert calls == []
    [done] = ops
    assert isinstance(done, Completion)
    assert done.result.error_code == ErrorCode.DEADLINE_EXCEEDED.value
