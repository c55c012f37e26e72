"""What every config model shares: strictness, gate params, defaults, small checks."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from types import UnionType
from typing import Annotated, Any, ClassVar, Union, get_args, get_origin
from urllib.parse import urlsplit

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationInfo,
    model_validator,
)

DEFAULT_POOL = "default"
DEFAULT_REQUEST_PATH = "/v1/completions"
Port = Annotated[int, Field(ge=0, le=65535)]


class Strict(BaseModel):
    """A config file's model: unknown keys are errors, and so is a number or a boolean
    written as text (``"batch_size": "10"``; the Go daemon refuses it too). Models built
    from flags (text by nature) set ``text_values``."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    text_values: ClassVar[bool] = False

    @model_validator(mode="before")
    @classmethod
    def _no_quoted_scalars(cls, data: Any) -> Any:
        if cls.text_values or not isinstance(data, dict):
            return data
        for key, value in data.items():
            kind = _scalar_kind(cls, key) if isinstance(value, str) else ""
            if kind:
                raise ValueError(f"{key}: {value!r} is text, not {kind}: write it without quotes")
        return data


def _scalar_kind(model: type[BaseModel], key: str) -> str:
    """ "a number" / "a boolean" when field ``key`` takes only that (no text), else ""."""
    field = model.model_fields.get(key) or next(
        (f for f in model.model_fields.values() if f.alias == key), None
    )
    if field is None:
        return ""
    annotation = _bare(field.annotation)
    union = get_origin(annotation) in (Union, UnionType)
    options = {_bare(a) for a in get_args(annotation)} if union else {annotation}
    options.discard(type(None))
    if options and options <= {bool}:
        return "a boolean"
    if options and options <= {int, float}:
        return "a number"
    return ""


def _bare(annotation: Any) -> Any:
    while get_origin(annotation) is Annotated:
        annotation = get_args(annotation)[0]
    return annotation


def _json_object_or_string(value: Any) -> Any:
    """``gate_params`` may be an object or a JSON-encoded string of one (Helm does that)."""
    if isinstance(value, str):
        if not value.strip():
            return {}
        try:
            return json.loads(value)
        except ValueError as exc:
            raise ValueError(f"not a JSON object: {exc}") from exc
    return {} if value is None else value


_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


def _env_refs(params: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
    """A gate param whose whole value is ``${NAME}`` takes the environment variable NAME.

    So a credential (a Redis URL with a password) comes from a Secret through the
    environment, not from the config file, which the chart keeps in a ConfigMap. The
    environment is the loader's (validation context ``env``), else the process's.
    """
    env: Mapping[str, str] = (info.context or {}).get("env", os.environ)
    out = dict(params)
    for key, value in params.items():
        match = _ENV_REF.fullmatch(value) if isinstance(value, str) else None
        if match is None:
            continue
        if not env.get(match.group(1)):
            raise ValueError(f"{key}: environment variable {match.group(1)} is not set")
        out[key] = env[match.group(1)]
    return out


GateParams = Annotated[
    dict[str, Any], BeforeValidator(_json_object_or_string), AfterValidator(_env_refs)
]


def zero_is_default(default: int) -> Any:
    def coerce(value: Any) -> Any:
        return default if value in (0, None) else value

    return BeforeValidator(coerce)


def check_http_url(value: str) -> str:
    try:
        parts = urlsplit(value)
        parts.port  # noqa: B018 - parsed lazily: raises ValueError for a bad port
    except ValueError:  # e.g. an unclosed IPv6 literal
        parts = None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{value!r} is not an http(s) URL with a host")
    return value


def require_unique(what: str, values: list[str]) -> None:
    seen: set[str] = set()
    for value in values:
        if value in seen:
            raise ValueError(f"{what}: duplicate {value!r}")
        seen.add(value)
