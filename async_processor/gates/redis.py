"""Redis-backed gates: ``redis`` (external budget key) and ``redis-quota`` (per attribute).

Input: a message (quota keys on one of its metadata values). Output: a ``Verdict``; quota
reservations are taken by atomic Lua scripts and given back through ``Releases``.
Clients come from ``redis_client``: one per connection per process, where ``address``
is ``host:port`` or a full ``redis://`` / ``rediss://`` URL (auth, db, TLS) and the other
connection fields are the transport's (``redis_mode``, sentinels, TLS files; see
``transports/redis_conn``); they are closed with the gate context at shutdown.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Sequence
from typing import Annotated, Literal, cast

import redis.asyncio as aioredis
import structlog
from pydantic import AfterValidator, Field, ValidationInfo, field_validator, model_validator

from async_processor.config.redis import Mode, RedisConnection, RedisConnectionFields
from async_processor.errors import GateError
from async_processor.gates.base import CONTINUE, GATES, REFUSE, Gate, GateContext, Releases, Verdict
from async_processor.gates.params import Duration, Int, Params, Str
from async_processor.gates.shared import Throttle, shielded
from async_processor.messages import Envelope, classify
from async_processor.redis.conn import REDIS_AWAY, connect
from async_processor.redis.scripts import lua_source

log = structlog.get_logger(__name__)

# Bound every call: a gate that hangs on a dead Redis would stall the whole pipeline.
# One quick retry covers a pooled connection gone stale after a Redis restart; the
# client's default (three retries with backoff up to seconds) would park every caller.
SOCKET_TIMEOUT = 5.0


def redis_client(ctx: GateContext, params: RedisAddress) -> aioredis.Redis:
    """The process-wide client for the gate's connection (created once, closed at shutdown)."""
    conn = params.redis_connection()
    key = f"redis:{conn}"
    client: aioredis.Redis | None = ctx.shared.get(key)
    if client is None:
        client = connect(conn, socket_timeout=SOCKET_TIMEOUT, retry_cap=0.2)
        ctx.shared[key] = client
        ctx.closers.append(client.aclose)
    return client


def _address(value: str) -> str:
    if "://" not in value:
        host, sep, port = value.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError("must be host:port or a redis:// / rediss:// URL")
    elif not value.startswith(("redis://", "rediss://", "unix://")):
        raise ValueError("URL scheme must be redis://, rediss:// or unix://")
    return value


Address = Annotated[Str, AfterValidator(_address)]


class RedisAddress(Params, RedisConnectionFields):
    """``address`` is required by every Redis gate; checked at startup. The mode is
    ``redis_mode`` here because ``redis-quota`` already has a ``mode`` field."""

    address: Address
    redis_mode: Mode = "standalone"

    @model_validator(mode="after")
    def _connection(self) -> RedisAddress:
        self.redis_connection().check()
        return self

    def redis_connection(self) -> RedisConnection:
        url = self.address if "://" in self.address else f"redis://{self.address}"
        return self.connection(url, self.redis_mode)


# ------------------------------------------------------------------------------ redis


class RedisBudgetParams(RedisAddress):
    budget_key: Str = "dispatch-gate-budget"


class RedisBudgetGate:
    """Budget read from a key an operator or controller writes.

    Missing key or a value that is not a finite number (NaN included): 1.0 (open), as the
    reference. Redis unreachable: 0.0 (closed).
    """

    def __init__(
        self, client: aioredis.Redis, params: RedisBudgetParams, batch: BudgetKeys
    ) -> None:
        self.params = params
        self._client = client
        self.key = params.budget_key
        self.batch = batch  # the idle queues' gates on this connection, read together
        self._warn = Throttle()

    async def budget(self) -> float:
        try:
            raw = await self._client.get(self.key)
        except REDIS_AWAY as exc:
            if self._warn.ready():
                log.warning("redis_gate_unavailable", key=self.key, error=str(exc))
            return 0.0
        return self.parse(raw)

    def parse(self, raw: bytes | str | None) -> float:
        """The budget a read of the key gives (see the class docstring)."""
        try:
            value = math.nan if raw is None else float(raw)
        except ValueError:
            value = math.nan
        if math.isnan(value):
            if raw is not None and self._warn.ready():
                log.warning("redis_gate_value_unparsable", key=self.key)
            return 1.0
        self._warn.reset()
        return min(1.0, max(0.0, value))

    async def apply(self, message: Envelope, releases: Releases) -> Verdict:
        return REFUSE if await self.budget() <= 0 else CONTINUE


class BudgetKeys:
    """The budget keys of the ``redis`` gates on one connection, read in one round trip:
    200 idle queues cost one MGET a round (one per hash slot in cluster mode), not 200
    GETs (issue 30, item 4)."""

    def __init__(self, client: aioredis.Redis) -> None:
        self._client = client
        self._warn = Throttle()

    async def budgets(self, gates: Sequence[Gate]) -> list[float]:
        mine = [cast(RedisBudgetGate, gate) for gate in gates]
        keys = [gate.key for gate in mine]
        try:
            if isinstance(self._client, aioredis.RedisCluster):
                raws = await self._client.mget_nonatomic(keys)
            else:
                raws = await self._client.mget(keys)
        except REDIS_AWAY as exc:
            if self._warn.ready():
                log.warning("redis_gate_unavailable", keys=len(keys), error=str(exc))
            return [0.0] * len(mine)
        self._warn.reset()
        return [gate.parse(raw) for gate, raw in zip(mine, raws, strict=True)]


@GATES.register("redis", RedisBudgetParams)
def _redis(params: RedisBudgetParams, ctx: GateContext) -> Gate:
    client = redis_client(ctx, params)
    batch: BudgetKeys | None = ctx.shared.get(f"redis-budget-keys:{id(client)}")
    if batch is None:
        batch = ctx.shared[f"redis-budget-keys:{id(client)}"] = BudgetKeys(client)
    return RedisBudgetGate(client, params, batch)


# ------------------------------------------------------------------------ redis-quota


class QuotaParams(RedisAddress):
    attribute: Str = "userid"
    mode: Literal["rate-limit", "concurrency"] = "rate-limit"
    limit: Int = Field(gt=0)
    window: Duration = Field(default=60.0, ge=0)
    prefix: Str = "quota:"
    gating_mode: Literal["blocking", "classifying"] = "blocking"

    @field_validator("window")
    @classmethod
    def _window_counts(cls, value: float, info: ValidationInfo) -> float:
        """A rate needs a window (upstream #452): 0 counted every request in one
        never-ending hour-long bucket. Concurrency keeps 0 = the default slot TTL."""
        if value <= 0 and info.data.get("mode", "rate-limit") == "rate-limit":
            raise ValueError("must be greater than 0 in mode rate-limit")
        return value


class RedisQuotaGate:
    """Per-attribute quota; stamps ``classification`` = reserved / overflow."""

    def __init__(self, client: aioredis.Redis, params: QuotaParams) -> None:
        self.params = params
        self._client = client
        self._concurrency = params.mode == "concurrency"
        window = int(params.window)
        if self._concurrency:
            self._ttl = window if window > 0 else 300
            self._acquire = client.register_script(lua_source("quota_concurrency_acquire"))
            self._release = client.register_script(lua_source("quota_concurrency_release"))
        else:
            self._ttl = window * 2 if window > 0 else 3600
            self._acquire = client.register_script(lua_source("quota_rate_acquire"))

    def key(self, value: str) -> str:
        return f"{self.params.prefix}{self.params.attribute}:{value}"

    async def budget(self) -> float:
        return 1.0  # the quota is per message, not per fetch

    async def apply(self, message: Envelope, releases: Releases) -> Verdict:
        value = message.request.metadata.get(self.params.attribute)
        if value is None:
            return CONTINUE
        key = self.key(value)
        try:
            reserved = bool(await self._acquire(keys=[key], args=self._acquire_args()))
        except REDIS_AWAY as exc:
            raise GateError(f"redis-quota on {key!r}: {exc}") from exc
        classify(message, reserved=reserved)
        if not reserved and self.params.gating_mode == "blocking":
            return REFUSE
        if reserved and self._concurrency:
            releases.add(shielded(lambda: self._give_back(key), "redis-quota"))
        return CONTINUE

    def _acquire_args(self) -> list[int | str]:
        if self._concurrency:
            return [self.params.limit, self._ttl]
        now = time.time_ns()
        window_ns = int(self.params.window * 1e9)
        return [now, window_ns, self.params.limit, self._ttl, f"{now}-{uuid.uuid4().hex[:8]}"]

    async def _give_back(self, key: str) -> None:
        await self._release(keys=[key], args=[self._ttl])


@GATES.register("redis-quota", QuotaParams)
def _redis_quota(params: QuotaParams, ctx: GateContext) -> Gate:
    return RedisQuotaGate(redis_client(ctx, params), params)
