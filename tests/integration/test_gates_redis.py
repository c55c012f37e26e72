"""Redis gates against a real redis-server: keys, TTLs and releases checked in Redis itself."""

from __future__ import annotations

import math
import time
from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest
import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry

from async_processor.errors import GateError
from async_processor.gates import redis as redis_gates
from async_processor.gates.base import (
    CONTINUE,
    REFUSE,
    Action,
    Gate,
    GateContext,
    GateOwner,
    Releases,
    build_gate,
)
from async_processor.messages import Envelope, Request
from async_processor.metrics import Metrics
from tests.fixtures.servers import RedisServer, free_port


@pytest.fixture
async def gate_ctx() -> AsyncIterator[GateContext]:
    context = GateContext(owner=GateOwner("q", "q", "pool-a"), metrics=Metrics(CollectorRegistry()))
    yield context
    for close in context.closers:
        await close()


@pytest.fixture
async def r(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(redis_url, decode_responses=True)
    yield client
    await client.aclose()


def address(redis_url: str) -> str:
    return redis_url.removeprefix("redis://").split("/")[0]


def user_msg(user: str | None, request_id: str = "r1") -> Envelope:
    metadata = {} if user is None else {"userid": user}
    return Envelope(Request(id=request_id, deadline=2_000_000_000, metadata=metadata))


def quota(ctx: GateContext, redis_url: str, unique: str, **params: Any) -> Gate:
    params = {"address": address(redis_url), "prefix": f"{unique}:", **params}
    return build_gate("redis-quota", params, ctx)


# ---------------------------------------------------------------------------------- redis


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("stored", "expected"),
    [(None, 1.0), ("0.25", 0.25), ("0", 0.0), ("-3", 0.0), ("7", 1.0), ("junk", 1.0), ("NaN", 1.0)],
)
async def test_redis_budget_key(
    gate_ctx: GateContext,
    r: aioredis.Redis,
    redis_url: str,
    unique: str,
    stored: Any,
    expected: float,
) -> None:
    if stored is not None:
        await r.set(unique, stored)
    gate = build_gate("redis", {"address": address(redis_url), "budget_key": unique}, gate_ctx)
    assert await gate.budget() == expected
    verdict = await gate.apply(user_msg("a"), Releases())
    assert verdict == (REFUSE if expected <= 0 else CONTINUE)


@pytest.mark.anyio
async def test_redis_gate_closes_when_redis_is_unreachable(
    gate_ctx: GateContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    warnings: list[str] = []
    monkeypatch.setattr(redis_gates.log, "warning", lambda event, **kw: warnings.append(event))
    gate = build_gate("redis", {"address": f"127.0.0.1:{free_port()}"}, gate_ctx)
    assert await gate.budget() == 0.0
    for _ in range(5):
        assert await gate.apply(user_msg("a"), Releases()) == REFUSE
    assert warnings == ["redis_gate_unavailable"]  # once, not at every call


@pytest.mark.anyio
async def test_redis_gate_takes_a_full_url_with_password_and_db(
    private_redis: RedisServer, gate_ctx: GateContext
) -> None:
    admin = aioredis.Redis(port=private_redis.port)
    await admin.config_set("requirepass", "s3cret")
    await admin.aclose()
    admin = aioredis.Redis(port=private_redis.port, password="s3cret", db=3)
    await admin.set("dispatch-gate-budget", "0.4")
    await admin.aclose()
    url = f"redis://:s3cret@127.0.0.1:{private_redis.port}/3"
    assert await build_gate("redis", {"address": url}, gate_ctx).budget() == 0.4
    wrong = f"redis://:nope@127.0.0.1:{private_redis.port}/3"
    assert await build_gate("redis", {"address": wrong}, gate_ctx).budget() == 0.0
    plain = f"127.0.0.1:{private_redis.port}"  # no auth: refused by the server, closed
    assert await build_gate("redis", {"address": plain}, gate_ctx).budget() == 0.0


# ---------------------------------------------------------------- redis-quota: concurrency


@pytest.mark.anyio
async def test_concurrency_quota_reserves_refuses_and_releases(
    gate_ctx: GateContext, r: aioredis.Redis, redis_url: str, unique: str
) -> None:
    gate = quota(gate_ctx, redis_url, unique, mode="concurrency", limit=2, window="90s")
    key = f"{unique}:userid:alice"
    held = [Releases(), Releases()]
    for releases in held:
        message = user_msg("alice")
        assert await gate.apply(message, releases) == CONTINUE
        assert message.routing.labels["classification"] == "reserved"
        assert len(releases) == 1
    assert await r.get(key) == "2"
    assert 85 <= await r.ttl(key) <= 90
    refused, releases = user_msg("alice"), Releases()
    assert await gate.apply(refused, releases) == REFUSE
    assert refused.routing.labels["classification"] == "overflow" and len(releases) == 0
    assert await r.get(key) == "2"
    assert await gate.apply(user_msg("bob"), Releases()) == CONTINUE  # own key
    await r.expire(key, 10)
    await held[0].release_all()
    assert await r.get(key) == "1"
    assert await r.ttl(key) > 80  # refreshed while something is held
    await held[1].release_all()
    assert await r.get(key) == "0"
    await held[1].release_all()  # released once: a second call gives nothing back
    assert await r.get(key) == "0"


@pytest.mark.anyio
async def test_release_survives_cancellation_and_never_goes_negative(
    gate_ctx: GateContext, r: aioredis.Redis, redis_url: str, unique: str
) -> None:
    gate = quota(gate_ctx, redis_url, unique, mode="concurrency", limit=5)
    key = f"{unique}:userid:carol"
    releases = Releases()
    await gate.apply(user_msg("carol"), releases)
    await gate.apply(user_msg("carol"), releases)
    with anyio.CancelScope() as scope:
        scope.cancel()  # the worker is being cancelled (shutdown) when it gives back
        await releases.release_all()
    assert await r.get(key) == "0"
    await r.delete(key)
    again = Releases()
    await gate.apply(user_msg("carol"), again)
    await r.set(key, "0", keepttl=True)  # an operator reset the counter meanwhile
    await again.release_all()
    assert await r.get(key) == "0"


@pytest.mark.anyio
async def test_classifying_quota_admits_overflow_without_holding(
    gate_ctx: GateContext, r: aioredis.Redis, redis_url: str, unique: str
) -> None:
    gate = quota(
        gate_ctx, redis_url, unique, mode="concurrency", limit=1, gating_mode="classifying"
    )
    first, second = user_msg("dan", "1"), user_msg("dan", "2")
    kept, extra = Releases(), Releases()
    assert await gate.apply(first, kept) == CONTINUE
    assert await gate.apply(second, extra) == CONTINUE
    assert first.routing.labels["classification"] == "reserved"
    assert second.routing.labels["classification"] == "overflow"
    assert (len(kept), len(extra)) == (1, 0)
    assert await r.get(f"{unique}:userid:dan") == "1"


@pytest.mark.anyio
async def test_quota_ignores_messages_without_the_attribute(
    gate_ctx: GateContext, r: aioredis.Redis, redis_url: str, unique: str
) -> None:
    gate = quota(gate_ctx, redis_url, unique, mode="concurrency", limit=1, attribute="tenant")
    message = user_msg("erin")
    assert await gate.apply(message, Releases()) == CONTINUE
    assert "classification" not in message.routing.labels
    assert await r.keys(f"{unique}*") == []
    assert await gate.budget() == 1.0
    present = Envelope(Request(id="x", deadline=2_000_000_000, metadata={"tenant": ""}))
    await gate.apply(present, Releases())  # an empty value still counts as present
    assert await r.get(f"{unique}:tenant:") == "1"


# ----------------------------------------------------------------- redis-quota: rate-limit


@pytest.mark.anyio
async def test_rate_limit_sliding_window(
    gate_ctx: GateContext, r: aioredis.Redis, redis_url: str, unique: str
) -> None:
    gate = quota(gate_ctx, redis_url, unique, limit=3, window="1s")
    key = f"{unique}:userid:fay"
    releases = Releases()
    verdicts = [(await gate.apply(user_msg("fay"), releases)).action for _ in range(4)]
    assert verdicts == [Action.CONTINUE] * 3 + [Action.REFUSE]
    assert len(releases) == 0  # entries age out; nothing to give back
    assert await r.zcard(key) == 3  # three distinct members even within one tick
    assert 1 <= await r.ttl(key) <= 2  # twice the window
    now_ns = time.time_ns()
    entries: Any = await r.zrange(key, 0, -1, withscores=True)
    scores = [int(score) for _, score in entries]
    assert all(abs(now_ns - s) < 5e9 for s in scores)  # nanosecond timestamps
    await anyio.sleep(1.1)
    assert await gate.apply(user_msg("fay"), releases) == CONTINUE
    assert await r.zcard(key) == 1


@pytest.mark.anyio
async def test_quota_errors_when_redis_is_down(gate_ctx: GateContext, unique: str) -> None:
    gate = quota(gate_ctx, f"redis://127.0.0.1:{free_port()}", unique, limit=1)
    message = user_msg("gus")
    with pytest.raises(GateError, match="redis-quota"):
        await gate.apply(message, Releases())
    assert "classification" not in message.routing.labels


# ------------------------------------------------------------------- composite all-or-none


@pytest.mark.anyio
@pytest.mark.parametrize("second", ["refuses", "fails"])
async def test_composite_gives_quota_back_when_a_later_gate_says_no(
    gate_ctx: GateContext, r: aioredis.Redis, redis_url: str, unique: str, second: str
) -> None:
    later = (
        {"gate_type": "constant", "gate_params": {"value": 0}}
        if second == "refuses"
        else {
            "gate_type": "redis-quota",
            "gate_params": {"address": f"127.0.0.1:{free_port()}", "limit": 1},
        }
    )
    first = {
        "gate_type": "redis-quota",
        "gate_params": {
            "address": address(redis_url),
            "prefix": f"{unique}:",
            "mode": "concurrency",
            "limit": 5,
        },
    }
    gate = build_gate("composite", {"gates": [first, later]}, gate_ctx)
    releases = Releases()
    if second == "refuses":
        assert await gate.apply(user_msg("hal"), releases) == REFUSE
    else:
        with pytest.raises(GateError):
            await gate.apply(user_msg("hal"), releases)
    assert await r.get(f"{unique}:userid:hal") == "0"
    assert len(releases) == 0


# ------------------------------------------------------------------------ redis-leased-rate


def leased(ctx: GateContext, redis_url: str, unique: str, **params: Any) -> Gate:
    params = {"address": address(redis_url), "control_key": f"{unique}:ctl", **params}
    return build_gate("redis-leased-rate", params, ctx)


async def lease(r: aioredis.Redis, unique: str, rps: str, valid_ms: int, **over: str) -> int:
    secs, micros = await r.time()
    until = secs * 1000 + micros // 1000 + valid_ms
    record = {
        "api_version": "llm-d.ai/v1alpha1",
        "pool_id": "pool-a",
        "max_admission_rps": rps,
        "valid_until_unix_ms": str(until),
        "decision_id": "d-1",
        **over,
    }
    await r.hset(f"{unique}:ctl", mapping=record)  # type: ignore[arg-type]
    return until


def gauges(ctx: GateContext) -> tuple[float | None, ...]:
    labels = {"queue_id": "q", "queue_name": "q", "pool_name": "pool-a"}
    assert ctx.metrics is not None
    registry = ctx.metrics.registry
    names = ("rps", "lease_valid", "valid_until_seconds")
    return tuple(
        registry.get_sample_value(f"llm_d_async_async_drain_limit_{n}", labels) for n in names
    )


@pytest.mark.anyio
async def test_leased_rate_fails_closed_without_a_lease(
    gate_ctx: GateContext, r: aioredis.Redis, redis_url: str, unique: str
) -> None:
    gate = leased(gate_ctx, redis_url, unique)
    assert gauges(gate_ctx) == (0.0, 0.0, 0.0)  # "no lease" from the start
    assert await gate.budget() == 0.0
    assert await gate.apply(user_msg("a"), Releases()) == REFUSE
    for bad in (
        {"pool_id": "other"},
        {"api_version": "v0"},
        {"decision_id": ""},
        {"valid_until_unix_ms": "soon"},
        {"valid_until_unix_ms": "9.9e15"},  # not an integer
        {"max_admission_rps": "-1"},
    ):
        await r.delete(f"{unique}:ctl")
        await lease(r, unique, "100", 60_000, **bad)
        assert await gate.budget() == 0.0, bad
        assert await gate.apply(user_msg("a"), Releases()) == REFUSE, bad
    await r.delete(f"{unique}:ctl")
    await lease(r, unique, "100", -1)  # expired
    assert await gate.apply(user_msg("a"), Releases()) == REFUSE
    assert gauges(gate_ctx)[1] == 0.0
    down = leased(gate_ctx, f"redis://127.0.0.1:{free_port()}", unique, pool_id="pool-a")
    assert await down.apply(user_msg("a"), Releases()) == REFUSE  # no error: refuse


@pytest.mark.anyio
async def test_leased_rate_token_bucket(
    gate_ctx: GateContext, r: aioredis.Redis, redis_url: str, unique: str
) -> None:
    gate = leased(gate_ctx, redis_url, unique, burst_seconds="1.25")
    until = await lease(r, unique, "4", 60_000)
    assert await gate.budget() == 1.0
    assert gauges(gate_ctx) == (4.0, 1.0, until / 1000)

    async def burst(n: int) -> tuple[int, float]:
        """(admitted, seconds taken) for n back-to-back applies."""
        start = time.monotonic()
        verdicts = [(await gate.apply(user_msg("a"), Releases())).action for _ in range(n)]
        return verdicts.count(Action.CONTINUE), time.monotonic() - start

    admitted, took = await burst(8)  # the bucket starts full: capacity 4/s x 1.25 s
    assert 5 <= admitted <= 5 + math.ceil(took * 4)
    state = await r.hgetall(f"{unique}:ctl:state")
    assert float(state["tokens"]) < 1 and int(state["last_ms"]) > 0
    assert 59_000 < await r.pttl(f"{unique}:ctl:state") <= 61_000
    start = time.monotonic()
    await anyio.sleep(0.5)  # refills 2 tokens at 4/s
    admitted, _ = await burst(8)
    assert 2 <= admitted <= min(5, math.ceil((time.monotonic() - start) * 4))


@pytest.mark.anyio
async def test_leased_rate_zero_is_a_pause(
    gate_ctx: GateContext, r: aioredis.Redis, redis_url: str, unique: str
) -> None:
    gate = leased(gate_ctx, redis_url, unique)
    await lease(r, unique, "0", 60_000)
    assert await gate.budget() == 0.0
    assert await gate.apply(user_msg("a"), Releases()) == REFUSE
    assert gauges(gate_ctx)[:2] == (0.0, 1.0)  # a valid lease that says pause
    wrapped = build_gate(
        "wait-on-refuse",
        {"gate": {"gate_type": "redis-leased-rate", "gate_params": {
            "address": address(redis_url), "control_key": f"{unique}:ctl"}}},
        gate_ctx,
    )  # fmt: skip
    assert (await wrapped.apply(user_msg("a"), Releases())).action is Action.WAIT


@pytest.mark.anyio
async def test_quota_keeps_working_across_a_redis_restart(
    private_redis: RedisServer, gate_ctx: GateContext, unique: str
) -> None:
    gate = quota(gate_ctx, private_redis.url, unique, mode="concurrency", limit=3)
    held = Releases()
    assert await gate.apply(user_msg("ivy"), held) == CONTINUE
    private_redis.restart()  # AOF keeps the count; the pooled connection is now stale
    assert await gate.apply(user_msg("ivy"), held) == CONTINUE
    await held.release_all()
    client = aioredis.Redis(port=private_redis.port, decode_responses=True)
    assert await client.get(f"{unique}:userid:ivy") == "0"
    await client.aclose()


# ------------------------------------------------------------------ cluster unreachable


@pytest.mark.anyio
async def test_redis_gates_treat_an_unreachable_cluster_as_a_standalone_outage(
    gate_ctx: GateContext, unique: str
) -> None:
    # The cluster client raises its own RedisClusterException (not a RedisError) when no
    # node answers. The gates let it out, and pool admission made every message a
    # GATE_ERROR result, where a standalone outage refuses and the message comes back.
    down = {"address": f"127.0.0.1:{free_port()}", "redis_mode": "cluster"}
    budget = build_gate("redis", down, gate_ctx)
    assert await budget.budget() == 0.0
    assert await budget.apply(user_msg("a"), Releases()) == REFUSE
    rate = build_gate(
        "redis-leased-rate", {**down, "control_key": "{rate}:ctl", "pool_id": "pool-a"}, gate_ctx
    )
    assert await rate.budget() == 0.0
    assert await rate.apply(user_msg("a"), Releases()) == REFUSE
    limit = build_gate("redis-quota", {**down, "prefix": f"{unique}:", "limit": 1}, gate_ctx)
    with pytest.raises(GateError, match="redis-quota"):  # as standalone (docs/gates.md)
        await limit.apply(user_msg("gus"), Releases())
