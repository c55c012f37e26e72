"""Go duration syntax (``500ms``, ``90s``, ``1h30m``, ``1.5h``, ``0``) to seconds.

Used by flags, environment variables and gate params so that configs written for the Go
daemon keep working.
"""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import BeforeValidator

_UNITS = {
    "ns": 1e-9,
    "us": 1e-6,
    "µs": 1e-6,
    "μs": 1e-6,
    "ms": 1e-3,
    "s": 1.0,
    "m": 60.0,
    "h": 3600.0,
}
_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|μs|ms|s|m|h)")


def parse_duration(text: str) -> float:
    """Seconds for a Go duration string; ValueError on anything else."""
    s = text.strip()
    if not s:
        raise ValueError("empty duration")
    sign = 1.0
    if s[0] in "+-":
        sign = -1.0 if s[0] == "-" else 1.0
        s = s[1:]
    if s == "0":
        return 0.0
    pos, total = 0, 0.0
    while pos < len(s):
        match = _PART.match(s, pos)
        if match is None:
            raise ValueError(f"invalid duration {text!r} (use Go syntax such as 90s, 2m, 1h30m)")
        total += float(match.group(1)) * _UNITS[match.group(2)]
        pos = match.end()
    if pos == 0:
        raise ValueError(f"invalid duration {text!r}")
    return sign * total


def format_duration(seconds: float) -> str:
    """Shortest Go-style text for a number of seconds (for printing configs)."""
    if seconds == 0:
        return "0s"
    if seconds < 1:
        return f"{seconds * 1000:g}ms"
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    out = ""
    if hours:
        out += f"{int(hours)}h"
    if minutes:
        out += f"{int(minutes)}m"
    if secs or not out:
        out += f"{secs:g}s"
    return out


def go_duration_string(nanoseconds: int) -> str:
    """Go's ``time.Duration.String`` for ``nanoseconds``, exactly: ``1m27.5s``, ``500ms``,
    ``1.5µs``, ``2h0m0s``, ``0s`` (what a Go sender would put in a header).

    Under a second the largest unit below it, with the fraction's trailing zeros dropped;
    from a second on ``[<h>h][<m>m]<s>[.<frac>]s``, with ``0m`` written once hours are.
    """
    sign, ns = ("-", -nanoseconds) if nanoseconds < 0 else ("", nanoseconds)
    if ns == 0:
        return "0s"
    if ns < 1_000_000_000:
        for unit, size in (("ms", 1_000_000), ("µs", 1_000), ("ns", 1)):
            if ns >= size:
                return sign + _fraction(ns, size) + unit
    seconds, minutes, hours = ns % 60_000_000_000, ns // 60_000_000_000 % 60, ns // 3600_000_000_000
    text = _fraction(seconds, 1_000_000_000) + "s"
    if hours:
        return f"{sign}{hours}h{minutes}m{text}"
    return f"{sign}{minutes}m{text}" if minutes else sign + text


def _fraction(value: int, unit: int) -> str:
    """``value / unit`` in decimal, exact, without trailing zeros (``1500, 1000`` -> 1.5)."""
    whole, frac = divmod(value, unit)
    if not frac:
        return str(whole)
    digits = str(frac).rjust(len(str(unit)) - 1, "0").rstrip("0")
    return f"{whole}.{digits}"


def _coerce(value: Any) -> Any:
    if isinstance(value, str):
        return parse_duration(value)
    if isinstance(value, bool):
        raise ValueError("a duration must be a string such as '90s'")
    if isinstance(value, int | float):
        # Go turns a number into text first, and a bare number has no unit.
        raise ValueError(f"duration {value!r} has no unit (use Go syntax such as '90s')")
    return value


# A float of seconds in a pydantic model, written in Go syntax in configs.
Duration = Annotated[float, BeforeValidator(_coerce)]
