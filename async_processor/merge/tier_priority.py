"""``tier-priority`` merge: six strict lanes, round-robin across queues inside a lane.

Stage: merge. Input: one receive stream of ``Work`` per queue of a pool. Output: ``Work``
with fairness, priority (when ``priority_header`` names one) and lane-objective headers
stamped, sent into the pool's stream,
always from the most urgent non-empty lane.

Lane index = class × 3 + tier (as in the Go reference): class 0 when the ``classification`` label
is ``reserved``, else 1 (overflow or unclassified); tier from ``labels[tier_label]``:
``interactive`` 0, ``async`` 1, anything else or missing 2. A lane holds at most
``lane_capacity`` messages; a reader blocks only while its own lane is full, so the bound
is backpressure to the broker, not memory growth. Lower lanes can starve by design.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Sequence

import anyio
from anyio.abc import ObjectReceiveStream, ObjectSendStream
from pydantic import Field, field_validator

from async_processor.headers import (
    DEFAULT_OBJECTIVE_HEADER,
    check_header_name,
    check_header_value,
)
from async_processor.merge.base import (
    MERGE_POLICIES,
    MergeContext,
    MergeParams,
    MergePolicy,
    Source,
    admit_sources,
    emit,
)
from async_processor.messages import CLASSIFICATION_LABEL, RESERVED
from async_processor.work import Work

LANES = (
    "reserved-interactive",
    "reserved-async",
    "reserved-batch",
    "overflow-interactive",
    "overflow-async",
    "overflow-batch",
)
TIERS = {"interactive": 0, "async": 1}
BATCH_TIER = 2
DEFAULT_TIER_LABEL = "tier"


class TierPriorityParams(MergeParams):
    priority_header: str = ""  # "" = no priority header, as upstream since v0.10 (#443)
    objective_header: str = DEFAULT_OBJECTIVE_HEADER
    tier_label: str = DEFAULT_TIER_LABEL
    lane_capacity: int = Field(default=1000, gt=0)
    lane_objectives: dict[str, str] = Field(default_factory=dict)

    @field_validator("priority_header")
    @classmethod
    def _priority_header(cls, value: str) -> str:
        return check_header_name(value) if value else ""

    @field_validator("objective_header")
    @classmethod
    def _objective_header(cls, value: str) -> str:
        return check_header_name(value or DEFAULT_OBJECTIVE_HEADER)

    @field_validator("tier_label")
    @classmethod
    def _tier_label(cls, value: str) -> str:
        return value or DEFAULT_TIER_LABEL

    @field_validator("lane_objectives")
    @classmethod
    def _lane_objectives(cls, value: dict[str, str]) -> dict[str, str]:
        for lane, objective in value.items():
            if lane not in LANES:
                raise ValueError(f"unknown lane {lane!r} (known: {', '.join(LANES)})")
            check_header_value(objective)
        return value


def lane_of(labels: dict[str, str], tier_label: str) -> int:
    """Lane index 0 (reserved-interactive, most urgent) … 5 (overflow-batch)."""
    klass = 0 if labels.get(CLASSIFICATION_LABEL) == RESERVED else 1
    return klass * 3 + TIERS.get(labels.get(tier_label, ""), BATCH_TIER)


class _Lane:
    """FIFO per source queue, served round-robin in first-seen order; bounded in total."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.count = 0
        self._queues: dict[int, deque[Work]] = {}
        self._rotation: deque[int] = deque()  # source keys with messages, next to serve first
        self._space = anyio.Event()

    async def push(self, source_key: int, work: Work) -> None:
        while self.count >= self.capacity:
            if self._space.is_set():  # readers blocked on this lane share one event
                self._space = anyio.Event()
            await self._space.wait()
        queue = self._queues.get(source_key)
        if queue is None:
            queue = self._queues[source_key] = deque()
            self._rotation.append(source_key)
        queue.append(work)
        self.count += 1

    def pop(self) -> Work:
        key = self._rotation[0]
        queue = self._queues[key]
        work = queue.popleft()
        if queue:
            self._rotation.rotate(-1)
        else:  # a drained queue leaves the rotation until it brings work again
            del self._queues[key]
            self._rotation.popleft()
        self.count -= 1
        self._space.set()
        return work


class _Scheduler:
    """The pool's six lanes and the emitter's wake-up."""

    def __init__(self, capacity: int, readers: int) -> None:
        self.lanes = [_Lane(capacity) for _ in LANES]
        self.open_readers = readers
        self._wakeup = anyio.Event()

    async def push(self, lane: int, source_key: int, work: Work) -> None:
        await self.lanes[lane].push(source_key, work)
        self._wakeup.set()

    def reader_done(self) -> None:
        self.open_readers -= 1
        self._wakeup.set()

    async def pop(self) -> tuple[int, Work] | None:
        """(lane, work) from the most urgent non-empty lane; None when all is done."""
        while True:
            for index, lane in enumerate(self.lanes):
                if lane.count:
                    return index, lane.pop()
            if self.open_readers == 0:
                return None
            self._wakeup = anyio.Event()
            await self._wakeup.wait()


class TierPriority:
    def __init__(self, params: TierPriorityParams) -> None:
        self._params = params
        self._objectives = [params.lane_objectives.get(lane, "") for lane in LANES]

    async def run(
        self,
        pool: str,
        sources: Sequence[Source],
        sink: ObjectSendStream[Work],
        more: ObjectReceiveStream[Source] | None = None,
    ) -> None:
        scheduler = _Scheduler(self._params.lane_capacity, len(sources) + (more is not None))
        keys = itertools.count()
        async with sink, anyio.create_task_group() as tg:
            for source in sources:
                tg.start_soon(self._read, next(keys), source, scheduler)
            if more is not None:

                def start(source: Source) -> None:
                    tg.start_soon(self._read, next(keys), source, scheduler)

                tg.start_soon(admit_sources, more, scheduler, start)
            while (popped := await scheduler.pop()) is not None:
                lane, work = popped
                work.stamped_headers = self.stamps(lane, work)
                await emit(sink, work)

    async def _read(self, key: int, source: Source, scheduler: _Scheduler) -> None:
        try:
            async with source.stream:
                async for work in source.stream:
                    lane = lane_of(work.envelope.routing.labels, self._params.tier_label)
                    await scheduler.push(lane, key, work)
        finally:
            scheduler.reader_done()

    def stamps(self, lane: int, work: Work) -> list[tuple[str, str]]:
        """Fairness, then priority, then the lane's objective, each when configured."""
        stamped = []
        fairness = self._params.fairness_stamp(work.envelope)
        if fairness:
            stamped.append(fairness)
        if self._params.priority_header:
            stamped.append((self._params.priority_header, str(lane)))
        if self._objectives[lane]:
            stamped.append((self._params.objective_header, self._objectives[lane]))
        return stamped


@MERGE_POLICIES.register("tier-priority", TierPriorityParams)
def _tier_priority(params: TierPriorityParams, ctx: MergeContext) -> MergePolicy:
    return TierPriority(params)
