"""What ``async-processor status`` shows: the per-queue model and its fixed-width table.

Stage: operator tools. Input: counts read by ``ops.status.collect``. Output: ``Status``
(also printed as JSON with ``--json``) and ``render``'s table.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from async_processor.durations import format_duration


@dataclass
class QueueStatus:
    queue: str
    pool: str
    depth: int | None = None  # waiting, not claimed
    in_flight: int | None = None  # claimed under a lease
    retry_due: int | None = None  # in the retry set, due now (moved back shortly)
    retry_parked: int | None = None  # in the retry set, due later (backoff)
    oldest_deadline: float | None = None  # epoch seconds of the most urgent waiting request
    dead_letters: int | None = None
    # configured; discovered (queue_discovery); removed (draining its claims and retries)
    origin: str = "configured"


@dataclass
class Status:
    transport: str
    time: float  # the broker's clock where it has one
    queues: list[QueueStatus]
    result_lists: dict[str, int | None] = field(default_factory=dict)
    # retry set -> {"due": n, "parked": m}, counted by score (cheap, whatever its size)
    retry_sets: dict[str, dict[str, int]] = field(default_factory=dict)
    # result list -> seconds since its oldest unconsumed result was written (redis-sortedset;
    # dated by the daemon's retention rounds, so up to 10 s older; null: empty or unknown)
    oldest_results: dict[str, float | None] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


COLUMNS = (
    ("QUEUE", "queue"),
    ("POOL", "pool"),
    ("DEPTH", "depth"),
    ("IN FLIGHT", "in_flight"),
    ("RETRY DUE", "retry_due"),
    ("RETRY PARKED", "retry_parked"),
    ("OLDEST DEADLINE", "oldest_deadline"),
    ("DEAD LETTERS", "dead_letters"),
)


def render(status: Status) -> str:
    """A fixed-width table per queue (with discovered queues, an ORIGIN column), then the
    result lists."""
    columns = list(COLUMNS)
    if any(queue.origin != "configured" for queue in status.queues):  # queue_discovery
        columns.insert(1, ("ORIGIN", "origin"))
    rows = [[title for title, _ in columns]]
    for queue in status.queues:
        rows.append([_cell(queue, attr, status.time) for _, attr in columns])
    widths = [max(len(row[i]) for row in rows) for i in range(len(columns))]
    lines = [f"transport {status.transport}", ""]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
              for row in rows]  # fmt: skip
    if status.result_lists:
        lines += ["", "RESULT LIST  LENGTH  OLDEST UNCONSUMED"]
        lines += [f"{name}  {_text(length)}  {_age(status.oldest_results.get(name))}"
                  for name, length in status.result_lists.items()]  # fmt: skip
    for name, counts in status.retry_sets.items():
        lines += ["", f"retry set {name}: {counts['due']} due, {counts['parked']} parked"]
    return "\n".join(lines)


def _cell(queue: QueueStatus, attr: str, now: float) -> str:
    value = getattr(queue, attr)
    if attr == "oldest_deadline" and value is not None:
        return _relative(value - now)
    return _text(value)


def _age(seconds: float | None) -> str:
    return "-" if seconds is None else _relative(-seconds)


def _text(value: object) -> str:
    return "-" if value is None else str(value)


def _relative(seconds: float) -> str:
    """``in 4m10s``, ``12s ago`` (whole seconds), or ``now`` (not "in 0s")."""
    if round(seconds) == 0:
        return "now"
    text = format_duration(abs(round(seconds)))
    return f"in {text}" if seconds >= 0 else f"{text} ago"
