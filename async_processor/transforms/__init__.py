"""Request transforms: the ``--transform-config-file`` chain.

Stage: transforms, between the pool gate and the HTTP send. Input: the envelope and the
``Outgoing`` request built by dispatch (body = the payload's exact bytes). Output: the same
``Outgoing``, rewritten by the configured transforms in config order.

Chain rules: ``validate`` runs every transform before any gate or HTTP work, the first
error stops. ``apply`` runs every transform on every attempt; payload sources and editors
(``payload_url``, ``set_params``) and header setters (``set_headers``) always run, and the
first body rewriter that applies (``gcs_uri_multipart``) claims the body
(``out.body_claimed``) so later rewriters skip. With no transform applying, the bytes sent
are exactly the payload's bytes. Errors carry the reference's wording and name the
transform: ``InvalidMessage`` -> INVALID_REQUEST, ``PayloadUnavailable`` ->
PAYLOAD_UNAVAILABLE.

Lifecycle: ``opened()`` opens the transforms that hold a resource (``base.Opens``:
``payload_url``'s HTTP session, reused by every message) and closes them on the way out.
The processor holds it open for the daemon's life.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import replace

import anyio

from async_processor.config import TransformConfig, TransformEntry
from async_processor.errors import ConfigError, InvalidMessage, MessageError, PayloadUnavailable
from async_processor.messages import Envelope
from async_processor.transforms.base import (
    TRANSFORMS,
    Opens,
    Outgoing,
    Transform,
    TransformContext,
)

__all__ = [
    "TRANSFORMS",
    "Opens",
    "Outgoing",
    "Transform",
    "TransformChain",
    "TransformContext",
    "build_transform_chain",
]

VALIDATE_FAILED = "Failed to validate request for transform"
TRANSFORM_FAILED = "Failed to transform request body"


class TransformChain:
    def __init__(self, steps: Sequence[tuple[TransformEntry, Transform]]) -> None:
        self._steps = tuple(steps)

    def __len__(self) -> int:
        return len(self._steps)

    @asynccontextmanager
    async def opened(self) -> AsyncIterator[TransformChain]:
        """The chain with its transforms' resources open (``base.Opens``), closed after."""
        async with AsyncExitStack() as stack:
            for _, transform in self._steps:
                if isinstance(transform, Opens):
                    await transform.open()
                    stack.push_async_callback(_close, transform)
            yield self

    def validate(self, envelope: Envelope) -> None:
        for entry, transform in self._steps:
            try:
                transform.validate(envelope)
            except MessageError as exc:
                raise _named(exc, VALIDATE_FAILED, entry, envelope) from exc

    async def apply(self, envelope: Envelope, out: Outgoing) -> None:
        for entry, transform in self._steps:
            try:
                await transform.apply(envelope, out)
            except MessageError as exc:
                raise _named(exc, TRANSFORM_FAILED, entry, envelope) from exc


def build_transform_chain(config: TransformConfig, ctx: TransformContext) -> TransformChain:
    """Build every entry (names are unique: ``TransformConfig`` checks that).

    An unknown type or a bad parameter is a one-line ConfigError naming the entry.
    """
    steps: list[tuple[TransformEntry, Transform]] = []
    for index, entry in enumerate(config.request_transforms):
        where = f"requestTransforms[{index}] ({entry.name})"
        try:
            transform = TRANSFORMS.build(
                entry.type, entry.parameters, replace(ctx, name=entry.name)
            )
        except ConfigError as exc:
            raise ConfigError(f"{where}: {exc}") from None
        steps.append((entry, transform))
    return TransformChain(steps)


async def _close(resource: Opens) -> None:
    """Shielded: this runs while the daemon is being cancelled."""
    with anyio.CancelScope(shield=True):
        await resource.aclose()


def _named(
    exc: MessageError, prefix: str, entry: TransformEntry, envelope: Envelope
) -> MessageError:
    """The same error, worded as the reference does and naming the transform."""
    where = f"transform {entry.name}/{entry.type}: {exc}"
    if isinstance(exc, PayloadUnavailable):
        return PayloadUnavailable(where)
    if isinstance(exc, InvalidMessage):
        return InvalidMessage(f"{prefix}: {where}", reason=exc.reason, request_id=envelope.id)
    return exc
