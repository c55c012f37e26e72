"""``weighted-fair`` merge: each ready queue of a pool gets its weighted share, for many
queues (one per tenant).

Stage: merge. Input: one receive stream of ``Work`` per queue of a pool. Output: the same
``Work`` (fairness header stamped) sent into the pool's stream.

The offer hand-off of ``random-robin`` (one message held per queue, empty queues make no
offer), but the next message comes from the ready queue with the smallest virtual finish
time (stride scheduling): a queue served once advances by ``1 / weight``. A queue that was
idle starts again from the current virtual time, so idling earns no burst later; a
backlogged queue of weight w gets w / (sum of the backlogged weights) of the pool's
dispatches. The ready offers are a heap by their queue's finish time, so choosing costs
O(log n): a pass over every ready queue per message was 8.7 % of a daemon's CPU at 200
queues (py-spy, bench.tenants). Weights come from ``weights`` (queue name -> weight), else
the queue's ``weight_label`` label (clamped to 0.001..1000), else ``default_weight``.
"""

from __future__ import annotations

import heapq
import itertools
import math
from typing import Annotated

from pydantic import Field

from async_processor.config.queues import QueueSpec
from async_processor.merge.base import MERGE_POLICIES, MergeContext, MergePolicy
from async_processor.merge.random_robin import RandomRobin, RandomRobinParams, _Offer, _Offers

# Weights are bounded because virtual time is a float: a weight near 0 (1e-300) moves a pool's
# virtual time so far that later steps of 1 / weight vanish in rounding (every queue then ties
# and weights stop counting), and one near infinity is a step of 0 that never lets the queue
# fall behind (every other queue starves). A ratio of a million between queues is plenty.
MIN_WEIGHT, MAX_WEIGHT = 1e-3, 1e3
Weight = Annotated[float, Field(ge=MIN_WEIGHT, le=MAX_WEIGHT)]


class WeightedFairParams(RandomRobinParams):
    weights: dict[str, Weight] = Field(default_factory=dict)
    weight_label: str = "weight"
    default_weight: Weight = 1.0


class _FairOffers(_Offers):
    """A pool's ready offers as a heap by their queue's virtual finish time at the offer.

    A queue holds at most one offer, and its finish time moves only when it is served, so
    the key stays right while the offer waits. The smallest finish has the smallest start
    (start = max(finish, the pool's virtual time)); among queues whose finish the virtual
    time has passed (all starting now), the one furthest behind goes first."""

    def __init__(self, readers: int, policy: WeightedFair) -> None:
        super().__init__(readers, lambda ready: 0)  # ``_remove`` below picks
        self._policy = policy
        self._heap: list[tuple[float, int, _Offer]] = []
        self._arrivals = itertools.count()  # equal keys: first offered, first out

    def __len__(self) -> int:
        return len(self._heap)

    def _add(self, offer: _Offer) -> None:
        key = self._policy.finish(offer.work.delivery.queue)
        heapq.heappush(self._heap, (key, next(self._arrivals), offer))

    def _remove(self) -> _Offer:
        key, _, offer = heapq.heappop(self._heap)
        self._policy.served(offer.work.delivery.queue, key)
        return offer


class WeightedFair(RandomRobin):
    def __init__(self, params: WeightedFairParams) -> None:
        super().__init__(params)
        self._weights = params
        self._finish: dict[str, float] = {}  # queue name -> virtual finish time
        # Virtual time per pool (one policy object serves every pool): the start of the
        # last message that pool served.
        self._now: dict[str, float] = {}
        # queue name -> (its spec, 1 / weight), computed once per spec (a reload may
        # give a queue a new weight label: a new spec)
        self._steps: dict[str, tuple[QueueSpec, float]] = {}

    def weight(self, queue: QueueSpec) -> float:
        params = self._weights
        if queue.name in params.weights:
            return params.weights[queue.name]
        try:
            value = float(queue.labels.get(params.weight_label, ""))
        except ValueError:
            return params.default_weight
        if not math.isfinite(value) or value <= 0:
            return params.default_weight
        return min(max(value, MIN_WEIGHT), MAX_WEIGHT)  # a label is not validated at start

    def _offers(self, pool: str, readers: int) -> _Offers:
        return _FairOffers(readers, self)

    def finish(self, queue: QueueSpec) -> float:
        """The queue's virtual finish time (-inf before its first message: it starts at
        the pool's virtual time, as a queue back from idle does)."""
        return self._finish.get(queue.name, -math.inf)

    def served(self, queue: QueueSpec, finish: float) -> None:
        """``queue`` (finish time ``finish``) sends the pool's next message: the pool's
        virtual time moves to its start, and its finish one step (1 / weight) past it."""
        start = max(finish, self._now.get(queue.pool, 0.0))
        cached = self._steps.get(queue.name)
        if cached is None or cached[0] is not queue:
            cached = self._steps[queue.name] = (queue, 1.0 / self.weight(queue))
        self._now[queue.pool] = start
        self._finish[queue.name] = start + cached[1]


@MERGE_POLICIES.register("weighted-fair", WeightedFairParams)
def _weighted_fair(params: WeightedFairParams, ctx: MergeContext) -> MergePolicy:
    return WeightedFair(params)
