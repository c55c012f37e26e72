"""Fetching for redis-sortedset when one process polls many queues: claims gathered into
rounds, and one probe for all the queues found empty.

Stage: broker I/O for ``SortedSetTransport.fetch``. Input: each poller's fetch (queue,
count). Output: its deliveries, held in the ``ClaimBook`` (the heartbeat renews them).

Claim rounds. With 200 tenant queues a freed pool slot goes to one queue, so each claim
carries about one message, plus its own marker read: two round trips a message against
well under one with 2 queues (bench.tenants). A fetch now joins the round being gathered;
the round's first fetch waits ``claim_gather_ms`` (or until ``GATHER_FULL`` messages are
asked for) and sends the whole round: one ``claim.lua`` call per slot group (all queues
together outside cluster mode; one call per hash slot in cluster mode, pipelined), then
the markers of everything claimed in one more round trip. Each queue's claim is still its
own: its count, its claim record, its keys checked and written on their own.

Idle probe. A queue whose last claim found nothing is not claimed again until the probe
sees members in it: every ``FETCH_POLL_STEP`` (the old claim retry step, so the added
pickup latency is unchanged: at most one step plus a round trip), one ``ready.lua`` call
per slot group answers for every idle queue this process polls. Before, each empty queue
cost a claim every 100 ms per replica (200 idle queues: 0.25-0.33 cores, ~2,000 round
trips a second). One waiter, the lead, sleeps to each step and sends the probe; the others
sleep on their own event until the probe sees their queue (or the lead leaves and hands
the probing to the next): a waiter per idle queue woken at every step, twice, was most of
an idle daemon's CPU (200 idle queues: 4,000 wake-ups a second, py-spy).
A failed probe counts as "ready" (the claims then meet what is wrong and report it), but it
is counted (``idle_probe_errors_total``) and logged at most every ``PROBE_WARN_SECONDS``:
a probe that keeps failing quietly brings back a claim per idle queue every step.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio
import structlog
from redis.asyncio import Redis
from redis.commands.core import AsyncScript

from async_processor.config.queues import QueueSpec
from async_processor.errors import TransportError
from async_processor.messages import ID_PREFIX_BYTES
from async_processor.redis.conn import redis_errors, transport_error
from async_processor.redis.keyspace import KeySpace
from async_processor.transports.base import Delivery
from async_processor.transports.redis_sortedset.claims import Claim, ClaimBook, key_text

if TYPE_CHECKING:
    from async_processor.metrics import Metrics

log = structlog.get_logger(__name__)

FETCH_POLL_STEP = 0.1  # seconds between probes of the idle queues (a new message's wait)
# The longest a claim is shielded from cancellation: a Redis that never answers must not
# hold a shutdown or a removed queue's poller (a claim cut here comes back by its lease).
CLAIM_SHIELD_SECONDS = 5.0
GATHER_FULL = 10  # messages asked for that send a round before its gather time is up
PROBE_WARN_SECONDS = 60.0  # at most one idle_probe_failed warning per this many seconds


@dataclass(eq=False)
class _Ask:
    """One fetch's part of a round: its queue, count and claim record's name; then its
    answer."""

    queue: QueueSpec
    limit: int
    prefix: str
    deliveries: list[Delivery] = field(default_factory=list)
    error: TransportError | None = None
    gone: bool = False  # its fetch stopped waiting: what the round claimed for it is let go


@dataclass(eq=False)
class _Round:
    asks: list[_Ask] = field(default_factory=list)
    full: anyio.Event = field(default_factory=anyio.Event)
    done: anyio.Event = field(default_factory=anyio.Event)


@dataclass(eq=False)
class _Waiter:
    """One idle fetch waiting for its queue: woken when a probe saw members in it
    (``ready``) or when the probing is handed to it (``leads``)."""

    name: str
    wake: anyio.Event = field(default_factory=anyio.Event)
    ready: bool = False
    leads: bool = False


CheckMarkers = Callable[[list[Delivery]], Awaitable[list[Delivery]]]


@dataclass
class Fetcher:
    """``fetch`` for ``SortedSetTransport``: claim rounds and the idle probe (above)."""

    redis: Redis
    keys: KeySpace
    scripts: dict[str, AsyncScript]
    claims: ClaimBook
    check_markers: CheckMarkers  # reads the round's cancel and live markers, parks seconds
    owner: str  # this process's claim owner token; a claim call's record is named by it
    lease: float
    max_bytes: int
    gather: float = 0.0  # seconds a round waits for more fetches to join
    metrics: Metrics | None = None
    _fetches: itertools.count[int] = field(default_factory=itertools.count)
    _round: _Round | None = None
    _empty: set[str] = field(default_factory=set)  # queues whose last claim found nothing
    # Idle fetches waiting for the probe, in arrival order (a dict as an ordered set).
    _waiters: dict[_Waiter, None] = field(default_factory=dict)
    _lead: _Waiter | None = None  # the waiter that sends the probes
    _probe_failures: int = 0  # since the last idle_probe_failed warning
    _probe_warned_at: float = -math.inf

    async def fetch(self, queue: QueueSpec, limit: int, wait: float) -> list[Delivery]:
        """Claim up to ``limit`` earliest-deadline members; an empty queue is claimed again
        once the probe sees members in it, within ``wait`` s."""
        if limit <= 0:
            return []
        give_up = anyio.current_time() + wait
        while True:
            remaining = give_up - anyio.current_time()
            idle = queue.name in self._empty and remaining > 0
            if idle and not await self._until_ready(queue.name, remaining):
                return []
            deliveries = await self._claim(queue, limit)
            if deliveries:
                self._empty.discard(queue.name)
                return deliveries
            self._empty.add(queue.name)
            if give_up - anyio.current_time() <= 0:
                return []

    async def until_ready(self, queue: QueueSpec) -> None:
        """Return once ``queue`` may hold members: at once, unless its last claim found it
        empty; then when the probe sees members in it (it is claimed at once next)."""
        if queue.name in self._empty and await self._until_ready(queue.name, math.inf):
            self._empty.discard(queue.name)

    def served(self, names: set[str]) -> None:
        """Forget the idle marks of queues no longer polled."""
        self._empty &= names

    # ------------------------------------------------------------------ claim rounds

    async def _claim(self, queue: QueueSpec, limit: int) -> list[Delivery]:
        """This fetch's claim, sent with the round it joins. A claim is recorded whole or
        not made: cancelled mid-way (a queue removed, a shutdown), its members would sit
        claimed by nobody until their lease ran out. So it is shielded, for at most
        ``CLAIM_SHIELD_SECONDS``; past it, what it holds is let go (not renewed: the
        leases lapse and the reaper returns the members)."""
        ask = _Ask(queue, limit, f"{self.owner}:{next(self._fetches)}")
        with anyio.move_on_after(CLAIM_SHIELD_SECONDS, shield=True) as claiming:
            await self._join(ask)
        if claiming.cancelled_caught:
            ask.gone = True
            self._let_go(ask)
            raise TransportError(f"redis claim: no answer in {CLAIM_SHIELD_SECONDS} s")
        if ask.error is not None:
            raise ask.error
        return ask.deliveries

    async def _join(self, ask: _Ask) -> None:
        gathering = self._round
        leads = gathering is None  # the first of a round sends it
        if gathering is None:
            gathering = self._round = _Round()
        gathering.asks.append(ask)
        if sum(a.limit for a in gathering.asks) >= GATHER_FULL:
            gathering.full.set()
        if leads:
            await self._send(gathering)
        else:
            await gathering.done.wait()

    async def _send(self, gathering: _Round) -> None:
        try:
            if self.gather > 0:
                with anyio.move_on_after(self.gather):
                    await gathering.full.wait()
            if self._round is gathering:
                self._round = None
            await self._claim_round(gathering.asks)
        except TransportError as exc:
            for ask in gathering.asks:
                ask.error = exc
        except BaseException:  # cut short: nobody may wait on a round that never ends
            for ask in gathering.asks:
                ask.error = TransportError("redis claim round cut short")
                self._let_go(ask)
            raise
        finally:
            if self._round is gathering:
                self._round = None
            gathering.done.set()
        for ask in gathering.asks:
            if ask.gone:
                self._let_go(ask)

    async def _claim_round(self, asks: list[_Ask]) -> None:
        """One ``claim.lua`` call per slot group, in one round trip; then the markers."""
        groups = self._groups(asks)
        calls = [self._call(group) for group in groups]
        if len(calls) == 1:  # alone, not in a pipeline: that would ask SCRIPT EXISTS first
            with redis_errors("claim"):
                replies = [await self.scripts["claim"](keys=calls[0][0], args=calls[0][1])]
        else:
            try:
                replies = await self._pipelined(calls)
            except TransportError:
                # The whole pipeline failed (in cluster mode: one master unreachable, its
                # connection dropped mid-send), yet the other masters may have claimed.
                # Each call again, on its own: claim.lua answers a record it has made with
                # the batch claimed under it, so those claims are recorded, not left to
                # wait out a lease in nobody's hands.
                replies = await self._one_by_one(calls)
        for group, reply in zip(groups, replies, strict=True):
            if isinstance(reply, Exception):
                failed = reply if isinstance(reply, TransportError) else None
                for ask in group:
                    ask.error = failed or transport_error("claim", reply)
                continue
            for ask, answer in zip(group, reply, strict=True):
                self._deliveries(ask, answer)
        kept = set(await self.check_markers([d for a in asks for d in a.deliveries]))
        for ask in asks:
            ask.deliveries = [d for d in ask.deliveries if d in kept]

    async def _pipelined(self, calls: list[tuple[list[str], list[Any]]]) -> list[Any]:
        with redis_errors("claim"):
            async with self.redis.pipeline(transaction=False) as pipe:
                for script_keys, args in calls:
                    await self.scripts["claim"](keys=script_keys, args=args, client=pipe)
                # Each slot group's call stands alone: one failing (a cluster node that
                # lost its scripts, or is out of memory) must not discard the others'
                # replies, whose claims are made in Redis and, unrecorded, would wait
                # out a whole lease in nobody's hands.
                return list(await pipe.execute(raise_on_error=False))

    async def _one_by_one(self, calls: list[tuple[list[str], list[Any]]]) -> list[Any]:
        """Each call sent alone, all at once: a reply, or the call's own error."""
        replies: list[Any] = [None] * len(calls)

        async def send(index: int, script_keys: list[str], args: list[Any]) -> None:
            try:
                with redis_errors("claim"):
                    replies[index] = await self.scripts["claim"](keys=script_keys, args=args)
            except TransportError as exc:
                replies[index] = exc

        async with anyio.create_task_group() as tg:
            for index, (script_keys, args) in enumerate(calls):
                tg.start_soon(send, index, script_keys, args)
        return replies

    def _groups(self, asks: Sequence[_Ask]) -> list[list[_Ask]]:
        """The round's asks per slot group (one claim.lua call each)."""
        by_name: dict[str, list[_Ask]] = {}
        for ask in asks:
            by_name.setdefault(ask.queue.name, []).append(ask)
        return [
            [ask for name in names for ask in by_name[name]]
            for names in self.keys.slot_groups(list(by_name))
        ]

    def _call(self, group: Sequence[_Ask]) -> tuple[list[str], list[Any]]:
        script_keys: list[str] = []
        args: list[Any] = [self.lease, self.max_bytes, ID_PREFIX_BYTES, self.owner]
        for ask in group:
            name = ask.queue.name
            script_keys += [name, *self.keys.claim_keys(name)]
            script_keys.append(self.keys.claim_record(name, ask.prefix))
            args.append(ask.limit)
        return script_keys, args

    def _deliveries(self, ask: _Ask, answer: Any) -> None:
        if isinstance(answer, bytes):  # this queue's keys have the wrong type; the rest ran
            ask.error = TransportError(f"redis claim failed: {answer.decode(errors='replace')}")
            return
        for i in range(0, len(answer), 5):
            claim = Claim(
                id=key_text(answer[i]),
                score=float(answer[i + 2]),
                size=int(answer[i + 3]),
                digest=answer[i + 4].decode(),
            )
            delivery = Delivery(queue=ask.queue, raw=bytes(answer[i + 1]), handle=claim)
            self.claims.hold(delivery)
            ask.deliveries.append(delivery)

    def _let_go(self, ask: _Ask) -> None:
        for delivery in ask.deliveries:
            self.claims.release(delivery)

    # ------------------------------------------------------------------ idle probe

    async def _until_ready(self, name: str, timeout: float) -> bool:
        """Wait for a probe to see members in queue ``name``: True, or False at ``timeout``.
        Probes run on the ``FETCH_POLL_STEP`` ticks, one per process for all idle queues,
        sent by the lead waiter; the others sleep until woken."""
        me = _Waiter(name)
        self._waiters[me] = None
        try:
            with anyio.move_on_after(timeout):
                if self._lead is None:
                    self._hand_lead(me)
                while not me.ready:
                    await me.wake.wait()
                    me.wake = anyio.Event()  # the flags say why it was woken
                    if me.leads:
                        await self._probe_until_ready(me)
            return me.ready
        finally:
            del self._waiters[me]
            if self._lead is me:  # left (ready, timed out, cancelled): the next one probes
                self._lead = None
                waiting = next((w for w in self._waiters if not w.ready), None)
                if waiting is not None:
                    self._hand_lead(waiting)

    def _hand_lead(self, waiter: _Waiter) -> None:
        self._lead = waiter
        waiter.leads = True
        waiter.wake.set()

    async def _probe_until_ready(self, me: _Waiter) -> None:
        """The lead's loop: a probe at each tick for every waiting queue, until its own
        queue is seen (the lead is then handed on)."""
        while not me.ready:
            now = anyio.current_time()
            tick = math.floor(now / FETCH_POLL_STEP) + 1
            await anyio.sleep(tick * FETCH_POLL_STEP - now)
            names = list(dict.fromkeys(w.name for w in self._waiters))
            ready = set(names)  # unless answered: their claims then see what is wrong
            try:
                with anyio.move_on_after(CLAIM_SHIELD_SECONDS, shield=True):
                    ready = await self._ready(names)
            except TransportError as exc:
                self._probe_failed(exc, len(names))
            for waiter in self._waiters:
                if waiter.name in ready and not waiter.ready:
                    waiter.ready = True
                    waiter.wake.set()

    def _probe_failed(self, exc: TransportError, queues: int) -> None:
        """Count a failed probe and warn, rate-limited: every step of a Redis that refuses
        the probe (an ACL without the script, a lost connection) fails it again."""
        if self.metrics is not None:
            self.metrics.idle_probe_errors_total.inc()
        self._probe_failures += 1
        now = anyio.current_time()
        if now - self._probe_warned_at < PROBE_WARN_SECONDS:
            return
        log.warning(
            "idle_probe_failed", error=str(exc), queues=queues, failures=self._probe_failures
        )
        self._probe_warned_at = now
        self._probe_failures = 0

    async def _ready(self, names: list[str]) -> set[str]:
        groups = self.keys.slot_groups(names)
        with redis_errors("probe"):
            if len(groups) == 1:
                replies = [await self.scripts["ready"](keys=groups[0])]
            else:
                async with self.redis.pipeline(transaction=False) as pipe:
                    for group in groups:
                        await self.scripts["ready"](keys=group, client=pipe)
                    replies = await pipe.execute()
        ready = zip(groups, replies, strict=True)
        return {group[int(index) - 1] for group, indexes in ready for index in indexes}
