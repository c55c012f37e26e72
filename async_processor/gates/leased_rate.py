"""``redis-leased-rate``: a dispatch-rate ceiling leased by an external controller.

Input: a message to admit, and the control hash at ``control_key`` (fields
``api_version``, ``pool_id``, ``max_admission_rps``, ``valid_until_unix_ms``,
``decision_id``). Output: CONTINUE while the shared token bucket (``state_key``, against
Redis ``TIME``) has a token, REFUSE otherwise. It fails closed: a missing, mismatched,
malformed or expired lease refuses, and so does any Redis error (REFUSE, not an error,
so a wrapping ``wait-on-refuse`` parks instead of failing the request).
``max_admission_rps`` 0 is an explicit pause. Gauges: ``…_drain_limit_rps``,
``…_drain_limit_lease_valid``, ``…_drain_limit_valid_until_seconds``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Self

import redis.asyncio as aioredis
import structlog
from pydantic import Field, model_validator

from async_processor.config.redis import slot
from async_processor.errors import ConfigError
from async_processor.gates.base import CONTINUE, GATES, REFUSE, Gate, GateContext, Releases, Verdict
from async_processor.gates.params import Float, Str
from async_processor.gates.redis import RedisAddress, redis_client
from async_processor.gates.shared import Throttle, owner_gauge
from async_processor.messages import Envelope
from async_processor.redis.conn import REDIS_AWAY
from async_processor.redis.scripts import lua_source

log = structlog.get_logger(__name__)

API_VERSION = "llm-d.ai/v1alpha1"
FIELDS = ("api_version", "pool_id", "max_admission_rps", "valid_until_unix_ms", "decision_id")


class LeasedRateParams(RedisAddress):
    control_key: Str = Field(min_length=1)
    pool_id: Str = ""  # default: the owner's worker pool
    burst_seconds: Float = Field(default=1.0, gt=0)
    state_key: Str = ""  # default: <control_key>:state

    @model_validator(mode="after")
    def _state_key(self) -> Self:
        if not self.state_key:
            object.__setattr__(self, "state_key", f"{self.control_key}:state")
        if self.redis_mode == "cluster" and slot(self.state_key) != slot(self.control_key):
            raise ValueError(
                "redis_mode cluster: control_key and state_key must share a hash slot "
                "(one script reads both), e.g. '{rate}:control' and '{rate}:state'"
            )
        return self


@dataclass(frozen=True, slots=True)
class Lease:
    valid: bool
    rps: float = 0.0
    valid_until_ms: int = 0


NO_LEASE = Lease(valid=False)


def check_lease(record: dict[str, str], pool_id: str, now_ms: int) -> Lease:
    """The lease a control record grants at ``now_ms`` (NO_LEASE when it grants nothing)."""
    if record.get("api_version") != API_VERSION or record.get("pool_id") != pool_id:
        return NO_LEASE
    if not record.get("decision_id"):
        return NO_LEASE
    try:
        rps = float(record.get("max_admission_rps", ""))
        until = int(record.get("valid_until_unix_ms", ""))
    except ValueError:
        return NO_LEASE
    if not math.isfinite(rps) or rps < 0 or until <= now_ms:
        return NO_LEASE
    return Lease(valid=True, rps=rps, valid_until_ms=until)


class LeasedRateGate:
    def __init__(
        self, client: aioredis.Redis, params: LeasedRateParams, pool_id: str, ctx: GateContext
    ) -> None:
        self.params = params
        self.pool_id = pool_id
        self._client = client
        self._take = client.register_script(lua_source("leased_rate_take"))
        self._warn = Throttle()
        self._rps = owner_gauge(ctx, "drain_limit_rps", "Leased dispatch-rate ceiling (req/s).")
        self._valid = owner_gauge(ctx, "drain_limit_lease_valid", "1 while a lease is valid.")
        self._until = owner_gauge(
            ctx, "drain_limit_valid_until_seconds", "Unix time the lease expires."
        )
        self._publish(NO_LEASE)

    async def budget(self) -> float:
        """1 while a positive lease exists (it says nothing about the rate itself)."""
        try:
            async with self._client.pipeline(transaction=True) as pipe:
                pipe.hgetall(self.params.control_key)
                pipe.time()
                raw, (secs, micros) = await pipe.execute()
        except REDIS_AWAY as exc:
            if self._warn.ready():
                log.warning("leased_rate_unavailable", error=str(exc))
            self._publish(NO_LEASE)
            return 0.0
        self._warn.reset()
        record = {_text(k): _text(v) for k, v in raw.items()}
        lease = check_lease(record, self.pool_id, int(secs) * 1000 + int(micros) // 1000)
        self._publish(lease)
        return 1.0 if lease.valid and lease.rps > 0 else 0.0

    async def apply(self, message: Envelope, releases: Releases) -> Verdict:
        p = self.params
        try:
            allowed, valid, rps, until = await self._take(
                keys=[p.control_key, p.state_key],
                args=[API_VERSION, self.pool_id, repr(p.burst_seconds)],
            )
        except REDIS_AWAY as exc:
            if self._warn.ready():
                log.warning("leased_rate_unavailable", error=str(exc))
            self._publish(NO_LEASE)
            return REFUSE
        self._warn.reset()
        lease = Lease(True, float(rps), int(until)) if valid else NO_LEASE
        self._publish(lease)
        return CONTINUE if allowed else REFUSE

    def _publish(self, lease: Lease) -> None:
        if self._rps is not None and self._valid is not None and self._until is not None:
            self._rps.set(lease.rps)
            self._valid.set(1 if lease.valid else 0)
            self._until.set(lease.valid_until_ms / 1000)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


@GATES.register("redis-leased-rate", LeasedRateParams)
def _leased_rate(params: LeasedRateParams, ctx: GateContext) -> Gate:
    pool_id = params.pool_id or ctx.owner.pool
    if not pool_id:
        raise ConfigError("gate 'redis-leased-rate': pool_id is required (no owner pool)")
    return LeasedRateGate(redis_client(ctx, params), params, pool_id, ctx)
