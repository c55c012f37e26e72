"""Broker I/O: the seam every transport implements (``base``) and one package or module per
``--transport`` type (``redis_sortedset/``, ``gcp_pubsub/``, ``redis_pubsub``).

Import from this package, not from ``base``.
"""

from __future__ import annotations

from async_processor.transports.base import (
    TRANSPORTS,
    Abandons,
    Completion,
    Deferral,
    Delivery,
    DiscoversQueues,
    LetsGo,
    LimitsResults,
    LoadsPayloads,
    SignalsMessages,
    Transport,
    TransportContext,
    WatchesCancels,
    abandon,
)

__all__ = [
    "TRANSPORTS",
    "Abandons",
    "Completion",
    "Deferral",
    "Delivery",
    "DiscoversQueues",
    "LetsGo",
    "LimitsResults",
    "LoadsPayloads",
    "SignalsMessages",
    "Transport",
    "TransportContext",
    "WatchesCancels",
    "abandon",
    "build_transport",
]


def build_transport(kind: str, config: object, ctx: TransportContext) -> Transport:
    """The transport ``kind`` for ``config`` (its model or a mapping); ConfigError if unknown."""
    return TRANSPORTS.build(kind, _as_mapping(config), ctx)


def _as_mapping(config: object) -> dict[str, object]:
    dump = getattr(config, "model_dump", None)
    return dict(dump()) if callable(dump) else dict(config)  # type: ignore[call-overload]
