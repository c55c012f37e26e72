"""``gcs_uri_multipart``: send a GCS signed URL as ``multipart/form-data`` instead of JSON.

Stage: transforms (body rewriter). Input: a message whose ``metadata.provider`` is one of
``providers`` and whose payload has a non-empty ``gcs_uri``. Output: a multipart body with
the field ``url`` (the signed URL) first, then every other payload field in payload order
(strings unquoted, other values as their exact JSON text), and the body claimed.

``validate`` rejects before any gate or HTTP work: a payload that is not a JSON object and
a signed URL that expires at or before the request deadline (V4 ``X-Goog-Date`` +
``X-Goog-Expires``, else V2 ``Expires``). ``apply`` checks the same on the body it
rewrites, which covers payloads fetched by ``payload_url`` (a message without a payload
passes ``validate``), and rejects an inline ``file_base64`` next to ``gcs_uri`` (as the
reference does, so the result reads ``Failed to transform request body: ...``).
"""

from __future__ import annotations

import re
import secrets
from datetime import UTC, datetime, timedelta
from urllib.parse import parse_qs, urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator

from async_processor.errors import InvalidMessage
from async_processor.messages import Envelope, Payload
from async_processor.transforms.base import TRANSFORMS, Outgoing, Transform, TransformContext
from async_processor.transforms.json_fields import Fields, scan

PROVIDER_KEY = "provider"
GCS_URI_FIELD = "gcs_uri"
INLINE_FIELD = "file_base64"
URL_FORM_FIELD = "url"
_INT = re.compile(r"[+-]?[0-9]+")


class GcsMultipartParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    providers: list[str] = Field(min_length=1)

    @field_validator("providers")
    @classmethod
    def _non_empty(cls, value: list[str]) -> list[str]:
        if not all(value):
            raise ValueError('"providers" entries must be non-empty')
        return value


class GcsMultipart:
    def __init__(self, name: str, providers: list[str]) -> None:
        self.name = name
        self._providers = frozenset(providers)

    def validate(self, envelope: Envelope) -> None:
        request = envelope.request
        # A message without a payload may get one later (payload_url): apply checks it then.
        if request.metadata.get(PROVIDER_KEY) in self._providers and request.payload != b"null":
            self._usable_uri(_fields(request.payload, envelope), envelope)

    async def apply(self, envelope: Envelope, out: Outgoing) -> None:
        if out.body_claimed or envelope.request.metadata.get(PROVIDER_KEY) not in self._providers:
            return
        fields = _fields(out.body, envelope)
        uri = self._usable_uri(fields, envelope)
        if uri is None:
            return
        # Here, not in validate: the reference's wording is "Failed to transform request
        # body: ..." for it, which is what producers match on.
        _reject_inline(fields, envelope)
        form = [(URL_FORM_FIELD, uri)]
        form += [(key, _form_value(fields, key)) for key in fields.spans if key != GCS_URI_FIELD]
        out.body, out.content_type = multipart_form(form)
        out.body_claimed = True

    def _usable_uri(self, fields: Fields, envelope: Envelope) -> str | None:
        """The signed URL to send, None when there is none; fatal when it cannot work."""
        uri = _gcs_uri(fields)
        if uri is None:
            return None
        expiry = signed_url_expiry(uri)
        deadline = envelope.request.deadline
        if expiry is not None and expiry <= deadline:
            raise InvalidMessage(
                f"signed URL expires at {_rfc3339(expiry)}, at or before the request deadline "
                f"{_rfc3339(deadline)}",
                reason="signed_url_expired",
                request_id=envelope.id,
            )
        return uri


def signed_url_expiry(uri: str) -> float | None:
    """Unix seconds at which a GCS signed URL expires, or None when it does not say."""
    try:
        query = parse_qs(urlsplit(uri).query, keep_blank_values=True)
    except ValueError:
        return None
    date, expires = query.get("X-Goog-Date"), query.get("X-Goog-Expires")
    if date and expires:  # V4; a bad value means no expiry, with no fall-back to V2
        try:
            start = datetime.strptime(date[0], "%Y%m%dT%H%M%SZ").replace(tzinfo=UTC)
        except ValueError:
            return None
        seconds = _int(expires[0])
        try:
            return None if seconds is None else (start + timedelta(seconds=seconds)).timestamp()
        except OverflowError:
            return None
    v2 = query.get("Expires")
    seconds = _int(v2[0]) if v2 else None
    return None if seconds is None else float(seconds)


def multipart_form(fields: list[tuple[str, str]]) -> tuple[bytes, str]:
    """``multipart/form-data`` body with plain (non-file) parts, and its content type."""
    encoded = [(_quote(name), value.encode()) for name, value in fields]
    boundary = secrets.token_hex(16)
    while any(boundary.encode() in value for _, value in encoded):
        boundary = secrets.token_hex(16)  # a value that contains it would split its part
    parts = []
    for name, value in encoded:
        head = f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n'
        parts += [head.encode(), value, b"\r\n"]
    parts.append(f"--{boundary}--\r\n".encode())
    return b"".join(parts), f"multipart/form-data; boundary={boundary}"


def _fields(payload: Payload, envelope: Envelope) -> Fields:
    try:
        return scan(payload)
    except ValueError as exc:
        raise InvalidMessage(
            f"failed to parse request body: {exc}", reason="malformed", request_id=envelope.id
        ) from exc


def _gcs_uri(fields: Fields) -> str | None:
    if GCS_URI_FIELD not in fields.spans:
        return None
    uri = fields.value(GCS_URI_FIELD)
    return uri if isinstance(uri, str) and uri else None


def _reject_inline(fields: Fields, envelope: Envelope) -> None:
    if INLINE_FIELD in fields.spans:
        raise InvalidMessage(
            f'"{INLINE_FIELD}" is not supported on the multipart path',
            reason="inline_file",
            request_id=envelope.id,
        )


def _form_value(fields: Fields, key: str) -> str:
    value = fields.value(key)
    return value if isinstance(value, str) else fields.raw(key)


def _quote(name: str) -> str:
    # Quote and backslash escaped as the reference does; CR/LF would end the part header.
    escaped = name.replace("\\", "\\\\").replace('"', '\\"')
    return escaped.replace("\r", "%0D").replace("\n", "%0A")


def _int(text: str) -> int | None:
    if not _INT.fullmatch(text):
        return None
    try:
        return int(text)
    except ValueError:  # more digits than int() converts (sys.get_int_max_str_digits)
        return None


def _rfc3339(unix: float) -> str:
    try:
        return datetime.fromtimestamp(unix, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    except (ValueError, OverflowError, OSError):  # outside the calendar: say it in seconds
        return f"{unix:.0f} (Unix seconds)"


@TRANSFORMS.register("gcs_uri_multipart", GcsMultipartParams)
def _gcs_uri_multipart(params: GcsMultipartParams, ctx: TransformContext) -> Transform:
    return GcsMultipart(ctx.name, params.providers)
