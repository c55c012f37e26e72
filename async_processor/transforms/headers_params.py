"""``set_headers`` and ``set_params``: inject routing headers and payload parameters.

Stage: transforms (header and payload editors; they never claim the body). Input: the
envelope (metadata, labels) and the ``Outgoing`` request. Output: headers set on
``out.headers`` (every letter-case variant replaced), or payload fields overridden or
defaulted in ``out.body``. Both may be limited to messages whose labels match
``when_labels`` (queue config labels are copied into message labels, so this is also how
to target a queue).

    {"type": "set_headers", "parameters": {"headers": {
        "x-model-family": {"value": "llama"},
        "x-tenant": {"from_metadata": "tenant"},
        "x-tier": {"from_label": "tier"}}}}
    {"type": "set_params", "parameters": {
        "set": {"model": "llama-3-70b"}, "default": {"max_tokens": 256},
        "when_labels": {"tier": "batch"}}}

A header whose metadata key or label is missing, or whose value is not a legal header
value, is left out. ``set_params`` leaves the bytes untouched when nothing changes and
otherwise rewrites only the changed fields; it needs a JSON object body, so place it
before any body rewriter (after a rewriter has claimed the body it does nothing).
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from async_processor.errors import InvalidMessage
from async_processor.headers import (
    apply_stamped,
    check_header_name,
    check_header_value,
    is_valid_header_value,
)
from async_processor.messages import Envelope
from async_processor.transforms.base import TRANSFORMS, Outgoing, Transform, TransformContext
from async_processor.transforms.json_fields import Fields, scan


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class _Conditional(_Strict):
    when_labels: dict[str, str] = Field(default_factory=dict)

    def matches(self, envelope: Envelope) -> bool:
        labels = envelope.routing.labels
        return all(labels.get(key) == value for key, value in self.when_labels.items())


class HeaderSource(_Strict):
    """Exactly one of a static value, a metadata key or a label name."""

    value: str | None = None
    from_metadata: str | None = None
    from_label: str | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> HeaderSource:
        given = [v for v in (self.value, self.from_metadata, self.from_label) if v is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of value, from_metadata, from_label")
        if self.value is not None:
            check_header_value(self.value)
        return self

    def resolve(self, envelope: Envelope) -> str | None:
        if self.value is not None:
            return self.value
        if self.from_metadata is not None:
            found = envelope.request.metadata.get(self.from_metadata)
        else:
            found = envelope.routing.labels.get(self.from_label or "")
        return found if found and is_valid_header_value(found) else None


class SetHeadersParams(_Conditional):
    headers: dict[str, HeaderSource] = Field(min_length=1)

    @field_validator("headers")
    @classmethod
    def _names(cls, value: dict[str, HeaderSource]) -> dict[str, HeaderSource]:
        for name in value:
            check_header_name(name)
            if name.lower() == "content-type":
                raise ValueError("content-type is set by the body rewriters, not set_headers")
        return value


class SetHeaders:
    def __init__(self, name: str, params: SetHeadersParams) -> None:
        self.name = name
        self._params = params

    def validate(self, envelope: Envelope) -> None:
        return None

    async def apply(self, envelope: Envelope, out: Outgoing) -> None:
        if not self._params.matches(envelope):
            return
        stamped = []
        for header, source in self._params.headers.items():
            value = source.resolve(envelope)
            if value is not None:
                stamped.append((header, value))
        apply_stamped(out.headers, stamped)


class SetParamsParams(_Conditional):
    set: dict[str, Any] = Field(default_factory=dict)
    default: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _something_to_do(self) -> SetParamsParams:
        if not self.set and not self.default:
            raise ValueError('give at least one field in "set" or "default"')
        both = sorted(set(self.set) & set(self.default))
        if both:
            raise ValueError(f"fields both in set and default: {', '.join(both)}")
        return self


class SetParams:
    def __init__(self, name: str, params: SetParamsParams) -> None:
        self.name = name
        self._params = params

    def validate(self, envelope: Envelope) -> None:
        return None

    async def apply(self, envelope: Envelope, out: Outgoing) -> None:
        if out.body_claimed or not self._params.matches(envelope):
            return
        try:
            fields = scan(out.body)
        except ValueError as exc:
            raise InvalidMessage(
                f"set_params needs a JSON object payload: {exc}",
                reason="malformed",
                request_id=envelope.id,
            ) from exc
        changes = {k: v for k, v in self._params.set.items() if not _holds(fields, k, v)}
        changes.update({k: v for k, v in self._params.default.items() if k not in fields.spans})
        if changes:
            out.body = fields.edited(changes)


def _holds(fields: Fields, key: str, value: Any) -> bool:
    """True when the payload already has ``value`` at ``key`` (so its bytes can stay)."""
    if key not in fields.spans:
        return False
    # Compare as JSON: in Python True == 1 == 1.0, but they are different payloads.
    return _canonical(fields.value(key)) == _canonical(value)


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True)


@TRANSFORMS.register("set_headers", SetHeadersParams)
def _set_headers(params: SetHeadersParams, ctx: TransformContext) -> Transform:
    return SetHeaders(ctx.name, params)


@TRANSFORMS.register("set_params", SetParamsParams)
def _set_params(params: SetParamsParams, ctx: TransformContext) -> Transform:
    return SetParams(ctx.name, params)
