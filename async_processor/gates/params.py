"""Gate param types: the reference's value coercion rules as pydantic annotations.

Input: raw ``gate_params`` values (JSON strings, numbers, bools, objects; the Helm chart
turns every value into a string). Output: typed fields of a ``GateParams`` model.

- ``Str``: a number becomes its shortest decimal text, a bool "true"/"false".
- ``Float``: a number or a numeric string; bools, objects and arrays are errors.
- ``Int``: an integral number or a plain base-10 string (``"1.0"`` and ``2.5`` are errors).
- ``Duration`` (re-exported): Go syntax; a bare number has no unit and is an error.
- ``StrMap``: an object, or a JSON string of one; values become text.
- ``GateSpec`` / ``GateSpecs``: nested gate configs, objects or JSON strings.
An empty string means "use the default" for every param (``Params`` drops it first).
"""

from __future__ import annotations

import json
import math
import re
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from async_processor.durations import Duration
from async_processor.gates.base import GateParams

__all__ = [
    "Duration",
    "Float",
    "GateSpec",
    "GateSpecObject",
    "GateSpecs",
    "Int",
    "Params",
    "Str",
    "StrMap",
    "json_object",
]

_BASE10 = re.compile(r"[+-]?\d+")


def _to_str(value: Any) -> Any:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value) if not value.is_integer() else str(int(value))
    return value


def _to_float(value: Any) -> Any:
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ValueError("must be a number or a numeric string")
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"{value!r} is not a number") from None


def _to_int(value: Any) -> Any:
    if isinstance(value, bool):
        raise ValueError("must be an integer")
    if isinstance(value, float):
        if not value.is_integer():
            raise ValueError(f"{value!r} is not an integer")
        return int(value)
    if isinstance(value, str):
        if not _BASE10.fullmatch(value.strip()):
            raise ValueError(f"{value!r} is not a base-10 integer")
        return int(value)
    if isinstance(value, int):
        return value
    raise ValueError("must be an integer")


def _json_text(value: Any, want: type) -> Any:
    """A JSON-encoded string becomes its value (Helm passes objects as strings)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise ValueError(f"not valid JSON: {exc}") from None
    if not isinstance(value, want):
        raise ValueError(f"must be a JSON {want.__name__} (or a string holding one)")
    return value


def json_object(value: Any) -> Any:
    """An object, or a JSON string holding one; empty/None is ``{}``."""
    return _json_text(value or {}, dict)


def _to_str_map(value: Any) -> Any:
    if value is None:
        return {}
    return {str(k): _to_str(v) for k, v in _json_text(value, dict).items()}


def _finite(value: float) -> float:
    if not math.isfinite(value):
        raise ValueError("must be finite")
    return value


Str = Annotated[str, BeforeValidator(_to_str)]
Float = Annotated[float, BeforeValidator(_finite), BeforeValidator(_to_float)]
Int = Annotated[int, BeforeValidator(_to_int)]
StrMap = Annotated[dict[str, str], BeforeValidator(_to_str_map)]


class GateSpec(BaseModel):
    """A nested ``{gate_type, gate_params}`` (composite, wait-on-refuse)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    gate_type: str = Field(min_length=1)
    gate_params: Annotated[dict[str, Any], BeforeValidator(json_object)] = Field(
        default_factory=dict
    )


def _spec_list(value: Any) -> Any:
    return _json_text(value, list)


GateSpecs = Annotated[list[GateSpec], BeforeValidator(_spec_list)]
GateSpecObject = Annotated[GateSpec, BeforeValidator(json_object)]


class Params(GateParams):
    """Base for gate params: an empty string means the field's default."""

    @model_validator(mode="before")
    @classmethod
    def _empty_is_default(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if not (isinstance(v, str) and v == "")}
        return data
