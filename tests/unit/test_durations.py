"""Go duration syntax, as flags, env variables and gate params use it."""

from __future__ import annotations

import pytest
from pydantic import BaseModel, ValidationError

from async_processor.durations import Duration, format_duration, go_duration_string, parse_duration


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("500ms", 0.5),
        ("90s", 90.0),
        ("2m", 120.0),
        ("1h30m", 5400.0),
        ("1.5h", 5400.0),
        ("0", 0.0),
        ("0s", 0.0),
        ("1m30.5s", 90.5),
        (".5s", 0.5),
        ("250us", 0.00025),
        ("250µs", 0.00025),
        ("10ns", 1e-8),
        ("-5s", -5.0),
        ("+5s", 5.0),
        (" 3s ", 3.0),
    ],
)
def test_parse(text: str, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "10", "5x", "1h 30m", "s", "1.5", "ms5", "1d", "--1s", "5S"])
def test_bad_durations(text: str) -> None:
    with pytest.raises(ValueError, match="duration"):
        parse_duration(text)


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0, "0s"), (0.5, "500ms"), (90, "1m30s"), (5400, "1h30m"), (300, "5m"), (3600, "1h")],
)
def test_format_round_trips(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text
    assert parse_duration(text) == seconds


class Model(BaseModel):
    timeout: Duration = 5.0


def test_pydantic_field() -> None:
    assert Model.model_validate({"timeout": "1m"}).timeout == 60.0
    assert Model().timeout == 5.0
    for bad in (60, 1.5, True, "60"):
        with pytest.raises(ValidationError):
            Model.model_validate({"timeout": bad})


@pytest.mark.parametrize(
    ("nanoseconds", "go"),
    [  # what Go's time.Duration(n).String() returns (its documentation and source)
        (0, "0s"),
        (1, "1ns"),
        (999, "999ns"),
        (1_000, "1µs"),
        (1_500, "1.5µs"),
        (1_100_000, "1.1ms"),
        (500_000_000, "500ms"),
        (999_999_999, "999.999999ms"),
        (1_000_000_000, "1s"),
        (87_500_000_000, "1m27.5s"),
        (60_000_000_000, "1m0s"),
        (3_600_000_000_000, "1h0m0s"),
        (4_530_918_273_645, "1h15m30.918273645s"),
        (72 * 3_600_000_000_000 + 180_500_000_000, "72h3m0.5s"),
        (-1_500, "-1.5µs"),
        (-90_000_000_000, "-1m30s"),
    ],
)
def test_go_duration_string_is_gos(nanoseconds: int, go: str) -> None:
    assert go_duration_string(nanoseconds) == go
    assert parse_duration(go) == pytest.approx(nanoseconds / 1e9, abs=1e-9)
