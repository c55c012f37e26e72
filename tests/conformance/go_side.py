"""Upstream's producer and result reader (llm-d-async main, after v0.10.0), as Python that
writes and reads the bytes the Go code does: the conformance suite's other side.

Written from shared/reference/upstream-v0.10.md (§2 result claims, §3 routing, §4 payload
keys, §5 submission order, §6 cluster names) and from reading upstream's producer, its
result-delivery scripts and its envelope types; no Go toolchain, no copied code. What
this side does, as the Go side does it:

- ``go_envelope``: an envelope as ``encoding/json`` lays it out: struct field order,
  ``omitempty``, map keys sorted, strings with Go's escapes (``<``, ``>``, ``&``,
  U+2028/U+2029 as ``\\u`` escapes), an inline payload compacted with the same escapes
  (``json.RawMessage`` goes through Go's ``compact``), and the placeholder
  ``"enqueue_seq":-1`` the producer splices its counter into. The routing fields' order
  is upstream's ``InternalRouting`` up to ``transport_correlation_id``; where
  ``enqueue_seq`` and ``payload_ref`` sit after it is our reading (JSON order does not
  change what a reader sees; the bytes around them are what a re-writer must keep).
- ``GoProducer.submit``: one atomic step (standalone): ``INCR request-seq:<Q>:<deadline>``,
  ``EXPIREAT`` deadline + 1 h, ``DEL request-cancel:<id>``, ``SET request-active:<id>
  <token> PX <ms to deadline>``, ``ZADD Q`` with ``%.17g`` of ``deadline + min(n, 2^21-1)
  / 2^21`` and the counter spliced in, the payload key ``SET ... PX`` (time to deadline
  + 10 min) with ``WithPayloadKeys()``. Cluster: markers and payload pipelined first,
  then counter ``request-seq:{Q}:<deadline>`` + ``ZADD`` in one script on Q's slot.
  Tokens are 32 hex characters (16 random bytes).
- ``GoProducer.cancel``: ``GET request-active:<id>``, then ``SET request-cancel:<id>
  <token> EX 7d`` (two commands, as upstream's cluster-era code).
- ``GoResultReader``: ``ReceiveResult`` / ``RenewResult`` / ``AckResult`` over
  ``R:result-claimed``, ``R:result-claim-owners``, ``R:result-claims-idx`` (ms from Redis
  ``TIME``) and ``R:result-ack-tombstones``; duplicates of an acked or claimed
  (id, request_token) are dropped, an entry that is not a result is claimed under the
  unparsable key and reported. ``get_result`` is the legacy ``BRPOP``.
- ``go_parse_result``: what ``json.Unmarshal`` into upstream's result type accepts (a
  field of the wrong JSON type fails the whole result).
"""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

import anyio
from redis.asyncio import Redis

SEQ_PLACEHOLDER = b'"enqueue_seq":-1'
CANCEL_TTL_SECONDS = 7 * 24 * 3600
SEQ_GRACE_SECONDS = 3600
PAYLOAD_GRACE_MS = 600_000
RESULT_LEASE_MS = 300_000
TOMBSTONE_TTL_MS = 7 * 24 * 3600 * 1000
SCAN_LIMIT = 100  # receive: expired claims moved back, tombstones purged, entries scanned
UNPARSABLE = "\x00unparsable-result\x00"

_HTML_ESCAPES = {b"<": b"\\u003c", b">": b"\\u003e", b"&": b"\\u0026"}
_LINE_SEPARATORS = {"\u2028".encode(): b"\\u2028", "\u2029".encode(): b"\\u2029"}
# Go 1.22+ writes \b and \f short too.
_SHORT = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t", "\b": "\\b", "\f": "\\f"}


def go_string(text: str) -> bytes:
    """A string as Go's ``encoding/json`` writes it (HTML-safe escaping on)."""
    out = []
    for char in text:
        if char in _SHORT:
            out.append(_SHORT[char])
        elif ord(char) < 0x20 or char in "<>&\u2028\u2029":
            out.append(f"\\u{ord(char):04x}")
        else:
            out.append(char)
    return b'"' + "".join(out).encode() + b'"'


def go_compact(raw: bytes) -> bytes:
    """``json.RawMessage`` as ``json.Marshal`` embeds it: whitespace outside strings
    dropped, ``<``, ``>``, ``&`` and U+2028/U+2029 inside strings escaped, number and
    escape texts kept as they are."""
    out = bytearray()
    in_string = escaped = False
    i = 0
    while i < len(raw):
        byte = raw[i : i + 1]
        line_sep = raw[i : i + 3]
        if in_string and line_sep in _LINE_SEPARATORS:
            out += _LINE_SEPARATORS[line_sep]
            i += 3
            continue
        if in_string:
            was_escaped = escaped
            out += byte if was_escaped else _HTML_ESCAPES.get(byte, byte)
            escaped = not was_escaped and byte == b"\\"
            in_string = was_escaped or byte != b'"'
        elif byte not in b" \t\r\n":
            out += byte
            in_string = byte == b'"'
        i += 1
    return bytes(out)


def _go_map(values: dict[str, str]) -> bytes:
    """A ``map[string]string``: keys sorted, as Go marshals maps."""
    items = [go_string(k) + b":" + go_string(values[k]) for k in sorted(values)]
    return b"{" + b",".join(items) + b"}"


@dataclass
class GoRequest:
    """upstream's ``RedisRequest``: ``RequestMessage`` then its two queue overrides."""

    id: str
    deadline: int
    payload: bytes | None = b'{"model":"m","prompt":"hi"}'
    created: int = 0
    metadata: dict[str, str] = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)
    endpoint: str = ""
    model: str = ""

    def data(self, *, with_payload: bool) -> bytes:
        parts = [
            b'"id":' + go_string(self.id),
            b'"created":%d' % self.created,
            b'"deadline":%d' % self.deadline,
        ]
        if with_payload:  # RawMessage without omitempty: nil is written as null
            parts.append(b'"payload":' + (go_compact(self.payload) if self.payload else b"null"))
        if self.metadata:
            parts.append(b'"metadata":' + _go_map(self.metadata))
        if self.headers:
            parts.append(b'"headers":' + _go_map(self.headers))
        if self.endpoint:
            parts.append(b'"endpoint":' + go_string(self.endpoint))
        if self.model:
            parts.append(b'"model":' + go_string(self.model))
        return b"{" + b",".join(parts) + b"}"


@dataclass
class GoRouting:
    """upstream's ``InternalRouting`` (every field ``omitempty``)."""

    request_token: str = ""
    request_queue_name: str = ""
    result_queue_name: str = ""
    retry_count: int = 0
    queue_id: str = ""
    result_ttl_seconds: int = 0
    result_routing_resolved: bool = False
    transport_correlation_id: str = ""
    enqueue_seq: int = 0  # -1: the producer's placeholder
    payload_ref: str = ""
    labels: dict[str, str] = field(default_factory=dict)

    def encode(self) -> bytes:
        parts = []
        if self.retry_count:
            parts.append(b'"retry_count":%d' % self.retry_count)
        for name in ("queue_id", "request_token", "request_queue_name", "result_queue_name"):
            if value := getattr(self, name):
                parts.append(b'"%s":%s' % (name.encode(), go_string(value)))
        if self.result_ttl_seconds:
            parts.append(b'"result_ttl_seconds":%d' % self.result_ttl_seconds)
        if self.result_routing_resolved:
            parts.append(b'"result_routing_resolved":true')
        if self.transport_correlation_id:
            parts.append(b'"transport_correlation_id":' + go_string(self.transport_correlation_id))
        if self.enqueue_seq:
            parts.append(b'"enqueue_seq":%d' % self.enqueue_seq)
        if self.payload_ref:
            parts.append(b'"payload_ref":' + go_string(self.payload_ref))
        if self.labels:
            parts.append(b'"labels":' + _go_map(self.labels))
        return b"{" + b",".join(parts) + b"}"


def go_envelope(routing: GoRouting, request: GoRequest, *, with_payload: bool = True) -> bytes:
    """The tagged envelope: ``internal``, ``request_kind``, ``data`` (a ``RedisRequest``)."""
    return (
        b'{"internal":' + routing.encode() + b',"request_kind":"redis","data":'
        + request.data(with_payload=with_payload) + b"}"
    )  # fmt: skip


def go_score(deadline: int, seq: int) -> float:
    """§5: ``deadline + min(seq, 2^21 - 1) / 2^21``; unstamped (seq <= 0): the deadline."""
    return deadline + min(seq, 2097151) / 2097152 if seq > 0 else float(deadline)


def new_token(nbytes: int = 16) -> str:
    return secrets.token_hex(nbytes)


def slot_key(name: str, cluster: bool) -> str:
    """§6: a private key's stem: the shared key hash-tagged in cluster mode (unless it
    already has a non-empty ``{…}`` tag), else the key itself."""
    start = name.find("{")
    tagged = start >= 0 and name.find("}", start + 2) > start + 1
    return name if not cluster or tagged else "{" + name + "}"


# KEYS: counter, cancel marker, active marker, queue[, payload key]
# ARGV: token, active ms, counter expiry (Unix s), envelope head, envelope tail, deadline
#       [, payload, payload ms]
_SUBMIT = """
local n = redis.call('INCR', KEYS[1])
redis.call('EXPIREAT', KEYS[1], tonumber(ARGV[3]))
redis.call('DEL', KEYS[2])
redis.call('SET', KEYS[3], ARGV[1], 'PX', tonumber(ARGV[2]))
local fraction = math.min(n, 2097151) / 2097152
redis.call('ZADD', KEYS[4], string.format('%.17g', tonumber(ARGV[6]) + fraction),
  ARGV[4] .. n .. ARGV[5])
if #KEYS == 5 then
  redis.call('SET', KEYS[5], ARGV[7], 'PX', tonumber(ARGV[8]))
end
return n
"""
# Cluster mode: KEYS counter, queue; ARGV counter expiry, head, tail, deadline.
_ENQUEUE = """
local n = redis.call('INCR', KEYS[1])
redis.call('EXPIREAT', KEYS[1], tonumber(ARGV[1]))
local fraction = math.min(n, 2097151) / 2097152
redis.call('ZADD', KEYS[2], string.format('%.17g', tonumber(ARGV[4]) + fraction),
  ARGV[2] .. n .. ARGV[3])
return n
"""


@dataclass
class Submitted:
    token: str
    member: bytes  # as queued (the counter spliced in)
    seq: int


class GoProducer:
    """``RedisSortedSetProducer``: ``SubmitRequest`` and ``CancelRequests``."""

    def __init__(
        self,
        redis: Redis,
        queue: str,
        result_queue: str,
        *,
        payload_keys: bool = False,
        cluster: bool = False,
    ) -> None:
        self.redis, self.queue, self.result_queue = redis, queue, result_queue
        self.payload_keys, self.cluster = payload_keys, cluster
        self._submit = redis.register_script(_SUBMIT)
        self._enqueue = redis.register_script(_ENQUEUE)

    async def submit(self, request: GoRequest) -> Submitted:
        token = new_token()
        routing = GoRouting(
            request_token=token,
            request_queue_name=self.queue,
            result_queue_name=self.result_queue,
            enqueue_seq=-1,
        )
        if self.payload_keys:
            routing.payload_ref = f"request-payload:{request.id}:{token}"
        envelope = go_envelope(routing, request, with_payload=not self.payload_keys)
        at = envelope.index(SEQ_PLACEHOLDER) + len(b'"enqueue_seq":')
        head, tail = envelope[:at], envelope[at + 2 :]
        active_ms = max(1, int((request.deadline - time.time()) * 1000))
        seq_key = f"request-seq:{slot_key(self.queue, self.cluster)}:{request.deadline}"
        expire_at = request.deadline + SEQ_GRACE_SECONDS
        payload = request.payload if request.payload is not None else b"null"
        if self.cluster:
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.delete(f"request-cancel:{request.id}")
                pipe.set(f"request-active:{request.id}", token, px=active_ms)
                if routing.payload_ref:
                    pipe.set(routing.payload_ref, payload, px=active_ms + PAYLOAD_GRACE_MS)
                await pipe.execute()
            args: list[Any] = [expire_at, head, tail, request.deadline]
            seq = await self._enqueue(keys=[seq_key, self.queue], args=args)
        else:
            keys = [seq_key, f"request-cancel:{request.id}", f"request-active:{request.id}"]
            keys.append(self.queue)
            args = [token, active_ms, expire_at, head, tail, request.deadline]
            if routing.payload_ref:
                keys.append(routing.payload_ref)
                args += [payload, active_ms + PAYLOAD_GRACE_MS]
            seq = await self._submit(keys=keys, args=args)
        return Submitted(token, head + str(seq).encode() + tail, int(seq))

    async def cancel(self, *ids: str) -> None:
        for request_id in ids:
            active = await self.redis.get(f"request-active:{request_id}")
            if active is not None:
                await self.redis.set(f"request-cancel:{request_id}", active, ex=CANCEL_TTL_SECONDS)


# ------------------------------------------------------------------ the result reader

# KEYS: list, claimed, owners, idx, tombstones. ARGV: owner, lease ms, limit.
# Returns {} (nothing pending), {0} (only duplicates scanned), {1, result, claim key} or
# {-1, entry, claim key} (not a result: claimed under the unparsable key).
_RECEIVE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local limit = tonumber(ARGV[3])
local lapsed = redis.call('ZRANGEBYSCORE', KEYS[4], '-inf', now, 'LIMIT', 0, limit)
for i = #lapsed, 1, -1 do
  local held = redis.call('HGET', KEYS[2], lapsed[i])
  if held then redis.call('RPUSH', KEYS[1], held) end
  redis.call('HDEL', KEYS[2], lapsed[i])
  redis.call('HDEL', KEYS[3], lapsed[i])
  redis.call('ZREM', KEYS[4], lapsed[i])
end
local stale = redis.call('ZRANGEBYSCORE', KEYS[5], '-inf', now, 'LIMIT', 0, limit)
for _, key in ipairs(stale) do redis.call('ZREM', KEYS[5], key) end
local function take(entry, key)
  redis.call('RPOP', KEYS[1])
  redis.call('HSET', KEYS[2], key, entry)
  redis.call('HSET', KEYS[3], key, ARGV[1])
  redis.call('ZADD', KEYS[4], now + tonumber(ARGV[2]), key)
end
local n = math.min(redis.call('LLEN', KEYS[1]), limit)
if n == 0 then return {} end
for _ = 1, n do
  local entry = redis.call('LINDEX', KEYS[1], -1)
  local ok, obj = pcall(cjson.decode, entry)
  local valid = ok and type(obj) == 'table' and type(obj['id']) == 'string' and obj['id'] ~= ''
  local token = ''
  if valid and obj['request_token'] ~= nil then
    token = obj['request_token']
    valid = type(token) == 'string'
  end
  if not valid then
    local key = string.char(0) .. 'unparsable-result' .. string.char(0) .. ARGV[1]
    take(entry, key)
    return {-1, entry, key}
  end
  local key = obj['id']
  if token ~= '' then key = key .. string.char(0) .. token end
  local until_ms = redis.call('ZSCORE', KEYS[5], key)
  if until_ms and tonumber(until_ms) <= now then
    redis.call('ZREM', KEYS[5], key)
    until_ms = nil
  end
  if until_ms or redis.call('HEXISTS', KEYS[3], key) == 1 then
    redis.call('RPOP', KEYS[1])
  else
    take(entry, key)
    return {1, entry, key}
  end
end
return {0}
"""
# KEYS: claimed, owners, idx, tombstones. ARGV: key, owner, tombstone ms.
# 1 acked, 2 already acked (tombstone), 0 ownership lost.
_ACK = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local owner = redis.call('HGET', KEYS[2], ARGV[1])
local expiry = redis.call('ZSCORE', KEYS[3], ARGV[1])
if owner and ARGV[2] ~= '' and owner == ARGV[2] and expiry and tonumber(expiry) > now then
  redis.call('HDEL', KEYS[1], ARGV[1])
  redis.call('HDEL', KEYS[2], ARGV[1])
  redis.call('ZREM', KEYS[3], ARGV[1])
  redis.call('ZADD', KEYS[4], now + tonumber(ARGV[3]), ARGV[1])
  redis.call('PEXPIRE', KEYS[4], tonumber(ARGV[3]))
  return 1
end
local tomb = redis.call('ZSCORE', KEYS[4], ARGV[1])
if tomb and tonumber(tomb) > now then return 2 end
return 0
"""


class UnparsableResult(Exception):
    """``ErrUnparsableResult``: the entry stays claimed and comes back after its lease."""


class OwnershipLost(Exception):
    """``ErrResultDeliveryOwnershipLost``."""


@dataclass
class Delivery:
    result: dict[str, Any]
    raw: bytes
    claim_key: str
    owner: str


class GoResultReader:
    """``ReceiveResult`` / ``AckResult`` on one result route (§2)."""

    def __init__(
        self,
        redis: Redis,
        route: str,
        *,
        cluster: bool = False,
        lease_ms: int = RESULT_LEASE_MS,
        reclaim_interval: float = 0.05,
    ) -> None:
        self.redis, self.route = redis, route
        stem = slot_key(route, cluster)
        self.keys = [route] + [
            f"{stem}:{suffix}"
            for suffix in ("result-claimed", "result-claim-owners", "result-claims-idx")
        ]
        self.tombstones = f"{stem}:result-ack-tombstones"
        self.lease_ms, self.reclaim_interval = lease_ms, reclaim_interval
        self._receive = redis.register_script(_RECEIVE)
        self._ack = redis.register_script(_ACK)

    async def receive(self, timeout: float = 15.0) -> Delivery:
        """The oldest result, claimed by a fresh owner (raises TimeoutError, or
        UnparsableResult for an entry that is not a result)."""
        owner = new_token()
        with anyio.fail_after(timeout):
            while True:
                reply = await self._receive(
                    keys=[*self.keys, self.tombstones], args=[owner, self.lease_ms, SCAN_LIMIT]
                )
                if reply and int(reply[0]) == -1:
                    raise UnparsableResult(bytes(reply[1]).decode("utf-8", "replace"))
                if reply and int(reply[0]) == 1:
                    raw = bytes(reply[1])
                    key = bytes(reply[2]).decode("utf-8", "surrogateescape")
                    return Delivery(go_parse_result(raw), raw, key, owner)
                if not reply:  # nothing pending: wait a reclaim interval
                    await anyio.sleep(self.reclaim_interval)

    async def ack(self, delivery: Delivery) -> int:
        reply = await self._ack(
            keys=[*self.keys[1:], self.tombstones],
            args=[delivery.claim_key, delivery.owner, TOMBSTONE_TTL_MS],
        )
        if int(reply) == 0:
            raise OwnershipLost(delivery.claim_key)
        return int(reply)

    async def receive_all(self, n: int, timeout: float = 20.0) -> dict[str, dict[str, Any]]:
        """``n`` results received and acked, by id (a second result for an id fails)."""
        out: dict[str, dict[str, Any]] = {}
        with anyio.fail_after(timeout):
            while len(out) < n:
                delivery = await self.receive(timeout)
                await self.ack(delivery)
                assert delivery.result["id"] not in out, f"second result: {delivery.result}"
                out[delivery.result["id"]] = delivery.result
        return out


_RESULT_FIELDS: dict[str, type] = {
    "id": str,
    "status_code": int,
    "payload": str,
    "error_code": str,
    "error_message": str,
    "request_token": str,
}


def go_parse_result(raw: bytes) -> dict[str, Any]:
    """A result as upstream's ``parseInternalResult`` reads it: each known field must
    have its Go type (null: the zero value), ``id`` must be non-empty; unknown fields
    are ignored. Returns the known fields with Go's zero values filled in."""
    obj = json.loads(raw)
    if not isinstance(obj, dict):
        raise UnparsableResult("not an object")
    out: dict[str, Any] = {}
    for name, kind in _RESULT_FIELDS.items():
        value = obj.get(name)
        if value is None:
            out[name] = kind()
            continue
        if not isinstance(value, kind) or isinstance(value, bool):
            raise UnparsableResult(f"{name}: cannot unmarshal {type(value).__name__}")
        out[name] = value
    if not out["id"]:
        raise UnparsableResult("result missing 'id' field")
    return out
