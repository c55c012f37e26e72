"""Per-tenant caps: open batches, queued lines, bytes stored; past one, a 429 with
``Retry-After``.

Stage: the API's HTTP edge, before a batch or an upload is taken. Input: the caps (the
``--max-open-batches`` / ``--max-queued-lines`` / ``--max-stored-bytes`` defaults, each
overridable per tenant in ``--tenant-caps-file``: ``{"<tenant>": {"open_batches": N,
"queued_lines": N, "stored_bytes": N}}``) and the tenant's usage in Redis (its open
batches ``keys.tenant_open``, its files' bytes ``keys.tenant_stored``, the unanswered
lines of its open batches). Output: nothing, or an ``ApiError`` 429.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

from async_processor.api import keys
from async_processor.api.errors import ApiError
from async_processor.api.store import Store, as_int, text
from async_processor.errors import ConfigError

MAX_OPEN_BATCHES = 100
MAX_QUEUED_LINES = 1_000_000  # twenty full files' worth
MAX_STORED_BYTES = 10 * 1024**3
RETRY_AFTER = 60  # seconds a refused caller is told to wait (lines finish, files expire)
FIELDS = ("open_batches", "queued_lines", "stored_bytes")
COUNTS = ("total", "file_lines", "completed", "failed")  # a batch's fields queued_lines reads

# KEYS: the tenant's open-batch zset. ARGV: batch id, created_at, cap. 1: taken (or the
# batch holds a place already); 0: the cap is reached. One script: two creates at once
# cannot both take the last place.
TAKE_PLACE = """
if redis.call('ZSCORE', KEYS[1], ARGV[1]) then return 1 end
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[3]) then return 0 end
redis.call('ZADD', KEYS[1], ARGV[2], ARGV[1])
return 1
"""

# KEYS: the tenant's stored-bytes hash. The sum of its values.
STORED = """
local sum = 0
for _, v in ipairs(redis.call('HVALS', KEYS[1])) do sum = sum + (tonumber(v) or 0) end
return sum
"""


@dataclass(frozen=True, slots=True)
class Caps:
    open_batches: int = MAX_OPEN_BATCHES
    queued_lines: int = MAX_QUEUED_LINES
    stored_bytes: int = MAX_STORED_BYTES


@dataclass(frozen=True, slots=True)
class CapsBook:
    """The default caps and each named tenant's."""

    default: Caps = field(default_factory=Caps)
    tenants: dict[str, Caps] = field(default_factory=dict)

    def of(self, tenant: str) -> Caps:
        return self.tenants.get(tenant, self.default)


def load_caps(path: str, default: Caps) -> CapsBook:
    """The caps file (empty path: every tenant has the defaults); ``ConfigError`` says
    what is wrong. A tenant's entry overrides only the caps it names."""
    if not path:
        return CapsBook(default)
    try:
        raw = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--tenant-caps-file {path}: {exc}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"--tenant-caps-file {path}: not a JSON object of tenant -> caps")
    tenants = {}
    for tenant, caps in raw.items():
        where = f"--tenant-caps-file {path}: {tenant}"
        if not isinstance(caps, dict) or not set(caps) <= set(FIELDS):
            raise ConfigError(f"{where}: an object of {', '.join(FIELDS)}")
        if not all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in caps.values()
        ):
            raise ConfigError(f"{where}: each cap is a whole number >= 0")
        tenants[str(tenant)] = replace(default, **caps)
    return CapsBook(default, tenants)


def refused(what: str, cap: int) -> ApiError:
    return ApiError(
        429,
        f"Tenant cap reached: {what} (at most {cap}). Retry later.",
        code="rate_limit_exceeded",
        headers={"Retry-After": str(RETRY_AFTER)},
    )


class Guard:
    """Checks (and, for open batches, takes) a tenant's room under its caps."""

    def __init__(self, store: Store, book: CapsBook) -> None:
        self.store, self.book = store, book
        self._take_place = store.redis.register_script(TAKE_PLACE)
        self._stored = store.redis.register_script(STORED)

    async def stored(self, tenant: str) -> int:
        return int(await self._stored(keys=[keys.tenant_stored(tenant)]))

    async def check_bytes(self, tenant: str, more: int, already: int | None = None) -> int:
        """429 when ``more`` bytes would pass the tenant's cap; its bytes stored (pass
        it back as ``already`` to check again as an upload grows, without a round trip)."""
        stored = await self.stored(tenant) if already is None else already
        cap = self.book.of(tenant).stored_bytes
        if stored + more > cap:
            raise refused("bytes stored", cap)
        return stored

    async def queued_lines(self, tenant: str) -> int:
        """Lines of the tenant's open batches without a result (a batch still validating
        counts its input file's lines)."""
        redis = self.store.redis
        ids = await redis.zrange(keys.tenant_open(tenant), 0, -1)
        pipe = redis.pipeline(transaction=False)  # one round trip, not one per batch
        for batch_id in ids:
            pipe.hmget(keys.batch_key(text(batch_id)), COUNTS)
        queued = 0
        for values in await pipe.execute():  # a batch gone meanwhile reads as all 0
            record = {name: text(v) for name, v in zip(COUNTS, values, strict=True) if v}
            total = as_int(record, "total") or as_int(record, "file_lines")
            queued += max(0, total - as_int(record, "completed") - as_int(record, "failed"))
        return queued

    async def take_batch_place(self, tenant: str, batch_id: str, created: int, lines: int) -> None:
        """429 unless the tenant has room for one more open batch of ``lines`` lines;
        then the batch holds its place (``release`` gives it back if it is not made)."""
        caps = self.book.of(tenant)
        queued = await self.queued_lines(tenant)
        if queued + lines > caps.queued_lines:
            raise refused("queued lines", caps.queued_lines)
        args: list[str | int] = [batch_id, created, caps.open_batches]
        if not await self._take_place(keys=[keys.tenant_open(tenant)], args=args):
            raise refused("open batches", caps.open_batches)

    async def release(self, tenant: str, batch_id: str) -> None:
        await self.store.redis.zrem(keys.tenant_open(tenant), batch_id)
