"""The cancel watcher's pace: fast for a few requests, bounded reads for many."""

from __future__ import annotations

from async_processor.pipeline.cancels import (
    CANCEL_WATCH_INTERVAL,
    MAX_MARKER_READS_PER_SECOND,
    watch_interval,
)


def test_few_requests_are_checked_every_quarter_second() -> None:
    assert watch_interval(0) == CANCEL_WATCH_INTERVAL
    assert watch_interval(1000) == CANCEL_WATCH_INTERVAL


def test_many_requests_never_read_more_markers_a_second_than_the_cap() -> None:
    for watched in (1001, 4000, 10_000, 50_000):
        assert watched / watch_interval(watched) <= MAX_MARKER_READS_PER_SECOND * (1 + 1e-9)
    assert watch_interval(10_000) == 2.5
