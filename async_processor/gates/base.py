"""The gate model: budget + per-message verdict, with reservations that are always given back.

Input: an ``Envelope`` (a gate may stamp labels such as ``classification``). Output: a
``Verdict``. Queue gates size fetches with ``budget()`` and judge each fetched message;
pool gates judge inside the worker. Every gate type registers in ``GATES`` with a
pydantic params model; ``build_gate`` turns ``gate_type``/``gate_params`` into a Gate.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict

from async_processor.messages import OVERFLOW, Envelope, Result, classification
from async_processor.registry import Registry

if TYPE_CHECKING:  # annotations only, as the other seams do
    from async_processor.metrics import Metrics


class Action(Enum):
    CONTINUE = "continue"
    DROP = "drop"
    REFUSE = "refuse"
    WAIT = "wait"


@dataclass(frozen=True, slots=True)
class Verdict:
    action: Action
    result: Result | None = None  # for DROP: the result to publish (else GATE_DROPPED)


CONTINUE = Verdict(Action.CONTINUE)
REFUSE = Verdict(Action.REFUSE)
WAIT = Verdict(Action.WAIT)


def refusal_decision(message: Envelope) -> str:
    """The ``gate_decision`` label of a refusal: ``quota_exhausted`` for over-quota traffic."""
    return "quota_exhausted" if classification(message) == OVERFLOW else "gate_closed"


DROP = Verdict(Action.DROP)

Release = Callable[[], Awaitable[None]]


class Releases:
    """Reservations taken by gates; given back in reverse order, exactly once each."""

    __slots__ = ("_items",)

    def __init__(self) -> None:
        self._items: list[Release] = []

    def add(self, release: Release) -> None:
        self._items.append(release)

    def mark(self) -> int:
        return len(self._items)

    async def rollback(self, mark: int) -> None:
        """Give back everything added after ``mark`` (composite's all-or-nothing)."""
        taken, self._items = self._items[mark:], self._items[:mark]
        await _run_reversed(taken)

    async def release_all(self) -> None:
        await self.rollback(0)

    def __len__(self) -> int:
        return len(self._items)


async def _run_reversed(items: list[Release]) -> None:
    first_error: BaseException | None = None
    for release in reversed(items):
        try:
            await release()
        except Exception as exc:  # one failed release must not leak the others
            first_error = first_error or exc
    if first_error is not None:
        raise first_error


class Gate(Protocol):
    """Admission control. ``budget`` never raises; ``apply`` raises GateError on failure."""

    async def budget(self) -> float: ...

    async def apply(self, message: Envelope, releases: Releases) -> Verdict: ...


# Longest a parked pool worker sleeps before asking a gate again (reference: 50 ms).
WAIT_POLL_INTERVAL = 0.05


@runtime_checkable
class WaitsForChange(Protocol):
    """Optional: a gate that can wake parked workers early (e.g. when a slot frees).

    ``wait_changed`` returns when the gate's answer may have changed or after ``timeout``
    seconds, whichever is first; it never raises. Callers re-``apply`` afterwards.
    Gates without it are re-asked every ``WAIT_POLL_INTERVAL``.
    """

    async def wait_changed(self, timeout: float) -> None: ...


def waits_in_apply(gate: Gate) -> bool:
    """Whether ``gate.apply`` may wait for as long as it takes (a gate that says so with a
    true ``waits_in_apply`` attribute: ``local-max-concurrency`` in ``blocking`` mode, a
    composite holding one). A queue gate's wait is bounded by the poller only then: the
    cancel scope that bounds it costs more than a whole open gate's check."""
    return bool(getattr(gate, "waits_in_apply", False))


class BudgetBatch(Protocol):
    """Reads the budgets of many gates of one kind together (``ReadsInBatch``)."""

    async def budgets(self, gates: Sequence[Gate]) -> list[float]:
        """Each gate's ``budget``, in order; never raises (as ``budget``)."""
        ...


@runtime_checkable
class ReadsInBatch(Protocol):
    """Optional: a gate whose budget is read with others of its kind in one round trip
    (``redis``: one MGET per hash slot for every budget key on one connection). The idle
    gates' rounds read each ``batch``'s gates with one ``budgets`` call."""

    @property
    def batch(self) -> BudgetBatch: ...


@runtime_checkable
class Observes(Protocol):
    """Optional: a pool gate that learns from dispatch outcomes (adaptive-concurrency,
    pool-headroom).

    The dispatcher calls ``observe`` after each HTTP attempt of a message the gate
    admitted: ``status`` None means no response; ``latency`` in seconds;
    ``dropped_reason`` is the ``x-llm-d-request-dropped-reason`` header ("" if absent).
    Must not block or raise.
    """

    def observe(
        self, message: Envelope, status: int | None, latency: float, dropped_reason: str
    ) -> None: ...


@dataclass(frozen=True, slots=True)
class GateOwner:
    """Who owns a gate: metric labels. Pool gates have empty queue fields."""

    queue_id: str = ""
    queue_name: str = ""
    pool: str = ""


@dataclass(slots=True)
class GateContext:
    """What gate factories may use: owner, process-wide settings and shared clients.

    ``shared`` holds process-wide objects keyed by name (Redis clients per address,
    Prometheus/HTTP sessions, metric caches) so gates built from the same settings share
    them; ``closers`` are awaited at shutdown.
    """

    owner: GateOwner
    metrics: Metrics | None = None
    prometheus_url: str = ""
    prometheus_cache_ttl: float = 5.0
    request_timeout: float = 300.0
    shared: dict[str, Any] = field(default_factory=dict)
    closers: list[Callable[[], Awaitable[None]]] = field(default_factory=list)

    def for_owner(self, owner: GateOwner) -> GateContext:
        return GateContext(
            owner=owner,
            metrics=self.metrics,
            prometheus_url=self.prometheus_url,
            prometheus_cache_ttl=self.prometheus_cache_ttl,
            request_timeout=self.request_timeout,
            shared=self.shared,
            closers=self.closers,
        )


class GateParams(BaseModel):
    """Base of every gate's params: unknown fields are errors (typos fail at startup)."""

    model_config = ConfigDict(extra="forbid", frozen=True)


GATES: Registry[Gate, GateContext] = Registry(
    "gate",
    plugins=[
        f"async_processor.gates.{name}"
        for name in (
            *("basic", "adaptive", "redis", "leased_rate"),
            *("prometheus", "scrape", "headroom", "tiers"),
        )
    ],
)


class ConstantParams(GateParams):
    value: float = 1.0


class ConstantGate:
    """Always the same budget; refuses when it is 0."""

    def __init__(self, value: float) -> None:
        self._value = min(1.0, max(0.0, value))

    async def budget(self) -> float:
        return self._value

    async def apply(self, message: Envelope, releases: Releases) -> Verdict:
        return REFUSE if self._value <= 0 else CONTINUE


@GATES.register("constant", ConstantParams)
def _constant(params: ConstantParams, ctx: GateContext) -> Gate:
    return ConstantGate(params.value)


OPEN_GATE: Gate = ConstantGate(1.0)


def build_gate(gate_type: str, gate_params: dict[str, Any] | None, ctx: GateContext) -> Gate:
    """Gate for a queue/pool entry; empty type = always open; unknown type = ConfigError."""
    if not gate_type:
        return OPEN_GATE
    return GATES.build(gate_type, gate_params, ctx)
