"""Broker I/O; see ``transports.base`` for the seam every transport implements."""

from __future__ import annotations

import importlib

from async_processor.errors import ConfigError
from async_processor.transports.base import TRANSPORTS, Transport, TransportContext

# Transport type -> the module that registers it in ``TRANSPORTS``. Only the one in use
# is imported, so a Redis deployment never loads the Pub/Sub client libraries.
TRANSPORT_MODULES: dict[str, str] = {
    "redis-sortedset": "redis_sortedset.transport",
    "redis-pubsub": "redis_pubsub",
    "gcp-pubsub": "gcp_pubsub.transport",
}


def build_transport(kind: str, config: object, ctx: TransportContext) -> Transport:
    module = TRANSPORT_MODULES.get(kind)
    if module is None:
        known = ", ".join(sorted(TRANSPORT_MODULES))
        raise ConfigError(f"unknown transport {kind!r} (known: {known})")
    importlib.import_module(f"async_processor.transports.{module}")
    return TRANSPORTS.build(kind, _as_mapping(config), ctx)


def _as_mapping(config: object) -> dict[str, object]:
    dump = getattr(config, "model_dump", None)
    return dict(dump()) if callable(dump) else dict(config)  # type: ignore[call-overload]
