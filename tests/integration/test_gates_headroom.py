"""pool-headroom: the in-flight limit follows the pool's free slots, read from a /metrics page."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import anyio
import pytest
from prometheus_client import CollectorRegistry

from async_processor.errors import ConfigError
from async_processor.gates.base import (
    Action,
    GateContext,
    GateOwner,
    Observes,
    Releases,
    build_gate,
)
from async_processor.gates.headroom import PoolHeadroomGate
from async_processor.messages import Envelope, Request
from async_processor.metrics import Metrics
from tests.fixtures.servers import stop_process
from tests.fixtures.simulator import SimulatorProcess, start_simulator
from tests.integration.test_gates_scrape import Page, page

__all__ = ["page"]  # a fixture used below


@pytest.fixture
async def ctx() -> AsyncIterator[GateContext]:
    context = GateContext(owner=GateOwner(pool="pool-a"), metrics=Metrics(CollectorRegistry()))
    yield context
    for close in context.closers:
        await close()


def envelope(request_id: str) -> Envelope:
    return Envelope(Request(id=request_id, deadline=2_000_000_000))


def pool_page(*pods: tuple[int, int]) -> str:
    """vLLM gauges for pods given as (running, waiting)."""
    lines = ["# TYPE vllm:num_requests_running gauge"]
    lines += [f'vllm:num_requests_running{{pod="p{i}"}} {r}' for i, (r, _) in enumerate(pods)]
    lines += ["# TYPE vllm:num_requests_waiting gauge"]
    lines += [f'vllm:num_requests_waiting{{pod="p{i}"}} {w}' for i, (_, w) in enumerate(pods)]
    return "\n".join(lines) + "\n"


def gate(ctx: GateContext, page: Page, **params: Any) -> PoolHeadroomGate:
    built = build_gate("pool-headroom", {"url": page.url, "max_num_seqs": 8, **params}, ctx)
    assert isinstance(built, PoolHeadroomGate)
    return built


async def admit_all(g: PoolHeadroomGate, releases: Releases, most: int = 100) -> int:
    admitted = 0
    for i in range(most):
        verdict = await g.apply(envelope(f"m{i}"), releases)
        if verdict.action is not Action.CONTINUE:
            assert verdict.action is Action.WAIT
            break
        admitted += 1
    return admitted


@pytest.mark.anyio
async def test_admits_the_free_slots_minus_the_headroom(page: Page, ctx: GateContext) -> None:
    page.text = pool_page((5, 0), (2, 0))  # 2 pods x 8 slots, 7 running: 9 free
    g = gate(ctx, page, headroom=3, interval="1h")
    assert await admit_all(g, Releases()) == 6
    assert await g.budget() == 0.0


@pytest.mark.anyio
async def test_its_own_requests_count_between_scrapes(page: Page, ctx: GateContext) -> None:
    page.text = pool_page((8, 0), (4, 0))  # 4 free
    g = gate(ctx, page, interval="1h")
    first, second = Releases(), Releases()
    assert await admit_all(g, first, most=2) == 2
    assert await admit_all(g, second) == 2  # the page is not read again: counted here
    await first.release_all()
    assert await admit_all(g, Releases()) == 2  # finished requests give their slots back


@pytest.mark.anyio
async def test_others_waiting_and_share(page: Page, ctx: GateContext) -> None:
    page.text = pool_page((8, 3), (6, 0))  # 14 running + 3 waiting of 16: nothing free
    g = gate(ctx, page, interval="10ms")
    assert await admit_all(g, Releases()) == 0
    page.text = pool_page((2, 0), (0, 0))  # others left: 14 free, half for us
    await anyio.sleep(0.02)
    assert await admit_all(gate(ctx, page, share=0.5), Releases()) == 7
    assert await admit_all(g, Releases()) == 14


@pytest.mark.anyio
async def test_a_parked_worker_wakes_when_a_slot_frees(page: Page, ctx: GateContext) -> None:
    page.text = pool_page((7, 0), (8, 0))  # 1 free
    g = gate(ctx, page, interval="1h")
    releases = Releases()
    assert await admit_all(g, releases) == 1
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(g.wait_changed, 60.0)
            await anyio.sleep(0.01)
            await releases.release_all()
    assert (await g.apply(envelope("next"), Releases())).action is Action.CONTINUE


@pytest.mark.anyio
async def test_a_failed_scrape_admits_nothing_new(page: Page, ctx: GateContext) -> None:
    page.status = 500
    g = gate(ctx, page, interval="10ms", when_full="refuse")
    assert (await g.apply(envelope("m"), Releases())).action is Action.REFUSE
    page.status, page.text = 200, pool_page((0, 0))
    await anyio.sleep(0.02)
    assert (await g.apply(envelope("m"), Releases())).action is Action.CONTINUE


def test_waiting_on_a_queue_is_a_config_error() -> None:
    ctx = GateContext(owner=GateOwner("q", "q", "p"))
    with pytest.raises(ConfigError, match="belongs on a pool"):
        build_gate("pool-headroom", {"url": "http://x/metrics", "max_num_seqs": 8}, ctx)


@pytest.mark.anyio
async def test_one_page_per_pod_is_summed(page: Page, ctx: GateContext) -> None:
    page.text = pool_page((4, 1))  # read twice: 2 pods x 8 slots, 8 running, 2 waiting
    g = gate(ctx, page, url=[page.url, page.url], interval="1h")
    assert await admit_all(g, Releases()) == 6


async def park_until_admitted(g: PoolHeadroomGate, name: str, asked: list[int]) -> None:
    """Admission's loop for one worker with no fallback re-ask: only the gate wakes it."""
    while True:
        asked[0] += 1
        if (await g.apply(envelope(name), Releases())).action is Action.CONTINUE:
            return
        await g.wait_changed(60.0)


@pytest.mark.anyio
async def test_parked_workers_sleep_through_stale_readings_until_slots_free(
    page: Page, ctx: GateContext
) -> None:
    page.text = pool_page((8, 0), (8, 0))  # full
    g, asked = gate(ctx, page, interval="20ms"), [0]
    with anyio.fail_after(10):  # nothing but the gate's re-scrapes can wake them
        async with anyio.create_task_group() as tg:
            for i in range(12):
                tg.start_soon(park_until_admitted, g, f"w{i}", asked)
            await anyio.sleep(0.5)  # 25 intervals
            while_full = asked[0]
            page.text = pool_page((0, 0), (0, 0))  # 16 free: a re-scrape admits all 12
    # Each worker waking at every interval to re-scrape asked about 12 x 25 times; one
    # timer waiter does so once per interval (plus the one a scrape wakes to take over).
    assert while_full < 12 * 25 / 2, while_full


@pytest.mark.anyio
async def test_a_worker_parked_during_a_fetch_sizing_scrape_still_re_scrapes(
    page: Page, ctx: GateContext
) -> None:
    page.text, page.delay = pool_page((8, 0), (8, 0)), 0.2  # full, and slow to answer
    g, asked = gate(ctx, page, interval="20ms"), [0]
    with anyio.fail_after(5):  # the parked worker waits 60 s unless the gate wakes it
        async with anyio.create_task_group() as tg:
            tg.start_soon(g.budget)  # the pool sizing a fetch: a scrape no worker waits on
            await anyio.sleep(0.05)
            tg.start_soon(park_until_admitted, g, "w", asked)  # parks while it runs
            await anyio.sleep(0.3)
            page.text, page.delay = pool_page((0, 0), (0, 0)), 0.0


@pytest.fixture
def pool_sim() -> Iterator[SimulatorProcess]:
    """One pod of 4 slots whose router sheds batch requests while all 4 are busy."""
    sim = start_simulator("--pods", "1", "--max-num-seqs", "4", "--inter-token-latency", "0.01")
    yield sim
    stop_process(sim.proc)


async def completion(session: aiohttp.ClientSession, url: str, batch: bool) -> tuple[int, str]:
    """One request of 2 s (200 tokens of 10 ms): its status and drop reason."""
    headers = {"x-gateway-priority": "-1"} if batch else {}
    body = {"model": "m", "prompt": "p", "max_tokens": 200}
    async with session.post(url + "/v1/completions", json=body, headers=headers) as r:
        await r.read()
        return r.status, r.headers.get("x-llm-d-request-dropped-reason", "")


@pytest.mark.anyio
async def test_a_shed_request_closes_the_gate_until_the_next_reading(
    pool_sim: SimulatorProcess, ctx: GateContext
) -> None:
    params = {"url": pool_sim.url + "/metrics", "max_num_seqs": 4, "interval": "1s"}
    g = build_gate("pool-headroom", params, ctx)
    assert isinstance(g, PoolHeadroomGate)
    assert await g.budget() == 1.0  # read: an idle pod, 4 free slots
    async with aiohttp.ClientSession() as session, anyio.create_task_group() as tg:
        for _ in range(4):  # interactive traffic takes every slot after the reading
            tg.start_soon(completion, session, pool_sim.url, False)
        await anyio.sleep(0.2)
        releases = Releases()
        assert (await g.apply(envelope("b1"), releases)).action is Action.CONTINUE
        status, reason = await completion(session, pool_sim.url, True)
        assert (status, reason) == (429, "pool-saturated")
        heard(g, status, reason)
        await releases.release_all()
        # The reading still says 4 free and only 0 are ours: the next request would be shed.
        assert (await g.apply(envelope("b2"), Releases())).action is Action.WAIT
    await anyio.sleep(1.0)  # the interactive requests are done, the reading is stale
    assert (await g.apply(envelope("b3"), Releases())).action is Action.CONTINUE


def heard(g: PoolHeadroomGate, status: int, reason: str) -> None:
    """What a worker does after each attempt: tell a gate that observes outcomes."""
    if isinstance(g, Observes):
        g.observe(envelope("b"), status, 0.001, reason)


@pytest.mark.anyio
async def test_a_reading_begun_before_a_shed_does_not_reopen_the_gate(
    page: Page, ctx: GateContext
) -> None:
    page.text, page.delay = pool_page((0, 0)), 0.3  # 8 free, read slowly
    g = gate(ctx, page, interval="1h")
    async with anyio.create_task_group() as tg:
        tg.start_soon(g.budget)  # the read is on its way
        await anyio.sleep(0.1)
        heard(g, 429, "pool-saturated")  # the pool shed one of ours meanwhile
    assert (await g.apply(envelope("m"), Releases())).action is Action.WAIT
