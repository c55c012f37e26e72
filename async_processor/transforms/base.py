"""The transform seam: rewrite the outgoing request (body, content type, headers, URL).

Input: the message's envelope and the ``Outgoing`` request the worker built. Output: the
same ``Outgoing``, possibly rewritten. A transform that holds a resource also has
``open``/``aclose`` (``Opens``). Transforms run in config order; once one has
claimed the body (``body_claimed``), later body rewriters leave it alone. Errors:
``InvalidMessage`` -> INVALID_REQUEST, ``PayloadUnavailable`` -> PAYLOAD_UNAVAILABLE.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from async_processor.messages import Envelope, Payload
from async_processor.registry import Registry


@dataclass(slots=True)
class Outgoing:
    url: str
    body: Payload  # the request's payload (a view into the message) until a transform sets it
    headers: dict[str, str] = field(default_factory=dict)
    content_type: str = "application/json"
    body_claimed: bool = False
    deadline: float = 0.0  # Unix seconds: transforms that fetch must finish before it


class Transform(Protocol):
    name: str

    def validate(self, envelope: Envelope) -> None:
        """Preflight before any gate or HTTP work; raise InvalidMessage to reject."""
        ...

    async def apply(self, envelope: Envelope, out: Outgoing) -> None: ...


@runtime_checkable
class Opens(Protocol):
    """Optional for a transform that holds a resource (``payload_url``: its HTTP session).

    The chain opens it before the first message and closes it at shutdown
    (``TransformChain.opened``); ``apply`` may rely on it being open.
    """

    async def open(self) -> None: ...

    async def aclose(self) -> None: ...


@dataclass(slots=True)
class TransformContext:
    """What transforms share: the size limit. Not the gateway's HTTP session: a transform
    that fetches (``payload_url``) must not present the gateway client certificate."""

    max_message_bytes: int = 4 * 1024 * 1024
    name: str = ""  # the config entry's ``name``, set per transform by the chain builder


TRANSFORMS: Registry[Transform, TransformContext] = Registry(
    "transform",
    plugins=[
        f"async_processor.transforms.{name}"
        for name in ("gcs_multipart", "headers_params", "payload_url")
    ],
)
