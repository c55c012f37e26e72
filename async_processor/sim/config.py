"""The simulator's settings and counters, and the view of it that its admin routes and
scrape-time series read.

Input: settings from flags or ``POST /admin/config``. Output: ``SimConfig`` (what the
simulator does), ``SimStats`` (what it did) and ``SimView``, which ``sim.app.Simulator``
satisfies, so ``sim.admin`` and ``sim.series`` need not import the server.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from prometheus_client import CollectorRegistry
from pydantic import BaseModel, ConfigDict, Field

from async_processor.sim.capacity import Occupancy, Slots
from async_processor.sim.serving import Load, PoolRuntime


class SimConfig(BaseModel):
    """What the simulator does; every field can change at run time (``POST /admin/config``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    latency: float = Field(0.0, ge=0)  # fixed seconds per request
    ttft: float = Field(0.0, ge=0)  # added: time to first token
    per_token: float = Field(0.0, ge=0)  # added: seconds per requested token (max_tokens)
    max_concurrent: int = Field(0, ge=0)  # running slots; 0 = unlimited
    max_waiting: int = Field(0, ge=0)  # FIFO queue for a running slot
    retry_after: float = Field(1.0, ge=0)  # Retry-After header of a capacity 429
    error_rate: float = Field(0.0, ge=0, le=1)
    error_status: int = Field(500, ge=400, le=599)
    reset_rate: float = Field(0.0, ge=0, le=1)  # abort the connection, no response
    hang_rate: float = Field(0.0, ge=0, le=1)  # never answer until the client goes away
    seed: int | None = None
    # Labels of the exported series, as a real llm-d deployment would carry them.
    model: str = "sim-model"
    pool: str = "sim-pool"
    namespace: str = "default"
    ready_pods: int = Field(1, ge=0)
    # EPP series names: llm-d-router v0.9+ (current), older EPPs (legacy), or both.
    epp_metrics: Literal["current", "legacy", "both"] = "current"
    # Raw text put in place of each answer's usage value (a hostile or odd gateway: huge
    # or negative counts, junk, embeddings-style usage); None: the real counts.
    usage_json: str | None = None

    def delay(self, max_tokens: int) -> float:
        return self.latency + self.ttft + self.per_token * max_tokens


@dataclass
class SimStats:
    total: int = 0
    by_status: Counter[str] = field(default_factory=Counter)

    def as_dict(self, slots: Slots, occupancy: Occupancy) -> dict[str, Any]:
        clock, in_flight_seconds = occupancy.reading()
        return {
            "total": self.total,
            "by_status": dict(self.by_status),
            "max_concurrent_seen": slots.max_running_seen,
            "running": slots.running,
            "waiting": slots.waiting,
            # Every request in a handler (running, queued, pooled, hung), and its integral
            # over time on the simulator's monotonic clock (read as a pair).
            "in_flight": occupancy.count,
            "in_flight_peak": occupancy.peak,
            "in_flight_seconds": in_flight_seconds,
            "clock": clock,
        }


class SimView(Protocol):
    """What the admin routes and the scrape-time collector read of a running simulator."""

    config: SimConfig
    registry: CollectorRegistry
    pool: PoolRuntime | None

    @property
    def stats(self) -> dict[str, Any]: ...

    def load(self) -> Load: ...

    def vllm_labels(self) -> dict[str, str]: ...

    def set_config(self, **changes: Any) -> SimConfig: ...

    def recorded(self) -> list[dict[str, Any]]: ...

    def reset(self) -> None: ...
