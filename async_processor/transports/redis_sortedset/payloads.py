"""Payloads stored apart from their envelope (upstream's payload keys, llm-d-async
#455-#458): a request whose routing has ``payload_ref`` carries no ``data.payload``; its
body is the STRING key ``request-payload:<id>:<request_token>``, written by the producer
with the envelope (``WithPayloadKeys()``; ``SortedSetClient(payload_keys=True)`` here).

Stage: broker I/O for the poller, between the queue gate and the pool's lane. Input: the
deliveries of one fetch that their queue gate let through (a refused, cancelled or
expired message never reads its payload). Output: each one's payload, the stored bytes
verbatim (empty: ``null``), read in one MGET (cluster mode: one per slot, in one
pipeline), or the result a message ends with: ``PAYLOAD_UNAVAILABLE`` when the key is
missing (expired, evicted, never written), ``INVALID_REQUEST`` when the stored body is
over ``--max-message-bytes`` or not a JSON object. The key is deleted with the result's
write (``lua/complete.lua``; cluster mode: a DEL after it, ``writes``); a retry
re-writes only the envelope, the key stays until the result.

The key is always derived from the id and the token, never taken from ``payload_ref``:
a message must not make the daemon read, or with its result delete, a key it names.
"""

from __future__ import annotations

from collections.abc import Sequence

from redis.asyncio import Redis

from async_processor.config.redis import slot
from async_processor.messages import ErrorCode, Result, too_large
from async_processor.redis import keys
from async_processor.redis.conn import redis_errors
from async_processor.redis.keyspace import KeySpace
from async_processor.transports.base import Delivery, TransportContext
from async_processor.transports.redis_sortedset.claims import token_of

PAYLOAD_MISSING_TEXT = "request payload is missing"
NOT_AN_OBJECT_TEXT = "payload must be a JSON object"


def payload_key(delivery: Delivery) -> str | None:
    """The key holding this delivery's payload, or None when the payload is inline."""
    envelope = delivery.envelope
    if envelope is None or not envelope.routing.payload_ref:
        return None
    return keys.payload_key(envelope.id, token_of(delivery))


class StoredPayloads:
    """The payload half of ``SortedSetTransport`` (``transports.base.LoadsPayloads``)."""

    _redis: Redis
    _keys: KeySpace
    _ctx: TransportContext

    def stored_apart(self, delivery: Delivery) -> bool:
        return payload_key(delivery) is not None

    async def load_payloads(self, deliveries: Sequence[Delivery]) -> list[Result | None]:
        """Per delivery: None once its stored payload is in its request, else the result
        it ends with. One round trip for all (raises ``TransportError``)."""
        names = [payload_key(d) or "" for d in deliveries]
        values = await self._read(names)
        return [self._take(d, v) for d, v in zip(deliveries, values, strict=True)]

    async def _read(self, names: list[str]) -> list[bytes | None]:
        with redis_errors("payload fetch"):
            if not self._keys.cluster:
                return [_bytes(v) for v in await self._redis.mget(names)]
            by_slot: dict[int, list[int]] = {}
            for index, name in enumerate(names):
                by_slot.setdefault(slot(name), []).append(index)
            async with self._redis.pipeline(transaction=False) as pipe:
                for indexes in by_slot.values():
                    # A cluster pipeline refuses mget(); one slot's MGET as a command.
                    pipe.execute_command("MGET", *[names[i] for i in indexes])
                replies = await pipe.execute()
        values: list[bytes | None] = [None] * len(names)
        for indexes, reply in zip(by_slot.values(), replies, strict=True):
            for index, value in zip(indexes, reply, strict=True):
                values[index] = _bytes(value)
        return values

    def _take(self, delivery: Delivery, value: bytes | None) -> Result | None:
        assert delivery.envelope is not None  # payload_key() was not None
        request = delivery.envelope.request
        if value is None:
            return Result.failure(request.id, ErrorCode.PAYLOAD_UNAVAILABLE, PAYLOAD_MISSING_TEXT)
        limit = self._ctx.max_message_bytes
        if len(value) > limit:
            refusal = str(too_large(len(value), limit, request.id))
            return Result.failure(request.id, ErrorCode.INVALID_REQUEST, "payload: " + refusal)
        if value.lstrip()[:1] not in (b"{", b"n", b""):
            return Result.failure(request.id, ErrorCode.INVALID_REQUEST, NOT_AN_OBJECT_TEXT)
        request.payload = value if value.strip() else b"null"
        return None


def _bytes(value: bytes | str | None) -> bytes | None:
    """A reply as bytes (the transport's client does not decode; a test's might)."""
    return value.encode() if isinstance(value, str) else value
