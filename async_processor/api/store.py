"""The API's state in Redis: files, batches, their indexes, counters and status.

Stage: the API's state (docs/batch-api.md, "State in Redis"). Input: records to keep,
results to count, status changes to make. Output: what was kept, read back; status
changes that are compare-and-set (``transition``) and result recording that counts each
line once (``record``), both as Lua scripts on one object's keys (one cluster slot).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis

from async_processor.api import keys

TERMINAL = ("completed", "failed", "cancelled", "expired")
LEASE_MS = 15_000
BATCH_RETENTION = 30 * 24 * 3600  # a finished batch object is kept this long, as OpenAI
IDEMPOTENCY_TTL = 24 * 3600
RETRY_MATCH_TTL = 600  # an SDK retry of the same body finds its batch this long

# Every key a script writes is checked for its type before the first write, so a
# wrong-typed key fails the call and changes nothing (the transport's habit, lua/lib.lua).
_CHECK = """
local function want(key, kind)
  local t = redis.call('TYPE', key).ok
  if t ~= 'none' and t ~= kind then return redis.error_reply('WRONGTYPE ' .. key) end
end
"""

# KEYS: batch hash. ARGV: new status, time, then the statuses it may come from.
# 1: moved; 0: the status was another (unchanged); -1: no such batch.
TRANSITION = """
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return -1 end
for i = 3, #ARGV do
  if ARGV[i] == status then
    redis.call('HSET', KEYS[1], 'status', ARGV[1], ARGV[1] .. '_at', ARGV[2])
    return 1
  end
end
return 0
"""

# KEYS: batch hash, done bitmap, out list, err list, seq string (one byte per recorded
# line in arrival order: 1 out, 0 err; the results stream's cursor). ARGV: per line 8
# values: index,
# 'out' or 'err', the file line, input, output, total, cached, reasoning tokens.
# Returns {new lines, lines answered now, the batch's created_at, new output lines}; {-1}
# when the batch is gone or sealed.
RECORD = (
    _CHECK
    + """
for i, kind in ipairs({'hash', 'string', 'list', 'list', 'string'}) do
  local err = want(KEYS[i], kind)
  if err then return err end
end
if redis.call('HGET', KEYS[1], 'sealed') ~= '0' then return {-1} end
local usage = {'input_tokens', 'output_tokens', 'total_tokens', 'cached_tokens',
               'reasoning_tokens'}
local new, new_ok = 0, 0
for i = 1, #ARGV, 8 do
  if redis.call('SETBIT', KEYS[2], ARGV[i], 1) == 0 then
    new = new + 1
    local ok = ARGV[i + 1] == 'out'
    if ok then new_ok = new_ok + 1 end
    redis.call('RPUSH', ok and KEYS[3] or KEYS[4], ARGV[i + 2])
    redis.call('APPEND', KEYS[5], ok and '\1' or '\0')
    redis.call('HINCRBY', KEYS[1], ok and 'completed' or 'failed', 1)
    for u = 1, 5 do
      local n = tonumber(ARGV[i + 2 + u])
      if n and n ~= 0 then redis.call('HINCRBY', KEYS[1], usage[u], n) end
    end
  end
end
local counts = redis.call('HMGET', KEYS[1], 'completed', 'failed', 'created_at')
return {new, (tonumber(counts[1]) or 0) + (tonumber(counts[2]) or 0), tonumber(counts[3]) or 0,
        new_ok}
"""
)

# KEYS: lease. ARGV: owner, ms. 1: held by owner (taken or extended); 0: another's.
LEASE = """
local holder = redis.call('GET', KEYS[1])
if holder and holder ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
"""

# KEYS: a request's hash. ARGV: ttl, then field, value pairs. 1: made; 0: it exists.
NEW_REQUEST = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV, 2))
redis.call('EXPIRE', KEYS[1], ARGV[1])
return 1
"""

# KEYS: a request's hash. ARGV: status, time, response, error. Only a queued one changes.
FINISH_REQUEST = """
if redis.call('HGET', KEYS[1], 'status') ~= 'queued' then return 0 end
redis.call('HSET', KEYS[1], 'status', ARGV[1], 'completed_at', ARGV[2],
           'response', ARGV[3], 'error', ARGV[4])
return 1
"""

# KEYS: lock. ARGV: owner. Deletes the lock only if the owner holds it.
RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


@dataclass(frozen=True, slots=True)
class Line:
    """One recorded result: its file line and the usage it adds."""

    index: int
    ok: bool
    text: str
    usage: tuple[int, int, int, int, int] = (0, 0, 0, 0, 0)


@dataclass(frozen=True, slots=True)
class Recorded:
    """What ``record`` did: lines new (-1: the batch is gone or finalized), lines of the
    batch answered now, the batch's ``created_at``, and how many of the new lines are
    output (not error) lines."""

    new: int
    answered: int = 0
    created_at: int = 0
    new_ok: int = 0


class Store:
    def __init__(
        self,
        redis: Redis,
        moved: Callable[[str], None] | None = None,
        batch_retention: int = BATCH_RETENTION,
    ) -> None:
        self.redis = redis
        self.batch_retention = batch_retention  # seconds a finished batch is kept
        self._moved = moved  # told each status this store moved a batch to (metrics)
        self._transition = redis.register_script(TRANSITION)
        self._record = redis.register_script(RECORD)
        self._lease = redis.register_script(LEASE)
        self._release = redis.register_script(RELEASE)
        self._new_request = redis.register_script(NEW_REQUEST)
        self._finish_request = redis.register_script(FINISH_REQUEST)

    # ------------------------------------------------------------------ files

    async def put_file(self, record: Mapping[str, str | int]) -> None:
        file_id, tenant = str(record["id"]), str(record["tenant"])
        await self.redis.hset(keys.file_key(file_id), mapping=_fields(record))
        await self.redis.zadd(keys.files_index(tenant), {file_id: 0})
        await self.redis.hset(keys.tenant_stored(tenant), file_id, int(record["bytes"]))
        if "expires_at" in record:
            await self.expire_at("file", file_id, int(record["expires_at"]))

    async def file(self, tenant: str, file_id: str) -> dict[str, str] | None:
        """The file's record if it is ``tenant``'s (another tenant's is None, as absent)."""
        return await self._owned(keys.file_key(file_id), tenant)

    async def delete_file(self, tenant: str, file_id: str) -> None:
        await self.redis.zrem(keys.files_index(tenant), file_id)
        await self.redis.hdel(keys.tenant_stored(tenant), file_id)
        await self.redis.delete(keys.file_key(file_id))

    # ------------------------------------------------------------------ batches

    async def create_batch(self, record: Mapping[str, str | int], claims: Sequence[str]) -> str:
        """Keep a new batch, unless one of ``claims`` (idempotency keys) names a batch
        already: then that batch's id (this one is not kept)."""
        batch_id, tenant = str(record["id"]), str(record["tenant"])
        for claim in claims:  # SET NX, then GET: Redis 6.2 has no SET NX GET
            if not await self.redis.set(claim, batch_id, nx=True, ex=IDEMPOTENCY_TTL):
                held = await self.redis.get(claim)
                if held is not None and text(held) != batch_id:
                    return text(held)
        await self.redis.hset(keys.batch_key(batch_id), mapping=_fields(record))
        await self.redis.zadd(keys.batches_index(tenant), {batch_id: 0})
        await self.redis.zadd(keys.OPEN_BATCHES, {batch_id: int(record["created_at"])})
        return batch_id

    async def remember_body(self, claim: str, batch_id: str) -> None:
        """Let an SDK retry of the same body find ``batch_id`` for a while."""
        await self.redis.set(claim, batch_id, ex=RETRY_MATCH_TTL)

    async def claimed(self, claim: str) -> str | None:
        held = await self.redis.get(claim)
        return None if held is None else text(held)

    async def batch(self, batch_id: str) -> dict[str, str] | None:
        return _decoded(await self.redis.hgetall(keys.batch_key(batch_id))) or None

    async def batch_for(self, tenant: str, batch_id: str) -> dict[str, str] | None:
        return await self._owned(keys.batch_key(batch_id), tenant)

    async def update(self, batch_id: str, fields: Mapping[str, str | int]) -> None:
        await self.redis.hset(keys.batch_key(batch_id), mapping=_fields(fields))

    async def transition(self, batch_id: str, to: str, from_: Sequence[str], now: int) -> bool:
        moved = await self._transition(keys=[keys.batch_key(batch_id)], args=[to, now, *from_])
        if moved == 1 and self._moved is not None:
            self._moved(to)
        if moved == 1 and to in TERMINAL:
            await self.closed(batch_id)
            await self.expire_at("batch", batch_id, now + self.batch_retention)
        return bool(moved == 1)

    async def closed(self, batch_id: str) -> None:
        """The batch is terminal (or gone): off the open lists, its tenant's too."""
        tenant = await self.redis.hget(keys.batch_key(batch_id), "tenant")
        if tenant is not None:
            await self.redis.zrem(keys.tenant_open(text(tenant)), batch_id)
        await self.redis.zrem(keys.OPEN_BATCHES, batch_id)

    async def record(self, batch_id: str, lines: Sequence[Line]) -> Recorded:
        """Count and keep each line whose result is not recorded yet."""
        args: list[str | int] = []
        for line in lines:
            args += [line.index, "out" if line.ok else "err", line.text, *line.usage]
        reply = await self._record(
            keys=[keys.batch_key(batch_id), *(keys.batch_part(batch_id, p) for p in PARTS)],
            args=args,
        )
        if int(reply[0]) < 0:
            return Recorded(new=-1)
        return Recorded(int(reply[0]), int(reply[1]), int(reply[2]), int(reply[3]))

    async def done(self, batch_id: str, start: int, stop: int) -> list[bool]:
        """Whether each line in [start, stop) has its result recorded."""
        if stop <= start:
            return []
        first_byte, last_byte = start // 8, (stop - 1) // 8
        got = await self.redis.getrange(keys.batch_part(batch_id, "done"), first_byte, last_byte)
        raw = as_bytes(got).ljust(last_byte - first_byte + 1, b"\0")  # a shorter bitmap: unset bits
        bits, width = int.from_bytes(raw, "big"), len(raw) * 8
        first = first_byte * 8
        return [bool(bits >> (width - 1 - (i - first)) & 1) for i in range(start, stop)]

    async def custom_ids(self, batch_id: str, indexes: Sequence[int]) -> list[str | None]:
        """Each line's custom_id (None: unknown line, or the batch is gone)."""
        if not indexes:
            return []
        raw = await self.redis.hmget(keys.batch_part(batch_id, "ids"), list(indexes))
        return [None if v is None else text(v) for v in raw]

    async def lease(self, batch_id: str, owner: str) -> bool:
        return await self.hold(keys.batch_part(batch_id, "lease"), owner, LEASE_MS)

    async def hold(self, key: str, owner: str, ms: int) -> bool:
        """Take or extend the lock ``key`` for ``owner``; False while another holds it."""
        return bool(await self._lease(keys=[key], args=[owner, ms]) == 1)

    async def release(self, key: str, owner: str) -> None:
        await self._release(keys=[key], args=[owner])

    async def expire_at(self, kind: str, object_id: str, when: int) -> None:
        """Have the retention sweep delete the file or batch at ``when`` (Unix seconds)."""
        await self.redis.zadd(keys.EXPIRIES, {f"{kind}:{object_id}": when})

    async def due(self, now: float, limit: int) -> list[str]:
        """Members ``<kind>:<id>`` of the expiry schedule that are due."""
        return [
            text(m) for m in await self.redis.zrangebyscore(keys.EXPIRIES, "-inf", now, 0, limit)
        ]

    async def delete_batch(self, batch_id: str) -> None:
        record = await self.batch(batch_id)
        if record is not None:
            await self.redis.zrem(keys.batches_index(record["tenant"]), batch_id)
            await self.redis.zrem(keys.tenant_open(record["tenant"]), batch_id)
        parts = (keys.batch_part(batch_id, p) for p in (*PARTS, "ids", "lease"))
        await self.redis.delete(keys.batch_key(batch_id), *parts)

    async def open_batches(self, limit: int = 1000) -> list[str]:
        ids = await self.redis.zrange(keys.OPEN_BATCHES, 0, limit - 1)
        return [text(i) for i in ids]

    async def statuses(self, batch_ids: Sequence[str]) -> list[str]:
        """Each batch's status ('' when it is gone), in one pipelined round trip."""
        pipe = self.redis.pipeline(transaction=False)
        for batch_id in batch_ids:
            pipe.hget(keys.batch_key(batch_id), "status")
        return [text(s) if s is not None else "" for s in await pipe.execute()]

    # ------------------------------------------------------------------ requests

    async def new_request(
        self, tenant: str, request_id: str, record: Mapping[str, str | int], ttl: int
    ) -> bool:
        """Keep a new request's record for ``ttl`` s; False when the id exists already."""
        pairs = [x for item in record.items() for x in item]
        made = await self._new_request(
            keys=[keys.request_key(tenant, request_id)], args=[ttl, *pairs]
        )
        return bool(made == 1)

    async def request(self, tenant: str, request_id: str) -> dict[str, str] | None:
        return await self._owned(keys.request_key(tenant, request_id), tenant)

    async def finish_request(
        self,
        tenant: str,
        request_id: str,
        status: str,
        response: object,
        error: object,
    ) -> bool:
        """Record a queued request's outcome once (a later one changes nothing)."""
        args: list[str | int] = [status, int(time.time()), json.dumps(response), json.dumps(error)]
        done = await self._finish_request(keys=[keys.request_key(tenant, request_id)], args=args)
        return bool(done == 1)

    # ------------------------------------------------------------------ listing

    async def page(
        self, index: str, after: str | None, limit: int, order: str = "desc"
    ) -> tuple[list[str], bool]:
        """Up to ``limit`` ids after the cursor id (byte order = creation order), and
        whether more follow."""
        if order == "asc":
            start, stop = (f"({after}" if after else "-"), "+"
        else:
            start, stop = (f"({after}" if after else "+"), "-"
        raw = await self.redis.zrange(
            index, start, stop, bylex=True, desc=order != "asc", offset=0, num=limit + 1
        )
        ids = [text(i) for i in raw]
        return ids[:limit], len(ids) > limit

    async def _owned(self, key: str, tenant: str) -> dict[str, str] | None:
        record = _decoded(await self.redis.hgetall(key))
        return record if record and record.get("tenant") == tenant else None


PARTS = ("done", "out", "err", "seq")


def _decoded(raw: Mapping[Any, Any]) -> dict[str, str]:
    return {text(k): text(v) for k, v in raw.items()}


def text(value: object) -> str:
    """A Redis reply as text (replies are bytes: the client does not decode)."""
    return value.decode() if isinstance(value, bytes) else str(value)


def as_bytes(value: bytes | str) -> bytes:
    return value.encode() if isinstance(value, str) else value


def _fields(record: Mapping[str, str | int]) -> dict[Any, Any]:
    return dict(record)


def loads(text: str | None, default: Any) -> Any:
    """A JSON field of a record (``default`` when absent)."""
    return default if not text else json.loads(text)


def as_int(record: Mapping[str, str], name: str) -> int:
    return int(record.get(name) or 0)
