"""Harvest bench PNGs: one per run, the run over time beside the harvest/impact plane.

Input: a ``RunResult``, every strategy's ``Point`` and the oracle frontiers. Output: a
PNG file. matplotlib comes from the ``[bench]`` extra; without it the bench still prints
its table and JSON and says where the PNGs would have been.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from bench.harvest_model import Point, percentile
from bench.harvest_runs import RunResult

WINDOW = 2.0  # seconds per TTFT p99 window


def available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def window_p99(result: RunResult) -> tuple[list[float], list[float]]:
    """Interactive TTFT p99 of the requests that arrived in each ``WINDOW``."""
    windows = math.ceil(result.duration / WINDOW)
    buckets: list[list[float]] = [[] for _ in range(windows)]
    for at, ttft in zip(result.arrivals, result.ttft, strict=True):
        buckets[min(windows - 1, int(at / WINDOW))].append(ttft)
    xs = [(i + 0.5) * WINDOW for i, b in enumerate(buckets) if b]
    return xs, [percentile(b, 99) for b in buckets if b]


def draw(
    path: Path,
    result: RunResult,
    capacity: int,
    points: Sequence[Point],
    frontiers: dict[str, Sequence[Point]],
    highlight: str,
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.5), width_ratios=(3, 2))
    t = [x.t for x in result.series]
    left.stackplot(t, [x.interactive for x in result.series], [x.batch for x in result.series],
                   labels=["interactive running", "batch running"], alpha=0.7)  # fmt: skip
    left.plot(t, [x.waiting for x in result.series], color="black", lw=1, label="waiting")
    left.axhline(capacity, color="grey", ls="--", lw=1, label="capacity")
    left.set(xlabel="seconds", ylabel="requests", title=result.name)
    ttft = left.twinx()
    ttft.plot(*window_p99(result), color="red", lw=1.2, label=f"TTFT p99 per {WINDOW:g} s")
    ttft.set_ylabel("interactive TTFT p99 (s)", color="red")
    left.legend(loc="upper left", fontsize=7)
    ttft.legend(loc="upper right", fontsize=7)
    for label, frontier in frontiers.items():
        ordered = sorted(frontier, key=lambda p: p.ttft_ratio)
        right.plot([p.ttft_ratio for p in ordered], [p.harvest_ratio for p in ordered],
                   marker="x", ls=":", label=label)  # fmt: skip
    for p in points:
        marker = "*" if p.name == highlight else "o"
        right.scatter(p.ttft_ratio, p.harvest_ratio, marker=marker, s=120 if marker == "*" else 30)
        right.annotate(p.name, (p.ttft_ratio, p.harvest_ratio), fontsize=6)
    right.axvline(1.3, color="grey", ls="--", lw=1)
    right.set(xscale="log", xlabel="TTFT p99 ratio (B / A)", ylabel="harvest ratio",
              title="harvest vs interactive impact")  # fmt: skip
    right.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
