"""ShedPause: how long a pool holds back after a gateway shed."""

from __future__ import annotations

import time

import pytest

from async_processor.pipeline.capacity import ShedPause


def test_shed_pause_follows_retry_after_up_to_its_cap() -> None:
    now = [100.0]
    pause = ShedPause(2.0, clock=lambda: now[0])
    pause.shed(0.5)
    assert pause.until == 100.5
    pause.shed(30.0)  # a long Retry-After is capped
    assert pause.until == 102.0
    now[0] = 101.0
    pause.shed(None)  # no Retry-After: the cap
    assert pause.until == 103.0
    pause.shed(0.1)  # never shortens a pause already running
    assert pause.until == 103.0
    off = ShedPause(0.0, clock=lambda: now[0])
    off.shed(5.0)
    assert off.until == 0.0


@pytest.mark.anyio
async def test_shed_pause_waits_out_the_pause_and_no_longer() -> None:
    pause = ShedPause(0.2)
    pause.shed(None)
    started = time.monotonic()
    await pause.wait()
    assert 0.15 <= time.monotonic() - started < 1.0
    started = time.monotonic()
    await pause.wait()  # over: no wait at all
    assert time.monotonic() - started < 0.05
