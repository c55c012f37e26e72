"""Client library for the redis-sortedset transport: submit, cancel, read results.

Stage: the producer/consumer side (used by ``submit``/``results``, the demo, tests and
users). Input: request objects (a dict or ``messages.Request``). Output: envelopes on the
request sorted set (score = deadline, plus upstream's ``enqueue_seq`` fraction that keeps
equal deadlines in submission order, shared with Go producers), cancellation markers,
and ``messages.Result`` objects read from the result list. It connects like the daemon
(``redis.conn``: standalone, sentinel, TLS, ACL users). Behaves like the Go producer:
each submission gets a fresh 32-hex ``request_token``; ``request-active:<id>`` holds it
until the deadline; ``cancel`` copies it to ``request-cancel:<id>`` for 7 days: the token
of the queue's own live submission (its ``<queue>:live:<id>``), so a cancel for one queue
never reaches the same id on another (docs/transports.md). With ``payload_keys`` each
payload goes in its own key, as upstream's ``WithPayloadKeys()``.

Reading results loses none: each is moved (``BLMOVE``, Redis >= 6.2) into this consumer's
processing list ``<result list>:processing:<consumer>``. ``results()`` removes it from
there only when the caller asks for the next one (or calls ``ack``, or leaves the client's
``async with`` without an error): a consumer killed while handling a result gets it again
when it restarts with the same ``consumer`` name (at-least-once). ``drain_results`` does
the same for a batch: the results it returned are removed at the next read of that list
(or ``ack``, or the clean exit), and whatever a crash left in the processing list comes
back first. A move whose reply was lost (the connection
dropped, redis-py sent the command again) leaves its result there, and the next read
returns it first. An entry that is not a result is returned as an ``UndecodableResult``
(its raw bytes), not dropped.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, cast

from redis.asyncio import Redis
from redis.asyncio.client import Pipeline

from async_processor.client.cluster import PAYLOAD_GRACE_MS, cancel_apart, write_apart
from async_processor.client.submission import as_request, new_token
from async_processor.config.redis import RedisConnection, cluster_problem
from async_processor.messages import Envelope, Request, Result, Routing
from async_processor.redis import keys
from async_processor.redis.conn import connect, redis_errors
from async_processor.redis.keyspace import KeySpace
from async_processor.routing import SEQ_DEADLINE_LIMIT

SUBMIT_CHUNK = 500  # submissions per MULTI/EXEC in submit_many


@dataclass(frozen=True, slots=True)
class Submitted:
    """One submission's outcome: its token, and whether it was queued (False: the id was
    already live, and ``token`` is that live submission's)."""

    token: str
    queued: bool


@dataclass(slots=True)
class UndecodableResult(Result):
    """A result-list entry that is not a result: its bytes as popped, and why."""

    raw: bytes = b""
    error: str = ""


class SortedSetClient:
    """Producer and result consumer over one Redis connection pool.

    ``redis`` is a URL (standalone) or a ``RedisConnection`` (any mode, TLS files). In
    cluster mode the markers carry the queue's hash tag (``redis.keyspace``), so
    ``cancel`` needs the queue, and a result list outside the queue's slot is refused.
    """

    def __init__(
        self,
        redis: str | RedisConnection,
        request_queue: str = keys.DEFAULT_REQUEST_QUEUE,
        result_queue: str = keys.DEFAULT_RESULT_LIST,
        *,
        consumer: str = "",
        payload_keys: bool = False,
    ) -> None:
        self.request_queue = request_queue
        # Off by default, as upstream: only once every consumer reads payload_ref.
        self.payload_keys = payload_keys
        self.result_queue = result_queue
        # Names this reader's processing lists; give a stable one to resume after a crash.
        self.consumer = consumer or secrets.token_hex(8)
        # No socket timeout: BRPOP blocks for as long as the caller asked.
        conn = RedisConnection(url=redis) if isinstance(redis, str) else redis
        self._redis: Redis = connect(conn.check(), socket_timeout=None)
        self._keys = KeySpace(cluster=conn.mode == "cluster")
        scripts = self._keys.scripts(self._redis)
        self._cancel, self._submit = scripts["cancel"], scripts["submit"]
        # Per processing list: the oldest entry it held after our last removal (None:
        # none). A list not here is unknown: the next read looks first.
        self._leftover: dict[str, bytes | None] = {}
        # Per processing list: the entries handed over last, not yet removed.
        self._unacked: dict[str, list[bytes]] = {}

    async def __aenter__(self) -> SortedSetClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            if exc_type is None:  # handled: what results() handed over last is done
                await self.ack()
        finally:
            await self.aclose()

    async def aclose(self) -> None:
        await self._redis.aclose()

    # ------------------------------------------------------------------ producing

    async def submit(
        self,
        request: dict[str, Any] | Request,
        *,
        queue: str | None = None,
        result_queue: str | None = None,
    ) -> str:
        """Enqueue one request; returns its token (raises ValueError if it is invalid)."""
        tokens = await self.submit_many([request], queue=queue, result_queue=result_queue)
        return tokens[0]

    async def submit_many(
        self,
        requests: Iterable[dict[str, Any] | Request],
        *,
        queue: str | None = None,
        result_queue: str | None = None,
    ) -> list[str]:
        """Enqueue many requests; returns the tokens (for an id already live, that
        submission's token: see ``submit_each``)."""
        done = await self.submit_each(requests, queue=queue, result_queue=result_queue)
        return [s.token for s in done]

    async def submit_each(
        self,
        requests: Iterable[dict[str, Any] | Request],
        *,
        queue: str | None = None,
        result_queue: str | None = None,
    ) -> list[Submitted]:
        """Enqueue many requests, one MULTI/EXEC round trip per chunk. An id that is
        already queued, in flight or retrying is not queued again (``queued=False``, with
        the live submission's token); once its result is written, it may be submitted anew."""
        target = queue or self.request_queue
        results_to = result_queue or self.result_queue
        if self._keys.cluster and (problem := cluster_problem(target, results_to)):
            raise ValueError(problem)
        done: list[Submitted] = []
        batch = [as_request(r) for r in requests]
        for start in range(0, len(batch), SUBMIT_CHUNK):
            chunk = [(request, new_token()) for request in batch[start : start + SUBMIT_CHUNK]]
            with redis_errors("submit"):
                if self._keys.cluster:
                    await write_apart(self._redis, chunk, payload_keys=self.payload_keys)
                async with self._redis.pipeline(transaction=True) as pipe:
                    for request, token in chunk:
                        await self._queue_submit(pipe, request, token, target, results_to)
                    replies = await pipe.execute()
            done += [Submitted(token.decode(), bool(queued)) for queued, token in replies]
        return done

    async def _queue_submit(
        self, pipe: Pipeline, request: Request, token: str, queue: str, result_queue: str
    ) -> None:
        """The reference producer's three commands for one request, as one script added to
        ``pipe``: it queues nothing while the id is live, and its score orders equal
        deadlines by submission (``lua/submit.lua``)."""
        envelope = Envelope(
            request=request,
            routing=Routing(
                request_token=token,
                request_queue_name=queue,
                result_queue_name=result_queue,
                # The placeholder lua/submit.lua replaces with the submission's order.
                enqueue_seq=-1 if request.deadline < SEQ_DEADLINE_LIMIT else 0,
            ),
            kind="redis",
        )
        ttl = max(1, request.deadline - int(time.time()))
        live, seq = self._keys.live(queue, request.id), self._keys.sequence(queue, request.deadline)
        script_keys = [queue, self._keys.active(queue, request.id), seq, live]
        args: list[bytes | int | str] = [b"", request.deadline, token, ttl]  # b"": below
        args += [ttl + keys.LIVE_GRACE_SECONDS, request.deadline + keys.SEQUENCE_GRACE_SECONDS]
        if self.payload_keys:  # the envelope goes without it (Envelope.encode)
            envelope.routing.payload_ref = keys.payload_key(request.id, token)
        if self.payload_keys and not self._keys.cluster:  # cluster mode: written apart
            script_keys.append(envelope.routing.payload_ref)
            args += [bytes(request.payload), ttl * 1000 + PAYLOAD_GRACE_MS]
        args[0] = envelope.encode()
        await self._submit(keys=script_keys, args=args, client=pipe)

    async def cancel(self, ids: Iterable[str], *, queue: str | None = None) -> int:
        """Mark ``queue``'s submissions of ``ids`` cancelled (idempotent); returns how many
        were still active. An id not live on ``queue`` through this library falls back to
        ``request-active:<id>`` (a producer writing around the library), unless that holds
        a library-made token: another queue's submission (``lua/cancel.lua``)."""
        target = queue or self.request_queue
        id_list = list(ids)
        if not id_list:
            return 0
        with redis_errors("cancel"):
            async with self._redis.pipeline(transaction=False) as pipe:
                for request_id in id_list:
                    await self._cancel(
                        keys=[
                            self._keys.active(target, request_id),
                            self._keys.cancel(target, request_id),
                            self._keys.live(target, request_id),
                        ],
                        args=[keys.CANCEL_TTL_SECONDS],
                        client=pipe,
                    )
                marked = await pipe.execute()
            if self._keys.cluster:
                await cancel_apart(self._redis, id_list, marked)
        return sum(1 for m in marked if m)

    # ------------------------------------------------------------------ consuming

    async def results(
        self,
        *,
        timeout: float | None = None,
        result_queue: str | None = None,
    ) -> AsyncIterator[Result]:
        """Results in arrival order; ends after ``timeout`` s with none (None = never ends).
        Each stays in the processing list until the next is asked for (or ``ack``)."""
        while (result := await self._pop(result_queue, timeout)) is not None:
            yield result

    async def ack(self) -> None:
        """Remove what ``results()`` or ``drain_results`` handed over last (the next read
        of the same list does it otherwise)."""
        with redis_errors("result ack"):
            for processing in list(self._unacked):
                await self._remove(processing, self._unacked[processing])

    async def drain_results(
        self,
        n: int,
        timeout: float,
        *,
        result_queue: str | None = None,
    ) -> list[Result]:
        """Up to ``n`` results, waiting at most ``timeout`` s in total. They stay in the
        processing list until the next read of this list (``drain_results`` or
        ``results()``), ``ack`` or a clean exit, as with ``results()``.

        One round trip to remove the last batch and look at what a crash left in the
        processing list (returned first, oldest first; one more look per such entry),
        then one ``BLMOVE`` per result.
        """
        source = result_queue or self.result_queue
        processing = processing_key(source, self.consumer)
        give_up = time.monotonic() + timeout
        with redis_errors("result read"):
            raws: list[bytes] = []
            left = await self._remove(processing, self._unacked.get(processing, []))
            while left is not None and len(raws) < n:  # what a crash left: rare, a look each
                raws.append(left)
                left = await self._oldest(processing, len(raws) + 1)
            self._leftover.pop(processing, None)  # what we now hold is in the list
            while len(raws) < n and (remaining := give_up - time.monotonic()) > 0:
                moved = await self._move(source, processing, max(remaining, 0.01))
                if moved is None:  # one whose reply was lost is returned by the next read
                    break
                raws.append(moved)
        if raws:
            self._unacked[processing] = raws
        return [_decoded(raw) for raw in raws]

    async def _pop(self, result_queue: str | None, wait: float | None) -> Result | None:
        """The oldest result left in our processing list, else one BLMOVE into it (0 =
        block forever, so a finite wait is at least 10 ms); removed at the next read.

        Two round trips per result: the move, and the removal pipelined with a look at
        what else the processing list holds (``_leftover``), so the next read needs no
        look of its own. Only the first read of a list, and the read after one that
        failed or was cancelled (its move may have landed), ask Redis first.
        """
        source = result_queue or self.result_queue
        processing = processing_key(source, self.consumer)
        seconds = 0.0 if wait is None else max(wait, 0.01)
        with redis_errors("result read"):
            if processing in self._unacked:  # handed over earlier and handled since
                await self._remove(processing, self._unacked[processing])
            raw = await self._take(source, processing, seconds)
            if raw is None:
                return None
            self._unacked[processing] = [raw]
        return _decoded(raw)

    async def _remove(self, processing: str, raws: Sequence[bytes]) -> bytes | None:
        """Remove ``raws`` and return the oldest entry the list still holds, in one round
        trip (``LINDEX``: the producer's ACL line has no ``LRANGE``)."""
        self._leftover.pop(processing, None)  # unknown until the reply is in
        async with self._redis.pipeline(transaction=False) as pipe:
            for raw in raws:
                pipe.lrem(processing, -1, raw)  # type: ignore[arg-type]  # bytes
            pipe.lindex(processing, -1)
            *_, left = await pipe.execute()
        self._unacked.pop(processing, None)
        self._leftover[processing] = cast(bytes | None, left)
        return cast(bytes | None, left)

    async def _take(self, source: str, processing: str, seconds: float) -> bytes | None:
        # Taken out, so a read that fails or is cancelled from here on leaves it unknown.
        if processing in self._leftover:
            raw = self._leftover.pop(processing)
        else:  # first read, or the last one failed
            raw = await self._oldest(processing)
        if raw is None:
            raw = await self._move(source, processing, seconds)
        if raw is None:  # a move whose reply was lost may have left one after all
            raw = await self._oldest(processing)
        return raw

    async def _move(self, source: str, processing: str, seconds: float) -> bytes | None:
        """The oldest result moved into the processing list (waiting ``seconds``; 0: ever)."""
        # Redis takes a fractional timeout; redis-py's stubs say int.
        moved = await self._redis.blmove(source, processing, seconds, "RIGHT", "LEFT")  # type: ignore[arg-type]
        return cast(bytes | None, moved)

    async def _oldest(self, processing: str, rank: int = 1) -> bytes | None:
        """The ``rank``-th oldest entry of the processing list (1: the oldest)."""
        return cast(bytes | None, await self._redis.lindex(processing, -rank))

    # ------------------------------------------------------------------ depths

    async def request_depth(self, queue: str | None = None) -> int:
        """Requests waiting in the sorted set (not counting claimed ones)."""
        with redis_errors("depth"):
            return int(await self._redis.zcard(queue or self.request_queue))

    async def inflight_depth(self, queue: str | None = None) -> int:
        """Requests claimed by a processor (ours or a Go daemon) and not yet answered or
        handed back (upstream's ``<queue>:claims-idx``)."""
        with redis_errors("depth"):
            name = queue or self.request_queue
            return int(await self._redis.zcard(self._keys.claims_idx(name)))

    async def result_depth(self, result_queue: str | None = None) -> int:
        with redis_errors("depth"):
            return int(await self._redis.llen(result_queue or self.result_queue))

    async def clear_matching(self, *patterns: str) -> None:
        """Delete every key matching one of ``patterns`` (SCAN, never KEYS): all a run
        left behind, including bookkeeping keys named after ids and deadlines."""
        with redis_errors("clear"):
            await delete_matching(self._redis, patterns)

    async def clear(self, names: Sequence[str] | None = None) -> None:
        """Delete the request queue, its claim keys (and the previous release's) and the
        result list (or ``names``)."""
        q = self.request_queue
        targets = names or [
            q,
            *self._keys.claim_keys(q),
            self._keys.inflight(q),
            self._keys.inflight_meta(q),
            self.result_queue,
        ]
        with redis_errors("clear"):
            await self._redis.delete(*targets)


def processing_key(result_queue: str, consumer: str) -> str:
    """The consumer's processing list, in the result list's cluster hash slot."""
    return keys.result_side_key(result_queue, f"processing:{consumer}")


def _decoded(raw: bytes) -> Result:
    try:
        return Result.decode(raw)
    except (ValueError, TypeError) as exc:
        text = raw.decode("utf-8", errors="replace")
        return UndecodableResult(id="", payload=text, raw=raw, error=f"not a result: {exc}")


async def delete_matching(redis: Redis, patterns: Sequence[str]) -> None:
    """Delete the keys matching ``patterns``, a SCAN page at a time (standalone Redis)."""
    for pattern in patterns:
        batch = [key async for key in redis.scan_iter(match=pattern, count=500)]
        for start in range(0, len(batch), 500):
            await redis.delete(*batch[start : start + 500])
