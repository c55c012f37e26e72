"""Broker I/O; see ``transports.base`` for the seam every transport implements."""

from __future__ import annotations

import importlib

from async_processor.transports.base import TRANSPORTS, Transport, TransportContext

# Modules that register transport types in ``TRANSPORTS`` when imported.
_TRANSPORT_MODULES: tuple[str, ...] = ("redis_sortedset",)


def build_transport(kind: str, config: object, ctx: TransportContext) -> Transport:
    for name in _TRANSPORT_MODULES:
        importlib.import_module(f"async_processor.transports.{name}")
    return TRANSPORTS.build(kind, _as_mapping(config), ctx)


def _as_mapping(config: object) -> dict[str, object]:
    dump = getattr(config, "model_dump", None)
    return dict(dump()) if callable(dump) else dict(config)  # type: ignore[call-overload]
