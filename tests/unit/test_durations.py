"""Go duration syntax, as flags, env variables and gate params use it."""

from __future__ import annotations

import pytest
from pydantic import BaseModel, ValidationError

from async_processor.durations import Duration, format_duration, parse_duration


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
