"""bench.harness's steady window: from 10 % of the results, whole rounds of the workers."""

from __future__ import annotations

from bench.harness import window


def test_the_window_spans_whole_rounds_of_the_workers() -> None:
    # 20,000 results at 1,024 workers: 15 rounds from 2,000 (10 %..90 % was 16,000
    # results, not a whole number of rounds: both marks fell at different places of a wave).
    low, high = window(20000, 1024)
    assert (low, high) == (2000, 2000 + 15 * 1024)
    assert window(20000, 1) == (2000, 18000)  # no rounds: 10 %..90 %, as before


def test_too_few_results_for_one_round_keep_ten_to_ninety_percent() -> None:
    assert window(100, 1024) == (10, 90)
