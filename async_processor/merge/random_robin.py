"""``random-robin`` merge: a uniformly random ready queue of the pool goes next.

Stage: merge. Input: one receive stream of ``Work`` per queue of a pool. Output: the same
``Work`` (fairness header stamped) sent into the pool's stream.

Like Go's ``select`` over the queue channels: one reader task per queue holds at most one
message ("offers" it); the emitter picks uniformly among the queues holding an offer. A
reader gets its next message as soon as its offer is taken, while the emitter may still be
blocked on a full pool stream, so at the next pick every queue with work is a candidate
again. An empty or closed queue simply makes no offer, so it never delays the others, and
a flooded queue gets no more than its share. Memory: one message per queue plus one in the
emitter.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import anyio
from anyio.abc import ObjectReceiveStream, ObjectSendStream

from async_processor.merge.base import (
    MERGE_POLICIES,
    MergeContext,
    MergeParams,
    MergePolicy,
    Source,
    admit_sources,
    emit,
)
from async_processor.work import Work, take


class RandomRobinParams(MergeParams):
    """Only the fairness pair."""


@dataclass(slots=True, eq=False)
class _Offer:
    """One reader's message in hand, and the event that tells it the message was taken."""

    work: Work
    taken: anyio.Event = field(default_factory=anyio.Event)


class _Offers:
    """The ready set: offers waiting for the emitter, and how many readers are still open.
    ``pick`` chooses among the ready offers (an index into the list); a policy with an
    order of its own (weighted-fair: a heap) overrides ``_add``, ``_remove`` and ``__len__``."""

    def __init__(self, readers: int, pick: Callable[[list[_Offer]], int]) -> None:
        self.ready: list[_Offer] = []
        self.open_readers = readers
        self._pick = pick
        self._wakeup = anyio.Event()

    def __len__(self) -> int:
        return len(self.ready)

    def put(self, offer: _Offer) -> None:
        self._add(offer)
        self._wakeup.set()

    def _add(self, offer: _Offer) -> None:
        self.ready.append(offer)

    def _remove(self) -> _Offer:
        index = self._pick(self.ready)
        # Swap-remove: order in the ready list carries no meaning.
        self.ready[index], self.ready[-1] = self.ready[-1], self.ready[index]
        return self.ready.pop()

    def reader_done(self) -> None:
        self.open_readers -= 1
        self._wakeup.set()

    async def take(self) -> _Offer | None:
        """The next ready offer; None once every reader is done and none is left."""
        while not len(self):
            if self.open_readers == 0:
                return None
            # No await between the check and the new event: a put cannot slip through.
            self._wakeup = anyio.Event()
            await self._wakeup.wait()
        return self._remove()


class RandomRobin:
    def __init__(self, params: RandomRobinParams, rng: random.Random | None = None) -> None:
        self._params = params
        self._rng = rng or random.Random()

    async def run(
        self,
        pool: str,
        sources: Sequence[Source],
        sink: ObjectSendStream[Work],
        more: ObjectReceiveStream[Source] | None = None,
    ) -> None:
        if len(sources) == 1 and more is None:  # nothing to choose: skip the offer hand-off
            async with sink, sources[0].stream as stream:
                while True:
                    try:
                        work = await take(stream)
                    except anyio.EndOfStream:
                        return
                    await self._emit(work, sink)
        offers = self._offers(pool, len(sources) + (more is not None))
        async with sink, anyio.create_task_group() as tg:
            for source in sources:
                tg.start_soon(self._read, source, offers)
            if more is not None:

                def start(source: Source) -> None:
                    tg.start_soon(self._read, source, offers)

                tg.start_soon(admit_sources, more, offers, start)
            while (offer := await offers.take()) is not None:
                offer.taken.set()
                await self._emit(offer.work, sink)

    def _offers(self, pool: str, readers: int) -> _Offers:
        """The ready set of ``pool``'s run."""
        return _Offers(readers, self._pick)

    def _pick(self, ready: list[_Offer]) -> int:
        """Uniformly random among the ready queues."""
        return self._rng.randrange(len(ready))

    async def _read(self, source: Source, offers: _Offers) -> None:
        try:
            async with source.stream:
                async for work in source.stream:
                    offer = _Offer(work)
                    offers.put(offer)
                    await offer.taken.wait()
        finally:
            offers.reader_done()

    async def _emit(self, work: Work, sink: ObjectSendStream[Work]) -> None:
        stamp = self._params.fairness_stamp(work.envelope)
        work.stamped_headers = [stamp] if stamp else []
        await emit(sink, work)


@MERGE_POLICIES.register("random-robin", RandomRobinParams)
def _random_robin(params: RandomRobinParams, ctx: MergeContext) -> MergePolicy:
    return RandomRobin(params)
