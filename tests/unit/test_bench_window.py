"""bench.harness's steady windows: from 10 % of the results, whole rounds of the workers;
and the in-flight occupancy over a span of time, free of the waves' steps."""

from __future__ import annotations

from bench.harness import SETTLE, Reading, steady_occupancy, window


def test_the_window_spans_whole_rounds_of_the_workers() -> None:
    # 20,000 results at 1,024 workers: 15 rounds from 2,000 (10 %..90 % was 16,000
    # results, not a whole number of rounds: both marks fell at different places of a wave).
    low, high = window(20000, 1024)
    assert (low, high) == (2000, 2000 + 15 * 1024)
    assert window(20000, 1) == (2000, 18000)  # no rounds: 10 %..90 %, as before


def test_too_few_results_for_one_round_keep_ten_to_ninety_percent() -> None:
    assert window(100, 1024) == (10, 90)


def run(fill: float, steady: float, drained: float, workers: int = 1024) -> list[Reading]:
    """Readings every 0.25 s of a run that ramps up to ``workers`` in flight by 1 s, then
    holds ``steady`` × workers on average, all 20,000 requests arrived at ``drained`` s,
    then empties: the ramp and the tail hold far fewer."""
    readings, integral, previous = [], 0.0, 0.0
    for i in range(int((drained + 3) * 4)):
        t = i / 4
        if t <= 1:
            level = fill * t
        elif t <= drained:
            level = steady * workers
        else:
            level = 100.0
        integral += level * (t - previous)
        previous = t
        peak = workers if t >= 1 else int(level)
        readings.append(Reading(t, integral, peak, 20000 if t >= drained else int(t * 900)))
    return readings


def test_occupancy_is_the_mean_in_flight_over_the_steady_span_only() -> None:
    # The ramp and the tail (much lower) are left out: exactly the steady level comes back.
    got = steady_occupancy(run(fill=1024, steady=0.977, drained=18.0), 1024, 20000)
    assert got is not None and abs(got - 0.977) < 1e-9


def test_the_span_starts_settle_after_full_and_ends_settle_before_the_last_arrival() -> None:
    # Only the readings in [1 + SETTLE, 18 - SETTLE] count: a step just outside it does not.
    readings = run(fill=1024, steady=1.0, drained=18.0)
    cut = [r for r in readings if 1 + SETTLE <= r.clock <= 18 - SETTLE]
    outside = [Reading(r.clock, r.integral * 2, r.peak, r.arrived) for r in readings]
    spliced = [o if not (1 + SETTLE <= o.clock <= 18 - SETTLE) else r
               for o, r in zip(outside, readings, strict=True)]  # fmt: skip
    assert len(cut) > 2
    got = steady_occupancy(spliced, 1024, 20000)
    assert got is not None and abs(got - 1.0) < 1e-9


def test_a_run_too_short_for_the_settle_margins_has_no_figure() -> None:
    assert steady_occupancy(run(fill=1024, steady=1.0, drained=1.0 + 2 * SETTLE - 0.5),
                            1024, 20000) is None  # fmt: skip
    assert steady_occupancy([], 1024, 20000) is None


def test_a_gateway_never_holding_all_the_workers_counts_from_the_first_arrival() -> None:
    # Peak 1,000 of 1,024: the span starts SETTLE after the first arrival (t = 0.25), the
    # slow start counts against the consumer.
    readings = [Reading(r.clock, r.integral, min(r.peak, 1000), r.arrived)
                for r in run(fill=1024, steady=0.9, drained=18.0)]  # fmt: skip
    first, last = 0.25 + SETTLE, 18.0 - SETTLE
    by_clock = {r.clock: r for r in readings}
    a = min(r for r in by_clock if r >= first)
    b = max(r for r in by_clock if r <= last)
    expected = (by_clock[b].integral - by_clock[a].integral) / (b - a) / 1024
    got = steady_occupancy(readings, 1024, 20000)
    assert got is not None and abs(got - expected) < 1e-9 and got < 0.9
